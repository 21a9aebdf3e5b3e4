"""Scaling-sweep assets, one set per sweep S of the deployment (`sweeps.yaml`, MARIN_SWEEPS):

    sweep/S                  the plan: every budget's candidates (and rejections) as JSON
    sweep_checkpoint/S[r]    one training run per fit-budget candidate r, then the target runs
    sweep_eval/S[r]          its evaluation
    sweep_harness_eval/S[r]  the eval suite on it, when S forecasts a harness metric (evaluation stage)
    scaling_fit/S            isoFLOP fit of the fit runs' eval losses: fit JSON, PNG, predictions
    forecast/S               the frozen forecast of each target budget's chosen run
    forecast_check/S         actual versus forecast, with an asset check on the interval

A sweep's runs are the dynamic partitions `S_sweep_runs`, its own, so that the runs of a sweep
nobody started never make the deployment's named runs (`checkpoint`, `eval`) look unfinished.
The fit runs follow from the config alone; a target run is added only after forecast/S commits
(by the `sweep_runs` sensor, or by `marin` when it discovers partitions), so it cannot be
trained first, and the forecast check also verifies that the forecast was committed before the
target's training started. Nothing here reads the store while the code location loads.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dagster as dg

from marin_assets.catalog import Catalog
from marin_assets.deployment import Deployment
from marin_assets.scaling_sweeps.config import (
    MixtureSweepConfig,
    SweepConfig,
    SweepPlan,
    mixture_sweep_runs,
    plan_sweep,
)
from marin_assets.scaling_sweeps.forecasting import (
    SweepFitError,
    chosen_target,
    envelope_status,
    fit_metric_link,
    fit_sweep,
    fitted_key,
    forecast_metric,
    forecast_record,
    harness_result_key,
    is_harness_metric,
    runs_table,
    score_forecast,
    score_metric_forecast,
)
from marin_assets.scaling_sweeps.mixture_fitting import TARGET, MixtureSweepFit, fit_mixture_sweep
from marin_assets.training.assets import (
    SpecLookup,
    build_run_assets,
    compute_planner,
    mixture_specs,
    tokenizer_specs,
)
from marin_assets.training.spec import RunSpec
from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import (
    ArtifactHandle,
    Built,
    MarinStore,
    all_partitions_in,
    checked_manifest,
    input_refused,
    marin_check,
    materialize_artifact,
)
from marin_resources.config_identity import config_identity
from marin_resources.display import png_markdown, records_table
from marin_resources.environments import MarinSettings, store_resource
from marin_resources.keys import asset_key
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore, Manifest

SWEEP_VERSION = "v1"
# v2: forecasts by both methods (envelope and joint), the primary one named by the config.
# v3: the envelope through interior optima only, refused when too few or when it predicts the impossible.
SCALING_FIT_VERSION = "v3"
FORECAST_VERSION = "v2"
FORECAST_CHECK_VERSION = "v2"
MIXTURE_FIT_VERSION = "v1"
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


def checkpoint_key(sweep: str) -> str:
    return f"sweep_checkpoint/{sweep}"


def eval_key(sweep: str) -> str:
    return f"sweep_eval/{sweep}"


def harness_key(sweep: str) -> str:
    """The eval suite on the sweep's runs (built by the evaluation stage when the sweep forecasts a
    harness metric)."""
    return f"sweep_harness_eval/{sweep}"


def mixture_checkpoint_key(sweep: str) -> str:
    return f"mixture_sweep_checkpoint/{sweep}"


def mixture_eval_key(sweep: str) -> str:
    return f"mixture_sweep_eval/{sweep}"


def runs_partitions(sweep: str) -> dg.DynamicPartitionsDefinition:
    return dg.DynamicPartitionsDefinition(name=f"{sweep}_sweep_runs")


@dataclass(frozen=True)
class SweepRuns:
    """A sweep's training runs: the plan's fit runs (from the config alone) and the committed
    forecast's chosen target runs (read from the store when asked, never at load)."""

    plan: SweepPlan

    @property
    def name(self) -> str:
        return self.plan.config.name

    def fit(self) -> dict[str, RunSpec]:
        return {r.spec.name: r.spec for r in self.plan.fit_runs()}

    def targets(self, store: ArtifactStore) -> dict[str, RunSpec]:
        forecast = stored_forecast(store, self.plan.config)
        if forecast is None:
            return {}
        targets = {}
        for budget in self.plan.config.target_budgets:
            try:
                run = chosen_target(self.plan, forecast, budget)
            except KeyError:
                continue  # a forecast of another plan: its target waits for a new forecast
            targets[run.spec.name] = run.spec
        return targets

    def names(self, store: ArtifactStore) -> list[str]:
        return sorted({**self.fit(), **self.targets(store)})

    def spec(self, run: str, store: ArtifactStore) -> RunSpec:
        fit = self.fit()
        if run in fit:
            return fit[run]
        targets = self.targets(store)
        if run not in targets:
            raise dg.Failure(f"{run!r} is neither a fit run of sweep {self.name!r} nor the target of its committed "
                             "forecast (targets: "
                             f"{sorted(targets) or 'none until forecast/' + self.name + ' commits'})")
        return targets[run]


