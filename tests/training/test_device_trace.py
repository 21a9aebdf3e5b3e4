"""benchmarks/device_trace.py: a profiler trace's device ops summed per thread and per op."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("device_trace", Path(__file__).parents[2] / "benchmarks/device_trace.py")
device_trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_trace)


def write_trace(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def meta(pid, name, tid=None):
    kind = "process_name" if tid is None else "thread_name"
    return {"ph": "M", "pid": pid, **({"tid": tid} if tid is not None else {}), "name": kind, "args": {"name": name}}


def op(pid, tid, name, dur, long_name=None):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": 0, "dur": dur, "name": name,
            **({"args": {"long_name": long_name}} if long_name else {})}


def test_the_busiest_device_ops_thread_is_summed_per_step(tmp_path):
    write_trace(tmp_path / "run/plugins/profile/1/perfetto_trace.json.gz", [
        meta(1, "/host:CPU"), meta(1, "python", tid=1), op(1, 1, "$python_frame", 9_000_000),
        meta(2, "/device:TPU:0"), meta(2, "XLA Ops", tid=7), meta(2, "Steps", tid=8),
        op(2, 7, "fusion.1", 4000, "%fusion.1 = bf16[64,1024,8,32] fusion(...)"), op(2, 7, "fusion.1", 4000),
        op(2, 7, "while.10", 12000), op(2, 8, "step", 30000),
    ])
    summary = device_trace.summarize(device_trace.find_trace(tmp_path / "run"), top=5, steps=2)
    assert summary["ops_thread"] == "/device:TPU:0 / XLA Ops"
    assert summary["threads"] == {"/device:TPU:0 / Steps": 15.0, "/device:TPU:0 / XLA Ops": 10.0}  # ms per step
    assert [(o["name"], o["ms"], o["count"], o["share"]) for o in summary["ops"]] == [
        ("while.10", 6.0, 0.5, 0.6), ("fusion.1", 4.0, 1.0, 0.4)]
    assert summary["ops"][1]["long_name"].startswith("%fusion.1 = bf16")
    assert "while.10" in device_trace.render(summary)


def test_on_cpu_the_xla_threads_are_the_device(tmp_path):
    trace = write_trace(tmp_path / "perfetto_trace.json.gz", [
        meta(1, "/host:CPU"), meta(1, "tf_XLAEigen/1", tid=3), meta(1, "python", tid=4),
        op(1, 3, "dot_general.2", 500), op(1, 4, "$frame", 10_000)])
    summary = device_trace.summarize(trace)
    assert summary["threads"] == {"/host:CPU / tf_XLAEigen/1": 0.5}
    assert summary["ops"][0]["name"] == "dot_general.2"


def test_no_trace_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        device_trace.main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"device_trace: no perfetto_trace.json.gz under {tmp_path}"
