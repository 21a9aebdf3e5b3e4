"""Wall and CPU time of one `marin materialize` over a sources file, on a fresh store and instance.

    python benchmarks/partitions.py SOURCES.yaml deduplicated/NAME [--max-parallel N] [--checkout DIR]

Runs the CLI of ``--checkout`` (default: this one; point it at another worktree to compare
versions) in a fresh DAGSTER_HOME and store under a temporary folder, and samples the whole
process tree (CLI, code server, run workers) every 0.2 s: CPU seconds are the sum over every
process seen of its last user + system time. CPU / wall above 1 means partitions ran in
parallel. The machine may be shared, so the load average before and after is printed too.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def tree_cpu_seconds(root: psutil.Process, seen: dict[int, float]) -> None:
    """Record each live process's user + system CPU time (keeps the last value of those that exit)."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            times = proc.cpu_times()
            seen[(proc.pid, proc.create_time())] = times.user + times.system
        except psutil.NoSuchProcess:
            continue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources")
    parser.add_argument("target")
    parser.add_argument("--max-parallel", type=int)
    parser.add_argument("--checkout", default=str(Path(__file__).resolve().parents[1]))
    args = parser.parse_args()

    checkout = Path(args.checkout).resolve()
    work = Path(tempfile.mkdtemp(prefix="marin-partitions-"))
    env = {**os.environ, "MARIN_SOURCES": str(Path(args.sources).resolve()), "MARIN_PREFIX": str(work / "store"),
           "DAGSTER_HOME": str(work / "home"), "MARIN_CACHE_DIR": str(work / "cache"), "MARIN_ENV": "local"}
    command = [str(checkout / ".venv/bin/python"), "-m", "marin_assets.cli", "materialize", args.target, "--json"]
    if args.max_parallel:
        command += ["--max-parallel", str(args.max_parallel)]
    load_before = os.getloadavg()
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root, seen = psutil.Process(proc.pid), {}
    while proc.poll() is None:
        tree_cpu_seconds(root, seen)
        time.sleep(0.2)
    wall = time.monotonic() - started
    stdout, stderr = proc.communicate()
    load_after = os.getloadavg()
    summary = json.loads(stdout) if stdout.strip().startswith("{") else {"success": False, "steps": []}
    runs = sum(s["ran"] for s in summary["steps"])
    cpu = sum(seen.values())
    partitions = len({s["partition"] for s in summary["steps"] if s["partition"] is not None})
    print(stderr.strip().splitlines()[-1] if stderr.strip() else "", file=sys.stderr)
    print(f"{args.target}: exit {proc.returncode}, {runs} run(s) over {partitions} partition(s), "
          f"wall {wall:.1f} s, CPU {cpu:.1f} s (CPU/wall {cpu / wall:.2f}), "
          f"load {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print(json.dumps({"target": args.target, "checkout": str(checkout), "exit": proc.returncode,
                      "success": summary["success"], "runs": runs, "partitions": partitions,
                      "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "max_parallel": args.max_parallel,
                      "load_before": [round(x, 2) for x in load_before],
                      "load_after": [round(x, 2) for x in load_after], "work": str(work)}))


if __name__ == "__main__":
    main()
