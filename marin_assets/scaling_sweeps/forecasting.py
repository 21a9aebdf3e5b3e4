"""Fit a sweep's finished runs, forecast its target runs, and score a forecast against the result.

The fit is approach 2 (`scaling.fit_isoflop_runs`): per-budget valleys, the envelope
L*(C) = E + A C^-alpha and N*(C), with seeded bootstrap intervals. A target budget's
candidates are forecast on the extrapolated valley

    L(N; C) = L*(C) + k (ln N - ln N*(C))^2

with k the mean curvature in ln N of the fitted budgets' valleys (valleys keep their width in
ln N across budgets). Intervals come from the same bootstrap replicates of L*(C) and N*(C);
the uncertainty of k is not propagated. The forecast target of a budget is the candidate with
the lowest forecast loss, i.e. the recipe's model nearest the forecast compute-optimal size.

Pure: numpy and `scaling` only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from marin_assets.scaling_sweeps.config import PlannedRun, SweepPlan, fit_params
from scaling import IsoflopOptions, fit_isoflop_runs, load_runs


class SweepFitError(ValueError):
    """The sweep's results cannot be fitted (missing runs, missing metric, unusable budgets)."""


def eval_loss_key(eval_set: str) -> str:
    return f"eval/{eval_set}/loss"


def runs_table(plan: SweepPlan, losses: Mapping[str, float]) -> list[dict[str, Any]]:
    """One row per fit run: the planned flops/params/tokens and the measured eval loss."""
    fit_runs = plan.fit_runs()
    missing = sorted(r.spec.name for r in fit_runs if r.spec.name not in losses)
    if missing:
        raise SweepFitError(f"sweep {plan.config.name!r}: no eval loss for fit run(s) {missing}")
    rows = []
    for run in fit_runs:
        c = run.candidate
        rows.append({"run": run.spec.name, "budget": c.budget, "hidden_dim": c.hidden_dim, "num_layers": c.num_layers,
                     "flops": c.flops, "params": fit_params(c, plan.config.params), "tokens": c.tokens,
                     "loss": float(losses[run.spec.name])})
    return rows


@dataclass(frozen=True)
class SweepFit:
    result: dict[str, Any]
    """JSON-ready: runs, the isoFLOP fit (optima, law, predictions, bootstrap) and target forecasts."""
    png: bytes


def fit_sweep(plan: SweepPlan, rows: list[dict[str, Any]]) -> SweepFit:
    config = plan.config
    table = load_runs(rows)
    targets = {budget: plan.target_candidates(budget) for budget in config.target_budgets}
    # Predict at each target budget (the envelope) and at every target candidate's realised FLOPs.
    predict = list(config.target_budgets) + [r.candidate.flops for runs in targets.values() for r in runs]
    options = IsoflopOptions(bootstrap_samples=config.bootstrap_samples, seed=config.seed, interval=config.interval)
    try:
        fit = fit_isoflop_runs(table, predict, options)
    except ValueError as exc:  # RunsError is a ValueError
        raise SweepFitError(f"sweep {config.name!r}: {exc}") from exc
    from scaling.plots import plot_isoflop_summary

    png = plot_isoflop_summary(fit, table)
    curvature = float(np.mean([b.params_coef[2] for b in fit.budgets]))
    tail = 100.0 * (1.0 - config.interval) / 2.0
    predictions = fit.predictions()
    forecasts = []
    column = len(config.target_budgets)
    for i, (budget, candidates) in enumerate(targets.items()):
        scored = []
        for run in candidates:
            n = float(fit_params(run.candidate, config.params))
            flops = run.candidate.flops
            point = float(fit.law.loss(flops) + curvature * (np.log(n) - np.log(fit.law.params(flops))) ** 2)
            replicates = fit.boot_loss[:, column] + curvature * (np.log(n) - np.log(fit.boot_params[:, column])) ** 2
            column += 1
            low, high = (float(np.percentile(replicates, tail)), float(np.percentile(replicates, 100 - tail))) \
                if replicates.size else (None, None)
            scored.append({"run": run.spec.name, "hidden_dim": run.candidate.hidden_dim, "params": n,
                           "tokens": run.candidate.tokens, "flops": run.candidate.flops,
                           "loss": point, "loss_low": low, "loss_high": high})
        chosen = min(scored, key=lambda s: s["loss"])
        forecasts.append({"budget": budget, "envelope": predictions[i], "candidates": scored, "chosen": chosen["run"]})
    result = {"sweep": config.name, "params_column": config.params, "eval_set": config.eval_set, "runs": rows,
              "fit": fit.to_dict(), "valley_curvature": curvature, "targets": forecasts}
    # Plain JSON types only (numpy scalars would not serialize into Dagster metadata).
    return SweepFit(json.loads(json.dumps(result, default=float)), png)


def forecast_record(fit_result: Mapping[str, Any]) -> dict[str, Any]:
    """What is frozen before training: per target budget, the chosen run and its forecast interval."""
    targets = []
    for target in fit_result["targets"]:
        chosen = next(c for c in target["candidates"] if c["run"] == target["chosen"])
        targets.append({"budget": target["budget"], **chosen, "envelope_loss": target["envelope"]["loss"]})
    return {"sweep": fit_result["sweep"], "eval_set": fit_result["eval_set"], "targets": targets}


def chosen_target(plan: SweepPlan, forecast: Mapping[str, Any], budget: float) -> PlannedRun:
    """The target candidate a forecast chose for `budget` (KeyError when it is not in the current plan)."""
    wanted = next((t["run"] for t in forecast["targets"] if t["budget"] == budget), None)
    if wanted is None:
        raise KeyError(f"the forecast has no target budget {budget:g}")
    for run in plan.target_candidates(budget):
        if run.spec.name == wanted:
            return run
    raise KeyError(f"forecast chose {wanted!r}, which the current plan of budget {budget:g} does not contain")


def score_forecast(target: Mapping[str, Any], actual: float, error_goal: float) -> dict[str, Any]:
    """Actual loss against one target's forecast: signed relative error and interval membership."""
    predicted, low, high = float(target["loss"]), target.get("loss_low"), target.get("loss_high")
    error = (predicted - actual) / actual
    inside = low is not None and high is not None and low <= actual <= high
    return {"run": target["run"], "budget": target["budget"], "actual": actual, "predicted": predicted,
            "low": low, "high": high, "error_pct": 100.0 * error, "within_interval": bool(inside),
            "within_goal": bool(abs(error) <= error_goal)}
