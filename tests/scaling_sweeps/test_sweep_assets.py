"""The sweep assets on synthetic run results: manifests written through the store API stand in for
training, with eval losses from a known law L(N, D) = E + A / N^a + B / D^b."""

import base64
import dataclasses
import io
import json
import math

import dagster as dg
import pytest
import yaml

from marin_assets.evaluation.assets import HARNESS_EVAL_VERSION, build_evaluation_stage
from marin_assets.scaling_sweeps import assets as sweep_assets
from marin_assets.scaling_sweeps.config import load_sweeps, plan_sweep, sweep_from_dict
from marin_assets.scaling_sweeps.forecasting import (
    SweepFitError,
    envelope_status,
    fit_sweep,
    forecast_record,
    runs_table,
    score_forecast,
)
from marin_assets.stages import build_stage
from marin_assets.training.assets import CHECKPOINT_VERSION, EVAL_VERSION
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.keys import asset_key
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore, UpstreamRef, producer_info, writing
from scaling import EnvelopeRefused, fit_isoflop_runs, load_runs

SWEEP = "syn"
CHECKPOINT, EVAL, RUNS = f"sweep_checkpoint/{SWEEP}", f"sweep_eval/{SWEEP}", f"{SWEEP}_sweep_runs"
HARNESS = f"sweep_harness_eval/{SWEEP}"
SWEEP_CONFIG = {
    "recipe": "micro",
    "recipe_overrides": {"vocab_size": 4096, "seq_len": 128},
    "mixture": "m",
    "tokenizer": "t",
    "eval_set": "m",
    "fit_budgets": [3e12, 1e13, 3e13],
    "target_budgets": [3e14],
    "bootstrap_samples": 50,
}


def law(params: float, tokens: float) -> float:
    return 1.7 + 80.0 / params**0.3 + 300.0 / tokens**0.3


@pytest.fixture
def env(tmp_path):
    sweeps_file = tmp_path / "sweeps.yaml"
    sweeps_file.write_text(yaml.safe_dump({"sweeps": {SWEEP: SWEEP_CONFIG}}))
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SWEEPS": str(sweeps_file)})
    return settings, sweeps_file


@pytest.fixture
def load(synthetic_deployment):
    """`load(settings, sweeps_file)`: what the code location does (the sweep stage), and the sweep's
    runs as the planner discovers them."""
    return lambda settings, sweeps_file: load_stage(settings, synthetic_deployment(sweeps=load_sweeps(sweeps_file)))


def load_stage(settings, deployment):
    defs, catalog = build_stage(sweep_assets.build_scaling_sweeps_stage, settings, deployment)
    defs = dg.Definitions.merge(defs, dg.Definitions(resources=build_resources(settings)))
    return defs, catalog.discoverers[RUNS](), catalog


def write_run(store: ArtifactStore, run, loss: float, *, spec=None, parameter_count=None, eval_spec=None) -> None:
    """A committed checkpoint (as training reports it) and its eval (as evaluation reports it)."""
    spec = spec or run.spec
    parameter_count = parameter_count or run.candidate.params
    with writing(store, CHECKPOINT, CHECKPOINT_VERSION, run.spec.name, fingerprint=fingerprint(spec.identity()),
                 run_id="test") as w:
        w.write_json("train_summary.json", {"final_step": run.spec.num_train_steps})
        checkpoint = w.commit(config=spec.identity(), upstream=[],
                              producer=producer_info("test"),
                              metrics={"final_step": run.spec.num_train_steps, "parameter_count": parameter_count})
    config = (eval_spec or run.spec).eval_identity()
    with writing(store, EVAL, EVAL_VERSION, run.spec.name, fingerprint=fingerprint(config), run_id="test") as w:
        w.write_json("eval_report.json", {"eval/m/loss": loss})
        w.commit(config=config,
                 upstream=[UpstreamRef(CHECKPOINT, run.spec.name, checkpoint.data_version, checkpoint.uri)],
                 producer=producer_info("test"), metrics={"eval/m/loss": loss})


