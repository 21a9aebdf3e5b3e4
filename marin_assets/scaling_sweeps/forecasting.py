"""Fit a sweep's finished runs, forecast its target runs, and score a forecast against the result.

Two forecasts are made for every target candidate, from the same fit runs:

* ``envelope`` (approach 2, `scaling.fit_isoflop_runs`): per-budget valleys, the envelope
  L*(C) = E + A C^-alpha and N*(C); a candidate's loss is read off the extrapolated valley

      L(N; C) = L*(C) + k (ln N - ln N*(C))^2

  with k the mean curvature in ln N of the fitted budgets' valleys (valleys keep their width
  in ln N across budgets). Intervals come from the isoFLOP bootstrap of L*(C) and N*(C); the
  uncertainty of k is not propagated.
* ``joint`` (approach 3, `scaling.fit_chinchilla_arrays`): L(N, D) = E + A/N^alpha + B/D^beta
  fitted to every fit run at once and evaluated at the candidate's own N and D. Intervals
  come from a bootstrap over runs.

The sweep's ``forecast_method`` names the primary one, fixed in the config before any target
trains: it picks the target (the candidate with the lowest primary forecast, i.e. the recipe's
model nearest the forecast compute optimum) and is what the forecast check scores; the other
method's forecast is recorded beside it and scored too.

Pure: numpy and `scaling` only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from marin_assets.scaling_sweeps.config import PlannedRun, SweepPlan, fit_params
from scaling import (
    IsoflopOptions,
    Runs,
    RunsError,
    fit_chinchilla_arrays,
    fit_isoflop_runs,
    isoflop_profiles,
    load_runs,
)
from scaling.chinchilla import bootstrap_chinchilla
from scaling.isoflop import IsoflopProfiles, finite_or_none, percentile_interval


class SweepFitError(ValueError):
    """The sweep's results cannot be fitted (missing runs, missing metric, unusable budgets)."""


def eval_loss_key(eval_set: str) -> str:
    return f"eval/{eval_set}/loss"


HARNESS_PREFIX = "harness_eval/"


def forecast_metric(config) -> str:
    """The metric the sweep forecasts and checks (``SweepConfig.metric``, default the eval loss)."""
    return config.metric or eval_loss_key(config.eval_set)


def is_harness_metric(metric: str) -> bool:
    return metric.startswith(HARNESS_PREFIX)


def harness_result_key(metric: str) -> str:
    """``harness_eval/<task>/acc`` -> ``<task>/acc``, the key in harness_eval's manifest."""
    return metric.removeprefix(HARNESS_PREFIX)


def fitted_key(config) -> str:
    """The eval asset's metric the scaling law is fitted to: the forecast metric itself, or for a
    harness metric the eval loss it is linked from."""
    metric = forecast_metric(config)
    return eval_loss_key(config.eval_set) if is_harness_metric(metric) else metric


def fit_metric_link(config, losses: Mapping[str, float], values: Mapping[str, float]) -> dict[str, Any]:
    """The link from the fit runs' losses to their harness metric, JSON-ready."""
    from scaling.links import LinkFitError, fit_sigmoid_link

    names = sorted(losses)
    missing = [n for n in names if n not in values]
    if missing:
        raise SweepFitError(f"sweep {config.name!r}: no {forecast_metric(config)} for fit run(s) {missing} "
                            "(is its task in the deployment's eval suite?)")
    try:
        link = fit_sigmoid_link([losses[n] for n in names], [values[n] for n in names], chance=config.link_floor)
    except LinkFitError as exc:
        raise SweepFitError(f"sweep {config.name!r}: {exc}") from exc
    return {**link.to_dict(), "metric": forecast_metric(config),
            "pairs": [{"run": n, "loss": losses[n], "metric": values[n]} for n in names]}


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
    """JSON-ready: runs, the isoFLOP and joint fits, and every target candidate's forecasts."""
    png: bytes
    """IsoFLOP profiles and the envelope with its predictions; when the envelope was refused, the
    profiles under a banner saying why."""
    joint_png: bytes
    """The joint L(N, D) fit over the runs, with every target candidate's joint forecast."""


