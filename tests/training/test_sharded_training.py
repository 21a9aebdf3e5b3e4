"""Sharded training on virtual CPU devices: FSDP 4 x data 2 on 8 devices trains the same losses as one
device at the same global batch and seed, its weights are really split, and its checkpoint resumes
on 4 devices (Levanter reshards it on load). Then two processes of 4 devices each, joined through
jax.distributed on this machine, as a multi-host slice would be."""

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SUBPROCESS_ENV, tiny_spec

from marin_assets.training.commands import train_command
from marin_assets.training.levanter_config import build_train_config, write_train_config
from marin_assets.training.spec import MeshShape, ParallelismSpec, ResourceSpec
from marin_resources.launchers import build_command_and_env

pytestmark = [pytest.mark.slow, pytest.mark.heaviest]

STEPS = 40
LOSS_TOLERANCE = 1e-3


def _train(spec, mixture, tokenizer_dir, out: Path, *, final_eval: bool = False) -> tuple[dict, dict[int, float]]:
    """Train ``spec`` through the launcher's command and env (which gives a CPU run its devices)."""
    config = write_train_config(build_train_config(spec, mixture, tokenizer_dir, str(out)), out / "train_config.yaml")
    launch = build_command_and_env(train_command(config, str(out), final_eval=final_eval), accelerator="cpu",
                                   cpu_devices=spec.resources.device_count)
    log = out / "train.log"
    proc = subprocess.run(launch.command, env={**os.environ, **SUBPROCESS_ENV, **launch.env}, stdout=subprocess.DEVNULL,
                          stderr=open(log, "w"))
    assert proc.returncode == 0, log.read_text()[-3000:]
    losses = {}
    for line in open(out / "metrics.jsonl"):
        record = json.loads(line)
        losses[record["step"]] = record["loss"]
    return json.loads((out / "train_summary.json").read_text()), losses


def _complete_checkpoints(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "metadata.json").exists())


ONE_DEVICE = tiny_spec(steps=STEPS, checkpoint_every=10, watch_every=0)


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory, tiny_artifact, tiny_mixture) -> tuple[dict, dict[int, float]]:
    """The reference: the run on one device."""
    return _train(ONE_DEVICE, tiny_mixture, tiny_artifact[1], tmp_path_factory.mktemp("one"))