def sweep_run_lookup(settings: MarinSettings, runs: SweepRuns) -> SpecLookup:
    """A sweep run's spec when a step asks; the store (for the forecast's targets) is read then, never at load."""
    store = store_resource(settings)
    return lambda run: runs.spec(run, store.get())


def trained_checkpoint(store: ArtifactStore, handle: ArtifactHandle, spec: RunSpec, wanted: str, checkpoint_key: str,
                       eval_key: str) -> Manifest:
    """The checkpoint the eval ``handle`` of run ``spec`` scored, checked to be the run as declared now
    (checkpoint fingerprint ``wanted``), trained for all its steps, and scored on the run's sample;
    `SweepFitError` (one line, naming the command that fixes it) otherwise."""
    name = spec.name
    manifest = store.read_manifest(handle.uri)
    if manifest is not None and manifest.config.get("examples") != spec.final_eval_examples:
        # E.g. the whole split where the sweep now scores a sample: losses of two samples don't mix.
        # (An eval of another spec's checkpoint is caught below, by the checkpoint's fingerprint.)
        raise SweepFitError(f"eval[{name}] scored another sample than the sweep's (eval_examples "
                            f"{spec.final_eval_examples}); re-evaluate it: marin materialize {eval_key} "
                            f"--partition {name}")
    checkpoint_ref = next((u for u in manifest.upstream if u.asset_key == checkpoint_key), None) if manifest else None
    checkpoint = store.read_manifest(checkpoint_ref.uri) if checkpoint_ref else None
    if checkpoint is None:
        raise SweepFitError(f"eval[{name}] does not record its checkpoint")
    if checkpoint.fingerprint != wanted:
        # Same name, another spec (the recipe changed): the eval is of the old checkpoint. The plan's
        # spec trains beside it (its identity is in the path), and its eval then replaces this one.
        raise SweepFitError(f"checkpoint[{name}] was trained from another spec than the sweep's "
                            f"({checkpoint.uri}); train and evaluate the sweep's beside it: "
                            f"marin materialize {eval_key} --partition {name}")
    trained = checkpoint.metrics
    if trained.get("final_step") is None:
        raise SweepFitError(f"checkpoint[{name}] records no final step (committed without its training "
                            f"summary); rebuild it: marin materialize {checkpoint_key} --partition {name} --rebuild")
    if trained["final_step"] != spec.num_train_steps:
        raise SweepFitError(f"checkpoint[{name}] finished {trained['final_step']} of {spec.num_train_steps} steps")
    return checkpoint


