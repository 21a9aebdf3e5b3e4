"""Scaling-sweep assets, one set per sweep S in `sweeps.yaml`:

    sweep/S            the plan: every budget's candidates (and rejections) as JSON
    checkpoint[r], eval[r]            one run per fit-budget candidate r (registered here)
    scaling_fit/S      isoFLOP fit of the fit runs' eval losses: fit JSON, PNG, predictions
    forecast/S         the frozen forecast of each target budget's chosen run
    checkpoint[t], eval[t]            the target run t, registered only once forecast/S exists
    forecast_check/S   actual versus forecast, with an asset check on the interval

Predict-before-train is enforced by registration: a target run is a partition of `checkpoint`
only when a committed forecast for the current sweep config is in the store, so it cannot be
trained first, and the forecast check also verifies that the forecast was committed before the
target's training started.
"""

import json
from typing import Any

import dagster as dg

from marin_assets.catalog import Catalog
from marin_assets.scaling_sweeps.config import DEFAULT_SWEEPS_YAML, SweepConfig, SweepPlan, load_sweeps, plan_sweep
from marin_assets.scaling_sweeps.forecasting import (SweepFitError, chosen_target, eval_loss_key, fit_sweep,
                                                     forecast_record, runs_table, score_forecast)
from marin_assets.tokenization.assets import deployment_registry
from marin_assets.training.spec import register_run
from marin_resources.artifacts import (ArtifactHandle, Built, MarinStore, all_partitions_in, marin_asset, marin_check,
                                       materialize_artifact)
from marin_resources.display import png_markdown, records_table
from marin_resources.environments import MarinSettings
from marin_resources.identity import fingerprint
from marin_resources.store import ArtifactStore

SWEEP_VERSION = "v1"
# v2: forecasts by both methods (envelope and joint), the primary one named by the config.
SCALING_FIT_VERSION = "v2"
FORECAST_VERSION = "v2"
FORECAST_CHECK_VERSION = "v2"
EVAL_KEY = dg.AssetKey(["eval"])
# A fit run's parameter count from Levanter must match the recipe's (else the vocabulary differs).
PARAMS_TOLERANCE = 0.005


def read_json(store: ArtifactStore, uri: str, name: str) -> Any:
    with store.open(f"{uri}/{name}") as fh:
        return json.load(fh)


def stored_forecast(store: ArtifactStore, config: SweepConfig) -> dict[str, Any] | None:
    """The committed forecast of this sweep config, or None (absent, or made for another config)."""
    manifest = store.find(f"forecast/{config.name}", FORECAST_VERSION, None)
    if manifest is None or manifest.config.get("sweep_fingerprint") != fingerprint(config.identity()):
        return None
    return read_json(store, manifest.uri, "forecast.json")


def register_sweep_runs(plan: SweepPlan, store: ArtifactStore) -> list[str]:
    """Register fit runs, and the forecast's chosen target runs when the forecast exists; returns target names."""
    for run in plan.fit_runs():
        register_run(run.spec)
    forecast = stored_forecast(store, plan.config)
    if forecast is None:
        return []
    targets = []
    for budget in plan.config.target_budgets:
        try:
            run = chosen_target(plan, forecast, budget)
        except KeyError:
            continue  # a forecast of another plan: its target waits for a new forecast
        register_run(run.spec)
        targets.append(run.spec.name)
    return targets