def fit_sweep(plan: SweepPlan, rows: list[dict[str, Any]], link: dict[str, Any] | None = None) -> SweepFit:
    """``link``: for a harness metric, ``fit_metric_link``'s result, recorded with the fit."""
    config = plan.config
    table = load_runs(rows)
    targets = {budget: plan.target_candidates(budget) for budget in config.target_budgets}
    candidates = [run for runs in targets.values() for run in runs]
    n = np.array([float(fit_params(r.candidate, config.params)) for r in candidates])
    d = np.array([float(r.candidate.tokens) for r in candidates])
    flops = np.array([r.candidate.flops for r in candidates])
    # Predict at each target budget (the envelope) and at every target candidate's realised FLOPs.
    predict = list(config.target_budgets) + flops.tolist()
    options = IsoflopOptions(bootstrap_samples=config.bootstrap_samples, seed=config.seed, interval=config.interval)
    try:
        joint = fit_chinchilla_arrays(table.params, table.tokens, table.loss)
    except ValueError as exc:
        raise SweepFitError(f"sweep {config.name!r}: {exc}") from exc
    # The envelope needs three budgets whose valley has an interior minimum, and predictions a
    # budget allows (scaling.EnvelopeRefused). When it is not the primary method, a refused envelope
    # (tiny runs whose best model is the smallest) is left unfitted, with the reason recorded, and
    # the joint law still forecasts.
    iso, envelope_error = None, None
    try:
        iso = fit_isoflop_runs(table, predict, options)
    except ValueError as exc:  # RunsError, EnvelopeRefused are ValueErrors
        if config.forecast_method == "envelope":
            raise SweepFitError(f"sweep {config.name!r}: {exc}") from exc
        envelope_error = str(exc)
    from scaling.plots import plot_envelope_refused, plot_isoflop_summary, plot_joint_forecast

    joint_point = joint.predict(n, d)
    joint_boot = bootstrap_chinchilla(joint, table.params, table.tokens, table.loss, n, d,
                                      samples=config.bootstrap_samples, seed=config.seed)
    by_method = {"joint": (joint_point, *percentile_interval(joint_boot, config.interval))}
    curvature, predictions = None, [None] * len(config.target_budgets)
    if iso is None:
        profiles = drawable_profiles(table, options)
        png = plot_envelope_refused(table, profiles.budgets, envelope_error)
        envelope = {"error": envelope_error, "skipped": profiles.left_out()}
    else:
        envelope = iso.to_dict()
        png = plot_isoflop_summary(iso, table)
        curvature = float(np.mean([b.params_coef[2] for b in iso.budgets]))
        first = len(config.target_budgets)
        envelope_point = iso.law.loss(flops) + curvature * (np.log(n) - np.log(iso.law.params(flops))) ** 2
        envelope_boot = iso.boot_loss[:, first:] + curvature * (np.log(n) - np.log(iso.boot_params[:, first:])) ** 2
        by_method["envelope"] = (envelope_point, *percentile_interval(envelope_boot, config.interval))
        predictions = iso.predictions()
    scored = []
    for i, run in enumerate(candidates):
        forecasts = {method: {"loss": float(point[i]), "loss_low": finite_or_none(low[i]),
                              "loss_high": finite_or_none(high[i])}
                     for method, (point, low, high) in by_method.items()}
        scored.append({"run": run.spec.name, "budget": run.candidate.budget, "hidden_dim": run.candidate.hidden_dim,
                       "params": n[i], "tokens": d[i], "flops": flops[i],
                       **forecasts[config.forecast_method], "method": config.forecast_method, "forecasts": forecasts})
    forecasts = []
    for i, budget in enumerate(targets):
        mine = [s for s in scored if s["budget"] == budget]
        chosen = min(mine, key=lambda s: s["loss"])
        forecasts.append({"budget": budget, "envelope": predictions[i], "candidates": mine, "chosen": chosen["run"]})
    result = {"sweep": config.name, "params_column": config.params, "eval_set": config.eval_set,
              "forecast_method": config.forecast_method, "runs": rows,
              "fit": envelope,
              "valley_curvature": curvature,
              "joint_fit": {**joint.to_dict(), "bootstrap": {"samples": config.bootstrap_samples,
                                                             "used": int(joint_boot.shape[0]), "resample": "runs"}},
              "targets": forecasts, "metric": forecast_metric(config), **({"link": link} if link else {})}
    joint_png = plot_joint_forecast(joint, table, [{**s["forecasts"]["joint"], "params": s["params"],
                                                    "tokens": s["tokens"], "label": s["run"]} for s in scored])
    # Plain JSON types only (numpy scalars would not serialize into Dagster metadata).
    return SweepFit(json.loads(json.dumps(result, default=float)), png, joint_png)


