import numpy as np
import pytest

from scaling import IsoflopOptions, fit_chinchilla_arrays, load_runs
from scaling.isoflop import fit_isoflop_runs
from scaling.plots import (
    plot_envelope,
    plot_isoflop_summary,
    plot_isoflops,
    plot_joint_forecast,
    plot_optimal_allocation,
)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # every matplotlib figure
def test_every_plot_returns_png_and_writes_it(tmp_path, known_law):
    runs = load_runs(known_law.sweep(np.geomspace(1e18, 1e21, 5), noise=0.003, seed=4))
    fit = fit_isoflop_runs(runs, [1e22], IsoflopOptions(bootstrap_samples=30))
    joint = fit_chinchilla_arrays(runs.params, runs.tokens, runs.loss)
    forecast = {"params": 5e9, "tokens": 1e11, "loss": 2.1, "loss_low": 2.0, "loss_high": 2.2, "label": "target"}
    for name, draw in {
        "isoflops": lambda path: plot_isoflops(fit, runs, path),
        "envelope": lambda path: plot_envelope(fit, path),
        "allocation": lambda path: plot_optimal_allocation(fit, path),
        "summary": lambda path: plot_isoflop_summary(fit, runs, path),
        "joint": lambda path: plot_joint_forecast(joint, runs, [forecast], path),
    }.items():
        path = tmp_path / "nested" / f"{name}.png"
        data = draw(path)
        assert data.startswith(PNG) and len(data) > 10_000
        assert path.read_bytes() == data
    assert plot_envelope(fit).startswith(PNG)  # bytes only, no file


def test_summary_plots_three_runs_a_budget_whose_bootstrap_cannot_vary():
    """Three runs a budget leave no residual to resample: every replicate is the point fit, and
    its percentiles may miss the point by rounding; the plot draws no negative bar (the demo sweep)."""
    rows = [{"flops": c, "params": n, "tokens": c / (6 * n), "loss": 6.0 - 0.1 * k + 0.02 * (j - 1) ** 2}
            for k, c in enumerate((2.5e10, 3.5e10, 5e10)) for j, n in enumerate((17e3, 35e3, 82e3))]
    runs = load_runs(rows)
    fit = fit_isoflop_runs(runs, [5e11], IsoflopOptions(bootstrap_samples=20))
    assert plot_isoflop_summary(fit, runs).startswith(PNG)
