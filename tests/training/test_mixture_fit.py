"""`mixture_fit/<sweep>`: RegMix's regression over a mixture-weight sweep's evaluated points. The
points' checkpoints and evals are committed through the store API with eval losses from a known law
in the weights (prose's loss rises with code's share, code's falls faster), so the fit has a known
answer; the refusals are the sweep's own (too few points, weights that do not vary) and its
inputs' (an eval of another spec, an eval missing)."""

import dataclasses
import json

import dagster as dg
import pytest
from conftest import tiny_spec
from test_init_from import _commit, _registry
from test_mixture_schedule import prose_and_code  # noqa: F401  (a fixture)

from marin_assets.scaling_sweeps.assets import MIXTURE_FIT_VERSION, build_scaling_sweeps_stage
from marin_assets.scaling_sweeps.config import MixtureFitConfig, MixtureSweepConfig, extend_mixture_sweeps
from marin_assets.scaling_sweeps.forecasting import SweepFitError
from marin_assets.scaling_sweeps.mixture_fitting import fit_mixture_sweep
from marin_assets.stages import build_stage
from marin_assets.training.assets import CHECKPOINT_VERSION, EVAL_VERSION
from marin_assets.training.spec import load_run_registry
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.keys import asset_key
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import UpstreamRef, producer_info, writing

PROSE, CODE = "prose", "code"
SWEEPS = {
    # Code's share 0, 1/4, 1/2, 3/4, 1: five points for two components.
    "mix": {"run": "base", "weights": [{PROSE: 1}, {PROSE: 3, CODE: 1}, {PROSE: 1, CODE: 1}, {PROSE: 1, CODE: 3},
                                       {CODE: 1}]},
    "few": {"run": "base", "weights": [{PROSE: 1}, {PROSE: 1, CODE: 1}, {CODE: 1}]},
    "same": {"run": "base", "weights": [{PROSE: 1, CODE: 1}, {PROSE: 2, CODE: 2}, {PROSE: 3, CODE: 3},
                                        {PROSE: 4, CODE: 4}]},
}
NOISE = (0.004, -0.003, 0.002, -0.004, 0.001)


def law(weights: dict[str, float], i: int) -> dict[str, float]:
    """Each set's loss at these weights: prose 2.0 + 1.0 s, code 3.0 - 1.5 s (s: code's share), plus noise."""
    share = weights.get(CODE, 0.0) / sum(weights.values())
    return {f"eval/{PROSE}/loss": 2.0 + 1.0 * share + NOISE[i % 5],
            f"eval/{CODE}/loss": 3.0 - 1.5 * share - NOISE[i % 5],
            f"eval/{PROSE}/bpb": 1.0, f"eval/{CODE}/bpb": 1.0}


@pytest.fixture
def stage(tmp_path, synthetic_deployment):
    """(defs with resources, catalog, store, points by sweep) of the sweeps stage over SWEEPS."""
    runs = load_run_registry(_registry(tmp_path, base={}))
    sweeps = extend_mixture_sweeps({}, SWEEPS, runs, "marin.yaml")
    deployment = dataclasses.replace(synthetic_deployment(runs=runs), mixture_sweeps=sweeps)
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store")})
    defs, catalog = build_stage(build_scaling_sweeps_stage, settings, deployment)
    defs = dg.Definitions.merge(defs, dg.Definitions(resources=build_resources(settings)))
    points = {name: sweep.runs(runs["base"]) for name, sweep in sweeps.items()}
    return defs, catalog, defs.resources["store"].get(), points