def materialize(defs, instance, *keys):
    return dg.materialize(list(defs.assets) + list(defs.asset_checks), selection=[asset_key(k) for k in keys],
                          instance=instance, resources=defs.resources, raise_on_error=False)


def sensor_tick(defs, instance, cursor: str | None) -> tuple[list[str], str]:
    """One tick of the `sweep_runs` sensor with its partition requests applied: the keys it added, its cursor."""
    sensor = next(s for s in defs.sensors if s.name == "sweep_runs")
    result = sensor(dg.build_sensor_context(instance=instance, cursor=cursor,
                                            resources={"store": defs.resources["store"]}))
    added = []
    for request in result.dynamic_partitions_requests or []:
        assert request.partitions_def_name == RUNS
        instance.add_dynamic_partitions(RUNS, list(request.partition_keys))
        added += request.partition_keys
    return sorted(added), result.cursor


def test_sweep_runs_are_their_own_partitions_and_targets_wait_for_the_forecast(env, load):
    settings, sweeps_file = env
    defs, partitions, catalog = load(settings, sweeps_file)
    plan = plan_sweep(load_sweeps(sweeps_file)[SWEEP])
    assert partitions == sorted(r.spec.name for r in plan.fit_runs())
    assert not any(name.startswith(f"{SWEEP}-3e14") for name in partitions)
    graph = defs.resolve_asset_graph()
    for key in (CHECKPOINT, EVAL):
        assert graph.get(asset_key(key)).partitions_def.name == RUNS
    assert {"sweep/syn", "scaling_fit/syn", "forecast/syn", "forecast_check/syn", CHECKPOINT, EVAL} <= \
        set(catalog.specs)


def test_a_sweep_on_a_mixture_this_deployment_lacks_is_left_out(env, synthetic_deployment):
    settings, sweeps_file = env
    deployment = synthetic_deployment(sweeps=load_sweeps(sweeps_file), mixture="other")
    defs, _ = build_stage(sweep_assets.build_scaling_sweeps_stage, settings, deployment)
    assert not list(defs.assets or []) and not list(defs.sensors or [])


@pytest.mark.slow  # several fits through Dagster runs
def test_fit_forecast_then_check_inside_and_outside_the_interval(env, load):
    settings, sweeps_file = env
    defs, partitions, _ = load(settings, sweeps_file)
    store = ArtifactStore(settings.prefix)
    plan = plan_sweep(load_sweeps(sweeps_file)[SWEEP])
    instance = dg.DagsterInstance.ephemeral()
    # The sensor adds the fit runs as partitions, and nothing more until a forecast commits.
    added, cursor = sensor_tick(defs, instance, None)
    assert added == partitions
    added, cursor = sensor_tick(defs, instance, cursor)
    assert added == []
    for run in plan.fit_runs():
        write_run(store, run, law(run.candidate.params, run.candidate.tokens))

    result = materialize(defs, instance, "sweep/syn", "scaling_fit/syn", "forecast/syn")
    assert result.success
    fit_manifest = store.find("scaling_fit/syn", sweep_assets.SCALING_FIT_VERSION, None)
    fit = json.loads(store.local_path(f"{fit_manifest.uri}/fit.json").read_text())
    assert len(fit["runs"]) == len(plan.fit_runs()) and all(o["interior"] for o in fit["fit"]["optima"])
    for png in ("fit.png", "joint.png"):
        assert store.local_path(f"{fit_manifest.uri}/{png}").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metadata = result.asset_materializations_for_node("scaling_fit__syn_scaling_fit")[0].metadata
    png = base64.b64decode(metadata["fit_plot"].value.split("base64,")[1].rstrip(")"))
    assert png[:4] == b"\x89PNG" and png_description(png) is None  # a fitted envelope: no banner
    assert metadata["envelope"].value.startswith("fitted through 3 interior optima of 3 budgets: E = ")
    (envelope_check,) = [c for c in result.get_asset_check_evaluations() if c.check_name == "envelope_fitted"]
    assert envelope_check.passed and envelope_check.metadata["interior_optima"].value == 3

    forecast_manifest = store.find("forecast/syn", sweep_assets.FORECAST_VERSION, None)
    target = json.loads(store.local_path(f"{forecast_manifest.uri}/forecast.json").read_text())["targets"][0]
    truth = law(target["params"], target["tokens"])
    assert abs(target["loss"] - truth) / truth < 0.01 and target["loss_low"] <= truth <= target["loss_high"]

    # The committed forecast makes the chosen target a partition: the sensor adds it, and discovery lists it.
    added, _ = sensor_tick(defs, instance, cursor)
    assert added == [target["run"]]
    assert target["run"] in load(settings, sweeps_file)[1]
    chosen = next(r for r in plan.target_candidates(3e14) if r.spec.name == target["run"])

    write_run(store, chosen, truth)
    result = materialize(defs, instance, "forecast_check/syn")
    assert result.success
    (check,) = result.get_asset_check_evaluations()
    assert check.passed
    assert check.metadata[f"{target['run']}/error_pct"].value == pytest.approx(100 * (target["loss"] - truth) / truth)

    write_run(store, chosen, target["loss_high"] * 1.05)
    result = materialize(defs, instance, "forecast_check/syn")
    (check,) = result.get_asset_check_evaluations()
    assert not check.passed


