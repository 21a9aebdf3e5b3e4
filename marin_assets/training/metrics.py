"""Throughput arithmetic and the per-step metrics file written by ``train_main``.

Pure Python (matplotlib only inside ``plot_loss_curve``), so the Dagster side can read and
plot a run's metrics without JAX.

``metrics.jsonl`` holds one JSON object per optimizer step, appended as training proceeds:
``{"step": int, "loss": float, "tokens_per_second": float | null, "mfu": float | null,
"learning_rate": float | null, "step_seconds": float | null, "total_tokens": int | null,
"attempt": int, ...eval metrics...}``, and for a mixture of experts ``load_balancing_loss`` and
``router_z_loss`` (the router's losses, which ``loss`` includes). ``step`` is Levanter's 0-based index of the step just
completed. A resumed run appends again from its checkpoint, so a step can appear more than
once; readers keep the last record per step.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from marin_assets.training.spec import ModelSpec

# Dense peak FLOP/s per JAX device at the precision Levanter trains with on that hardware
# (bf16 on accelerators). Matched as lowercase substrings of ``jax.Device.device_kind``;
# the first match wins, so more specific names come first.
PEAK_FLOPS_BY_DEVICE_KIND: tuple[tuple[str, float], ...] = (
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("a100", 312e12),
    ("l40s", 362e12),
    ("l4", 121e12),
    ("a10g", 70e12),
    ("v100", 125e12),
    ("tpu v6 lite", 918e12),
    ("tpu v6e", 918e12),
    ("tpu v5p", 459e12),
    ("tpu v5 lite", 197e12),
    ("tpu v5e", 197e12),
    ("tpu v4", 275e12),
    ("tpu v3", 61.5e12),  # JAX exposes each v3 core as a device
)

CPU_PEAK_FLOPS_ENV = "MARIN_CPU_PEAK_FLOPS"
# Theoretical fp32 peak of one x86 core with two 256-bit FMA units at ~2 GHz: 2 units x 8 lanes
# x 2 FLOPs x 2e9. Override with MARIN_CPU_PEAK_FLOPS (FLOP/s of the whole host, however many
# virtual CPU devices it shows).
CPU_PEAK_FLOPS_PER_CORE = 64e9


def cpu_peak_flops() -> float:
    configured = os.environ.get(CPU_PEAK_FLOPS_ENV)
    if configured:
        return float(configured)
    return CPU_PEAK_FLOPS_PER_CORE * (os.cpu_count() or 1)


def peak_flops_per_device(device_kind: str) -> float | None:
    """Peak FLOP/s for a JAX ``device_kind``; CPUs use ``cpu_peak_flops()``; unknown kinds give None."""
    kind = device_kind.lower()
    if kind == "cpu":
        return cpu_peak_flops()
    for name, flops in PEAK_FLOPS_BY_DEVICE_KIND:
        if name in kind:
            return flops
    return None


def training_flops_per_token(model: ModelSpec, vocab_size: int) -> float:
    """Training FLOPs per token with the same convention as the scaling library (Levanter's
    `lm_flops_per_token`, training = 3x forward), so MFU and scaling-law budgets agree."""
    if model.head_dim is not None and model.head_dim * model.num_heads != model.hidden_dim:
        raise ValueError("FLOPs accounting assumes head_dim = hidden_dim / num_heads")
    return model.dims(vocab_size).training_flops_per_token(model.seq_len)


def peak_flops_total(device_kind: str, device_count: int, process_count: int) -> float | None:
    """Peak FLOP/s of a job's devices together (None for unknown kinds). Virtual CPU devices share
    their host's cores, so a CPU job's peak is its hosts' (one per process), whatever the device count."""
    if device_kind.lower() == "cpu":
        return cpu_peak_flops() * process_count
    peak = peak_flops_per_device(device_kind)
    return None if peak is None else peak * device_count


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops_total: float) -> float:
    """Model FLOPs utilisation as a fraction in [0, 1] (not percent)."""
    return tokens_per_second * flops_per_token / peak_flops_total


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of ``metrics.jsonl`` ordered by step, keeping the last record written for each step.

    A truncated final line (process killed mid-write) is skipped.
    """
    p = Path(path)
    if not p.exists():
        return []
    with p.open() as f:
        return parse_metrics(f)


def parse_metrics(lines: Iterable[str]) -> list[dict[str, Any]]:
    """`read_metrics` of the lines of a ``metrics.jsonl`` read from anywhere (a store, a bucket)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def median(values: Iterable[float]) -> float | None:
    ordered = sorted(v for v in values if v is not None and math.isfinite(v))
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on a worker or in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curve(metrics_jsonl: str | os.PathLike, png_path: str | os.PathLike, *, title: str | None = None) -> str:
    """Draw train loss (and any ``eval/loss`` points) against step into a PNG; returns the PNG path."""
    records = read_metrics(metrics_jsonl)
    if not records:
        raise ValueError(f"no metrics in {metrics_jsonl}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss", linewidth=1.2)
    evals = [r for r in records if r.get("eval/loss") is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return str(png_path)


def eval_sets(values: Mapping[str, Any]) -> list[str]:
    """The eval sets an evaluation's metrics report (`eval/<set>/<metric>`)."""
    return sorted({k.split("/")[1] for k in values if k.startswith("eval/") and k.count("/") == 2})


def eval_lines(metrics: Mapping[str, Any]) -> list[str]:
    """An evaluation's loss and bits-per-byte on each set, a line each, as `marin materialize` prints
    them once the evaluation is built."""
    lines = []
    for name in eval_sets(metrics):
        loss, bpb, tokens = (metrics.get(f"eval/{name}/{m}") for m in ("loss", "bpb", "tokens"))
        figures = [f"loss {loss:.4f}" if loss is not None else None, f"bpb {bpb:.4f}" if bpb is not None else None]
        lines.append(f"eval {name}: {', '.join(f for f in figures if f) or 'no loss'}"
                     + (f" over {int(tokens):,} tokens" if tokens is not None else ""))
    return lines