def drawable_profiles(table: Runs, options: IsoflopOptions) -> IsoflopProfiles:
    """The valleys a refused envelope's figure draws; none where a budget has too few runs for one."""
    try:
        return isoflop_profiles(table, options)
    except RunsError:
        return IsoflopProfiles([], [])


def envelope_status(fit_result: Mapping[str, Any]) -> str:
    """One line on the envelope of a `fit_sweep` result: fitted (through how many optima), or why not."""
    envelope = fit_result["fit"]
    if "law" not in envelope:
        return f"not fitted: {envelope['error']}"
    law, used = envelope["law"], len(envelope["optima"])
    return (f"fitted through {used} interior optima of {used + len(envelope['skipped'])} budgets: "
            f"E = {law['E']:.4g}, A = {law['A']:.4g}, alpha = {law['alpha']:.4g}")


def forecast_record(fit_result: Mapping[str, Any]) -> dict[str, Any]:
    """What is frozen before training: per target budget, the chosen run and its forecast intervals."""
    targets = []
    for target in fit_result["targets"]:
        chosen = next(c for c in target["candidates"] if c["run"] == target["chosen"])
        envelope = target.get("envelope")
        targets.append({**chosen, "budget": target["budget"], "envelope_loss": envelope["loss"] if envelope else None})
    link = fit_result.get("link")
    if link is not None:
        from scaling.links import SigmoidLink, link_interval

        curve = SigmoidLink.from_dict(link)
        for target in targets:
            point, low, high = link_interval(curve, target["loss"], target.get("loss_low"), target.get("loss_high"))
            target.update({"metric_predicted": point, "metric_low": low, "metric_high": high})
    return {"sweep": fit_result["sweep"], "eval_set": fit_result["eval_set"],
            "metric": fit_result.get("metric", eval_loss_key(fit_result["eval_set"])),
            "method": fit_result["forecast_method"], "targets": targets, **({"link": link} if link else {})}


def chosen_target(plan: SweepPlan, forecast: Mapping[str, Any], budget: float) -> PlannedRun:
    """The target candidate a forecast chose for `budget` (KeyError when it is not in the current plan)."""
    wanted = next((t["run"] for t in forecast["targets"] if t["budget"] == budget), None)
    if wanted is None:
        raise KeyError(f"the forecast has no target budget {budget:g}")
    for run in plan.target_candidates(budget):
        if run.spec.name == wanted:
            return run
    raise KeyError(f"forecast chose {wanted!r}, which the current plan of budget {budget:g} does not contain")


def _score(forecast: Mapping[str, Any], actual: float, error_goal: float) -> dict[str, Any]:
    predicted, low, high = float(forecast["loss"]), forecast.get("loss_low"), forecast.get("loss_high")
    error = (predicted - actual) / actual
    inside = low is not None and high is not None and low <= actual <= high
    return {"predicted": predicted, "low": low, "high": high, "error_pct": 100.0 * error,
            "within_interval": bool(inside), "within_goal": bool(abs(error) <= error_goal)}


def score_metric_forecast(target: Mapping[str, Any], metric: str, actual: float,
                          error_goal: float) -> dict[str, Any]:
    """Actual harness metric against its forecast through the link (the loss forecast's interval
    mapped through the link is the metric's interval)."""
    linked = {"loss": target["metric_predicted"], "loss_low": target.get("metric_low"),
              "loss_high": target.get("metric_high")}
    return {"run": target["run"], "budget": target["budget"], "metric": metric, "actual": actual,
            "method": f"{target.get('method', 'envelope')}+link", **_score(linked, actual, error_goal),
            "by_method": {}}


def score_forecast(target: Mapping[str, Any], actual: float, error_goal: float) -> dict[str, Any]:
    """Actual loss against one target's primary forecast (signed relative error, interval membership),
    with every recorded method's score under ``by_method``."""
    return {"run": target["run"], "budget": target["budget"], "actual": actual,
            "method": target.get("method", "envelope"), **_score(target, actual, error_goal),
            "by_method": {m: _score(f, actual, error_goal) for m, f in target.get("forecasts", {}).items()}}
