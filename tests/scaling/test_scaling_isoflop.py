import numpy as np
import pytest

from scaling import IsoflopOptions, fit_isoflop
from scaling.isoflop import (
    EnvelopeRefused,
    fit_envelope,
    fit_isoflop_runs,
    group_budgets,
    isoflop_profiles,
    robust_quadratic,
)
from scaling.runs import RunsError, load_runs

BUDGETS = np.geomspace(1e18, 1e21, 7)
TARGETS = [1e22, 1e23]


def test_recovers_known_frontier_without_noise(known_law):
    result = fit_isoflop(known_law.sweep(BUDGETS), TARGETS, options=IsoflopOptions(bootstrap_samples=0))
    assert len(result["optima"]) == len(BUDGETS)
    for optimum in result["optima"]:
        flops = optimum["flops"]
        # A quadratic in log size only approximates the valley, so the optimum carries a
        # small, systematic error; it must still be within a few percent.
        assert optimum["params"] == pytest.approx(known_law.optimal_params(flops), rel=0.05)
        assert optimum["tokens"] == pytest.approx(known_law.optimal_tokens(flops), rel=0.05)
        assert optimum["loss"] == pytest.approx(known_law.optimal_loss(flops), rel=2e-3)
        assert optimum["interior"] is True
    law = result["law"]
    assert law["params_exponent"] == pytest.approx(known_law.params_exponent, abs=0.01)
    assert law["tokens_exponent"] == pytest.approx(1 - known_law.params_exponent, abs=0.01)
    assert law["alpha"] == pytest.approx(known_law.loss_exponent, rel=0.03)
    assert law["E"] == pytest.approx(known_law.E, rel=0.02)
    for prediction in result["predictions"]:
        assert prediction["loss"] == pytest.approx(known_law.optimal_loss(prediction["flops"]), rel=3e-3)
        assert prediction["params"] == pytest.approx(known_law.optimal_params(prediction["flops"]), rel=0.08)


@pytest.mark.slow  # hundreds of refits (about 8 s each on 2 loaded cores)
@pytest.mark.parametrize("resample", ["residuals", "runs"])
def test_bootstrap_interval_contains_truth_and_is_deterministic(known_law, resample):
    runs = known_law.sweep(BUDGETS, noise=0.005, seed=11)
    options = IsoflopOptions(bootstrap_samples=200, seed=7, resample=resample)
    first = fit_isoflop(runs, TARGETS, options=options)
    again = fit_isoflop(runs, TARGETS, options=options)
    assert first == again
    assert first["bootstrap"]["used"] >= 190
    for prediction in first["predictions"]:
        flops = prediction["flops"]
        assert prediction["loss_low"] < prediction["loss"] < prediction["loss_high"]
        assert prediction["loss_low"] <= known_law.optimal_loss(flops) <= prediction["loss_high"]
        assert prediction["params_low"] <= known_law.optimal_params(flops) <= prediction["params_high"]
        assert prediction["tokens_low"] <= known_law.optimal_tokens(flops) <= prediction["tokens_high"]
    # A different seed resamples differently.
    other = fit_isoflop(runs, TARGETS, options=IsoflopOptions(bootstrap_samples=200, seed=8, resample=resample))
    assert other["predictions"][0]["loss_low"] != first["predictions"][0]["loss_low"]
    # Wider coverage, wider interval.
    wide = fit_isoflop(runs, TARGETS, options=IsoflopOptions(bootstrap_samples=200, seed=7, interval=0.99,
                                                             resample=resample))
    assert wide["predictions"][1]["loss_high"] - wide["predictions"][1]["loss_low"] > (
        first["predictions"][1]["loss_high"] - first["predictions"][1]["loss_low"]
    )


def test_robust_quadratic_resists_an_outlier():
    x = np.linspace(-2.0, 2.0, 9)
    y = 3.0 + 0.4 * x + 0.5 * x**2
    y_bad = y.copy()
    y_bad[1] += 2.0  # one diverged run
    center, coef, ok = robust_quadratic(x[None, :], y_bad[None, :], IsoflopOptions())
    assert ok[0]
    robust_argmin = center[0] - coef[0, 1] / (2 * coef[0, 2])
    c2, c1, _ = np.polyfit(x, y_bad, 2)
    least_squares_argmin = -c1 / (2 * c2)
    assert abs(robust_argmin - (-0.4)) < 0.02
    assert abs(least_squares_argmin - (-0.4)) > 0.1


def test_envelope_fit_recovers_parameters():
    flops = np.geomspace(1e18, 1e22, 6)
    loss = 1.9 + 300.0 * flops**-0.12
    e, a, alpha = fit_envelope(flops, loss)
    assert (e, a, alpha) == pytest.approx((1.9, 300.0, 0.12), rel=1e-5)


def test_budgets_group_by_relative_flops():
    flops = np.array([1.0e15, 1.003e15, 0.998e15, 3e15, 3.01e15, 1e16])
    groups = group_budgets(flops, tolerance=0.05)
    assert [sorted(g.tolist()) for g in groups] == [[0, 1, 2], [3, 4], [5]]
    assert len(group_budgets(flops, tolerance=0.0)) == 6