def test_forecast_check_before_the_target_is_a_partition_says_what_to_do(env, load):
    settings, sweeps_file = env
    defs, partitions, _ = load(settings, sweeps_file)
    store = ArtifactStore(settings.prefix)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(RUNS, partitions)
    for run in plan_sweep(load_sweeps(sweeps_file)[SWEEP]).fit_runs():
        write_run(store, run, law(run.candidate.params, run.candidate.tokens))
    result = materialize(defs, instance, "sweep/syn", "scaling_fit/syn", "forecast/syn", "forecast_check/syn")
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert "is not yet a partition of sweep_eval/syn" in failure.step_failure_data.error.message


@pytest.mark.parametrize("problem", ["parameter count", "another spec"])
def test_scaling_fit_refuses_a_run_that_is_not_the_planned_one(env, load, problem):
    settings, sweeps_file = env
    defs, partitions, _ = load(settings, sweeps_file)
    store = ArtifactStore(settings.prefix)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(RUNS, partitions)
    runs = plan_sweep(load_sweeps(sweeps_file)[SWEEP]).fit_runs()
    for run in runs[1:]:
        write_run(store, run, law(run.candidate.params, run.candidate.tokens))
    bad = runs[0]
    if problem == "parameter count":  # e.g. a tokenizer whose vocabulary is not the recipe's
        write_run(store, bad, 5.0, parameter_count=bad.candidate.params * 2)
    else:  # a run of the same name trained before the recipe changed
        write_run(store, bad, 5.0, spec=dataclasses.replace(bad.spec, seed=bad.spec.seed + 1))
    result = materialize(defs, instance, "sweep/syn", "scaling_fit/syn")
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert problem in failure.step_failure_data.error.message


def test_scaling_fit_refuses_an_eval_of_another_sample_than_the_sweeps(env, load):
    settings, sweeps_file = env
    sweeps_file.write_text(yaml.safe_dump({"sweeps": {SWEEP: {**SWEEP_CONFIG, "eval_examples": 256}}}))
    defs, partitions, _ = load(settings, sweeps_file)
    store = ArtifactStore(settings.prefix)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(RUNS, partitions)
    runs = plan_sweep(load_sweeps(sweeps_file)[SWEEP]).fit_runs()
    assert all(run.spec.final_eval_examples == 256 for run in runs)
    for run in runs[1:]:
        write_run(store, run, law(run.candidate.params, run.candidate.tokens))
    # Evaluated on the whole split before the sweep declared its sample.
    write_run(store, runs[0], 5.0, eval_spec=dataclasses.replace(runs[0].spec, final_eval_examples=None))
    result = materialize(defs, instance, "sweep/syn", "scaling_fit/syn")
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert "scored another sample than the sweep's (eval_examples 256)" in failure.step_failure_data.error.message


