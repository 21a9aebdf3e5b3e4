"""harness_eval on bad input: one clear line, the failure recorded in the instance (`marin failures`), no hang."""

import dataclasses
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

from conftest import tiny_spec  # noqa: E402  (tests/training/conftest.py)
from data_fixtures import single_cache_mixture  # noqa: E402

from marin_assets.curation.config import CurationConfig  # noqa: E402
from marin_assets.deployment import Deployment  # noqa: E402
from marin_assets.evaluation.assets import build_evaluation_stage  # noqa: E402
from marin_assets.evaluation.suites import load_suites  # noqa: E402
from marin_assets.stages import build_stage
from marin_assets.tokenization.registry import TokenizationRegistry  # noqa: E402
from marin_assets.training.assets import CHECKPOINT_VERSION, RUNS  # noqa: E402
from marin_assets.training.levanter_config import build_train_config, write_train_config  # noqa: E402
from marin_resources.environments import MarinSettings, build_resources  # noqa: E402
from marin_resources.failures import failed_materializations  # noqa: E402
from marin_resources.storage.identity import fingerprint  # noqa: E402
from marin_resources.storage.store import producer_info, writing  # noqa: E402

RUN = "tiny"


@pytest.fixture
def harness_deployment(tmp_path, monkeypatch):
    """`make(suite_tasks) -> (materialize, instance)`: a store holding checkpoint[tiny], whose run
    config names a tokenizer directory without a tokenizer, and the evaluation stage on a suites
    file with ``suite_tasks``."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    spec = tiny_spec(RUN, steps=2)
    # The run alone: nothing tokenized here, so the suite's offline tasks and held-out sets are not built.
    deployment = Deployment(CurationConfig(sources=()), TokenizationRegistry(tokenizers={}, tokenized={}, mixtures={}),
                            runs={RUN: spec}, sweeps={})
    empty_tokenizer = tmp_path / "tokenizer"
    empty_tokenizer.mkdir()
    instance = dg.DagsterInstance.ephemeral()

    def make(suite_tasks, unfit_suites=None):
        suites = tmp_path / "suites.yaml"
        suites.write_text(yaml.safe_dump({"suites": {"s": {"tasks": suite_tasks}}, "default_suite": "s"}))
        settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SUITES": str(suites),
                                           "MARIN_PROCESS_OUTPUT": "file"})
        resources = build_resources(settings)
        store = resources["store"].get()
        if store.find("checkpoint", CHECKPOINT_VERSION, RUN) is None:
            with writing(store, "checkpoint", CHECKPOINT_VERSION, RUN, fingerprint=fingerprint(spec.identity()),
                         run_id="seed") as writer:
                out = store.local_path(writer.uri)
                mixture = single_cache_mixture("stdlib-docs", str(tmp_path / "cache"), str(empty_tokenizer))
                write_train_config(build_train_config(dataclasses.replace(spec, watch_every=0), mixture,
                                                      str(empty_tokenizer), str(out)),
                                   Path(out) / "train_config.yaml")
                writer.commit(config=spec.identity(), upstream=[],
                              producer=producer_info("seed"))
        stage, _ = build_stage(build_evaluation_stage, settings, dataclasses.replace(
            deployment, suites=load_suites(suites), unfit_suites=unfit_suites or {}))

        @dg.asset(key="checkpoint", partitions_def=RUNS, metadata={"marin/version": CHECKPOINT_VERSION},
                  io_manager_key="artifact_io_manager")
        def checkpoint():
            raise AssertionError("seeded in the store, never built here")

        instance.add_dynamic_partitions(RUNS.name, [RUN])
        assets = [a for a in stage.assets if a.key == dg.AssetKey("harness_eval")]
        return dg.materialize([checkpoint, *assets], selection=["harness_eval"], partition_key=RUN,
                              instance=instance, resources=resources, raise_on_error=False)

    yield make, instance
    instance.dispose()


def failure_of(result, instance) -> str:
    assert not result.success
    rows = [r for r in failed_materializations(instance) if r["run_id"] == result.run_id]
    assert rows and rows[0]["failed_assets"] == ["harness_eval"] and rows[0]["partition"] == RUN
    return rows[0]["error"]


def test_unknown_task_fails_before_any_process(harness_deployment):
    make, instance = harness_deployment
    error = failure_of(make([{"task": "arc_easyy"}]), instance)
    assert "unknown lm-eval task 'arc_easyy'" in error and "suite 's'" in error
    assert error.count("\n") == 0, error


def test_a_run_the_default_suite_does_not_fit_is_refused_in_one_line_naming_what_to_declare(harness_deployment):
    """A project run that only falls to the built-in default suite (Deployment.unfit_suites): the deployment
    loads, and its harness_eval refuses before any process, in the line the load would have given."""
    make, instance = harness_deployment
    problem = "run 'tiny' (tokenizer 't') is evaluated with suite 's' (default_suite), ...; name a suite for it"
    error = failure_of(make([{"task": "copa"}], unfit_suites={RUN: problem}), instance)
    assert error == f"Failure: harness_eval[tiny]: {problem}"


@pytest.mark.slow  # an eval harness process
@pytest.mark.timeout(300)
def test_checkpoint_without_tokenizer_is_one_line_from_the_process(harness_deployment):
    make, instance = harness_deployment
    error = failure_of(make([{"task": "copa"}]), instance)
    assert "harness_eval[tiny]" in error and "holds no tokenizer.json or tokenizer_config.json" in error
    assert error.count("\n") == 0, error


def test_offline_task_without_its_data_file_is_refused(tmp_path):
    """The process checks every offline task's YAML and data files before it loads anything."""
    from marin_assets.evaluation.harness_main import HarnessInputError, check_offline_tasks
    from marin_assets.evaluation.next_line import NextLineTaskSpec, render_task_yaml

    spec = NextLineTaskSpec(name="t_next_line", source="s")
    (tmp_path / "t_next_line.yaml").write_text(render_task_yaml(spec, str(tmp_path / "t_next_line.jsonl")))
    with pytest.raises(HarnessInputError,
                       match=r"offline task 't_next_line': data file .*t_next_line.jsonl is missing"):
        check_offline_tasks(str(tmp_path), ["t_next_line"])
    (tmp_path / "t_next_line.jsonl").write_text("{}\n")
    check_offline_tasks(str(tmp_path), ["t_next_line"])
    with pytest.raises(HarnessInputError, match="offline task 'other': no task config"):
        check_offline_tasks(str(tmp_path), ["other"])
