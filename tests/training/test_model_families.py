"""Every model family, and the second optimizer, trains on CPU: 20 steps of a tiny model each and the
loss falls. All runs share one process (one JAX/Levanter start-up), each in its own run directory, as
the checkpoint asset's process would train it (`train_main.train`). Llama trains with Lion here: Llama
with Adam is what every other training test trains."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from conftest import FAMILY_MODELS, SUBPROCESS_ENV, tiny_spec

from marin_assets.training.levanter_config import WandbSettings, build_train_config, write_train_config
from marin_assets.training.metrics import training_flops_per_token

pytestmark = [pytest.mark.slow, pytest.mark.heaviest]

STEPS = 20
VOCAB = 512  # the tiny artifact's tokenizer

# Trains each (config, output directory) pair of argv in turn, in this one process.
TRAIN_EACH = """
import sys
from pathlib import Path
from marin_assets.training.reporting import ConsoleReporter
from marin_assets.training.train_main import train
for config, out in zip(sys.argv[1::2], sys.argv[2::2]):
    train(config, Path(out), ConsoleReporter())
"""


def _runs():
    base = tiny_spec(steps=STEPS, watch_every=0)
    runs = {family: dataclasses.replace(base, name=family,
                                        model=dataclasses.replace(base.model, family=family, **fields))
            for family, fields in FAMILY_MODELS.items() if family != "llama"}
    # Lion moves every weight by the learning rate each step: a third of Adam's rate (its authors advise a
    # tenth for long runs; 20 steps at that rate barely start).
    runs["llama-lion"] = dataclasses.replace(base, name="llama-lion", optimizer=dataclasses.replace(
        base.optimizer, type="lion", learning_rate=base.optimizer.learning_rate / 3))
    return runs


def test_every_family_and_lion_train_and_the_loss_falls(tmp_path, tiny_artifact, tiny_mixture):
    _, tokenizer_dir = tiny_artifact
    runs = _runs()
    argv = []
    for name, spec in runs.items():
        out = tmp_path / name
        # No W&B: one process holds one W&B run, which the runs after the first would share.
        config = build_train_config(spec, tiny_mixture, tokenizer_dir, str(out), wandb=WandbSettings(mode="disabled"))
        argv += [write_train_config(config, out / "train_config.yaml"), str(out)]
    log = tmp_path / "train.log"
    proc = subprocess.run([sys.executable, "-c", TRAIN_EACH, *argv], env={**os.environ, **SUBPROCESS_ENV},
                          stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    assert proc.returncode == 0, log.read_text()[-3000:]

    for name, spec in runs.items():
        summary = json.loads((tmp_path / name / "train_summary.json").read_text())
        records = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        losses = [record["loss"] for record in records]
        assert summary["final_step"] == len(losses) == STEPS, name
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        print(f"{name}: loss {first:.3f} -> {last:.3f} ({summary['parameter_count']} parameters)")
        assert last < first - 0.5, (name, losses)
        # Levanter's count of the model it trained is the spec's (scaling library's) count, and the
        # FLOPs the process used for MFU are the family's.
        assert summary["parameter_count"] == spec.model.parameter_count(VOCAB), name
        assert summary["flops_per_token"] == training_flops_per_token(spec.model, VOCAB), name
        # Mixtral's router losses, which it logs from inside the forward pass, are recorded each step.
        moe = spec.model.num_experts is not None
        assert all(("load_balancing_loss" in r and "router_z_loss" in r) == moe for r in records), name
