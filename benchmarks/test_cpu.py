"""CPU seconds a test file costs: the whole process tree of a one-file pytest run, daemons included.

Wall time means little on a shared two-core machine; CPU seconds are what the suite spends of CI's
two cores, so a change that makes the suite cheaper shows here whatever else the machine runs.
Runs ``pytest -n 0 -p no:cacheprovider FILE`` for each file given, as a child of a process that has
made itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): processes the tests detach
(code servers, run workers, Ray, the emulators) are reparented here instead of to init, so their CPU
is counted too once they are reaped. Prints, per file, user+system CPU seconds, wall seconds and
pytest's summary line, beside an optional baseline, and a final JSON line.

Usage: python -m benchmarks.test_cpu [--baseline BASELINE.json] [--out OUT.json] [-k EXPR] FILE [FILE ...]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def _reap_all(deadline_s: float) -> None:
    """Waits (up to ``deadline_s``) for every descendant that was reparented here, so its rusage counts."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.2)


def measure(path: str, extra: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", *extra, path],
                          capture_output=True, text=True)
    wall = time.monotonic() - start
    _reap_all(120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"file": path, "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1),
            "wall_s": round(wall, 1), "exit": proc.returncode, "summary": lines[-1] if lines else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--baseline", help="a JSON file this script wrote earlier")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    args = parser.parse_args()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("marin: cannot become a child subreaper (Linux only): detached processes would go uncounted")
    baseline = {}
    if args.baseline:
        baseline = {r["file"]: r for r in json.load(open(args.baseline))}
    extra = ["-k", args.keyword] if args.keyword else []
    results = []
    for path in args.files:
        result = measure(path, extra)
        results.append(result)
        base = baseline.get(path)
        against = f"  (baseline {base['cpu_s']:.1f} CPU-s, {result['cpu_s'] / base['cpu_s'] - 1:+.0%})" if base else ""
        print(f"{path}: {result['cpu_s']:.1f} CPU-s, {result['wall_s']:.0f} s wall, exit {result['exit']}, "
              f"{result['summary']}{against}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
