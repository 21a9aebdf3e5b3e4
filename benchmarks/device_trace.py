"""Where a device's time goes: the ops of a JAX profiler trace, summed by name.

``jax.profiler.start_trace(..., create_perfetto_trace=True)`` (Levanter's ``trainer.profiler``) writes
``perfetto_trace.json.gz`` beside its xplane file: Chrome trace events, one complete event ("ph": "X")
per op run on each device thread. This sums them per device thread and per op over the traced steps,
with no TensorBoard or xprof needed, so it runs on a host without network and prints figures a
person can act on (which fusion, how long, how often, what it computes).

Usage: python benchmarks/device_trace.py TRACE_DIR_OR_FILE [--top 30] [--steps N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

TRACE_FILE = "perfetto_trace.json.gz"


def find_trace(path: Path) -> Path:
    """``path`` itself, or the newest perfetto trace under it."""
    if path.is_file():
        return path
    found = sorted(path.rglob(TRACE_FILE), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no {TRACE_FILE} under {path}")
    return found[-1]


def summarize(trace: Path, top: int = 30, steps: int | None = None) -> dict:
    """Per device thread, its busy microseconds; and the ``top`` ops of the busiest device thread by total
    time (count, total, share, and XLA's long name where the trace gives it). ``steps`` divides totals
    into per-step figures."""
    with gzip.open(trace, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    busy: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, dict]] = defaultdict(dict)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        process = processes.get(e["pid"], str(e["pid"]))
        thread_name = str(threads.get((e["pid"], e.get("tid")), e.get("tid")))
        # A device's own rows; on CPU, where XLA's ops run on the host, its XLA threads.
        if not (any(d in process for d in ("TPU", "GPU", "/device:")) or thread_name.startswith("tf_XLA")):
            continue
        thread = f"{process} / {thread_name}"
        busy[thread] += e["dur"]
        op = ops[thread].setdefault(e["name"], {"count": 0, "us": 0.0, "long_name": None})
        op["count"] += 1
        op["us"] += e["dur"]
        args = e.get("args") or {}
        if op["long_name"] is None:
            op["long_name"] = args.get("long_name") or args.get("hlo_op") or args.get("tf_op")
    per_step = steps or 1
    result = {"trace": str(trace), "steps": steps,
              "threads": {t: round(us / per_step / 1e3, 3) for t, us in sorted(busy.items(), key=lambda kv: -kv[1])},
              "ops_thread": None, "ops": []}
    op_threads = [t for t in ops if "XLA Ops" in t] or list(ops)
    if op_threads:
        thread = max(op_threads, key=lambda t: busy[t])
        total = busy[thread]
        result["ops_thread"] = thread
        for name, op in sorted(ops[thread].items(), key=lambda kv: -kv[1]["us"])[:top]:
            result["ops"].append({"name": name, "count": op["count"] / per_step,
                                  "ms": round(op["us"] / per_step / 1e3, 3), "share": round(op["us"] / total, 4),
                                  "long_name": (op["long_name"] or "")[:160]})
    return result


def render(summary: dict) -> str:
    lines = [f"trace {summary['trace']}" + (f", per step over {summary['steps']} steps" if summary["steps"] else "")]
    for thread, ms in list(summary["threads"].items())[:8]:
        lines.append(f"  {ms:10.2f} ms  {thread}")
    if summary["ops_thread"]:
        lines.append(f"top ops of {summary['ops_thread']}:")
        for op in summary["ops"]:
            lines.append(f"  {op['ms']:9.2f} ms {op['share']:6.1%} x{op['count']:<6g} {op['name'][:48]:48} "
                         f"{op['long_name'][:110]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--steps", type=int, help="steps traced: totals become per-step figures")
    args = parser.parse_args(argv)
    try:
        summary = summarize(find_trace(args.path), args.top, args.steps)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"device_trace: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(render(summary))
    return summary


if __name__ == "__main__":
    main()
