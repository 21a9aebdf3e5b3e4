"""`harness_eval` itself, with the prod `launcher` bound, against the fake API server: the suite runs
in a pod placed like the run's training (its accelerators, its pool), the files the asset hands
the process (the run's Levanter config, the rendered suite) reach the pod, and the pod's report
becomes the manifest. The fake kubelet runs tests/deploy/fake_harness_main.py in place of
harness_main, so nothing is evaluated."""

import json
import sys
from pathlib import Path

import dagster as dg
import yaml

from marin_assets.catalog import Catalog
from marin_assets.evaluation.assets import HARNESS_EVAL_VERSION, HarnessSuite, RunSuites, build_harness_asset
from marin_assets.evaluation.suites import load_suites
from marin_assets.stages import build_stage
from marin_assets.training.assets import CHECKPOINT_VERSION, RUNS, build_training_stage, named_run_lookup
from marin_assets.training.levanter_config import TRAIN_CONFIG_FILE, build_train_config
from marin_assets.training.spec import load_run_registry
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import producer_info, writing
from tests.deploy.test_k8s_training_launcher import make_deployment

FAKE_HARNESS_MAIN = str(Path(__file__).with_name("fake_harness_main.py"))
RUN = "h100x8"


def commit_checkpoint(store, spec) -> None:
    """A finished run as `checkpoint` leaves it: the Levanter config the harness reads back."""
    mixture = {"cache_dir": None, "train_weights": {"m": 1.0}, "configs": {"m": {"cache_dir": f"{store.prefix}/c"}}}
    with writing(store, "checkpoint", CHECKPOINT_VERSION, spec.name, fingerprint=fingerprint(spec.identity()),
                 run_id="test") as writer:
        config = build_train_config(spec, mixture, f"{store.prefix}/tokenizer", str(writer.path("")))
        with writer.open(TRAIN_CONFIG_FILE) as fh:
            fh.write(yaml.safe_dump(config).encode())
        writer.commit(config=spec.identity(), upstream=[], producer=producer_info("test"),
                      metrics={"final_step": spec.num_train_steps})


def test_the_suite_runs_in_a_pod_placed_like_the_run_and_its_report_is_the_manifest(tmp_path, cluster,
                                                                                   synthetic_deployment):
    settings, resources = make_deployment(tmp_path, cluster, str(tmp_path / "store"), store_claim="marin-store")
    cluster.programs["marin_assets.evaluation.harness_main"] = [sys.executable, FAKE_HARNESS_MAIN]
    deployment = synthetic_deployment(runs=load_run_registry(settings.runs_file))
    spec = dict(deployment.runs)[RUN]
    store = resources["store"].get()
    commit_checkpoint(store, spec)
    registry = load_suites()
    suite = registry.suite("core")
    harness = RunSuites.single(HarnessSuite.resolve(registry, suite, set(), {}))
    harness_eval, _ = build_harness_asset(harness, key="harness_eval",
                                          partitions=RUNS, heldout={},
                                          checkpoint=build_stage(build_training_stage, settings, deployment)[1].spec(
                                              "checkpoint"),
                                          spec_for=named_run_lookup(settings, deployment), pool="gpu",
                                          group_name="evaluation", catalog=Catalog())
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(RUNS.name, [RUN])
        instance.event_log_storage.set_concurrency_slots("gpu", 1)
        training, _ = build_stage(build_training_stage, settings, deployment)
        result = dg.materialize([*training.assets, harness_eval], partition_key=RUN, instance=instance,
                                resources=resources, selection=[harness_eval.key], raise_on_error=False)
    assert result.success, [e.message for e in result.all_events if e.is_failure]

    (ran,) = cluster.pods.values()
    container = ran.pod.spec.containers[0]
    assert ran.exit_code == 0
    assert "marin_assets.evaluation.harness_main" in container.command + (container.args or [])
    assert container.resources.limits["nvidia.com/gpu"] == "8"  # the run's placement, not a default
    manifest = store.find("harness_eval", HARNESS_EVAL_VERSION, RUN)
    tasks = [t.name for t in suite.tasks]
    assert {f"{t}/acc" for t in tasks} <= set(manifest.metrics) and manifest.metrics["arc_easy/n"] == 100
    with store.open(f"{manifest.uri}/harness_report.json") as fh:
        report = json.load(fh)
    assert report["run_id"].startswith(f"{RUN}-")  # the config the pod read was this run's
