"""Stands in for ``python -m marin_assets.evaluation.harness_main`` inside a fake-cluster pod.

It takes the same arguments and reads both files the asset hands it (the run's Levanter config
and the rendered suite), so a file that did not reach the pod fails the run. It writes a report
in harness_main's shape, with one accuracy per task of the suite, and evaluates nothing.
"""

import argparse
import json
import os
from pathlib import Path

import yaml

from marin_assets.training.reporting import open_reporter

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
parser.add_argument("--harness", required=True)
parser.add_argument("--output", required=True)
parser.add_argument("--checkpoint")
args = parser.parse_args()

run_id = yaml.safe_load(Path(args.config).read_text())["trainer"]["id"]
suite = json.loads(Path(args.harness).read_text())
tasks = [t.get("task_alias") or t["task"] for group in suite["groups"] for t in group["task_spec"]]
report = {"run_id": run_id, "pod_gpus": os.environ.get("NVIDIA_VISIBLE_DEVICES", "")}
for task in tasks:
    report.update({f"{task}/acc": 0.5, f"{task}/acc_stderr": 0.05, f"{task}/n": 100})
Path(args.output).parent.mkdir(parents=True, exist_ok=True)
Path(args.output).write_text(json.dumps(report))
with open_reporter() as reporter:
    reporter.log(f"{run_id}: {len(tasks)} task(s)")
    reporter.materialization({k: v for k, v in report.items() if "/" in k})
