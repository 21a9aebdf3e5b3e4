"""JAX's persistent compilation cache for training processes: chosen by environment, handed to the
process, and a run that reads it trains exactly as one that compiled everything itself."""

import json
import os
import subprocess
import sys

import pytest
from conftest import SUBPROCESS_ENV, tiny_spec

from marin_assets.training.commands import train_command
from marin_assets.training.levanter_config import WandbSettings, build_train_config, write_train_config
from marin_resources.environments import MarinSettings, build_resources

TRAIN = """
import sys
from pathlib import Path
from marin_assets.training.reporting import ConsoleReporter
from marin_assets.training.train_main import train
train(sys.argv[1], Path(sys.argv[2]), ConsoleReporter())
"""


def launch_env(environ: dict[str, str], tmp_path) -> dict[str, str]:
    launcher = build_resources(MarinSettings.from_env(environ, cwd=tmp_path))["launcher"]
    return launcher.launch(train_command("/o/c.yaml", "/o")).env


def test_the_cache_is_a_runtime_choice_of_the_environment(tmp_path):
    home = tmp_path / "home"
    env = launch_env({"DAGSTER_HOME": str(home)}, tmp_path)
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(home / "jax_compilation_cache")
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert int(env["JAX_COMPILATION_CACHE_MAX_SIZE"]) > 0  # bounded, and read and written under JAX's file lock
    assert launch_env({"DAGSTER_HOME": str(home), "MARIN_JAX_CACHE": "/shared/jax"}, tmp_path)[
        "JAX_COMPILATION_CACHE_DIR"] == "/shared/jax"
    assert "JAX_COMPILATION_CACHE_DIR" not in launch_env({"DAGSTER_HOME": str(home), "MARIN_JAX_CACHE": "off"},
                                                         tmp_path)
    assert launch_env({"DAGSTER_HOME": str(home), "JAX_COMPILATION_CACHE_DIR": "/jax"}, tmp_path)[
        "JAX_COMPILATION_CACHE_DIR"] == "/jax"  # JAX's own setting, where MARIN_JAX_CACHE is not set
    assert "JAX_COMPILATION_CACHE_DIR" not in launch_env({}, tmp_path)  # no home, no default
    # A cluster's pods share nothing by default: only a directory named in MARIN_JAX_CACHE.
    assert MarinSettings.from_env({"MARIN_ENV": "prod", "MARIN_PREFIX": "s3://b/p", "DAGSTER_HOME": str(home),
                                   "JAX_COMPILATION_CACHE_DIR": "/jax"}, cwd=tmp_path).jax_compilation_cache is None
    # Never part of what a run is: the fingerprint and the rendered config do not name it.
    spec = tiny_spec()
    assert "jax_compilation_cache" not in json.dumps(spec.identity())


@pytest.mark.slow
def test_a_run_that_reads_the_cache_trains_bit_for_bit_the_same(tmp_path, tiny_artifact, tiny_mixture):
    _, tokenizer_dir = tiny_artifact
    cache = tmp_path / "jax_cache"
    spec = tiny_spec(steps=5, watch_every=0)
    env = {**os.environ, **SUBPROCESS_ENV, **launch_env({"MARIN_JAX_CACHE": str(cache)}, tmp_path)}
    entries, losses = {}, {}
    for name in ("cold", "warm"):
        out = tmp_path / name
        config = build_train_config(spec, tiny_mixture, tokenizer_dir, str(out), wandb=WandbSettings(mode="disabled"))
        log = tmp_path / f"{name}.log"
        proc = subprocess.run([sys.executable, "-c", TRAIN, write_train_config(config, out / "train_config.yaml"),
                               str(out)], env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        assert proc.returncode == 0, log.read_text()[-3000:]
        entries[name] = set(os.listdir(cache))
        losses[name] = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]
    assert any(name.startswith("jit__train_step") for name in entries["cold"]), sorted(entries["cold"])
    # The second run compiled nothing new: every executable came from the cache.
    assert {e for e in entries["warm"] if e.endswith("-cache")} == {e for e in entries["cold"] if e.endswith("-cache")}
    assert len(losses["cold"]) == 5 and losses["warm"] == losses["cold"]