def eval_losses(store: ArtifactStore, plan: SweepPlan, evals: dict[str, ArtifactHandle]) -> dict[str, float]:
    """Eval loss of each fit run, after checking the run trained the planned model for all its steps."""
    key = eval_loss_key(plan.config.eval_set)
    losses = {}
    for run in plan.fit_runs():
        name = run.spec.name
        handle = evals.get(name)
        if handle is None:
            raise SweepFitError(f"no eval of fit run {name!r}; materialize eval --partition {name}")
        if key not in handle.metrics:
            raise SweepFitError(f"eval[{name}] has no {key!r} (has {sorted(handle.metrics)})")
        manifest = store.read_manifest(handle.uri)
        checkpoint_ref = next((u for u in manifest.upstream if u.asset_key == "checkpoint"), None) if manifest else None
        checkpoint = store.read_manifest(checkpoint_ref.uri) if checkpoint_ref else None
        if checkpoint is None:
            raise SweepFitError(f"eval[{name}] does not record its checkpoint")
        if checkpoint.fingerprint != fingerprint(run.spec.identity()):
            # Same name, another spec (the recipe changed): a drift-reused artifact must not be fitted.
            # --force would reuse it (drift), and --rebuild alone would resume from its checkpoints.
            raise SweepFitError(f"checkpoint[{name}] was trained from another spec than the plan's; move its "
                                f"checkpoints aside ({checkpoint.uri}/checkpoints), then retrain it: "
                                f"marin materialize checkpoint --partition {name} --rebuild")
        trained = checkpoint.metrics
        if trained.get("final_step") is None:
            raise SweepFitError(f"checkpoint[{name}] records no final step (committed without its training "
                                f"summary); rebuild it: marin materialize checkpoint --partition {name} --rebuild")
        if trained["final_step"] != run.spec.num_train_steps:
            raise SweepFitError(f"checkpoint[{name}] finished {trained['final_step']} of "
                                f"{run.spec.num_train_steps} steps")
        counted = trained.get("parameter_count")
        if counted is None or abs(counted - run.candidate.params) > PARAMS_TOLERANCE * run.candidate.params:
            raise SweepFitError(f"checkpoint[{name}]: parameter count {counted} differs from the recipe's "
                                f"{run.candidate.params}; is the recipe's vocab_size the tokenizer's?")
        losses[name] = float(handle.metrics[key])
    return losses