def test_both_methods_forecast_every_candidate_and_the_primary_one_picks_the_target():
    plan = plan_sweep(sweep_from_dict(SWEEP, {**SWEEP_CONFIG, "forecast_method": "joint"}))
    rows = runs_table(plan, {r.spec.name: law(r.candidate.params, r.candidate.tokens) for r in plan.fit_runs()})
    result = fit_sweep(plan, rows).result
    assert result["forecast_method"] == "joint" and result["joint_fit"]["bootstrap"]["used"] >= 45
    (target,) = result["targets"]
    assert len(target["candidates"]) >= 3
    for candidate in target["candidates"]:
        truth = law(candidate["params"], candidate["tokens"])
        assert set(candidate["forecasts"]) == {"envelope", "joint"}
        joint = candidate["forecasts"]["joint"]
        # The runs follow an approach-3 law exactly, so the joint fit recovers it 10x beyond its budgets.
        assert joint["loss"] == pytest.approx(truth, rel=1e-3)
        assert joint["loss_low"] - 1e-9 <= joint["loss"] <= joint["loss_high"] + 1e-9
        assert candidate["loss"] == joint["loss"] and candidate["method"] == "joint"
    assert target["chosen"] == min(target["candidates"], key=lambda c: c["forecasts"]["joint"]["loss"])["run"]
    (frozen,) = forecast_record(result)["targets"]
    assert frozen["run"] == target["chosen"] and forecast_record(result)["method"] == "joint"
    score = score_forecast(frozen, law(frozen["params"], frozen["tokens"]), 0.02)
    assert score["method"] == "joint" and score["within_goal"]
    assert set(score["by_method"]) == {"envelope", "joint"}
    assert score["by_method"]["joint"]["error_pct"] == pytest.approx(score["error_pct"])


@pytest.mark.slow  # several fits through Dagster runs
def test_without_interior_valleys_a_joint_sweep_still_fits_and_says_why_the_envelope_is_missing():
    """Runs so data-starved that the smallest model wins at every budget, the loss rising ever less
    steeply with size (as in the demo's sweep): no budget's valley is convex, so the envelope cannot
    be fitted. A sweep whose primary method is the joint law records why and forecasts anyway; one
    that relies on the envelope fails."""
    def data_starved(run):
        return 3.0 + 0.2 * math.sqrt(math.log(run.candidate.params))

    joint_plan = plan_sweep(sweep_from_dict(SWEEP, {**SWEEP_CONFIG, "forecast_method": "joint"}))
    rows = runs_table(joint_plan, {r.spec.name: data_starved(r) for r in joint_plan.fit_runs()})
    fitted = fit_sweep(joint_plan, rows)
    assert fitted.result["fit"]["error"].startswith("not enough interior optima: 0 of 3") and fitted.joint_png
    assert [s["reason"] for s in fitted.result["fit"]["skipped"]] == \
        ["loss is not convex in log tokens/params (no interior minimum)"] * 3
    assert png_description(fitted.png) == f"Envelope not fitted: {fitted.result['fit']['error']}"
    (target,) = fitted.result["targets"]
    assert target["envelope"] is None and all(set(c["forecasts"]) == {"joint"} for c in target["candidates"])
    (frozen,) = forecast_record(fitted.result)["targets"]
    assert frozen["envelope_loss"] is None and frozen["method"] == "joint"

    envelope_plan = plan_sweep(sweep_from_dict(SWEEP, SWEEP_CONFIG))
    with pytest.raises(SweepFitError, match="not enough interior optima"):
        fit_sweep(envelope_plan, runs_table(envelope_plan, {r.spec.name: data_starved(r)
                                                             for r in envelope_plan.fit_runs()}))


def png_description(png: bytes) -> str | None:
    """The Description text chunk of a PNG (the refused envelope's banner, `scaling.plots`)."""
    from PIL import Image

    return Image.open(io.BytesIO(png)).text.get("Description")


