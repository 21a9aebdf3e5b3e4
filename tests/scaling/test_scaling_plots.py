import numpy as np

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
