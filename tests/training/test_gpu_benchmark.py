"""benchmarks/gpu_train.py in its CPU size: a real (tiny) Levanter run whose last output line is the JSON report."""

import json
import math
import subprocess
import sys
from pathlib import Path

from marin_assets.training.metrics import peak_flops_per_device

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_train.py"


def test_cpu_sized_run_reports_finite_positive_throughput_and_mfu(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--steps", "6", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["device_kind"] == "cpu" and report["final_step"] == 6
    assert report["steady_steps"] == 4  # steps 2..5; 0 and 1 include compilation
    for key in ("tokens_per_second", "model_flops_per_second", "peak_flops_per_device", "mfu", "step_seconds"):
        assert math.isfinite(report[key]) and report[key] > 0, (key, report[key])
    assert report["mfu"] < 1
    # MFU is Levanter's model FLOP/s over the table's peak.
    assert math.isclose(report["mfu"], report["model_flops_per_second"] / report["peak_flops_per_device"])
    assert report["parameter_count"] > 0 and report["vocab_size"] == 512


def test_h200_is_measured_against_its_dense_bf16_peak():
    assert peak_flops_per_device("NVIDIA H200") == 989e12
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3") == 989e12
