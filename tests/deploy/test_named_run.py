"""deploy/tpu_host/named_run.py's parts that need no chip: the bundle of a run's inputs, the loss curves'
comparison, and its refusals. (The whole chain runs on CPU with `run --accelerator cpu`; docs/tpu-host.md.)"""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def named_run():
    spec = importlib.util.spec_from_file_location("named_run", REPO / "deploy/tpu_host/named_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_metrics(path: Path, losses: list[float], attempts: int = 1) -> Path:
    lines = [json.dumps({"step": step, "attempt": a, "loss": loss + a}) for a in range(attempts)
             for step, loss in enumerate(losses)]
    path.write_text("\n".join(lines + [json.dumps({"step": 3, "eval/loss": 1.0})]) + "\n")
    return path


def test_curves_within_the_tolerance_and_outside_it(named_run, tmp_path):
    cpu = named_run.train_losses(write_metrics(tmp_path / "cpu.jsonl", [4.0] * 30))
    near = named_run.train_losses(write_metrics(tmp_path / "near.jsonl", [4.0 * 1.004] * 30))
    assert cpu[29] == 4.0  # an eval-only record carries no training loss
    close = named_run.compare_curves(cpu, near)
    assert close["within"] and close["largest_window_gap"] == pytest.approx(0.004) and close["steps"] == 30
    far = named_run.compare_curves(cpu, {**near, **{s: 4.2 for s in range(20, 30)}})
    assert not far["within"] and far["at_steps"] == [20, 29] and far["largest_window_gap"] == pytest.approx(0.05)


def test_a_later_attempt_of_a_step_is_the_one_compared(named_run, tmp_path):
    losses = named_run.train_losses(write_metrics(tmp_path / "m.jsonl", [4.0, 3.0], attempts=2))
    assert losses == {0: 5.0, 1: 4.0}


def test_curves_with_no_common_step_are_refused(named_run):
    with pytest.raises(named_run.NamedRunError, match="share no logged step"):
        named_run.compare_curves({0: 1.0}, {5: 1.0})


def test_a_store_without_the_run_is_refused_in_one_line(named_run, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        named_run.main(["bundle", "--store", str(tmp_path), "--out", str(tmp_path / "bundle")])
    assert exit_info.value.code == 2
