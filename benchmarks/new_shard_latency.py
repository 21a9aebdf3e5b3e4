"""A file landing -> the token cache holding it, with `dagster-daemon` running: the runs of the
new-shard flow launched locally (the embedded default's launcher, warm run workers) beside the same
flow sent to a running two-node Ray cluster (`NewShardRunLauncher`, docs/scaling-out.md, "New shards
on a running Ray cluster").

    python -m benchmarks.new_shard_latency [--modes local ray] [--workdir DIR]

For each mode, from an empty store: a source of three one-file shards built with `marin materialize
tokenized/letters`; the daemon started (the new-shard sensor and the automation sensor, both every
30 s) and its first automation tick awaited; then a fourth file written. Measured: the time from the
write to `tokenized/letters` committed with four shards, and for every run of the flow the wait
from its creation to its start (the launch: a local worker, or a Ray job's `dagster api execute_run`
starting on the cluster) and its time from start to end. The sensors' 30 s intervals are in the
total and are the same in both modes. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import yaml

from benchmarks.repo_tests import load_test_module
from marin_assets.tokenization.registry import TOKENIZED_VERSION
from marin_resources.dagster_private import finished_sensor_ticks
from marin_resources.keys import TRIGGER_TAG
from marin_resources.new_shard_launcher import LAUNCHED_BY_TAG
from marin_resources.storage.store import ArtifactStore

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
REGISTRY = """tokenizers:
  letters_bpe: {train_on: [letters], vocab_size: 400}
tokenized:
  letters: {tokenizer: letters_bpe, validation_fraction: 0.2}
mixtures: {}
"""
BODY = ("The {name} keeper walked the length of the harbour wall each evening, counting the boats "
        "that had come home and writing their names in a ledger kept dry under his coat. ")
TIMEOUT_S = 900


def write_letter(folder: Path, name: str) -> None:
    (folder / f"{name}.txt").write_text("\n\n".join(f"{name} {i}. " + BODY.format(name=name) * (4 + i)
                                                   for i in range(8)))


def two_node_cluster():
    load_test_module("tests/ops/conftest.py")  # ray_nodes imports its free_port
    return load_test_module("tests/ops/ray_nodes.py").two_node_cluster()


def wait(what: str, ready, daemon: subprocess.Popen, log: Path, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if daemon.poll() is not None:
            raise RuntimeError(f"dagster-daemon exited {daemon.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s:.0f} s; daemon log:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def measure(mode: str, work: Path, job_server: str | None) -> dict:
    letters = work / "letters"
    letters.mkdir(parents=True)
    for name in ("alpha", "bravo", "charlie"):
        write_letter(letters, name)
    (work / "sources.yaml").write_text(f"sources:\n  - name: letters\n    uri: {letters}/*.txt\n    format: text\n"
                                       "    files_per_shard: 1\n")
    (work / "registry.yaml").write_text(REGISTRY)
    (work / "runs.yaml").write_text("runs: {}\n")
    home = work / "home"
    home.mkdir()
    config = yaml.safe_load((REPO / "dagster.yaml").read_text())
    if job_server is not None:
        config["run_launcher"] = {"module": "marin_resources.new_shard_launcher", "class": "NewShardRunLauncher",
                                  "config": {"ray": {"address": job_server}, "when_unreachable": "stop"}}
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MARIN_", "RAY_"))},
           "DAGSTER_HOME": str(home), "MARIN_ENV": "local", "MARIN_PREFIX": str(work / "store"),
           "MARIN_SOURCES": str(work / "sources.yaml"), "MARIN_REGISTRY": str(work / "registry.yaml"),
           "MARIN_RUNS": str(work / "runs.yaml"), "RAY_AUTH_MODE": "disabled", "DAGSTER_GRPC_TIMEOUT_SECONDS": "300"}
    built = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", "tokenized/letters"], env=env,
                           cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    if built.returncode != 0:
        raise RuntimeError(built.stdout + built.stderr)
    store = ArtifactStore(str(work / "store"))

    def cache_shards() -> int:
        manifest = store.find("tokenized/letters", TOKENIZED_VERSION, None)
        return 0 if manifest is None else manifest.metrics["shards"]

    assert cache_shards() == 3
    log = work / "daemon.log"
    with open(log, "w") as out:
        daemon = subprocess.Popen([str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"], cwd=REPO, env=env,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            wait("first automation tick", lambda: finished_sensor_ticks(instance, "automation", 0.0) > 0, daemon, log)
            landed = time.time()
            write_letter(letters, "delta")
            wait("a four-shard token cache", lambda: cache_shards() == 4, daemon, log)
            latency = time.time() - landed
            # The cache is committed before its run's last events; let every run end before reading them.
            wait("the flow's runs ending", lambda: all(r.is_finished for r in instance.get_runs()), daemon, log, 300)
            runs = []
            since = dg.RunsFilter(created_after=datetime.fromtimestamp(landed - 1, UTC))
            for record in instance.get_run_records(since):
                run = record.dagster_run
                if TRIGGER_TAG not in run.tags:
                    continue
                runs.append({"assets": sorted(k.to_user_string() for k in run.asset_selection or ()),
                             "partition": run.tags.get("dagster/partition"), "status": run.status.value,
                             "launched_by": run.tags.get(LAUNCHED_BY_TAG, "local"),
                             "launch_s": round(record.start_time - record.create_timestamp.timestamp(), 2)
                             if record.start_time else None,
                             "run_s": round(record.end_time - record.start_time, 2)
                             if record.start_time and record.end_time else None})
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, 9)
    launches = [r["launch_s"] for r in runs if r["launch_s"] is not None]
    return {"mode": mode, "latency_s": round(latency, 1), "runs": len(runs),
            "failed": sum(r["status"] != "SUCCESS" for r in runs),
            "launch_s_median": round(statistics.median(launches), 2) if launches else None,
            "run_s_median": round(statistics.median([r["run_s"] for r in runs if r["run_s"]]), 2) if runs else None,
            "detail": sorted(runs, key=lambda r: r["assets"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=("local", "ray"), default=["local", "ray"])
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="new-shard-latency-"))
    results = []
    for mode in args.modes:
        work = root / mode
        shutil.rmtree(work, ignore_errors=True)
        if mode == "ray":
            with two_node_cluster() as jobs:
                results.append(measure(mode, work, jobs))
        else:
            results.append(measure(mode, work, None))
        result = results[-1]
        for run in result["detail"]:
            print(f"  {mode:5} {','.join(run['assets']):40} {run['partition'] or '-':12} {run['launched_by']:6} "
                  f"launch {run['launch_s']} s, run {run['run_s']} s, {run['status']}")
    print(f"{'mode':6} {'file -> cache s':>16} {'runs':>5} {'failed':>7} {'launch s (median)':>18} "
          f"{'run s (median)':>15}")
    for r in results:
        print(f"{r['mode']:6} {r['latency_s']:>16} {r['runs']:>5} {r['failed']:>7} {r['launch_s_median']!s:>18} "
              f"{r['run_s_median']!s:>15}")
    print(json.dumps([{k: v for k, v in r.items() if k != "detail"} for r in results]))


if __name__ == "__main__":
    main()