# The demo sweep's eval losses (sweep_eval/demo: its 1,024-sequence sample of the shakespeare split),
# widths 4, 8 and 16 at each fit budget, as `marin demo` measured them on a clean store:
# 2026-12-03 in docs/scaling.md ("The demo sweep"), and 2026-12-07 in this change's own run, whose
# three valleys are all convex with their vertices beyond their most tokens: the fit before this
# change made of them E = 0 and 5.9e-08 parameters on 2.8e+31 tokens, issue 52's nonsense to the digit.
DEMO_LOSSES = {
    "2026-12-03": {"1.25e10": (6.4885, 6.5340, 6.6242), "1.75e10": (6.4389, 6.4960, 6.5738),
                   "2.5e10": (6.2665, 6.4478, 6.5018)},
    "2026-12-07": {"1.25e10": (6.498369, 6.529413, 6.586697), "1.75e10": (6.471406, 6.486484, 6.519186),
                   "2.5e10": (6.244294, 6.349007, 6.488565)},
}


@pytest.mark.parametrize("measured", sorted(DEMO_LOSSES))
def test_the_demo_sweeps_own_runs_say_not_enough_interior_optima_and_fit_no_envelope(measured):
    """At every demo budget the smallest model is best, so no valley has its minimum inside its runs:
    the fit says so (status, banner, check) and forecasts by the joint law alone, never an envelope."""
    plan = plan_sweep(load_sweeps()["demo"])
    losses = {f"demo-{budget}-d{width}": loss for budget, row in DEMO_LOSSES[measured].items()
              for width, loss in zip((4, 8, 16), row)}
    fitted = fit_sweep(plan, runs_table(plan, losses))
    status = envelope_status(fitted.result)
    assert status.startswith("not fitted: not enough interior optima: 0 of 3 budget(s)"), status
    assert "law" not in fitted.result["fit"] and len(fitted.result["fit"]["skipped"]) == 3
    if measured == "2026-12-07":  # every valley has a vertex, and every vertex lies beyond its runs
        assert all(s["reason"].startswith("minimum outside its runs (D* ") for s in fitted.result["fit"]["skipped"])
    assert png_description(fitted.png) == f"Envelope not fitted: {fitted.result['fit']['error']}"
    check = sweep_assets.envelope_check_result(fitted.result)
    assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN and check.description == status
    (target,) = fitted.result["targets"]
    assert target["envelope"] is None and all(set(c["forecasts"]) == {"joint"} for c in target["candidates"])


# Micro-Delphi attempt 5's fit runs (docs/scaling.md, "Fit runs"): eval/shakespeare/loss by width.
MICRO_DELPHI_LOSSES = {
    "3e11": {8: 5.665, 12: 5.626, 16: 5.977, 20: 6.097, 24: 6.239},
    "6e11": {8: 5.451, 12: 5.369, 16: 5.573, 20: 5.653, 24: 5.805},
    "1.2e12": {12: 5.221, 16: 5.228, 20: 5.281, 24: 5.355, 32: 5.444},
}


def test_micro_delphi_attempt_5_has_one_interior_optimum_and_no_envelope():
    """Its envelope was fitted through two optima below their smallest model (E = 0, and a forecast
    that missed by 15.5%); now those two are left out, and one interior optimum fits nothing."""
    plan = plan_sweep(load_sweeps()["micro-delphi"])
    losses = {f"micro-delphi-{budget}-d{width}": loss for budget, row in MICRO_DELPHI_LOSSES.items()
              for width, loss in row.items()}
    runs = load_runs(runs_table(plan, losses))
    with pytest.raises(EnvelopeRefused) as refused:
        fit_isoflop_runs(runs, [1.2e13])
    assert str(refused.value).startswith("not enough interior optima: 1 of 3 budget(s)")
    assert "(left out: 3e+11 FLOPs: minimum outside its runs (D* " in str(refused.value)
    assert "; 1.2e+12 FLOPs: minimum outside its runs (D* " in str(refused.value)


@pytest.mark.parametrize("actual, inside", [(4.0, True), (3.9, True), (4.31, False), (3.7, False)])
def test_score_forecast(actual, inside):
    score = score_forecast({"run": "r", "budget": 1e14, "loss": 4.0, "loss_low": 3.8, "loss_high": 4.3}, actual, 0.02)
    assert score["within_interval"] is inside
    assert score["error_pct"] == pytest.approx(100 * (4.0 - actual) / actual)
    assert score["within_goal"] is (abs(4.0 - actual) / actual <= 0.02)


