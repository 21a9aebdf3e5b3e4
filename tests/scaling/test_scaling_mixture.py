"""RegMix's regression (scaling.mixture) on synthetic sweeps whose losses follow a known linear law
in the weights, so the coefficients, the best mixture and the refusals have known answers."""

import numpy as np
import pytest

from scaling.mixture import MixtureFitRefused, MixtureOptions, best_mixture, fit_mixture_regression
from scaling.plots import plot_mixture_fit, plot_mixture_refused

COMPONENTS = ("code", "prose", "web")
# The loss of training on each component alone: prose is best.
ALONE = np.array([3.0, 2.5, 2.8])


def sweep(runs: int, seed: int = 1, noise: float = 0.0, scale: float = 1.0, concentration=(1.0, 1.0, 1.0)):
    """``runs`` weight sets (unnormalized: each scaled by a different total, as a project file may
    write them) and their losses under the law ALONE . w, with Gaussian noise."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(concentration, size=runs)
    losses = weights @ ALONE + rng.normal(0.0, noise, size=runs)
    totals = scale * rng.uniform(0.5, 4.0, size=runs)
    return [dict(zip(COMPONENTS, map(float, w * t))) for w, t in zip(weights, totals)], losses


def test_the_fit_recovers_each_components_loss_and_predicts_the_best_mixture():
    points, losses = sweep(12, noise=0.005)
    fit = fit_mixture_regression(points, losses)
    assert fit.components == COMPONENTS
    np.testing.assert_allclose(fit.coefficients, ALONE, atol=0.03)
    assert fit.r2 > 0.98 and fit.degrees_of_freedom == 9
    assert 0.002 < fit.loo_rmse < 0.015  # of the order of the noise, a little above it
    optimum = best_mixture(fit, MixtureOptions(samples=20_000, top_k=20, interval=0.9))
    # The linear law's minimum is prose's vertex; the top-k mean sits just inside it.
    assert optimum.vertex == "prose" and optimum.vertex_loss == pytest.approx(2.5, abs=0.03)
    assert optimum.weights["prose"] > 0.95 and sum(optimum.weights.values()) == pytest.approx(1.0)
    true_loss = float(np.array([optimum.weights[c] for c in COMPONENTS]) @ ALONE)
    assert optimum.loss_low < true_loss < optimum.loss_high and optimum.loss_high - optimum.loss_low < 0.1
    # The sweep's Dirichlet(1) draws came nowhere near prose alone: the corner is an extrapolation.
    assert "prose" in optimum.extrapolated
    assert all(w is not None and w["prose"] > 0.9 for w in optimum.loo_weights)
    # Deterministic: the same seed gives the same mixture; another seed, another sample of the simplex.
    again = best_mixture(fit, MixtureOptions(samples=20_000, top_k=20, interval=0.9))
    assert again.weights == optimum.weights
    assert best_mixture(fit, MixtureOptions(samples=20_000, top_k=20, seed=5)).weights != optimum.weights


def test_a_noiseless_law_is_fitted_exactly_in_log_space():
    rng = np.random.default_rng(3)
    weights = rng.dirichlet((2.0, 2.0, 2.0), size=6)
    losses = np.exp(weights @ np.log(ALONE))
    fit = fit_mixture_regression([dict(zip(COMPONENTS, w)) for w in weights], losses, log_loss=True)
    np.testing.assert_allclose(fit.predict(np.eye(3)), ALONE, rtol=1e-9)
    np.testing.assert_allclose(fit.loo, losses, rtol=1e-9)
    assert fit.r2 == pytest.approx(1.0)


def test_a_component_only_one_run_weighs_cannot_be_predicted_without_that_run():
    points, losses = sweep(6, noise=0.01, concentration=(1.0, 1.0, 1e-9))
    points = [{k: v for k, v in p.items() if k != "web"} for p in points]
    points.append({"web": 1.0, "prose": 1.0})
    losses = np.append(losses, (ALONE[1] + ALONE[2]) / 2)
    fit = fit_mixture_regression(points, losses)
    assert np.isnan(fit.loo[-1]) and np.all(np.isfinite(fit.loo[:-1]))
    assert best_mixture(fit, MixtureOptions(samples=2_000, top_k=10)).loo_weights[-1] is None


@pytest.mark.parametrize("points, losses, message", [
    ([{"a": 1.0, "b": 1.0}] * 5, [2.0, 2.1, 2.0, 2.2, 2.1], "the weights do not vary: all 5 run(s) train on the same"),
    ([{"a": 2.0, "b": 2.0}, {"a": 1.0, "b": 1.0}, {"a": 3, "b": 3}], [2.0, 2.1, 2.0], "the weights do not vary"),
    ([{"a": 1.0}, {"b": 1.0}, {"a": 1.0, "b": 1.0}], [2.0, 2.1, 2.05],
     "too few runs: 3 for 2 weighed components (a, b); the linear fit needs at least 4"),
    # a and b always 1:1: only c's share varies, so a's effect cannot be told from b's.
    ([{"a": 1, "b": 1, "c": w} for w in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)], [2, 2.1, 2.2, 2.3, 2.4, 2.5],
     "the weights vary in 1 independent direction(s), not the 2 that 3 components need"),
    ([{"a": 1.0}, {"b": 1.0}, {"a": 1.0, "b": 1.0}, {"a": 1, "b": 3}], [2.0, float("nan"), 2.0, 2.1],
     "losses must be finite, got [nan]"),
])
def test_what_cannot_be_fitted_is_refused_in_one_line(points, losses, message):
    with pytest.raises(MixtureFitRefused) as refused:
        fit_mixture_regression(points, losses)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_log_loss_refuses_a_loss_at_or_below_zero():
    with pytest.raises(MixtureFitRefused, match="log_loss needs losses above 0"):
        fit_mixture_regression([{"a": 1.0}, {"b": 1.0}, {"a": 1.0, "b": 1.0}, {"a": 1, "b": 3}],
                               [2.0, 0.0, 2.0, 2.1], log_loss=True)


def test_the_figures_are_pngs_and_a_refused_fit_carries_its_reason():
    points, losses = sweep(8, noise=0.01)
    fit = fit_mixture_regression(points, losses)
    png = plot_mixture_fit(fit, best_mixture(fit, MixtureOptions(samples=2_000, top_k=10)),
                           [f"w{i}" for i in range(8)], "mean eval loss")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    refused = plot_mixture_refused(["w0", "w1"], [2.0, 2.1], "mean eval loss", "too few runs")
    assert b"Mixture weights not fitted: too few runs" in refused
