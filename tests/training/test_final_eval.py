"""eval/<run> adopts the training process's final-eval report only when this eval code wrote it."""

import dataclasses
import json

import pytest

from marin_assets.training.assets import eval_built, final_eval_report
from marin_assets.training.commands import eval_command, train_command
from marin_assets.training.eval_main import REPORT_VERSION, evenly_spaced
from marin_assets.training.spec import validate_run
from marin_assets.training.train_main import FINAL_EVAL_FILE
from marin_resources.artifacts import ArtifactHandle
from marin_resources.storage.store import ArtifactStore


def checkpoint_with(tmp_path, report):
    store = ArtifactStore(str(tmp_path / "store"))
    run_dir = tmp_path / "store" / "checkpoint" / "v1-abc" / "run"
    run_dir.mkdir(parents=True)
    if report is not None:
        (run_dir / FINAL_EVAL_FILE).write_text(json.dumps(report))
    return store, ArtifactHandle("checkpoint", "run", "v1", str(run_dir), "dv")


def test_a_report_of_this_version_is_adopted_with_its_samples(tmp_path):
    report = {"report_version": REPORT_VERSION, "checkpoint_path": "/x/step-9", "eval/m/loss": 2.5,
              "eval/m/bpb": 1.25, "samples": [{"prompt": "a", "completion": "b"}]}
    store, checkpoint = checkpoint_with(tmp_path, report)
    assert final_eval_report(store, checkpoint) == report
    built = eval_built(report, evaluated_by="training process")
    assert built.metrics == {"eval/m/loss": 2.5, "eval/m/bpb": 1.25}
    assert built.metadata["evaluated_by"] == "training process" and "samples" in built.metadata


def test_no_report_or_another_version_means_the_eval_process_runs(tmp_path):
    store, checkpoint = checkpoint_with(tmp_path / "none", None)
    assert final_eval_report(store, checkpoint) is None
    store, checkpoint = checkpoint_with(tmp_path / "old", {"report_version": REPORT_VERSION - 1, "eval/m/loss": 2.5})
    assert final_eval_report(store, checkpoint) is None
    store, checkpoint = checkpoint_with(tmp_path / "unversioned", {"eval/m/loss": 2.5})
    assert final_eval_report(store, checkpoint) is None


def test_a_sampled_report_is_adopted_only_for_the_same_sample(tmp_path):
    sampled = {"report_version": REPORT_VERSION, "sample_examples": 1024, "eval/m/loss": 2.5}
    store, checkpoint = checkpoint_with(tmp_path / "sampled", sampled)
    assert final_eval_report(store, checkpoint, 1024) == sampled
    assert final_eval_report(store, checkpoint, 512) is None
    assert final_eval_report(store, checkpoint) is None  # the run now scores the whole split
    whole = {"report_version": REPORT_VERSION, "eval/m/loss": 2.5}
    store, checkpoint = checkpoint_with(tmp_path / "whole", whole)
    assert final_eval_report(store, checkpoint) == whole
    assert final_eval_report(store, checkpoint, 1024) is None


def test_the_sample_is_evenly_spaced_and_never_more_than_the_split():
    assert evenly_spaced(10, None) == list(range(10))
    assert evenly_spaced(10, 20) == list(range(10))
    assert evenly_spaced(10, 4) == [0, 2, 5, 7]
    sample = evenly_spaced(4384, 1024)
    assert len(set(sample)) == 1024 and sample[0] == 0 and sample[-1] >= 4384 - 5
    assert evenly_spaced(4384, 1024) == sample  # deterministic: every run scores the same sequences


def test_the_sample_is_part_of_evals_identity_not_the_checkpoints():
    from conftest import tiny_spec

    spec = tiny_spec()
    sampled = dataclasses.replace(spec, final_eval_examples=1024)
    assert sampled.identity() == spec.identity() and sampled.fingerprint() == spec.fingerprint()
    assert spec.eval_identity() == {"run": spec.identity()}  # unchanged for evals of the whole split
    assert sampled.eval_identity() == {"run": spec.identity(), "examples": 1024}
    with pytest.raises(ValueError, match="final_eval_examples"):
        validate_run(dataclasses.replace(spec, final_eval_examples=0))
    command = train_command("/o/c.yaml", "/o", final_eval=True, final_eval_examples=1024)
    assert command.args[-3:] == ("--final-eval", "--final-eval-examples", "1024")
    assert eval_command("/o/c.yaml", "/o", sample_examples=1024).args[-2:] == ("--sample-examples", "1024")
