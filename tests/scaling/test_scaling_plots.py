import io

import numpy as np
import pytest
from PIL import Image

from scaling import EnvelopeRefused, IsoflopOptions, fit_chinchilla_arrays, isoflop_profiles, load_runs
from scaling.isoflop import fit_isoflop_runs
from scaling.plots import (
    BANNER_FACE,
    plot_envelope,
    plot_envelope_refused,
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


def test_a_refused_envelope_is_drawn_under_a_banner_saying_why(known_law):
    """Convex valleys whose minima lie beyond their runs (the demo sweep's): the figure shows the
    profiles, no envelope, and a banner with the refusal; its text is also the PNG's Description."""
    runs = load_runs(known_law.sweep(np.geomspace(1e18, 1e20, 3), sizes_per_budget=3, centre=8.0))
    with pytest.raises(EnvelopeRefused) as refused:
        fit_isoflop_runs(runs, [1e21])
    profiles = isoflop_profiles(runs).budgets
    png = plot_envelope_refused(runs, profiles, str(refused.value))
    image = Image.open(io.BytesIO(png))
    assert image.text["Description"] == f"Envelope not fitted: {refused.value}"
    assert image.text["Description"].startswith("Envelope not fitted: not enough interior optima: 0 of 3")
    face = tuple(int(BANNER_FACE[i:i + 2], 16) for i in (1, 3, 5))
    banner_pixels = (np.asarray(image.convert("RGB")) == face).all(axis=-1)
    assert banner_pixels.mean() > 0.05  # a band across the top, not a speck
    assert banner_pixels[: image.height // 4].sum() > 0.9 * banner_pixels.sum()
    # A fitted envelope's figure has none of the banner's colour.
    sane = load_runs(known_law.sweep(np.geomspace(1e18, 1e20, 3), sizes_per_budget=5))
    fitted = fit_isoflop_runs(sane, [1e21], IsoflopOptions(bootstrap_samples=0))
    plain = Image.open(io.BytesIO(plot_isoflop_summary(fitted, sane)))
    assert not (np.asarray(plain.convert("RGB")) == face).all(axis=-1).any()
