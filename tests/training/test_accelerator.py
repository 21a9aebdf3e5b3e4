"""The host's accelerator, asked without holding it: TPU types from device kinds, a held chip and a
missing platform as one line, and gpu_train's refusals before anything trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from marin_assets.training.accelerator import AcceleratorError, held_message, probe, sole_process, tpu_type_for

GPU_TRAIN = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_train.py"
# What JAX 0.10.2 raised on the lent TPU v5e host when a second program opened the chip (2026-12-07).
HELD = ("RuntimeError: Unable to initialize backend 'tpu': ABORTED: Internal error when accessing libtpu "
        "multi-process lockfile. Run \"$ sudo rm /tmp/libtpu_lockfile\". (set JAX_PLATFORMS='' to automatically "
        "choose an available backend)")


@pytest.mark.parametrize("kind, chips, expected", [
    ("TPU v5 lite", 1, "v5litepod-1"), ("TPU v5e", 8, "v5litepod-8"), ("TPU v6 lite", 4, "v6e-4"),
    ("TPU v4", 4, "v4-8"), ("TPU v5p", 4, "v5p-8"),
])
def test_tpu_types_follow_cloud_tpu_naming(kind, chips, expected):
    assert tpu_type_for(kind, chips) == expected


def test_an_unknown_device_kind_asks_for_the_type():
    with pytest.raises(AcceleratorError, match="pass --tpu-type"):
        tpu_type_for("TPU v9 imaginary", 1)


def test_a_held_chip_is_recognised_and_said_in_one_line():
    message = held_message("Traceback (most recent call last):\n  ...\n" + HELD)
    assert message is not None and "\n" not in message and "held by another process" in message
    assert held_message("RuntimeError: Unable to initialize backend 'tpu': NOT_FOUND") is None


def test_a_platform_the_host_lacks_is_one_line():
    with pytest.raises(AcceleratorError) as raised:
        probe("tpu")  # this machine has no TPU: JAX refuses in the child process, which exits
    assert "no tpu devices on this host" in str(raised.value) and "\n" not in str(raised.value)


def run_gpu_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GPU_TRAIN), *args], capture_output=True, text=True, timeout=120)


def test_gpu_train_refuses_a_missing_tpu_in_one_line_with_exit_code_2(tmp_path):
    proc = run_gpu_train("--size", "tiny", "--accelerator", "tpu", "--workdir", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no tpu devices on this host" in proc.stderr
    assert not (tmp_path / "data").exists()  # refused before any data was built


def test_gpu_train_validates_the_run_before_the_chip_with_the_given_type(tmp_path):
    """With --devices and --tpu-type nothing is probed: a batch the devices do not divide is refused first."""
    proc = run_gpu_train("--size", "tiny", "--accelerator", "tpu", "--devices", "4", "--tpu-type", "v5litepod-4",
                         "--batch-size", "6", "--workdir", str(tmp_path))
    assert proc.returncode == 2 and "not divisible" in proc.stderr
    proc = run_gpu_train("--size", "tiny", "--accelerator", "tpu", "--devices", "1", "--tpu-type", "v5litepod-3",
                         "--workdir", str(tmp_path))
    assert proc.returncode == 2 and "resources.tpu_type" in proc.stderr


@pytest.mark.parametrize("environ, alone", [
    ({}, True),
    ({"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5litepod-4"}, True),  # the one-chip host
    ({"TPU_WORKER_HOSTNAMES": "t1k-0,t1k-1,t1k-2,t1k-3"}, False),  # a four-host slice: JAX must join them
    ({"SLURM_NTASKS": "8"}, False),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, True),
    ({"MARIN_COORDINATOR_ADDRESS": "127.0.0.1:8476"}, False),  # our launcher's group joins it itself
    ({"TPU_ACCELERATOR_TYPE": "v5litepod-16"}, False),  # workers from the metadata server: JAX's detection decides
    ({"TPU_WORKER_HOSTNAMES": "localhost", "MEGASCALE_NUM_SLICES": "2"}, False),  # one host of a multislice run
])
def test_one_host_one_process_starts_no_jax_distributed(environ, alone):
    assert sole_process(environ) is alone


def test_gpu_train_refuses_a_run_that_cannot_fit_before_any_data_or_chip(tmp_path):
    """Whole f32 logits and every activation of llama_150m at batch 64 need about 44 GiB of a 16 GiB chip."""
    proc = run_gpu_train("--size", "llama_150m", "--accelerator", "tpu", "--devices", "1", "--tpu-type", "v5litepod-1",
                         "--gradient-checkpointing", "off", "--fused-loss", "off", "--cross-entropy-block-size", "none",
                         "--workdir", str(tmp_path / "work"))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "does not fit its resources" in proc.stderr and "16 GiB" in proc.stderr
    assert not (tmp_path / "work").exists()


def test_a_process_that_finds_the_chip_held_exits_2_with_one_line(capsys):
    from marin_assets.training.process import exits_when_held

    with pytest.raises(SystemExit) as exited, exits_when_held("eval_main"):
        raise RuntimeError(HELD)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("eval_main: the TPU is held by another process") and err.count("\n") == 1
    with pytest.raises(RuntimeError, match="NOT_FOUND"), exits_when_held("eval_main"):
        raise RuntimeError("Unable to initialize backend 'tpu': NOT_FOUND")