def test_check_result_needs_interval_and_forecast_before_training():
    target = {"run": "r", "error_pct": 1.0, "actual": 4.0, "low": 3.8, "high": 4.3, "within_goal": True}
    assert sweep_assets.forecast_check_result(
        {"targets": [{**target, "within_interval": True, "forecast_before_training": True}]}).passed
    assert not sweep_assets.forecast_check_result(
        {"targets": [{**target, "within_interval": True, "forecast_before_training": False}]}).passed
    outside = sweep_assets.forecast_check_result(
        {"targets": [{**target, "within_interval": False, "forecast_before_training": True}]})
    assert not outside.passed
    assert outside.description == \
        f"{target['run']}: actual={target['actual']} outside [{target['low']}, {target['high']}]"
    assert not sweep_assets.forecast_check_result({"targets": []}).passed


LINKED = {"metric": "harness_eval/plays_next_line/acc", "link": "sigmoid", "link_floor": 0.25}
TRUE_LINK = {"floor": 0.25, "ceiling": 0.9, "k": 2.0, "loss_mid": 6.3}  # the fit runs span losses 5.6..8.4


def accuracy(loss: float) -> float:
    """The harness accuracy a run at ``loss`` scores (a sigmoid of the loss, as the link assumes)."""
    from scaling.links import SigmoidLink

    return float(SigmoidLink(**TRUE_LINK, rmse=0.0, points=0).predict(loss))


def write_harness(store: ArtifactStore, run, acc: float) -> None:
    """A committed sweep_harness_eval/syn[run] (as the evaluation stage reports it) over the run's checkpoint."""
    checkpoint = store.find(CHECKPOINT, CHECKPOINT_VERSION, run.spec.name)
    config = {"run": run.spec.identity(), "suite": "s"}
    with writing(store, HARNESS, HARNESS_EVAL_VERSION, run.spec.name, fingerprint=fingerprint(config),
                 run_id="test") as w:
        w.write_json("harness_report.json", {"plays_next_line/acc": acc})
        w.commit(config=config,
                 upstream=[UpstreamRef(CHECKPOINT, run.spec.name, checkpoint.data_version, checkpoint.uri)],
                 producer=producer_info("test"), metrics={"plays_next_line/acc": acc, "plays_next_line/n": 400})


@pytest.fixture
def linked(tmp_path, synthetic_deployment):
    """`(settings, plan, load_linked)` for sweep `syn` forecasting a harness accuracy; `load_linked()`
    is the sweep stage and the evaluation stage's harness asset of the sweep (its artifacts are
    written through the store here, never launched), and the sweep's runs."""
    sweeps_file = tmp_path / "sweeps.yaml"
    sweeps_file.write_text(yaml.safe_dump({"sweeps": {SWEEP: {**SWEEP_CONFIG, **LINKED}}}))
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store")})
    sweeps = load_sweeps(sweeps_file)
    deployment = synthetic_deployment(sweeps=sweeps)

    def load_linked():
        defs, partitions, _ = load_stage(settings, deployment)
        evaluation, catalog = build_stage(build_evaluation_stage, settings, deployment)
        assert HARNESS in catalog.specs
        harness = [a for a in evaluation.assets if a.key == asset_key(HARNESS)]
        return dg.Definitions.merge(defs, dg.Definitions(assets=harness)), partitions

    return settings, plan_sweep(sweeps[SWEEP]), load_linked


