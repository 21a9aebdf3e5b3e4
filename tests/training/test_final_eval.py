"""eval/<run> adopts the training process's final-eval report only when this eval code wrote it."""

import json

from marin_assets.training.assets import eval_built, final_eval_report
from marin_assets.training.eval_main import REPORT_VERSION
from marin_assets.training.train_main import FINAL_EVAL_FILE
from marin_resources.artifacts import ArtifactHandle
from marin_resources.store import ArtifactStore


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
