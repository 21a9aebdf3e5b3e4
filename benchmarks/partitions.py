"""Serial against parallel partitions: one `marin materialize` per setting, side by side.

    python -m benchmarks.partitions [--megabytes 40 --shard-mb 10] [--target filtered] \\
        [--settings 1 default] [--repeat 2] [--sources SOURCES.yaml --source NAME] [--checkout DIR]

Without ``--sources`` it writes a seeded corpus of real paragraphs (`benchmarks/scale_corpus.py`)
in JSONL shards of ``--shard-mb``, one partition each. Each setting is a value of
``--max-parallel`` ("default" leaves it out, so the CLI picks: the cores, capped by the
instance's run limit); settings alternate ``--repeat`` times so that both see the same shifts
of a shared machine's load. Every command runs the CLI of ``--checkout`` (default: this one) in
a fresh DAGSTER_HOME and store, and the whole process tree (CLI, code server, run workers) is
sampled every 0.2 s: CPU seconds are the sum over every process seen of its last user + system
time. From the runs' own start and end records it reports how many ran at once (the most
windows overlapping). The load average before and after each command is printed too.
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

REPO = Path(__file__).resolve().parents[1]


def tree_cpu_seconds(root: psutil.Process, seen: dict) -> None:
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


def write_corpus(folder: Path, megabytes: int, shard_mb: float) -> Path:
    from benchmarks.scale_corpus import CorpusWriter

    writer = CorpusWriter(folder / "corpus", seed=0, shard_bytes=int(shard_mb * 1e6))
    for _ in range(max(1, round(megabytes / shard_mb))):
        writer.write_shard()
    sources = folder / "sources.yaml"
    sources.write_text(f"sources:\n  - name: corpus\n    uri: {folder / 'corpus'}/*.jsonl\n    format: jsonl\n"
                       "    id_field: id\n    files_per_shard: 1\n")
    return sources


def runs_at_once(home: Path) -> int:
    """The most runs whose start-end windows overlapped, from the instance's run records."""
    import dagster as dg

    os.environ["DAGSTER_HOME"] = str(home)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        windows = [(r.start_time, r.end_time) for r in instance.get_run_records()
                   if r.start_time is not None and r.end_time is not None]
    edges = sorted([(s, 1) for s, _ in windows] + [(e, -1) for _, e in windows])
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    return most


def measure(checkout: Path, sources: Path, target: str, setting: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix="marin-partitions-"))
    env = {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(work / "store"),
           "DAGSTER_HOME": str(work / "home"), "MARIN_CACHE_DIR": str(work / "cache"), "MARIN_ENV": "local"}
    command = [str(checkout / ".venv/bin/python"), "-m", "marin_assets.cli", "materialize", target, "--json"]
    if setting != "default":
        command += ["--max-parallel", setting]
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
    if not summary["success"]:
        print(stderr[-3000:], file=sys.stderr)
    cpu = sum(seen.values())
    return {"max_parallel": setting, "success": summary["success"], "runs": sum(s["ran"] for s in summary["steps"]),
            "partitions": len({s["partition"] for s in summary["steps"] if s["partition"] is not None}),
            "runs_at_once": runs_at_once(work / "home"), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "cpu_per_wall": round(cpu / wall, 2), "load_before": round(load_before[0], 2),
            "load_after": round(load_after[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", type=Path, help="a sources YAML; default: a generated corpus")
    parser.add_argument("--source", default="corpus", help="the source's name in --sources")
    parser.add_argument("--megabytes", type=int, default=40)
    parser.add_argument("--shard-mb", type=float, default=10.0)
    parser.add_argument("--target", default="filtered", help="stage to build, e.g. filtered or deduplicated")
    parser.add_argument("--settings", nargs="+", default=["1", "default"], help="--max-parallel values")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--checkout", type=Path, default=REPO)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="marin-partitions-corpus-"))
    sources = args.sources.resolve() if args.sources else write_corpus(folder, args.megabytes, args.shard_mb)
    target = f"{args.target}/{args.source}"
    print(f"{target} on {os.cpu_count()} cores; the settings alternate {args.repeat} time(s)", flush=True)
    print(f"{'max-parallel':>12} {'runs':>5} {'at once':>8} {'wall s':>7} {'CPU s':>7} {'CPU/wall':>8} "
          f"{'load before -> after':>21}", flush=True)
    results = []
    for _ in range(args.repeat):
        for setting in args.settings:
            r = measure(args.checkout.resolve(), sources, target, setting)
            results.append(r)
            print(f"{setting:>12} {r['runs']:>5} {r['runs_at_once']:>8} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} "
                  f"{r['cpu_per_wall']:>8.2f} {r['load_before']:>10.1f} -> {r['load_after']:<6.1f}"
                  + ("" if r["success"] else "  FAILED"), flush=True)
    best = {s: min(r["wall_s"] for r in results if r["max_parallel"] == s) for s in args.settings}
    baseline = best[args.settings[0]]
    print("best wall: " + ", ".join(f"{s}: {w:.1f} s ({baseline / w:.2f}x)" for s, w in best.items()), flush=True)
    print(json.dumps({"target": target, "cores": os.cpu_count(), "sources": str(sources), "results": results,
                      "best_wall_s": best, "speedup_vs_first": {s: round(baseline / w, 2) for s, w in best.items()}}))


if __name__ == "__main__":
    main()