def commit_point(store, catalog, sweep: str, spec, metrics: dict[str, float], *, config=None):
    """The point's checkpoint (as training commits it; ``config``: another spec's) and its eval."""
    key = f"mixture_sweep_checkpoint/{sweep}"
    config = config or catalog.specs[key].identity(spec.name)
    with writing(store, key, CHECKPOINT_VERSION, spec.name, fingerprint=fingerprint(config), run_id="test") as w:
        w.write_json("train_summary.json", {"final_step": spec.num_train_steps})
        checkpoint = w.commit(config=config, upstream=[], producer=producer_info("test"),
                              metrics={"final_step": spec.num_train_steps})
    eval_config = spec.eval_identity()
    with writing(store, f"mixture_sweep_eval/{sweep}", EVAL_VERSION, spec.name, fingerprint=fingerprint(eval_config),
                 run_id="test") as w:
        w.write_json("eval_report.json", metrics)
        w.commit(config=eval_config, upstream=[UpstreamRef(key, spec.name, checkpoint.data_version, checkpoint.uri)],
                 producer=producer_info("test"), metrics=metrics)


def commit_sweep(store, catalog, points, sweep: str) -> None:
    for i, spec in enumerate(points[sweep].values()):
        commit_point(store, catalog, sweep, spec, law(dict(spec.mixture_weights), i))


def materialize(defs, instance, sweep: str, points):
    instance.add_dynamic_partitions(f"{sweep}_mixture_runs", sorted(points[sweep]))
    return dg.materialize(list(defs.assets) + list(defs.asset_checks), selection=[asset_key(f"mixture_fit/{sweep}")],
                          instance=instance, resources=defs.resources, raise_on_error=False)


def fit_json(store, sweep: str) -> dict:
    manifest = store.find(f"mixture_fit/{sweep}", MIXTURE_FIT_VERSION, None)
    return json.loads(store.local_path(f"{manifest.uri}/fit.json").read_text())


def failure_of(result) -> str:
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return failure.event_specific_data.error.message


@pytest.mark.slow  # Dagster runs of the sweeps stage
def test_the_fit_recovers_the_law_and_predicts_the_best_mixture(stage):
    defs, catalog, store, points = stage
    commit_sweep(store, catalog, points, "mix")
    with dg.instance_for_test() as instance:
        result = materialize(defs, instance, "mix", points)
    assert result.success
    fit = fit_json(store, "mix")
    assert fit["status"].startswith("fitted on 5 runs: R^2 ") and fit["target"] == "mean loss of code, prose"
    target = fit["fits"]["target"]
    # The mean of the two sets' losses is 2.5 - 0.25 s: 2.5 on prose alone, 2.25 on code alone.
    assert target["alone"] == pytest.approx({PROSE: 2.5, CODE: 2.25}, abs=1e-9)  # the noise cancels in the mean
    assert target["best"]["vertex"] == CODE and target["best"]["weights"][CODE] > 0.99
    assert target["best"]["extrapolated"] == {}  # the sweep ran code alone
    # Each set on its own: prose's loss is lowest on prose alone, code's on code alone.
    assert fit["fits"][f"eval/{PROSE}/loss"]["best"]["vertex"] == PROSE
    assert fit["fits"][f"eval/{CODE}/loss"]["best"]["vertex"] == CODE
    prose = fit["fits"][f"eval/{PROSE}/loss"]
    assert prose["alone"] == pytest.approx({PROSE: 2.0, CODE: 3.0}, abs=0.01) and prose["r2"] > 0.99
    assert 0.002 < prose["loo_rmse"] < 0.02
    low, high = prose["best"]["loss_low"], prose["best"]["loss_high"]
    assert low < 2.0 + 1.0 * prose["best"]["weights"][CODE] < high and high - low < 0.05
    [materialization] = result.asset_materializations_for_node("mixture_fit__mix_mixture_fit")
    metadata = materialization.metadata
    assert metadata["status"].value == fit["status"] and metadata["best/code"].value > 0.99
    assert metadata["predicted_loss"].value == pytest.approx(2.25, abs=0.01)
    assert {"fit_plot", "runs_table", "fits", "loo_rmse", "r2", "alone/prose"} <= set(metadata)
    [check] = result.get_asset_check_evaluations()
    assert check.passed and check.check_name == "mixture_fitted"


