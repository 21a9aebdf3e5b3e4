"""A run whose loss becomes NaN ends in one line, exit code 2, naming the last finite step: no traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import SUBPROCESS_ENV, tiny_spec

from marin_assets.training.spec import OptimizerSpec
from marin_assets.training.train_main import INPUT_ERROR_FILE


@pytest.mark.slow
def test_a_diverging_run_is_one_line_naming_its_last_finite_step(tmp_path, tiny_artifact, tiny_mixture):
    from marin_assets.training.levanter_config import build_train_config, write_train_config

    # No warm-up, no clipping, a learning rate of 10^9: the first update sends the weights to inf.
    spec = tiny_spec(steps=4, watch_every=0, optimizer=OptimizerSpec(learning_rate=1e9, warmup=0, max_grad_norm=None))
    config = write_train_config(build_train_config(spec, tiny_mixture, tiny_artifact[1], str(tmp_path)),
                                tmp_path / "train_config.yaml")
    proc = subprocess.run([sys.executable, "-m", "marin_assets.training.train_main", "--config", config,
                           "--output-dir", str(tmp_path)], env={**os.environ, **SUBPROCESS_ENV},
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    line = (tmp_path / INPUT_ERROR_FILE).read_text().strip()
    assert re.fullmatch(r"training diverged: the loss became NaN after step \d+ \(loss \d+\.\d{4} there\); lower "
                        r"optimizer\.learning_rate.*", line)
    assert f"error: {line}" in proc.stderr
