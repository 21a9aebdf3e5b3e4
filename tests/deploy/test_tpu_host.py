"""A training host without Dagster (docs/tpu-host.md): the processes it runs import none, and the
wheelhouse that deploy/tpu_host/ builds for it holds the locked versions."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TRAINING_PATH = (
    "benchmarks.gpu_train",
    "marin_assets.training.train_main",
    "marin_assets.training.eval_main",
    "marin_assets.training.export_main",
    "marin_assets.training.commands",
)


def test_the_training_path_imports_no_dagster():
    """Only dagster_pipes, the one package the processes report through; Dagster itself (and its
    integrations) is not installed on such a host. Run as the benchmark runs: a fresh process."""
    probe = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import " + ", ".join(TRAINING_PATH) + "; "
             "print(' '.join(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0].startswith('dagster')})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["dagster_pipes"]