@pytest.mark.slow  # Dagster runs of the sweeps stage, and `marin materialize`'s planner
@pytest.mark.parametrize("sweep, reason", [
    ("few", "too few runs: 3 for 2 weighed components (code, prose); the linear fit needs at least 4"),
    ("same", "the weights do not vary: all 4 run(s) train on the same mixture"),
])
def test_a_sweep_that_cannot_give_a_fit_says_why_in_its_status_check_and_figure(stage, sweep, reason):
    from marin_assets.planning import Planner

    defs, catalog, store, points = stage
    commit_sweep(store, catalog, points, sweep)
    with dg.instance_for_test() as instance:
        plan = Planner(defs, catalog, store, instance)
        plan.discover()
        *points_steps, step = plan.materialize_all([(asset_key(f"mixture_fit/{sweep}"), None)], log=lambda *_: None)
        # The points were committed as declared: fresh, not run again.
        assert len(points_steps) == len(points[sweep]) and not any(s.ran for s in points_steps)
        assert step.asset_keys == [f"mixture_fit/{sweep}"] and step.ran
        # The CLI's one line: the failed ERROR check, with the reason.
        assert not step.success and step.error.startswith(f"ERROR check(s) failed: mixture_fit/{sweep}") \
            and reason in step.error and "\n" not in step.error, step.error
    fit = fit_json(store, sweep)
    assert fit["status"].startswith(f"refused: {reason}") and "fits" not in fit
    assert len(fit["runs"]) == len(points[sweep])
    manifest = store.find(f"mixture_fit/{sweep}", MIXTURE_FIT_VERSION, None)
    assert manifest.metrics["status"] == fit["status"]
    png = store.local_path(f"{manifest.uri}/fit.png").read_bytes()
    assert f"Mixture weights not fitted: {reason}".encode() in png


@pytest.mark.slow  # Dagster runs of the sweeps stage
def test_a_missing_eval_or_an_eval_of_another_spec_is_refused_in_one_line(stage):
    defs, catalog, store, points = stage
    *evaluated, (last, spec) = points["mix"].items()
    for i, (_, point) in enumerate(evaluated):
        commit_point(store, catalog, "mix", point, law(dict(point.mixture_weights), i))
    with dg.instance_for_test() as instance:
        missing = materialize(defs, instance, "mix", points)
        assert not missing.success and \
            f"upstream mixture_sweep_eval/mix[{last}] has no committed artifact" in failure_of(missing)
        commit_point(store, catalog, "mix", spec, law(dict(spec.mixture_weights), 4))
        # mix-w2's checkpoint is of another spec (another seed) than the sweep declares now.
        stale = points["mix"]["mix-w2"]
        commit_point(store, catalog, "mix", stale, law(dict(stale.mixture_weights), 2),
                     config={**catalog.specs["mixture_sweep_checkpoint/mix"].identity("mix-w2"), "seed": 99})
        refused = materialize(defs, instance, "mix", points)
    message = failure_of(refused)
    assert not refused.success and "mixture_fit/mix: checkpoint[mix-w2] was trained from another spec than the " \
        "sweep's" in message and "marin materialize mixture_sweep_eval/mix --partition mix-w2" in message
    assert store.find("mixture_fit/mix", MIXTURE_FIT_VERSION, None) is None