@pytest.mark.slow  # several fits through Dagster runs
def test_a_sweep_forecasts_harness_accuracy_through_the_sigmoid_link(linked):
    settings, plan, load_linked = linked
    defs, partitions = load_linked()
    graph = defs.resolve_asset_graph()
    harness = graph.get(asset_key(HARNESS))
    assert harness.partitions_def.name == RUNS and harness.parent_keys == {asset_key(CHECKPOINT)}
    assert {asset_key(f"scaling_fit/{SWEEP}"), asset_key(f"forecast_check/{SWEEP}")} <= harness.child_keys
    store = ArtifactStore(settings.prefix)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(RUNS, partitions)
    for run in plan.fit_runs():
        loss = law(run.candidate.params, run.candidate.tokens)
        write_run(store, run, loss)
        write_harness(store, run, accuracy(loss))
    assert materialize(defs, instance, "sweep/syn", "scaling_fit/syn", "forecast/syn").success
    fit = store.find("scaling_fit/syn", sweep_assets.SCALING_FIT_VERSION, None)
    assert fit.metrics["link/k"] == pytest.approx(TRUE_LINK["k"], rel=0.05)
    assert fit.metrics["link/loss_mid"] == pytest.approx(TRUE_LINK["loss_mid"], rel=0.01)
    forecast = json.loads(store.local_path(
        f"{store.find('forecast/syn', sweep_assets.FORECAST_VERSION, None).uri}/forecast.json").read_text())
    assert forecast["metric"] == LINKED["metric"]
    target = forecast["targets"][0]
    truth = accuracy(law(target["params"], target["tokens"]))
    assert target["metric_low"] <= target["metric_predicted"] <= target["metric_high"]
    assert target["metric_predicted"] == pytest.approx(truth, abs=0.01)

    # The check compares the target's harness accuracy with the linked forecast.
    defs, partitions = load_linked()
    assert target["run"] in partitions
    instance.add_dynamic_partitions(RUNS, [target["run"]])
    chosen = next(r for r in plan.target_candidates(3e14) if r.spec.name == target["run"])
    write_run(store, chosen, law(target["params"], target["tokens"]))
    write_harness(store, chosen, truth)
    result = materialize(defs, instance, "forecast_check/syn")
    assert result.success
    (check,) = result.get_asset_check_evaluations()
    assert check.passed and check.metadata[f"{target['run']}/actual"].value == pytest.approx(truth)
    write_harness(store, chosen, 0.25)  # back at chance: far outside the interval
    (check,) = materialize(defs, instance, "forecast_check/syn").get_asset_check_evaluations()
    assert not check.passed


def test_a_linked_fit_without_a_runs_harness_eval_names_it(linked):
    settings, plan, load_linked = linked
    defs, partitions = load_linked()
    store = ArtifactStore(settings.prefix)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(RUNS, partitions)
    fit_runs = plan.fit_runs()
    for run in fit_runs:
        loss = law(run.candidate.params, run.candidate.tokens)
        write_run(store, run, loss)
        if run is not fit_runs[0]:
            write_harness(store, run, accuracy(loss))
    result = materialize(defs, instance, "sweep/syn", "scaling_fit/syn")
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert f"upstream {HARNESS}[{fit_runs[0].spec.name}] has no committed artifact" in \
        failure.step_failure_data.error.message


@pytest.mark.parametrize("change, problem", [
    ({"metric": "eval/other/loss"}, "an eval metric is eval/m/<loss|bpb>"),
    ({"metric": "harness_eval/t/acc"}, "a harness metric needs a link"),
    ({"metric": "harness_eval/t/f1", "link": "sigmoid"}, "expected eval/<set>/<loss|bpb> or harness_eval"),
    ({"metric": "eval/m/bpb", "link": "sigmoid"}, "a link is for harness metrics"),
    ({"link": "cubic"}, "'cubic' is not one of 'sigmoid'"),
])
def test_a_sweep_names_a_metric_it_can_fit(change, problem):
    from marin_assets.scaling_sweeps.config import SweepConfigError

    with pytest.raises(SweepConfigError, match=problem.replace("[", r"\[").replace("]", r"\]").replace("|", r"\|")):
        sweep_from_dict(SWEEP, {**SWEEP_CONFIG, **change})


def test_the_default_metric_leaves_a_sweeps_identity_unchanged():
    config = sweep_from_dict(SWEEP, SWEEP_CONFIG)
    assert "metric" not in config.identity() and "link" not in config.identity()
    assert "eval_examples" not in config.identity()
    assert sweep_from_dict(SWEEP, {**SWEEP_CONFIG, "eval_examples": 64}).identity()["eval_examples"] == 64
    assert sweep_from_dict(SWEEP, {**SWEEP_CONFIG, "metric": "eval/m/bpb"}).identity()["metric"] == "eval/m/bpb"
