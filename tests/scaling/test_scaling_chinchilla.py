import numpy as np
import pytest

from scaling.chinchilla import HuberLogLossObjective, StartGrid, fit_chinchilla_arrays

# Epoch AI's published refit of Hoffmann et al.'s approach 3 (scaling/data/README.md).
EPOCH = {"E": 1.8172, "A": 477.84, "B": 2143.86, "alpha": 0.34731, "beta": 0.36718}
EPOCH_OBJECTIVE = 0.0010182740


@pytest.mark.slow  # the full Chinchilla fit
def test_reproduces_epoch_fit(epoch_points):
    assert epoch_points["loss"].size == 240
    grid = StartGrid()
    assert len(grid) == 4500
    fit = fit_chinchilla_arrays(epoch_points["params"], epoch_points["tokens"], epoch_points["loss"], grid=grid)
    for name, published in EPOCH.items():
        assert getattr(fit, name) == pytest.approx(published, rel=5e-3), name
    assert fit.objective == pytest.approx(EPOCH_OBJECTIVE, rel=1e-6)
    assert fit.starts == 4500
    assert fit.converged.all()


@pytest.mark.slow  # scipy's solver, fit by fit
def test_batched_solver_matches_scipy_loop(epoch_points):
    # A 24-start slice of the grid, some starts in the optimum's basin and some far from it
    # (the full 4,500-start comparison is benchmarks/fit.py).
    grid = StartGrid(a=(0.0, 10.0), b=(5.0, 20.0), e=(0.0, 1.0), alpha=(0.5,), beta=(0.0, 0.5, 1.0))
    args = (epoch_points["params"], epoch_points["tokens"], epoch_points["loss"])
    batched = fit_chinchilla_arrays(*args, grid=grid, solver="batched")
    reference = fit_chinchilla_arrays(*args, grid=grid, solver="scipy")
    assert batched.objective == pytest.approx(reference.objective, rel=1e-7)
    for name in ("E", "A", "B", "alpha", "beta"):
        assert getattr(batched, name) == pytest.approx(getattr(reference, name), rel=2e-3), name


def test_analytic_gradient_matches_finite_differences(epoch_points):
    objective = HuberLogLossObjective(epoch_points["params"], epoch_points["tokens"], epoch_points["loss"])
    theta = np.array([[6.0, 7.5, 0.6, 0.35, 0.37], [3.0, 20.0, -1.0, 1.5, 0.5], [25.0, 0.0, 1.0, 2.0, 0.0]])
    _, grad = objective.value_and_grad(theta)
    step = 1e-6
    for k in range(5):
        up, down = theta.copy(), theta.copy()
        up[:, k] += step
        down[:, k] -= step
        numeric = (objective.value_and_grad(up)[0] - objective.value_and_grad(down)[0]) / (2 * step)
        np.testing.assert_allclose(grad[:, k], numeric, rtol=1e-4, atol=1e-9)


def test_extreme_parameters_fall_back_to_stable_logsumexp(epoch_points):
    objective = HuberLogLossObjective(epoch_points["params"], epoch_points["tokens"], epoch_points["loss"])
    log_n = np.log(epoch_points["params"])
    # The N term spans ~1,000 nats across runs and the others are far below it, so a single
    # shift per row underflows for the largest models; those rows must be recomputed exactly.
    alpha, a, b, e = 200.0, 200.0 * log_n.min(), -2000.0, -900.0
    assert alpha * np.ptp(log_n) > 800
    value, grad = objective.value_and_grad(np.array([[a, b, e, alpha, 0.0]]))
    assert np.isfinite(value).all() and np.isfinite(grad).all()
    predicted = np.logaddexp(np.logaddexp(a - alpha * log_n, b), e)
    residual = predicted - np.log(epoch_points["loss"])
    expected = np.where(np.abs(residual) <= 1e-3, 0.5 * residual**2, 1e-3 * (np.abs(residual) - 0.5e-3)).sum()
    assert value[0] == pytest.approx(expected, rel=1e-9)


def test_recovers_noise_free_law(known_law):
    rng = np.random.default_rng(3)
    n = np.exp(rng.uniform(np.log(1e7), np.log(1e10), 120))
    d = np.exp(rng.uniform(np.log(1e9), np.log(1e12), 120))
    grid = StartGrid(a=(0.0, 5.0, 10.0), b=(0.0, 5.0, 10.0), e=(0.0, 0.5), alpha=(0.2, 0.5), beta=(0.2, 0.5))
    fit = fit_chinchilla_arrays(n, d, known_law.loss(n, d), grid=grid)
    assert fit.objective < 1e-12
    for name in ("E", "A", "B", "alpha", "beta"):
        assert getattr(fit, name) == pytest.approx(getattr(known_law, name), rel=1e-3), name
    np.testing.assert_allclose(fit.predict(n, d), known_law.loss(n, d), rtol=1e-6)


def test_rejects_unfittable_inputs():
    with pytest.raises(ValueError, match="at least 5"):
        fit_chinchilla_arrays([1e6, 1e7], [1e8, 1e9], [3.0, 2.5])
    with pytest.raises(ValueError, match="differ in length"):
        fit_chinchilla_arrays([1e6] * 6, [1e8] * 5, [3.0] * 6)
    with pytest.raises(ValueError, match="positive finite"):
        fit_chinchilla_arrays([1e6] * 6, [1e8] * 6, [3.0] * 5 + [0.0])