def test_realised_flops_near_nominal_budget_share_a_budget(known_law):
    rows = known_law.sweep(BUDGETS[:4])
    for i, row in enumerate(rows):
        row["flops"] *= 1.0 + 0.004 * ((i % 3) - 1)  # integer steps: realised FLOPs jitter
    result = fit_isoflop(rows, [], options=IsoflopOptions(bootstrap_samples=0))
    assert [o["runs"] for o in result["optima"]] == [9, 9, 9, 9]
    assert result["predictions"] == []


def test_non_convex_budget_is_skipped_and_reported(known_law):
    rows = known_law.sweep(BUDGETS[:4])
    broken = [r for r in rows if r["flops"] == BUDGETS[0]]
    for r, bump in zip(broken, [-0.3, -0.1, 0.0, 0.1, 0.2, 0.1, 0.0, -0.1, -0.3]):
        r["loss"] = 3.0 + bump  # a hump instead of a valley
    result = fit_isoflop(rows, [1e22], options=IsoflopOptions(bootstrap_samples=20))
    assert len(result["optima"]) == 3
    assert len(result["skipped"]) == 1
    assert result["skipped"][0]["flops"] == pytest.approx(BUDGETS[0])
    assert "not convex" in result["skipped"][0]["reason"]


def test_too_few_runs_in_a_budget_is_an_error(known_law):
    rows = known_law.sweep(BUDGETS[:4])
    rows += known_law.sweep([1e22], sizes_per_budget=2)
    with pytest.raises(RunsError, match=r"budget 1e\+22 FLOPs has 2 run\(s\); a quadratic fit needs at least 3"):
        fit_isoflop(rows, [1e23])


def test_too_few_budgets_is_an_error(known_law):
    with pytest.raises(RunsError, match="needs at least 3"):
        fit_isoflop(known_law.sweep(BUDGETS[:2]), [1e23])


def test_accepts_polars_dataframe(known_law):
    import polars as pl

    rows = known_law.sweep(BUDGETS[:3])
    frame = pl.DataFrame(rows).with_columns(pl.lit("x").alias("run_name"))
    options = IsoflopOptions(bootstrap_samples=0)
    assert fit_isoflop(frame, [1e21], options=options) == fit_isoflop(rows, [1e21], options=options)


def test_runs_are_validated_with_row_and_column():
    good = {"flops": 1e15, "params": 1e6, "tokens": 1e8, "loss": 3.0}
    with pytest.raises(RunsError, match=r"row 2, column 'loss': must be positive"):
        load_runs([good, {**good, "loss": -1.0}])
    with pytest.raises(RunsError, match=r"row 1, column 'params': not a number: 'abc'"):
        load_runs([{**good, "params": "abc"}])
    with pytest.raises(RunsError, match=r"not a finite number"):
        load_runs([{**good, "tokens": float("nan")}])
    with pytest.raises(RunsError, match=r"missing required column\(s\) tokens"):
        load_runs([{k: v for k, v in good.items() if k != "tokens"}])
    with pytest.raises(RunsError, match="no runs"):
        load_runs([])
    derived = load_runs([{k: v for k, v in good.items() if k != "tokens"}], derive_tokens=True)
    assert derived.tokens[0] == pytest.approx(1e15 / 6e6)
    # Approach 3 does not need flops; with tokens present it is derived the same way.
    no_flops = load_runs([{k: v for k, v in good.items() if k != "flops"}], derive_tokens=True)
    assert no_flops.flops[0] == pytest.approx(6 * 1e6 * 1e8)
    with pytest.raises(RunsError, match=r"missing required column\(s\) flops, tokens"):
        load_runs([{"params": 1e6, "loss": 3.0}], derive_tokens=True)


def test_prediction_budgets_must_be_positive(known_law):
    runs = load_runs(known_law.sweep(BUDGETS[:3]))
    with pytest.raises(ValueError, match="positive finite"):
        fit_isoflop_runs(runs, [1e21, -1.0])


def test_residual_bootstrap_keeps_small_sweeps_fittable(known_law):
    # A micro sweep: three budgets of five runs. Resampling whole runs leaves most replicates
    # without three distinct sizes (or convex valleys) in every budget; residuals keep them all.
    runs = known_law.sweep([1e18, 2e18, 4e18], sizes_per_budget=5, noise=0.01, seed=3)
    by_runs = fit_isoflop(runs, [4e19], options=IsoflopOptions(bootstrap_samples=200, resample="runs"))
    by_residuals = fit_isoflop(runs, [4e19], options=IsoflopOptions(bootstrap_samples=200))
    assert by_residuals["bootstrap"]["resample"] == "residuals"
    assert by_residuals["bootstrap"]["used"] >= 190 > by_runs["bootstrap"]["used"]
    prediction = by_residuals["predictions"][0]
    assert prediction["loss_low"] < prediction["loss"] < prediction["loss_high"]


