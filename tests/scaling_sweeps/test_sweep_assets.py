"""The sweep assets on synthetic run results: manifests written through the store API stand in for
training, with eval losses from a known law L(N, D) = E + A / N^a + B / D^b."""

import base64
import dataclasses
import json

import dagster as dg
import pytest
import yaml

from marin_assets.scaling_sweeps import assets as sweep_assets
from marin_assets.scaling_sweeps.config import load_sweeps, plan_sweep, sweep_from_dict
from marin_assets.scaling_sweeps.forecasting import fit_sweep, forecast_record, runs_table, score_forecast
from marin_assets.training import spec as spec_module
from marin_assets.training.assets import CHECKPOINT_VERSION, EVAL_VERSION, build_training_stage
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.identity import fingerprint
from marin_resources.keys import asset_key
from marin_resources.store import ArtifactStore, UpstreamRef, producer_info, writing

SWEEP = "syn"
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
def env(tmp_path, monkeypatch):
    # Registrations are process-global; each test starts from an empty programmatic registry.
    monkeypatch.setattr(spec_module, "_PROGRAMMATIC_RUNS", {})
    sweeps_file = tmp_path / "sweeps.yaml"
    sweeps_file.write_text(yaml.safe_dump({"sweeps": {SWEEP: SWEEP_CONFIG}}))
    runs_file = tmp_path / "runs.yaml"
    runs_file.write_text("runs: {}\n")
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_RUNS": str(runs_file)})
    return settings, sweeps_file


def load(settings, sweeps_file):
    """What the code location does: sweep stage (registers runs) plus training stage."""
    sweep_defs, sweep_catalog = sweep_assets.build_scaling_sweeps_stage(settings, str(sweeps_file), {"m"})
    training_defs, training_catalog = build_training_stage(settings, {"m": "v1"}, {"t": "v1"})
    defs = dg.Definitions.merge(sweep_defs, training_defs, dg.Definitions(resources=build_resources(settings)))
    return defs, training_catalog.discoverers["runs"](), sweep_catalog


def write_run(store: ArtifactStore, run, loss: float, *, spec=None, parameter_count=None) -> None:
    """A committed checkpoint (as training reports it) and its eval (as evaluation reports it)."""
    spec = spec or run.spec
    parameter_count = parameter_count or run.candidate.params
    with writing(store, "checkpoint", CHECKPOINT_VERSION, run.spec.name, run_id="test") as w:
        w.write_json("train_summary.json", {"final_step": run.spec.num_train_steps})
        checkpoint = w.commit(fingerprint=fingerprint(spec.identity()), config=spec.identity(), upstream=[],
                              producer=producer_info("test"),
                              metrics={"final_step": run.spec.num_train_steps, "parameter_count": parameter_count})
    with writing(store, "eval", EVAL_VERSION, run.spec.name, run_id="test") as w:
        w.write_json("eval_report.json", {"eval/m/loss": loss})
        config = {"run": run.spec.identity()}
        w.commit(fingerprint=fingerprint(config), config=config,
                 upstream=[UpstreamRef("checkpoint", run.spec.name, checkpoint.data_version, checkpoint.uri)],
                 producer=producer_info("test"), metrics={"eval/m/loss": loss})


def materialize(defs, instance, *keys):
    return dg.materialize(list(defs.assets) + list(defs.asset_checks), selection=[asset_key(k) for k in keys],
                          instance=instance, resources=defs.resources, raise_on_error=False)


def test_registration_gives_path_safe_partitions_and_targets_wait_for_the_forecast(env):
    settings, sweeps_file = env
    _, partitions, catalog = load(settings, sweeps_file)
    plan = plan_sweep(load_sweeps(sweeps_file)[SWEEP])
    assert partitions == sorted(r.spec.name for r in plan.fit_runs())
    assert not any(name.startswith(f"{SWEEP}-3e14") for name in partitions)
    assert set(spec_module.registered_runs(settings.runs_file)) == set(partitions)
    assert {"sweep/syn", "scaling_fit/syn", "forecast/syn", "forecast_check/syn"} <= set(catalog.identities)


def test_a_sweep_on_a_mixture_this_deployment_lacks_is_left_out(env):
    settings, sweeps_file = env
    defs, _ = sweep_assets.build_scaling_sweeps_stage(settings, str(sweeps_file), {"other"})
    assert not list(defs.assets or []) and not spec_module.registered_runs(settings.runs_file)


def test_fit_forecast_then_check_inside_and_outside_the_interval(env):
    settings, sweeps_file = env
    defs, partitions, _ = load(settings, sweeps_file)
    store = ArtifactStore(settings.prefix)
    plan = plan_sweep(load_sweeps(sweeps_file)[SWEEP])
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", partitions)
    for run in plan.fit_runs():
        write_run(store, run, law(run.candidate.params, run.candidate.tokens))

    result = materialize(defs, instance, "sweep/syn", "scaling_fit/syn", "forecast/syn")
    assert result.success
    fit_manifest = store.find("scaling_fit/syn", sweep_assets.SCALING_FIT_VERSION, None)
    fit = json.loads(store.local_path(f"{fit_manifest.uri}/fit.json").read_text())
    assert len(fit["runs"]) == len(plan.fit_runs()) and all(o["interior"] for o in fit["fit"]["optima"])
    for png in ("fit.png", "joint.png"):
        assert store.local_path(f"{fit_manifest.uri}/{png}").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot = result.asset_materializations_for_node("scaling_fit__syn_scaling_fit")[0].metadata["fit_plot"].value
    assert base64.b64decode(plot.split("base64,")[1].rstrip(")"))[:4] == b"\x89PNG"

    forecast_manifest = store.find("forecast/syn", sweep_assets.FORECAST_VERSION, None)
    target = json.loads(store.local_path(f"{forecast_manifest.uri}/forecast.json").read_text())["targets"][0]
    truth = law(target["params"], target["tokens"])
    assert abs(target["loss"] - truth) / truth < 0.01 and target["loss_low"] <= truth <= target["loss_high"]

    # Reloading the code location registers the chosen target run, which the check now reads.
    defs, partitions, _ = load(settings, sweeps_file)
    assert target["run"] in partitions
    instance.add_dynamic_partitions("runs", [target["run"]])
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


def test_forecast_check_before_the_target_is_registered_says_what_to_do(env):
    settings, sweeps_file = env
    defs, partitions, _ = load(settings, sweeps_file)
    store = ArtifactStore(settings.prefix)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", partitions)
    for run in plan_sweep(load_sweeps(sweeps_file)[SWEEP]).fit_runs():
        write_run(store, run, law(run.candidate.params, run.candidate.tokens))
    result = materialize(defs, instance, "sweep/syn", "scaling_fit/syn", "forecast/syn", "forecast_check/syn")
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert "is registered when the code location loads" in failure.step_failure_data.error.message


@pytest.mark.parametrize("problem", ["parameter count", "another spec"])
def test_scaling_fit_refuses_a_run_that_is_not_the_planned_one(env, problem):
    settings, sweeps_file = env
    defs, partitions, _ = load(settings, sweeps_file)
    store = ArtifactStore(settings.prefix)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", partitions)
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
    assert not sweep_assets.forecast_check_result(
        {"targets": [{**target, "within_interval": False, "forecast_before_training": True}]}).passed
    assert not sweep_assets.forecast_check_result({"targets": []}).passed