def eval_losses(store: ArtifactStore, plan: SweepPlan, evals: dict[str, ArtifactHandle]) -> dict[str, float]:
    """The fitted eval metric (loss, or bpb) of each fit run, after checking the run trained the
    planned model for all its steps."""
    key = fitted_key(plan.config)
    losses = {}
    for run in plan.fit_runs():
        name = run.spec.name
        handle = evals.get(name)
        if handle is None:
            raise SweepFitError(f"no eval of fit run {name!r}; materialize {eval_key(plan.config.name)} "
                                f"--partition {name}")
        if key not in handle.metrics:
            raise SweepFitError(f"eval[{name}] has no {key!r} (has {sorted(handle.metrics)})")
        checkpoint = trained_checkpoint(store, handle, run.spec, fingerprint(run.spec.identity()),
                                        checkpoint_key(plan.config.name), eval_key(plan.config.name))
        counted = checkpoint.metrics.get("parameter_count")
        if counted is None or abs(counted - run.candidate.params) > PARAMS_TOLERANCE * run.candidate.params:
            raise SweepFitError(f"checkpoint[{name}]: parameter count {counted} differs from the recipe's "
                                f"{run.candidate.params}; is the recipe's vocab_size the tokenizer's?")
        losses[name] = float(handle.metrics[key])
    return losses


