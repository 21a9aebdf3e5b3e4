"""Stands in for ``python -m marin_assets.training.train_main`` inside a fake-cluster pod.

It takes the same arguments, reads the config the launcher wrote, writes the run summary where
the checkpoint asset looks for it and reports through Dagster Pipes like the real entry point;
it trains nothing. The figures come from the config and the pod's env, so a test can see what
reached the pod.
"""

import argparse
import json
import os
from pathlib import Path

import yaml

from marin_assets.training.reporting import open_reporter
from marin_assets.training.train_main import SUMMARY_FILE

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--output-dir", required=True)
parser.add_argument("--final-eval", action="store_true")  # accepted; this stand-in evaluates nothing
args = parser.parse_args()

config = yaml.safe_load(Path(args.config).read_text())
steps = config["trainer"]["num_train_steps"]
host = int(os.environ.get("TPU_WORKER_ID", "0"))
hostnames = os.environ.get("TPU_WORKER_HOSTNAMES", "")
summary = {"final_step": steps, "train_loss_first": 6.0, "train_loss_last": 3.5, "device_kind": "fake",
           "num_train_steps": steps, "hosts": len(hostnames.split(",")) if hostnames else 1}
out = Path(args.output_dir)
out.mkdir(parents=True, exist_ok=True)
if host == 0:  # every host runs the same program; one writes the run's record
    tmp = out / f".{SUMMARY_FILE}.tmp"
    tmp.write_text(json.dumps(summary))
    os.replace(tmp, out / SUMMARY_FILE)
with open_reporter() as reporter:
    reporter.log(f"host {host} finished {steps} steps")
    reporter.materialization(summary)