def test_the_target_is_the_declared_sets_mean_and_each_must_be_in_every_eval():
    """Without Dagster: the target averages the declared sets only; a point without an eval, or an
    eval without a target set, is refused in one line."""
    weights = SWEEPS["mix"]["weights"]
    config = MixtureSweepConfig(name="mix", run="base", weights=tuple(weights),
                                fit=MixtureFitConfig(target=(PROSE,), samples=5_000, top_k=10))
    points = {f"mix-w{i}": tiny_spec(f"mix-w{i}", mixture_weights=w) for i, w in enumerate(weights)}
    metrics = {name: law(weights[i], i) for i, name in enumerate(points)}
    fitted = fit_mixture_sweep(config, points, metrics)
    assert fitted.result["target"] == "eval/prose/loss" and fitted.result["fits"]["target"]["best"]["vertex"] == PROSE
    assert [r["target"] for r in fitted.result["runs"]] == [m["eval/prose/loss"] for m in metrics.values()]
    del metrics["mix-w3"]["eval/prose/loss"]
    with pytest.raises(SweepFitError, match=r"^eval\[mix-w3\] has no eval/prose/loss \(has eval/code/bpb, "):
        fit_mixture_sweep(config, points, metrics)
    with pytest.raises(SweepFitError, match=r"^no eval of point\(s\) mix-w3 of mixture sweep 'mix': marin "
                                            r"materialize mixture_sweep_eval/mix --partition mix-w3$"):
        fit_mixture_sweep(config, points, {k: v for k, v in metrics.items() if k != "mix-w3"})


def commit_directory(store, key: str, directory: str):
    """Every file under ``directory`` committed as the artifact ``key`` (a cache or a tokenizer, as the
    tokenization stage commits them)."""
    from pathlib import Path

    root = Path(directory)
    return _commit(store, key, None, {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()})


@pytest.mark.slow  # trains four tiny runs through `marin materialize`'s planner
def test_a_real_swarm_of_tiny_runs_fits_each_sources_best_weights(tmp_path, synthetic_deployment, request,
                                                                    monkeypatch):
    """Four tiny runs on stdlib docstrings (prose) and stdlib code, weighted 1:0, 3:1, 1:3 and 0:1,
    trained and evaluated for real, then fitted: each source's loss is predicted lowest on that
    source alone, and the fit says how well it knows."""
    from marin_assets.planning import Planner

    sources = request.getfixturevalue("prose_and_code")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runs = load_run_registry(_registry(tmp_path, base={
        "num_train_steps": 80, "optimizer": {"learning_rate": 0.01, "warmup": 0.1}, "watch_every": 0,
        "steps_per_eval": 10_000, "max_eval_batches": 4}))
    weights = [{PROSE: 1}, {PROSE: 3, CODE: 1}, {PROSE: 1, CODE: 3}, {CODE: 1}]
    sweeps = extend_mixture_sweeps({}, {"swarm": {"run": "base", "weights": weights}}, runs, "marin.yaml")
    deployment = dataclasses.replace(synthetic_deployment(runs=runs), mixture_sweeps=sweeps)
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store")})
    defs, catalog = build_stage(build_scaling_sweeps_stage, settings, deployment)
    defs = dg.Definitions.merge(defs, dg.Definitions(resources=build_resources(settings)))
    store = defs.resources["store"].get()
    caches = {name: commit_directory(store, f"tokenized/{name}", component["cache_dir"]).uri
              for name, component in sources["configs"].items()}
    tokenizer = commit_directory(store, "tokenizer/t", sources["tokenizer"])
    _commit(store, "mixture/m", None, {"data.json": json.dumps({
        **sources, "tokenizer": tokenizer.uri,
        "configs": {name: {**component, "cache_dir": caches[name]}
                    for name, component in sources["configs"].items()}}).encode()})
    with dg.instance_for_test() as instance:
        plan = Planner(defs, catalog, store, instance)
        plan.discover()
        results = plan.materialize_all([(asset_key("mixture_fit/swarm"), None)], log=print)
    assert all(r.success for r in results), [r.error for r in results if not r.success]
    fit = fit_json(store, "swarm")
    for source in (PROSE, CODE):
        record = fit["fits"][f"eval/{source}/loss"]
        print(source, json.dumps({k: record[k] for k in ("alone", "r2", "loo_rmse")}),
              json.dumps(record["best"]["weights"]), record["best"]["loss"], record["best"]["loss_low"],
              record["best"]["loss_high"])
        assert record["best"]["vertex"] == source and record["best"]["weights"][source] > 0.9
        assert record["best"]["extrapolated"] == {}
    print("target", fit["status"])
    assert fit["status"].startswith("fitted on 4 runs")