def test_fsdp_on_8_devices_matches_one_device_and_resumes_on_4(tmp_path, tiny_artifact, tiny_mixture, one_device_run):
    _, tokenizer_dir = tiny_artifact
    one = ONE_DEVICE
    eight = dataclasses.replace(one, resources=ResourceSpec(device_count=8),
                                parallelism=ParallelismSpec(data=2, fsdp=4))
    four = dataclasses.replace(one, resources=ResourceSpec(device_count=4), parallelism=ParallelismSpec(data=2, fsdp=2))
    assert one.fingerprint() == eight.fingerprint() == four.fingerprint()

    single, single_losses = one_device_run
    sharded, sharded_losses = _train(eight, tiny_mixture, tokenizer_dir, tmp_path / "eight", final_eval=True)
    # The training process evaluates its final checkpoint on the same mesh.
    assert json.loads((tmp_path / "eight" / "final_eval_report.json").read_text())["eval/stdlib-docs/loss"] > 0

    assert (single["device_count"], single["process_count"]) == (1, 1)
    assert (sharded["device_count"], sharded["process_count"]) == (8, 1)
    assert (sharded["mesh_data"], sharded["mesh_fsdp"], sharded["mesh_tensor"]) == (2, 4, 1)
    assert sorted(sharded_losses) == sorted(single_losses) == list(range(STEPS))
    for step, loss in single_losses.items():
        assert sharded_losses[step] == pytest.approx(loss, abs=LOSS_TOLERANCE), step
    print("max |loss(8 devices) - loss(1 device)|:",
          max(abs(sharded_losses[s] - single_losses[s]) for s in single_losses))

    # The largest weight (the 512 x 32 token embedding) is split along embed over the mesh's
    # FSDP ("data") axis, a quarter on each device; on one device (a mesh of size 1) it is whole.
    weight = sharded["sharded_weight"]
    axes = list(weight["axes"])
    embed = axes.index("embed")
    assert weight["axes"]["embed"] == 32 and weight["devices"] == 8
    assert weight["partition_spec"][embed] == "data"
    assert weight["device_shape"] == [8 if i == embed else size for i, size in enumerate(weight["axes"].values())]
    whole = single["sharded_weight"]
    assert whole["path"] == weight["path"] and whole["devices"] == 1
    assert whole["device_shape"] == list(whole["axes"].values())

    # The 8-device run's directory, cut back to its first checkpoint, resumes on 4 devices (data 2 x
    # fsdp 2): Levanter loads the arrays into the new shardings, and the loss continues the 1-device run's.
    resumed = tmp_path / "four"
    shutil.copytree(tmp_path / "eight", resumed, ignore=shutil.ignore_patterns("wandb"))
    first, *later = _complete_checkpoints(resumed / "checkpoints")
    assert later, "the 8-device run wrote only one checkpoint"
    for step in later:
        shutil.rmtree(resumed / "checkpoints" / f"step-{step}")
    (resumed / "train_summary.json").unlink()
    summary, losses = _train(four, tiny_mixture, tokenizer_dir, resumed)
    assert summary["resumed_from_step"] == first + 1 and summary["final_step"] == STEPS
    assert (summary["device_count"], summary["mesh_data"], summary["mesh_fsdp"]) == (4, 2, 2)
    assert summary["sharded_weight"]["device_shape"][embed] == 16
    for step in range(first + 1, STEPS):
        assert losses[step] == pytest.approx(single_losses[step], abs=LOSS_TOLERANCE), step
    print("max |loss(resumed on 4) - loss(1 device)|:",
          max(abs(losses[s] - single_losses[s]) for s in range(first + 1, STEPS)), "from step", first + 1)


def _losses(metrics_path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(metrics_path))}


