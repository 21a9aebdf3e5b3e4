"""Scaling-law library: FLOPs accounting, isoFLOP sweep recipes, and scaling-law fits.

Pure numpy/scipy/matplotlib; no Dagster, and no JAX/Levanter imports, so it loads fast
inside the Dagster code location and in the CLI (``python -m scaling``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .chinchilla import HUBER_DELTA, ChinchillaFit, StartGrid, fit_chinchilla_arrays
from .flops import (
    ModelDims,
    forward_flops_per_token,
    param_count,
    training_flops_per_token,
)
from .isoflop import EnvelopeRefused, IsoflopFit, IsoflopOptions, fit_isoflop_runs, isoflop_profiles
from .recipe import BudgetPlan, Candidate, MicroRecipe, Recipe
from .runs import Runs, RunsError, load_runs

__all__ = [
    "BudgetPlan",
    "Candidate",
    "ChinchillaFit",
    "EnvelopeRefused",
    "IsoflopFit",
    "IsoflopOptions",
    "MicroRecipe",
    "ModelDims",
    "Recipe",
    "Runs",
    "RunsError",
    "StartGrid",
    "fit_chinchilla",
    "fit_chinchilla_arrays",
    "fit_isoflop",
    "fit_isoflop_runs",
    "forward_flops_per_token",
    "isoflop_profiles",
    "load_runs",
    "param_count",
    "training_flops_per_token",
]


def fit_isoflop(
    runs: Any,
    predict: list[float],
    *,
    options: IsoflopOptions | None = None,
    plot: str | Path | None = None,
) -> dict:
    """Approach 2 plus envelope and bootstrap; returns the same JSON-ready dict as the CLI.

    ``runs``: CSV path, list of dicts, or polars/pandas DataFrame with flops, params, tokens,
    loss. ``plot``: optional PNG path for the two-panel summary figure; when the envelope is refused
    (`EnvelopeRefused`, raised), the profiles under a banner saying why.
    """
    table = load_runs(runs)
    options = options or IsoflopOptions()
    try:
        fit = fit_isoflop_runs(table, predict, options)
    except EnvelopeRefused as refused:
        if plot is not None:
            from .plots import plot_envelope_refused

            plot_envelope_refused(table, isoflop_profiles(table, options).budgets, str(refused), plot)
        raise
    if plot is not None:
        from .plots import plot_isoflop_summary

        plot_isoflop_summary(fit, table, plot)
    return fit.to_dict()


def fit_chinchilla(
    runs: Any,
    *,
    derive_tokens: bool = False,
    delta: float = HUBER_DELTA,
    grid: StartGrid | None = None,
    solver: str = "batched",
) -> dict:
    """Approach 3 (Huber on log loss, multi-start); returns the same dict as the CLI.

    With ``derive_tokens`` a table lacking a tokens column gets tokens = flops / (6 params).
    """
    table = load_runs(runs, derive_tokens=derive_tokens)
    fit = fit_chinchilla_arrays(
        table.params, table.tokens, table.loss, delta=delta, grid=grid or StartGrid(), solver=solver
    )
    return fit.to_dict()