def build_sweep_assets(settings: MarinSettings, deployment: Deployment, config: SweepConfig,
                       catalog: Catalog, upstream: Catalog) -> tuple[list, list]:
    plan = plan_sweep(config)
    runs = SweepRuns(plan)
    identity = config.identity()
    sweep_fp = fingerprint(identity)
    fit_names = [r.spec.name for r in plan.fit_runs()]
    name = config.name
    sweep_spec = ArtifactSpec.fixed(f"sweep/{name}", SWEEP_VERSION, identity)
    fit_spec = ArtifactSpec.fixed(f"scaling_fit/{name}", SCALING_FIT_VERSION,
                                  {"sweep_fingerprint": sweep_fp, "fit_runs": fit_names})
    forecast_spec = ArtifactSpec.fixed(f"forecast/{name}", FORECAST_VERSION, {"sweep_fingerprint": sweep_fp})
    # The targets follow from the forecast, an upstream whose data version is recorded.
    forecast_check_spec = ArtifactSpec.fixed(f"forecast_check/{name}", FORECAST_CHECK_VERSION,
                                             {"sweep_fingerprint": sweep_fp})
    tags = {"marin/sweep": name}
    partitions = runs_partitions(name)
    store = store_resource(settings)
    spec_for = sweep_run_lookup(settings, runs)

    run_assets, run_checks = build_run_assets(
        checkpoint_key=checkpoint_key(name), eval_key=eval_key(name), partitions=partitions, spec_for=spec_for,
        plan_for=compute_planner(settings, deployment),
        mixtures={config.mixture: mixture_specs(deployment, upstream)[config.mixture]},
        tokenizers={config.tokenizer: tokenizer_specs(deployment, upstream)[config.tokenizer]},
        pool=settings.train_pool, group_name="scaling", catalog=catalog, store=store.get, tags=tags,
        subject=f" of sweep {name!r}")
    catalog.add_discoverer(partitions.name, lambda: runs.names(store.get()))

    @catalog.asset(sweep_spec, group_name="scaling", kinds={"json"}, tags={"marin/sweep": name},
                   description=f"IsoFLOP plan of sweep `{name}`: fit budgets {list(config.fit_budgets)}, target "
                               f"budgets {list(config.target_budgets)}; every candidate and rejection (plan.json).")
    def sweep(context: dg.AssetExecutionContext, store: MarinStore):
        def build(writer) -> Built:
            writer.write_json("plan.json", plan.to_dict())
            return Built(metrics={"fit_runs": len(fit_names), "fit_budgets": list(config.fit_budgets),
                                  "target_budgets": list(config.target_budgets)},
                         metadata={"runs": dg.MetadataValue.json(fit_names)})

        return materialize_artifact(context, store, sweep_spec, upstream=[], build=build)

    fit_runs_only = dg.SpecificPartitionsPartitionMapping(fit_names)
    metric = forecast_metric(config)
    linked = is_harness_metric(metric)
    # A harness metric is checked on the sweep's harness asset; the loss it is linked from stays on sweep_eval/S.
    checked_key = harness_key(name) if linked else eval_key(name)
    fit_ins = {"plan_handle": dg.AssetIn(key=sweep.key),
               "evals": all_partitions_in(eval_key(name), partition_mapping=fit_runs_only)}
    if linked:
        fit_ins["harness"] = all_partitions_in(harness_key(name), partition_mapping=fit_runs_only)

    @catalog.asset(fit_spec, group_name="scaling", ins=fit_ins, kinds={"scipy", "matplotlib"},
                   tags={"marin/sweep": name},
                   description=f"Sweep `{name}`'s fit runs ({fitted_key(config)}) fitted two ways: the "
                               "approach-2 isoFLOP envelope L(C) and the approach-3 law L(N, D), each forecasting "
                               "every target candidate with a bootstrap interval: fit.json, joint.png and fit.png. "
                               "The envelope is fitted through interior optima only, and refused (fit.png's banner, "
                               "the check envelope_fitted) with fewer than three or with impossible predictions."
                               + (f" {metric} follows the loss through a {config.link} link fitted over the fit runs."
                                  if linked else ""))
    def scaling_fit(context: dg.AssetExecutionContext, store: MarinStore, plan_handle: ArtifactHandle,
                    evals: dict[str, ArtifactHandle], **linked_inputs: dict[str, ArtifactHandle]):
        # `harness` is an input only when the sweep forecasts a harness metric.
        harness = linked_inputs.get("harness", {})
        artifacts = store.get()
        try:
            losses = eval_losses(artifacts, plan, evals)
            link = None
            if linked:
                key = harness_result_key(metric)
                values = {n: float(h.metrics[key]) for n, h in harness.items() if key in h.metrics}
                link = fit_metric_link(config, losses, values)
            fitted = fit_sweep(plan, runs_table(plan, losses), link)
        except SweepFitError as exc:
            raise dg.Failure(str(exc)) from exc

        def build(writer) -> Built:
            writer.write_json("fit.json", fitted.result)
            for file_name, png in {"fit.png": fitted.png, "joint.png": fitted.joint_png}.items():
                with writer.open(file_name) as fh:
                    fh.write(png)
            envelope, joint = fitted.result["fit"], fitted.result["joint_fit"]
            # The envelope's status leads, so a refused one reads first, before any number.
            metrics = {"envelope": envelope_status(fitted.result), "runs": len(fitted.result["runs"]),
                       **{f"joint/{k}": joint[k] for k in ("E", "A", "B", "alpha", "beta")}}
            metadata = {"fit_plot": png_markdown(fitted.png, f"isoFLOP fit of {name}"),
                        "joint_plot": png_markdown(fitted.joint_png, f"joint L(N, D) fit of {name}")}
            if "law" in envelope:
                law = envelope["law"]
                metrics.update({"E": law["E"], "A": law["A"], "alpha": law["alpha"],
                                "params_exponent": law["params_exponent"], "tokens_exponent": law["tokens_exponent"]})
                metadata.update({"optima": records_table(envelope["optima"]),
                                 "predictions": records_table(envelope["predictions"])})
            if envelope["skipped"]:
                metadata["left_out"] = records_table(envelope["skipped"])
            for target in fitted.result["targets"]:
                metrics[f"forecast/{target['chosen']}/loss"] = next(
                    c["loss"] for c in target["candidates"] if c["run"] == target["chosen"])
            if link is not None:
                metrics.update({f"link/{k}": link[k] for k in ("floor", "ceiling", "k", "loss_mid", "rmse")})
            return Built(metrics=metrics, metadata=metadata)

        upstream = [plan_handle] + [evals[n] for n in sorted(evals)] + [harness[n] for n in sorted(harness)]
        return materialize_artifact(context, store, fit_spec, upstream=upstream, build=build)

    @marin_check(scaling_fit, name="envelope_fitted",
                 description="The approach-2 envelope was fitted: at least three budgets have their loss minimum "
                             "inside their runs, and its predictions are physical (E > 0, each prediction's "
                             "parameters and tokens spend its budget as the fit runs do, intervals of some width). "
                             "A warning: the joint law forecasts without it.")
    def envelope_fitted(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        return committed_json_check(context, store, fit_spec, "fit.json", "scaling fit", envelope_check_result,
                                    severity=dg.AssetCheckSeverity.WARN)

    @catalog.asset(forecast_spec, group_name="scaling", kinds={"json"}, tags={"marin/sweep": name},
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
                if "metric_predicted" in t:
                    metrics.update({f"{t['run']}/{record['metric']}": t["metric_predicted"],
                                    f"{t['run']}/{record['metric']}_low": t["metric_low"],
                                    f"{t['run']}/{record['metric']}_high": t["metric_high"]})
            return Built(metrics=metrics, metadata={"targets": dg.MetadataValue.json(record["targets"])})

        return materialize_artifact(context, store, forecast_spec, upstream=[fit], build=build)

    @catalog.asset(forecast_check_spec, group_name="scaling",
                   ins={"forecast_in": dg.AssetIn(key=forecast.key), "evals": all_partitions_in(checked_key)},
                   kinds={"json"}, tags={"marin/sweep": name},
                   description=f"Sweep `{name}`: each target run's {metric} against its forecast (signed error %, "
                               "inside the interval or not, forecast committed before training or not).")
    def forecast_check(context: dg.AssetExecutionContext, store: MarinStore, forecast_in: ArtifactHandle,
                       evals: dict[str, ArtifactHandle]):
        # `evals` holds every run of the sweep that is a partition now: the fit runs, and the target
        # runs once the committed forecast added them.
        artifacts = store.get()
        record = read_json(artifacts, forecast_in.uri, "forecast.json")
        forecast_manifest = artifacts.read_manifest(forecast_in.uri)
        scores = []
        for target in record["targets"]:
            handle = evals.get(target["run"])
            if handle is None:
                raise dg.Failure(f"target run {target['run']!r} is not yet a partition of {checked_key}: the "
                                 f"sweep_runs sensor (or marin) adds it once forecast/{name} is committed; then "
                                 f"materialize {checked_key} --partition {target['run']}")
            key = harness_result_key(metric) if linked else record.get("metric", fitted_key(config))
            if key not in handle.metrics:
                raise dg.Failure(f"{checked_key}[{target['run']}] has no {key!r}")
            actual = float(handle.metrics[key])
            score = (score_metric_forecast(target, metric, actual, config.error_goal) if linked
                     else score_forecast(target, actual, config.error_goal))
            trained = artifacts.read_manifest(
                next(u.uri for u in artifacts.read_manifest(handle.uri).upstream
                     if u.asset_key == checkpoint_key(name)))
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

        targets = sorted(s["run"] for s in scores)
        upstream = [forecast_in] + [evals[n] for n in targets]
        return materialize_artifact(context, store, forecast_check_spec, upstream=upstream, build=build)

    @marin_check(forecast_check, name="within_forecast_interval",
                    description="Every target's actual eval loss lies inside its primary forecast's interval, and the "
                                "forecast was committed before the target trained. Metadata: signed error % per "
                                "target, for the primary and every other recorded method.")
    def within_forecast_interval(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        return committed_json_check(context, store, forecast_check_spec, "check.json", "forecast check",
                                    forecast_check_result)

    return ([sweep, scaling_fit, forecast, forecast_check, *run_assets],
            [envelope_fitted, within_forecast_interval, *run_checks])


def committed_json_check(context: dg.AssetCheckExecutionContext, store: MarinStore, spec: ArtifactSpec, file_name: str,
                         what: str, result: Callable[[Any], dg.AssetCheckResult],
                         severity: dg.AssetCheckSeverity = dg.AssetCheckSeverity.ERROR) -> dg.AssetCheckResult:
    """``result`` of the JSON file ``file_name`` of the artifact ``spec`` committed as the checked run
    built it; failed (at ``severity``) when there is none."""
    manifest = checked_manifest(context, store, spec)
    if manifest is None:
        return dg.AssetCheckResult(passed=False, severity=severity, metadata={"error": f"no committed {what}"})
    return result(read_json(store.get(), manifest.uri, file_name))


def envelope_check_result(fit_result: dict[str, Any]) -> dg.AssetCheckResult:
    """`envelope_fitted` on a fit.json: passed when the envelope was fitted; else why not, as a warning."""
    envelope = fit_result["fit"]
    metadata = {"interior_optima": len(envelope.get("optima", [])), "left_out": len(envelope["skipped"])}
    if "law" in envelope:
        return dg.AssetCheckResult(passed=True, severity=dg.AssetCheckSeverity.WARN, metadata=metadata)
    return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN, metadata=metadata,
                               description=envelope_status(fit_result))


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
    broken = [f"{t['run']}: actual={t['actual']} outside [{t['low']}, {t['high']}]" for t in targets
              if not t["within_interval"]]
    broken += [f"{t['run']}: trained before its forecast was committed" for t in targets
               if not t["forecast_before_training"]]
    return dg.AssetCheckResult(passed=passed, metadata=metadata,
                               description=None if passed else "; ".join(broken) or "no target to check")


def build_mixture_sweep_assets(settings: MarinSettings, deployment: Deployment, config: MixtureSweepConfig,
                               catalog: Catalog, upstream: Catalog) -> tuple[list, list]:
    """A mixture sweep's checkpoint and eval assets, one partition per point (`<sweep>-w<i>`), as a
    scaling sweep's runs are, and its fit over the points' evals (`mixture_fit/<sweep>`)."""
    runs = mixture_sweep_runs(config, deployment.runs)
    base = deployment.runs[config.run]
    name = config.name
    partitions = dg.DynamicPartitionsDefinition(name=f"{name}_mixture_runs")
    store = store_resource(settings)

    def spec_for(run: str) -> RunSpec:
        if run not in runs:
            raise input_refused(f"{run!r} is not a run of mixture sweep {name!r} (runs: {sorted(runs)})")
        return runs[run]

    catalog.add_discoverer(partitions.name, lambda: sorted(runs))
    run_assets, run_checks = build_run_assets(
        checkpoint_key=mixture_checkpoint_key(name), eval_key=mixture_eval_key(name),
        partitions=partitions, spec_for=spec_for, plan_for=compute_planner(settings, deployment),
        mixtures={base.mixture: mixture_specs(deployment, upstream)[base.mixture]},
        tokenizers={base.tokenizer: tokenizer_specs(deployment, upstream)[base.tokenizer]},
        pool=settings.train_pool, group_name="scaling", catalog=catalog, store=store.get,
        tags={"marin/mixture_sweep": name}, subject=f" of mixture sweep {name!r}")
    checkpoints = catalog.specs[mixture_checkpoint_key(name)]
    fit_spec = ArtifactSpec.fixed(mixture_fit_key(name), MIXTURE_FIT_VERSION, mixture_fit_identity(config, runs))
    fit_config = config.fit

    @catalog.asset(fit_spec, group_name="scaling", kinds={"numpy", "matplotlib"}, tags={"marin/mixture_sweep": name},
                   ins={"evals": all_partitions_in(mixture_eval_key(name), partition_mapping=(
                       dg.SpecificPartitionsPartitionMapping(sorted(runs))))},
                   description=f"RegMix's regression over mixture sweep `{name}`: each point's eval "
                               f"{fit_config.metric} (each eval set's, and the mean over "
                               f"{list(fit_config.target) or 'all of them'}) fitted linearly on its normalized weights"
                               f"{' in log space' if fit_config.log_loss else ''}; the best mixture predicted as the "
                               f"mean of the best {fit_config.top_k} of "
                               f"{fit_config.samples:,} seeded simplex samples, with its {fit_config.interval:.0%} "
                               "prediction interval, R^2 and leave-one-out errors (fit.json, fit.png). Refused "
                               "(status, fit.png's banner, the check mixture_fitted) with fewer runs than "
                               "components + 2 or weights that do not vary.")
    def mixture_fit(context: dg.AssetExecutionContext, store: MarinStore, evals: dict[str, ArtifactHandle]):
        artifacts = store.get()
        try:
            for run, handle in evals.items():
                if run in runs:
                    trained_checkpoint(artifacts, handle, runs[run], fingerprint(checkpoints.identity(run)),
                                       checkpoints.key, mixture_eval_key(name))
            fitted = fit_mixture_sweep(config, runs, {run: handle.metrics for run, handle in evals.items()
                                                      if run in runs})
        except SweepFitError as exc:
            raise input_refused(f"{mixture_fit_key(name)}: {exc}") from None

        def build(writer) -> Built:
            writer.write_json("fit.json", fitted.result)
            with writer.open("fit.png") as fh:
                fh.write(fitted.png)
            return mixture_fit_built(fitted)

        return materialize_artifact(context, store, fit_spec, upstream=[evals[n] for n in sorted(evals)], build=build)

    @marin_check(mixture_fit, name="mixture_fitted",
                 description="The points gave a regression: at least components + 2 runs, with weights that vary in "
                             "every component's direction and finite metrics. Fails (an ERROR) with the reason.")
    def mixture_fitted(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        return committed_json_check(context, store, fit_spec, "fit.json", "mixture fit", mixture_check_result)

    return [*run_assets, mixture_fit], [*run_checks, mixture_fitted]


def mixture_fit_key(sweep: str) -> str:
    return f"mixture_fit/{sweep}"


def mixture_fit_identity(config: MixtureSweepConfig, runs: dict[str, RunSpec]) -> dict[str, Any]:
    """The sweep's points (each eval's identity, so their weights, base run and sample) and the fit's config."""
    return {"sweep": config.name, "points": {run: fingerprint(spec.eval_identity()) for run, spec in runs.items()},
            "fit": config_identity(config.fit)}


def mixture_fit_built(fitted: MixtureSweepFit) -> Built:
    """The fit's metrics (the status first, so a refusal reads before any number) and the UI's tables."""
    result = fitted.result
    metrics: dict[str, Any] = {"status": fitted.status, "runs": len(result["runs"]), "target": result["target"]}
    metadata: dict[str, Any] = {"fit_plot": png_markdown(fitted.png, f"mixture fit of {result['sweep']}"),
                                "runs_table": records_table([{"run": r["run"], **{f"weight/{c}": w for c, w in
                                                                                  r["weights"].items()},
                                                              **{k: v for k, v in r.items()
                                                                 if k not in ("run", "weights")}}
                                                             for r in result["runs"]])}
    target = result.get("fits", {}).get(TARGET)
    if target is not None:
        best = target["best"]
        metrics.update({"r2": target["r2"], "loo_rmse": target["loo_rmse"], "predicted_loss": best["loss"],
                        "predicted_loss_low": best["loss_low"], "predicted_loss_high": best["loss_high"],
                        "best_vertex": best["vertex"], "extrapolated": sorted(best["extrapolated"])})
        metrics.update({f"best/{c}": w for c, w in best["weights"].items()})
        metrics.update({f"alone/{c}": v for c, v in target["alone"].items()})
        metadata["fits"] = records_table([
            {"fitted": key, **({"status": fit["status"]} if "status" in fit else {
                "r2": fit["r2"], "loo_rmse": fit["loo_rmse"], "predicted": fit["best"]["loss"],
                **{f"best/{c}": w for c, w in fit["best"]["weights"].items()},
                **{f"alone/{c}": v for c, v in fit["alone"].items()}})}
            for key, fit in result["fits"].items()])
    return Built(metrics=metrics, metadata=metadata)


def mixture_check_result(fit_result: dict[str, Any]) -> dg.AssetCheckResult:
    """`mixture_fitted` on a fit.json: passed when the target was fitted; else the reason, failed."""
    status = fit_result["status"]
    fitted = "fits" in fit_result
    metadata: dict[str, Any] = {"runs": len(fit_result["runs"])}
    if fitted:
        metadata.update({"r2": fit_result["fits"][TARGET]["r2"], "loo_rmse": fit_result["fits"][TARGET]["loo_rmse"]})
    return dg.AssetCheckResult(passed=fitted, metadata=metadata, description=None if fitted else status)


def build_sweep_runs_sensor(deployment: Deployment) -> dg.SensorDefinition:
    """Adds each sweep's fit runs as partitions, and its target runs once its forecast commits.

    The cursor keeps, per sweep, the storage id of the last forecast materialization it read, so
    the store is read only when a new forecast has committed. Training stays manual: it adds
    partitions and requests no runs."""
    sweeps = {name: SweepRuns(plan_sweep(config)) for name, config in deployment.sweeps.items()}

    @dg.sensor(name="sweep_runs", minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
               description="Adds the fit runs of every sweep as its partitions, and a sweep's target runs once its "
                           "forecast is committed (predict before train).")
    def sweep_runs(context: dg.SensorEvaluationContext, store: MarinStore) -> dg.SensorResult:
        cursor = json.loads(context.cursor) if context.cursor else {}
        requests = []
        for name, runs in sorted(sweeps.items()):
            wanted = set(runs.fit())
            latest = context.instance.fetch_materializations(asset_key(f"forecast/{name}"), limit=1).records
            if latest and latest[0].storage_id != cursor.get(name):
                wanted |= set(runs.targets(store.get()))
                cursor[name] = latest[0].storage_id
            partitions = runs_partitions(name)
            new = sorted(wanted - set(context.instance.get_dynamic_partitions(partitions.name)))
            if new:
                requests.append(partitions.build_add_request(new))
        if not requests:
            return dg.SensorResult(skip_reason="every sweep's runs are partitions already",
                                   cursor=json.dumps(cursor, sort_keys=True))
        return dg.SensorResult(dynamic_partitions_requests=requests, cursor=json.dumps(cursor, sort_keys=True))

    return sweep_runs


def build_scaling_sweeps_stage(settings: MarinSettings, deployment: Deployment,
                               upstream: Catalog) -> tuple[dg.Definitions, Catalog]:
    """One asset set per sweep of the deployment (sweeps on a mixture it does not build are left out),
    and per mixture-weight sweep."""
    assets, checks = [], []
    catalog = Catalog()
    for config in deployment.sweeps.values():
        sweep_assets, sweep_checks = build_sweep_assets(settings, deployment, config, catalog, upstream)
        assets += sweep_assets
        checks += sweep_checks
    for mixture_sweep in deployment.mixture_sweeps.values():
        sweep_assets, sweep_checks = build_mixture_sweep_assets(settings, deployment, mixture_sweep, catalog, upstream)
        assets += sweep_assets
        checks += sweep_checks
    sensors = [build_sweep_runs_sensor(deployment)] if deployment.sweeps else []
    return dg.Definitions(assets=assets, asset_checks=checks, sensors=sensors), catalog