def build_sweep_assets(config: SweepConfig, store: ArtifactStore) -> tuple[list, list, dict[str, Any]]:
    plan = plan_sweep(config)
    targets = register_sweep_runs(plan, store)
    identity = config.identity()
    sweep_fp = fingerprint(identity)
    fit_names = [r.spec.name for r in plan.fit_runs()]
    name = config.name
    # Identity of each artifact; the catalog gives the same to `marin status` for drift detection.
    configs = {"sweep": identity,
               "scaling_fit": {"sweep_fingerprint": sweep_fp, "fit_runs": fit_names},
               "forecast": {"sweep_fingerprint": sweep_fp},
               "forecast_check": {"sweep_fingerprint": sweep_fp, "targets": targets}}

    @marin_asset(key=f"sweep/{name}", version=SWEEP_VERSION, identity=configs["sweep"], group_name="scaling",
                 kinds={"json"}, tags={"marin/sweep": name},
                 description=f"IsoFLOP plan of sweep `{name}`: fit budgets {list(config.fit_budgets)}, target "
                             f"budgets {list(config.target_budgets)}; every candidate and rejection (plan.json).")
    def sweep(context: dg.AssetExecutionContext, store: MarinStore):
        def build(writer) -> Built:
            writer.write_json("plan.json", plan.to_dict())
            return Built(metrics={"fit_runs": len(fit_names), "fit_budgets": list(config.fit_budgets),
                                  "target_budgets": list(config.target_budgets)},
                         metadata={"runs": dg.MetadataValue.json(fit_names)})

        return materialize_artifact(context, store, config=configs["sweep"], upstream=[], build=build)

    fit_evals = all_partitions_in(EVAL_KEY, partition_mapping=dg.SpecificPartitionsPartitionMapping(fit_names))

    @marin_asset(key=f"scaling_fit/{name}", version=SCALING_FIT_VERSION, identity=configs["scaling_fit"],
                 group_name="scaling", ins={"plan_handle": dg.AssetIn(key=sweep.key), "evals": fit_evals},
                 kinds={"scipy", "matplotlib"}, tags={"marin/sweep": name},
                 description=f"The fit runs of sweep `{name}` (eval loss on `{config.eval_set}`) fitted two ways: the "
                             "approach-2 isoFLOP envelope L(C) and the approach-3 law L(N, D), each forecasting "
                             "every target candidate with a bootstrap interval: fit.json, fit.png and joint.png.")
    def scaling_fit(context: dg.AssetExecutionContext, store: MarinStore, plan_handle: ArtifactHandle,
                    evals: dict[str, ArtifactHandle]):
        artifacts = store.get()
        try:
            fitted = fit_sweep(plan, runs_table(plan, eval_losses(artifacts, plan, evals)))
        except SweepFitError as exc:
            raise dg.Failure(str(exc)) from exc

        def build(writer) -> Built:
            writer.write_json("fit.json", fitted.result)
            for file_name, png in (("fit.png", fitted.png), ("joint.png", fitted.joint_png)):
                with writer.open(file_name) as fh:
                    fh.write(png)
            law, joint = fitted.result["fit"]["law"], fitted.result["joint_fit"]
            metrics = {"E": law["E"], "A": law["A"], "alpha": law["alpha"], "params_exponent": law["params_exponent"],
                       "tokens_exponent": law["tokens_exponent"], "runs": len(fitted.result["runs"]),
                       **{f"joint/{k}": joint[k] for k in ("E", "A", "B", "alpha", "beta")}}
            for target in fitted.result["targets"]:
                metrics[f"forecast/{target['chosen']}/loss"] = next(
                    c["loss"] for c in target["candidates"] if c["run"] == target["chosen"])
            return Built(metrics=metrics, metadata={
                "fit_plot": png_markdown(fitted.png, f"isoFLOP fit of {name}"),
                "joint_plot": png_markdown(fitted.joint_png, f"joint L(N, D) fit of {name}"),
                "optima": records_table(fitted.result["fit"]["optima"]),
                "predictions": records_table(fitted.result["fit"]["predictions"])})

        upstream = [plan_handle] + [evals[n] for n in sorted(evals)]
        return materialize_artifact(context, store, config=configs["scaling_fit"], upstream=upstream, build=build)

    @marin_asset(key=f"forecast/{name}", version=FORECAST_VERSION, identity=configs["forecast"], group_name="scaling",
                 kinds={"json"}, tags={"marin/sweep": name},
                 ins={"fit": dg.AssetIn(key=scaling_fit.key)},
                 description=f"The forecast of the target runs of sweep `{name}`, frozen before they train: for each "
                             "target budget, the candidate nearest the forecast optimum and its loss interval. "
                             "Its existence registers the target runs as partitions of checkpoint/eval.")
    def forecast(context: dg.AssetExecutionContext, store: MarinStore, fit: ArtifactHandle):
        record = forecast_record(read_json(store.get(), fit.uri, "fit.json"))

        def build(writer) -> Built:
            writer.write_json("forecast.json", record)
            metrics: dict[str, Any] = {"method": record["method"]}
            for t in record["targets"]:
                metrics.update({f"{t['run']}/loss": t["loss"], f"{t['run']}/loss_low": t["loss_low"],
                                f"{t['run']}/loss_high": t["loss_high"]})
                metrics.update({f"{t['run']}/{m}/loss": f["loss"] for m, f in t["forecasts"].items()})
            return Built(metrics=metrics, metadata={"targets": dg.MetadataValue.json(record["targets"])})

        return materialize_artifact(context, store, config=configs["forecast"], upstream=[fit], build=build)

    check_ins: dict[str, dg.AssetIn] = {"forecast_in": dg.AssetIn(key=forecast.key)}
    if targets:
        check_ins["evals"] = all_partitions_in(EVAL_KEY,
                                               partition_mapping=dg.SpecificPartitionsPartitionMapping(targets))

    @marin_asset(key=f"forecast_check/{name}", version=FORECAST_CHECK_VERSION, identity=configs["forecast_check"],
                 group_name="scaling", ins=check_ins, kinds={"json"}, tags={"marin/sweep": name},
                 description=f"Sweep `{name}`: each target run's eval loss against its forecast (signed error %, "
                             "inside the interval or not, forecast committed before training or not).")
    def forecast_check(context: dg.AssetExecutionContext, store: MarinStore, forecast_in: ArtifactHandle,
                       **target_evals: dict[str, ArtifactHandle]):
        # `evals` is an input only once the target runs are known (registered from the stored forecast).
        artifacts = store.get()
        record = read_json(artifacts, forecast_in.uri, "forecast.json")
        forecast_manifest = artifacts.read_manifest(forecast_in.uri)
        evals = target_evals.get("evals", {})
        scores = []
        for target in record["targets"]:
            handle = evals.get(target["run"])
            if handle is None:
                raise dg.Failure(f"target run {target['run']!r} has no eval input: it is registered when the code "
                                 f"location loads with forecast/{name} stored; reload, then materialize "
                                 f"eval --partition {target['run']}")
            key = eval_loss_key(record["eval_set"])
            if key not in handle.metrics:
                raise dg.Failure(f"eval[{target['run']}] has no {key!r}")
            score = score_forecast(target, float(handle.metrics[key]), config.error_goal)
            trained = artifacts.read_manifest(
                next(u.uri for u in artifacts.read_manifest(handle.uri).upstream if u.asset_key == "checkpoint"))
            # ISO-8601 UTC timestamps compare as strings.
            score["forecast_committed_at"] = forecast_manifest.finished_at
            score["training_started_at"] = trained.started_at
            score["forecast_before_training"] = forecast_manifest.finished_at <= trained.started_at
            scores.append(score)

        def build(writer) -> Built:
            writer.write_json("check.json", {"sweep": name, "error_goal": config.error_goal, "targets": scores})
            metrics = {}
            for s in scores:
                metrics.update({f"{s['run']}/{k}": s[k] for k in ("actual", "predicted", "error_pct",
                                                                    "within_interval", "within_goal",
                                                                    "forecast_before_training")})
                metrics.update({f"{s['run']}/{m}/error_pct": b["error_pct"] for m, b in s["by_method"].items()})
            return Built(metrics=metrics, metadata={"targets": dg.MetadataValue.json(scores)})

        upstream = [forecast_in] + [evals[n] for n in sorted(evals)]
        return materialize_artifact(context, store, config=configs["forecast_check"], upstream=upstream, build=build)

    @marin_check(forecast_check, name="within_forecast_interval",
                    description="Every target's actual eval loss lies inside its primary forecast's interval, and the "
                                "forecast was committed before the target trained. Metadata: signed error % per "
                                "target, for the primary and every other recorded method.")
    def within_forecast_interval(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        manifest = store.get().find(f"forecast_check/{name}", FORECAST_CHECK_VERSION, None)
        if manifest is None:
            return dg.AssetCheckResult(passed=False, metadata={"error": "no committed forecast check"})
        return forecast_check_result(read_json(store.get(), manifest.uri, "check.json"))

    identities = {f"{kind}/{name}": (lambda _partition, config=config: config) for kind, config in configs.items()}
    return [sweep, scaling_fit, forecast, forecast_check], [within_forecast_interval], identities


def forecast_check_result(check: dict[str, Any]) -> dg.AssetCheckResult:
    targets = check["targets"]
    passed = bool(targets) and all(t["within_interval"] and t["forecast_before_training"] for t in targets)
    metadata: dict[str, Any] = {}
    for t in targets:
        metadata[f"{t['run']}/error_pct"] = float(t["error_pct"])
        metadata[f"{t['run']}/actual"] = float(t["actual"])
        metadata[f"{t['run']}/interval"] = f"[{t['low']}, {t['high']}]"
        metadata[f"{t['run']}/within_goal"] = bool(t["within_goal"])
        for method, score in t.get("by_method", {}).items():
            metadata[f"{t['run']}/{method}/error_pct"] = float(score["error_pct"])
    return dg.AssetCheckResult(passed=passed, metadata=metadata)


def available_mixtures(settings: MarinSettings) -> set[str]:
    """Mixtures of the tokenization registry whose sources are curated in this deployment."""
    from marin_assets.stages import curated_source_names  # stages lists this module's builder

    return set(deployment_registry(settings, curated_source_names(settings)).mixtures)


def build_scaling_sweeps_stage(settings: MarinSettings, sweeps_file: str | None = None,
                               mixtures: set[str] | None = None) -> tuple[dg.Definitions, Catalog]:
    """One asset set per sweep; registers the sweeps' runs with the training registry as a side effect.

    Sweeps on a mixture this deployment does not build are left out, as the training stage leaves
    out their runs.
    """
    store = MarinStore(prefix=settings.prefix).get()
    mixtures = available_mixtures(settings) if mixtures is None else mixtures
    assets, checks = [], []
    catalog = Catalog()
    for config in load_sweeps(sweeps_file or DEFAULT_SWEEPS_YAML).values():
        if config.mixture not in mixtures:
            continue
        sweep_assets, sweep_checks, identities = build_sweep_assets(config, store)
        assets += sweep_assets
        checks += sweep_checks
        for key, fn in identities.items():
            catalog.add_identity(key, fn)
    return dg.Definitions(assets=assets, asset_checks=checks), catalog