def _start(spec, config: str, out: Path, group, extra_env=()) -> subprocess.Popen:
    launch = build_command_and_env(train_command(config, str(out)), accelerator="cpu",
                                   cpu_devices=spec.resources.device_count // spec.resources.process_count)
    return subprocess.Popen(launch.command, env={**os.environ, **SUBPROCESS_ENV, **launch.env, **group.env(),
                                                 **dict(extra_env)},
                            stdout=subprocess.DEVNULL, stderr=open(out / f"process-{group.process_id}.log", "w"))


def test_a_coordinator_that_never_comes_up_is_one_line_and_commits_nothing(tmp_path, tiny_artifact, tiny_mixture):
    from marin_resources.launchers import local_process_groups

    spec = dataclasses.replace(ONE_DEVICE, resources=ResourceSpec(device_count=8, processes=2))
    out = tmp_path / "run"
    config = write_train_config(build_train_config(spec, tiny_mixture, tiny_artifact[1], str(out)),
                                out / "train_config.yaml")
    _, follower = local_process_groups(2)  # process 0, the coordinator, is never started
    proc = _start(spec, config, out, follower, {"MARIN_COORDINATOR_TIMEOUT_S": "3"})
    assert proc.wait(timeout=120) != 0
    assert (out / "process-1.log").read_text().strip().splitlines()[-1] == (
        f"train_main: the coordinator at {follower.coordinator_address} did not come up within 3 s (process 1 of 2)")
    assert not (out / "train_summary.json").exists() and not (out / "checkpoints").exists()


def test_two_processes_checkpoint_to_s3_stop_together_when_one_is_killed_and_resume_from_the_bucket(
        tmp_path, tiny_artifact, tiny_mixture, one_device_run, s3_server, s3_prefix, monkeypatch):
    """Two processes of 4 devices with FSDP over all 8 save checkpoints into a bucket (moto); killing one
    stops both with nothing committed; the rerun through the local launcher, from a fresh scratch, resumes
    from the bucket and trains the 1-device run's losses; the evaluation reads the final checkpoint back."""
    import signal
    import time

    import dagster as dg
    import s3fs

    from marin_assets.training.commands import eval_command
    from marin_assets.training.levanter_config import set_checkpoint_base
    from marin_resources.launchers import LocalPipesLauncher, local_process_groups

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    store, options = s3_prefix
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    _, single_losses = one_device_run
    spec = dataclasses.replace(ONE_DEVICE, resources=ResourceSpec(device_count=8, processes=2))
    assert spec.mesh == MeshShape(data=1, fsdp=8, tensor=1)  # across hosts, FSDP by default
    scratch = tmp_path / "scratch"
    config = write_train_config(build_train_config(spec, tiny_mixture, tiny_artifact[1], str(scratch)),
                                tmp_path / "train_config.yaml")
    checkpoints = f"{store}/run/checkpoints"
    set_checkpoint_base(config, checkpoints)

    def saved() -> list[int]:
        return sorted(int(p.split("/step-")[1].split("/")[0])
                      for p in fs.glob(f"{checkpoints[5:]}/step-*/metadata.json", refresh=True))

    scratch.mkdir()
    leader, follower = (_start(spec, config, scratch, group) for group in local_process_groups(2))
    deadline = time.monotonic() + 300
    while not saved():
        assert leader.poll() is None and follower.poll() is None, (scratch / "process-0.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint reached the bucket within 300 s"
        time.sleep(0.2)
    follower.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    assert leader.wait(timeout=180) != 0
    print(f"process 0 stopped {time.monotonic() - killed:.1f} s after process 1 was killed")
    kept = saved()
    assert kept[-1] < STEPS - 1, "training finished before it could be killed"
    assert not (scratch / "train_summary.json").exists() and not fs.exists(f"{store[5:]}/run/train_summary.json")

    # A fresh machine: the rerun has only the bucket, and the launcher starts both processes.
    shutil.rmtree(scratch)

    @dg.asset
    def two_hosts(context: dg.AssetExecutionContext, launcher: LocalPipesLauncher):
        return launcher.run_process(context, train_command(config, str(scratch)), resources=spec.resources
                                    ).get_materialize_result()

    result = dg.materialize([two_hosts], resources={"launcher": LocalPipesLauncher()})
    assert result.success
    (materialization,) = result.asset_materializations_for_node("two_hosts")
    meta = {k: v.value for k, v in materialization.metadata.items()}
    assert meta["resumed_from_step"] == kept[-1] + 1 and meta["final_step"] == STEPS and meta["attempt"] == 1
    assert (meta["device_count"], meta["process_count"]) == (8, 2)
    assert (meta["mesh_data"], meta["mesh_fsdp"], meta["mesh_tensor"]) == (1, 8, 1)
    assert meta["sharded_weight"]["devices"] == 8 and meta["sharded_weight"]["device_shape"][-1] == 4
    assert meta["latest_checkpoint_path"] == f"{checkpoints}/step-{STEPS - 1}"
    losses = _losses(scratch / "metrics.jsonl")  # the first attempt's steps came back from the bucket
    assert sorted(losses) == list(range(STEPS))
    for step, loss in single_losses.items():
        assert losses[step] == pytest.approx(loss, abs=LOSS_TOLERANCE), step
    print("max |loss(2 processes, resumed) - loss(1 device)|:",
          max(abs(losses[s] - single_losses[s]) for s in single_losses))
    assert (scratch / "train_output.process-1.log").exists()

    # The evaluation, one process with all 8 devices, reads the final checkpoint back from the bucket and
    # scores the examples Levanter's final in-training evaluation scored.
    evaluation = build_command_and_env(
        eval_command(config, str(tmp_path / "eval"),
                     extra_args=["--max-examples", str(spec.max_eval_batches * spec.train_batch_size)]),
        accelerator="cpu", cpu_devices=spec.resources.for_evaluation().device_count)
    proc = subprocess.run(evaluation.command, env={**os.environ, **SUBPROCESS_ENV, **evaluation.env},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "eval_report.json").read_text())
    assert report["checkpoint_path"] == meta["latest_checkpoint_path"]
    assert report["eval/stdlib-docs/loss"] == pytest.approx(meta["eval_loss_last"], rel=1e-3)
