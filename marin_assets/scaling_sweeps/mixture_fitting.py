"""The fit of a mixture-weight sweep (``mixture_fit/<sweep>``): its points' eval metrics regressed on
their weights (`scaling.mixture`), for the target (the mean over the target eval sets) and for each
eval set, with the predicted best mixture of each.

Pure: no Dagster import; the asset in `assets` reads the evaluations and writes what this returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from marin_assets.scaling_sweeps.config import MixtureSweepConfig
from marin_assets.scaling_sweeps.forecasting import SweepFitError
from marin_assets.training.metrics import eval_sets
from marin_assets.training.spec import RunSpec
from scaling.mixture import (
    MixtureFitRefused,
    MixtureOptimum,
    MixtureRegression,
    best_mixture,
    fit_mixture_regression,
)
from scaling.plots import plot_mixture_fit, plot_mixture_refused

TARGET = "target"


@dataclass(frozen=True)
class MixtureSweepFit:
    result: dict[str, Any]
    """fit.json: the runs' weights and metrics, and each fit (or why the target was not fitted)."""
    png: bytes

    @property
    def status(self) -> str:
        return self.result["status"]


def target_sets(config: MixtureSweepConfig, metrics: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The eval sets the target averages: the declared ones, else every set some point reports."""
    return list(config.fit.target) or sorted({s for m in metrics.values() for s in eval_sets(m)})


def points_table(config: MixtureSweepConfig, points: Mapping[str, RunSpec],
                 metrics: Mapping[str, Mapping[str, float]]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """One row per point (its weights, each set's metric, the target); the target's sets; the sets
    every point reports. `SweepFitError` (one line) for a point without an eval, or one whose eval
    lacks a target set's metric."""
    metric = config.fit.metric
    missing = [run for run in points if run not in metrics]
    if missing:
        raise SweepFitError(f"no eval of point(s) {', '.join(missing)} of mixture sweep {config.name!r}: marin "
                            f"materialize mixture_sweep_eval/{config.name} --partition {missing[0]}")
    targets = target_sets(config, metrics)
    if not targets:
        raise SweepFitError(f"the evals of mixture sweep {config.name!r} report no eval set's {metric}")
    for run, values in metrics.items():
        absent = [s for s in targets if f"eval/{s}/{metric}" not in values]
        if absent:
            raise SweepFitError(f"eval[{run}] has no {', '.join(f'eval/{s}/{metric}' for s in absent)} "
                                f"(has {', '.join(sorted(values))})")
    common = sorted(set.intersection(*({s for s in eval_sets(m) if f"eval/{s}/{metric}" in m}
                                       for m in metrics.values())))
    rows = []
    for run, spec in points.items():
        values = metrics[run]
        row = {"run": run, "weights": dict(spec.mixture_weights or {}),
               **{f"eval/{s}/{metric}": float(values[f"eval/{s}/{metric}"]) for s in common}}
        row[TARGET] = float(np.mean([values[f"eval/{s}/{metric}"] for s in targets]))
        rows.append(row)
    return rows, targets, common


def target_name(config: MixtureSweepConfig, targets: list[str]) -> str:
    metric = config.fit.metric
    return f"eval/{targets[0]}/{metric}" if len(targets) == 1 else f"mean {metric} of {', '.join(targets)}"


def fit_record(fit: MixtureRegression, optimum: MixtureOptimum, runs: list[str]) -> dict[str, Any]:
    alone = fit.predict(np.eye(len(fit.components)))
    return {"coefficients": dict(zip(fit.components, map(float, fit.coefficients))),
            "alone": dict(zip(fit.components, map(float, alone))),
            "r2": fit.r2, "loo_rmse": fit.loo_rmse, "residual_scale": fit.residual_scale,
            "degrees_of_freedom": fit.degrees_of_freedom,
            "runs": [{"run": r, "actual": float(a), "fitted": float(f), "loo": float(o) if np.isfinite(o) else None}
                     for r, a, f, o in zip(runs, fit.losses, fit.fitted, fit.loo)],
            "best": optimum.to_dict()}


def fit_mixture_sweep(config: MixtureSweepConfig, points: Mapping[str, RunSpec],
                      metrics: Mapping[str, Mapping[str, float]]) -> MixtureSweepFit:
    """The sweep's fit from its points (name -> spec, whose ``mixture_weights`` are the point's) and
    their evals' metrics (name -> ``{eval/<set>/<metric>: value}``). A target the runs cannot give
    a regression is a refused fit (its ``status`` says why); a missing eval is `SweepFitError`."""
    rows, targets, common = points_table(config, points, metrics)
    runs = [r["run"] for r in rows]
    weights = [r["weights"] for r in rows]
    name = target_name(config, targets)
    result: dict[str, Any] = {"sweep": config.name, "run": config.run, "target": name, "runs": rows,
                              "fit": {**dataclasses.asdict(config.fit), "target": targets}}
    try:
        target_fit = fit_mixture_regression(weights, [r[TARGET] for r in rows], log_loss=config.fit.log_loss)
    except MixtureFitRefused as refused:
        result["status"] = f"refused: {refused}"
        return MixtureSweepFit(result, plot_mixture_refused(runs, [r[TARGET] for r in rows], name, str(refused)))
    options = config.fit.options()
    optimum = best_mixture(target_fit, options)
    result["components"] = list(target_fit.components)
    result["fits"] = {TARGET: fit_record(target_fit, optimum, runs)}
    for eval_set in common:
        key = f"eval/{eval_set}/{config.fit.metric}"
        try:
            set_fit = fit_mixture_regression(weights, [r[key] for r in rows], log_loss=config.fit.log_loss)
            result["fits"][key] = fit_record(set_fit, best_mixture(set_fit, options), runs)
        except MixtureFitRefused as refused:  # e.g. one set's loss not finite
            result["fits"][key] = {"status": f"refused: {refused}"}
    best = result["fits"][TARGET]["best"]
    result["status"] = (f"fitted on {len(rows)} runs: R^2 {target_fit.r2:.3f}, best mixture "
                        + ", ".join(f"{c} {w:.3f}" for c, w in best["weights"].items())
                        + f", {name} {best['loss']:.4g}"
                        + (f" (extrapolated beyond the swept {', '.join(best['extrapolated'])})"
                           if best["extrapolated"] else ""))
    return MixtureSweepFit(result, plot_mixture_fit(target_fit, optimum, runs, name))
