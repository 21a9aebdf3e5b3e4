"""benchmarks/gpu_train.py in its CPU size: real (tiny) Levanter runs, data parallel and FSDP over two
virtual devices, whose last output line is the JSON report."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from marin_assets.training.metrics import peak_flops_per_device

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_train.py"


@pytest.mark.slow
def test_cpu_sized_run_reports_finite_positive_throughput_and_mfu_for_both_variants(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--steps", "6", "--devices", "2",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["device_kind"] == "cpu" and report["device_count"] == 2
    assert report["parameter_count"] > 0 and report["vocab_size"] == 512
    assert sorted(report["variants"]) == ["data_parallel", "fsdp"]
    for name, variant in report["variants"].items():
        assert variant["final_step"] == 6 and variant["device_count"] == 2, name
        assert variant["steady_steps"] == 4, name  # steps 2..5; 0 and 1 include compilation
        for key in ("tokens_per_second", "model_flops_per_second", "mfu", "step_seconds"):
            assert math.isfinite(variant[key]) and variant[key] > 0, (name, key, variant[key])
        assert variant["mfu"] < 1
        # MFU is Levanter's model FLOP/s over the table's peak times the devices.
        assert math.isclose(variant["mfu"], variant["model_flops_per_second"] / (2 * report["peak_flops_per_device"]))
    # The same two devices, as replicas or as FSDP shards: the embedding is whole on each replica and
    # split in two along embed under FSDP.
    assert report["variants"]["data_parallel"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
    assert report["variants"]["fsdp"]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    replicated, sharded = (report["variants"][v]["sharded_weight"] for v in ("data_parallel", "fsdp"))
    assert replicated["device_shape"] == list(replicated["axes"].values())
    assert sharded["device_shape"][list(sharded["axes"]).index("embed")] == sharded["axes"]["embed"] // 2


def test_a_batch_the_devices_do_not_divide_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--devices", "3", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "train_batch_size" in proc.stderr and "not divisible" in proc.stderr


def test_h200_is_measured_against_its_dense_bf16_peak():
    assert peak_flops_per_device("NVIDIA H200") == 989e12
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3") == 989e12