def valleys(optima, sizes=5, curvature=0.05, noise=0.0, seed=0) -> list[dict[str, float]]:
    """Runs around given optima (flops, N*, D*, L*): N = N* f and D = D* / f for f spread 4x either
    way, loss L* + curvature (ln f)^2, so each budget's vertex is exactly (N*, D*, L*)."""
    rng = np.random.default_rng(seed)
    return [{"flops": c, "params": n * f, "tokens": d / f,
             "loss": float((best + curvature * np.log(f) ** 2) * np.exp(rng.normal(0.0, noise)))}
            for c, n, d, best in optima for f in np.geomspace(0.25, 4.0, sizes)]


def test_three_run_valleys_give_zero_width_intervals_which_are_refused(known_law):
    # Exactly three runs per budget: each quadratic interpolates, so no replicate differs and the
    # "interval" would claim a certainty the sweep does not have.
    runs = known_law.sweep(BUDGETS, sizes_per_budget=3, noise=0.001, seed=3)
    with pytest.raises(EnvelopeRefused, match=r"zero-width intervals of loss, params, tokens at 1e\+22 FLOPs"):
        fit_isoflop(runs, [1e22], options=IsoflopOptions(bootstrap_samples=50))
    # Without the bootstrap the same fit claims no interval, and its point predictions stand.
    point = fit_isoflop(runs, [1e22], options=IsoflopOptions(bootstrap_samples=0))["predictions"][0]
    assert point["loss_low"] is None and point["loss"] == pytest.approx(known_law.optimal_loss(1e22), rel=0.01)


def test_a_budget_whose_minimum_lies_outside_its_runs_is_left_out_and_reported(known_law):
    rows = known_law.sweep(BUDGETS[:3], noise=0.002, seed=1)
    # The fourth budget sampled only models 2..32x too large: its vertex lies beyond its most tokens.
    rows += known_law.sweep([BUDGETS[3]], centre=8.0, noise=0.002, seed=1)
    result = fit_isoflop(rows, [1e22], options=IsoflopOptions(bootstrap_samples=20))
    assert [o["flops"] for o in result["optima"]] == pytest.approx(BUDGETS[:3].tolist())
    (left_out,) = result["skipped"]
    assert left_out["flops"] == pytest.approx(BUDGETS[3]) and left_out["interior"] is False
    assert left_out["reason"].startswith("minimum outside its runs (D* ")
    assert " sampled tokens; N* " in left_out["reason"] and left_out["reason"].endswith(" sampled params)")
    everything_in = fit_isoflop(known_law.sweep(BUDGETS[:3], noise=0.002, seed=1), [1e22],
                                options=IsoflopOptions(bootstrap_samples=20))
    assert result["law"] == everything_in["law"]  # the budget left out does not move the fit


def test_convex_profiles_with_minima_beyond_the_sampled_tokens_are_refused(known_law):
    """Every budget's valley is convex, but its vertex is an extrapolation past the runs (the demo's case)."""
    runs = load_runs(known_law.sweep(BUDGETS[:3], sizes_per_budget=5, centre=8.0, noise=0.002, seed=2))
    assert all(b.tokens > b.tokens_range[1] for b in isoflop_profiles(runs).budgets)
    with pytest.raises(EnvelopeRefused, match=r"^not enough interior optima: 0 of 3 budget\(s\) .* needs at least 3 "
                                              r"\(left out: 1e\+18 FLOPs: minimum outside its runs \(D\* "):
        fit_isoflop_runs(runs, [1e22])


def test_an_envelope_without_a_floor_is_refused():
    """Optima that fall by the same amount per doubling of compute (micro-Delphi attempt 5) fit E = 0."""
    budgets = [3e11, 6e11, 1.2e12]
    optima = [(c, 4e4, c / 2.4e5, best) for c, best in zip(budgets, (5.636, 5.417, 5.185))]
    with pytest.raises(EnvelopeRefused, match=r"envelope refused: E = 0 at its bound of 0; the optimal losses 5.636, "
                                              r"5.417, 5.185 do not flatten"):
        fit_isoflop(valleys(optima), [1.2e13], options=IsoflopOptions(bootstrap_samples=0))


def test_a_prediction_that_spends_another_budget_than_its_own_is_refused():
    # Recorded FLOPs that grow slower than N* D*: the optima buy 4x more parameter-tokens per doubling
    # of the budget, and extrapolated 100x the law's model would cost far more than the budget.
    budgets = [1e18, 1e19, 1e20]
    optima = [(c, 1e8 * s, c / 6e8, 1.8 + 400 * c**-0.15) for c, s in zip(budgets, (1.0, 4.0, 16.0))]
    fitted = fit_isoflop(valleys(optima), [2e20], options=IsoflopOptions(bootstrap_samples=0))
    assert fitted["predictions"][0]["params"] == pytest.approx(16e8 * 2 ** np.log10(4.0), rel=1e-6)
    with pytest.raises(EnvelopeRefused, match=r"at 1e\+22 FLOPs it predicts N\* = 2.56e\+10 parameters and "
                                              r"D\* = 1.67e\+13 tokens, which spend 0.0234 FLOPs per parameter per "
                                              r"token; the fit runs spend 0.375..6 \(2x either way allowed\)"):
        fit_isoflop(valleys(optima), [1e22], options=IsoflopOptions(bootstrap_samples=0))
