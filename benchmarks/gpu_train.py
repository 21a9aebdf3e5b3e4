"""Training throughput and MFU of Marin's llama_150m shape on one accelerator, with Levanter.

Trains hidden 512 / intermediate 1792 / 8 heads / 6 layers / seq 1024 for a fixed number of
steps through ``marin_assets.training.train_main`` (the process the ``checkpoint`` asset
launches, running Levanter's ``train_lm`` unchanged) on a Levanter token cache built from
stdlib docstrings. The vocabulary has Marin's Llama 3 tokenizer size, 128,256 entries (untied
embeddings: 154M parameters, hence the name): a byte-level BPE trained on the docstrings,
padded with entries the data never uses, so the embedding and output layers have their real size.

The figures are Levanter's own. Its performance hook logs, per step, ``throughput/tokens_per_second``
and ``throughput/gflops_per_second`` (model FLOPs from Levanter's flop counter: 3 x forward,
attention included, recomputation not counted). MFU here is the median model FLOP/s over the
steps after the first two (which include XLA compilation) divided by the device's dense bf16
peak times the device count; the peak comes from the explicit table below. Levanter's own
``throughput/mfu`` is reported next to it when Levanter knows the device (its table has no
entry that H200's device kind maps to, so on H200 it is null).

Sizes:
  llama_150m  the shape above, batch 64 x 1024 tokens, 50 steps, bf16 compute (default; needs a GPU/TPU)
  tiny        CPU-sized: hidden 64, 2 layers, seq 128, batch 8, 8 steps, f32 (the test suite runs it)

Usage: python benchmarks/gpu_train.py [--size llama_150m|tiny] [--steps N] [--batch-size B]
                                      [--accelerator gpu|tpu|cpu] [--gradient-checkpointing] [--workdir DIR]
The last line of output is one JSON object.
"""

from __future__ import annotations

import sys

# Sibling scripts (benchmarks/tokenize.py) shadow stdlib modules when this file is run as a script.
if sys.path and sys.path[0].rstrip("/").endswith("benchmarks"):
    sys.path.pop(0)

import argparse
import json
import math
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.train import WARMUP_STEPS, load_fixtures, steady_step_metrics  # noqa: E402
from marin_assets.training.levanter_config import build_train_config, write_train_config  # noqa: E402
from marin_assets.training.metrics import PEAK_FLOPS_BY_DEVICE_KIND, median, peak_flops_per_device  # noqa: E402
from marin_assets.training.spec import ModelSpec, OptimizerSpec, ResourceSpec, RunSpec  # noqa: E402
from marin_assets.training.train_main import SUMMARY_FILE  # noqa: E402
from marin_assets.training.commands import train_command  # noqa: E402
from marin_resources.launchers import build_command_and_env  # noqa: E402

# MFU's denominator: PEAK_FLOPS_BY_DEVICE_KIND (marin_assets/training/metrics.py), dense bf16
# FLOP/s per device from the vendors' data sheets (half their "with sparsity" figures), e.g.
# H200 and H100 SXM 989e12, A100 312e12, TPU v5e 197e12. The checkpoint asset's MFU uses the
# same table; `--peaks` prints it.


@dataclass(frozen=True)
class Size:
    model: ModelSpec
    batch_size: int
    steps: int
    vocab_size: int
    accelerator: str


SIZES = {
    "llama_150m": Size(ModelSpec(hidden_dim=512, intermediate_dim=1792, num_layers=6, num_heads=8, num_kv_heads=8,
                                 seq_len=1024),
                       batch_size=64, steps=50, vocab_size=128256, accelerator="gpu"),
    "tiny": Size(ModelSpec(hidden_dim=64, intermediate_dim=224, num_layers=2, num_heads=2, num_kv_heads=2,
                           seq_len=128),
                 batch_size=8, steps=8, vocab_size=512, accelerator="cpu"),
}


def levanter_figures(log_text: str) -> dict[str, float | None]:
    """Medians of Levanter's per-step throughput figures over the steady steps."""
    steps = steady_step_metrics(log_text)
    if not steps:
        raise RuntimeError("the training log holds no json_logger step records after the warm-up steps")

    def med(key: str) -> float | None:
        return median(float(m[key]) for m in steps if m.get(key) is not None)

    levanter_mfu_percent = med("throughput/mfu")
    gflops = med("throughput/gflops_per_second")
    return {
        "steady_steps": len(steps),
        "tokens_per_second": med("throughput/tokens_per_second"),
        "model_flops_per_second": None if gflops is None else gflops * 1e9,
        "step_seconds": med("throughput/duration"),
        "levanter_mfu": None if levanter_mfu_percent is None else levanter_mfu_percent / 100.0,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="llama_150m")
    parser.add_argument("--steps", type=int, help="training steps (the first two are warm-up and not measured)")
    parser.add_argument("--batch-size", type=int, help="sequences per step")
    parser.add_argument("--vocab-size", type=int, help="tokenizer size (default: Marin's Llama 3 tokenizer's 128,256)")
    parser.add_argument("--accelerator", choices=("gpu", "tpu", "cpu"))
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute activations (off: a 150M model fits easily, and recompute is not "
                             "counted in model FLOPs, so it lowers MFU)")
    parser.add_argument("--attn-backend", help="Levanter attention backend (default: Levanter's for the device)")
    parser.add_argument("--cross-entropy-block-size", type=int,
                        help="compute the loss over vocabulary blocks of this size (Levanter's option; saves the "
                             "memory of full batch x seq x vocab logits)")
    parser.add_argument("--peak-flops", type=float, help="override the per-device peak FLOP/s")
    parser.add_argument("--workdir")
    parser.add_argument("--peaks", action="store_true", help="print the peak table and exit")
    args = parser.parse_args(argv)
    if args.peaks:
        for kind, flops in PEAK_FLOPS_BY_DEVICE_KIND:
            print(f"{kind:14} {flops / 1e12:8.1f} TFLOP/s")
        return {}

    size = SIZES[args.size]
    steps = args.steps or size.steps
    batch = args.batch_size or size.batch_size
    accelerator = args.accelerator or size.accelerator
    if steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-gpu-train-"))

    fixtures = load_fixtures()
    data_started = time.time()
    needed_tokens = int((steps + 1) * batch * size.model.seq_len * 1.05)
    vocab_size = args.vocab_size or size.vocab_size
    cache_root, tokenizer_dir = fixtures.build_tokenized_artifact(
        fixtures.stdlib_docstrings(), work / "data", vocab_size=vocab_size, min_train_tokens=needed_tokens)
    vocab_size = pad_vocabulary(tokenizer_dir, vocab_size)
    data_seconds = time.time() - data_started

    spec = RunSpec(
        name=f"bench-{args.size}", model=size.model, mixture="stdlib-docs", tokenizer="stdlib-docs",
        optimizer=OptimizerSpec(learning_rate=3e-3, warmup=0.1), train_batch_size=batch, num_train_steps=steps,
        steps_per_eval=10 * steps, max_eval_batches=1, checkpoint_every=10 * steps,
        # No gradient-norm logging, which compiles a second train step.
        watch_every=0, resources=ResourceSpec(accelerator=accelerator, device_count=1))
    run_dir = work / "run"
    mixture = fixtures.single_cache_mixture(spec.mixture, cache_root, tokenizer_dir)
    config = build_train_config(spec, mixture, tokenizer_dir, str(run_dir))
    config["model"]["gradient_checkpointing"] = args.gradient_checkpointing
    if args.attn_backend:
        config["model"]["attn_backend"] = args.attn_backend
    if args.cross_entropy_block_size:
        config["model"]["cross_entropy_block_size"] = args.cross_entropy_block_size
    config["trainer"]["tracker"] = [config["trainer"]["tracker"], {"type": "json_logger"}]
    config_path = write_train_config(config, run_dir / "train_config.yaml")

    launch = build_command_and_env(train_command(config_path, str(run_dir)), accelerator=accelerator)
    log_path = run_dir / "train_output.log"
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(launch.command, env={**os.environ, **launch.env}, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - started
    log_text = log_path.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"training failed (exit {proc.returncode}); last lines of {log_path}:\n"
                         + "\n".join(log_text.splitlines()[-40:]))

    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    figures = levanter_figures(log_text)
    device_kind, device_count = summary["device_kind"], summary["device_count"]
    peak = args.peak_flops or peak_flops_per_device(device_kind)
    if peak is None:
        raise SystemExit(f"no bf16 peak for device kind {device_kind!r}: add it to PEAK_FLOPS_BY_DEVICE_KIND "
                         "(marin_assets/training/metrics.py) or pass --peak-flops")
    flops = figures["model_flops_per_second"]
    result = {
        "benchmark": "gpu_train",
        "size": args.size,
        "model": {"hidden_dim": size.model.hidden_dim, "intermediate_dim": size.model.intermediate_dim,
                  "num_heads": size.model.num_heads, "num_layers": size.model.num_layers,
                  "seq_len": size.model.seq_len},
        "accelerator": accelerator,
        "device_kind": device_kind,
        "device_count": device_count,
        "peak_flops_per_device": peak,
        "parameter_count": summary.get("parameter_count"),
        "vocab_size": vocab_size,
        "batch_size": batch,
        "steps": steps,
        "final_step": summary["final_step"],
        "gradient_checkpointing": args.gradient_checkpointing,
        "mixed_precision": config["trainer"]["mp"],
        "attn_backend": args.attn_backend,
        "cross_entropy_block_size": args.cross_entropy_block_size,
        **figures,
        "mfu": None if flops is None else flops / (peak * device_count),
        "train_wall_seconds": wall,
        "data_build_seconds": data_seconds,
        "workdir": str(work),
    }
    precision = "bf16" if "bfloat16" in config["trainer"]["mp"] else "f32"
    print(f"device {device_kind} x{device_count}, peak {peak / 1e12:.3g} TFLOP/s per device ({precision} dense)")
    print(f"{args.size}: {result['parameter_count']} params, batch {batch} x {size.model.seq_len} tokens, "
          f"{steps} steps ({figures['steady_steps']} measured)")
    print(f"tokens/s {_fmt(figures['tokens_per_second'], '.0f')}   model TFLOP/s {_fmt(flops and flops / 1e12, '.2f')}   "
          f"MFU {_fmt(result['mfu'], '.1%')}   (Levanter's own MFU {_fmt(figures['levanter_mfu'], '.1%')})")
    print(json.dumps(result))
    return result


def pad_vocabulary(tokenizer_dir: str, size: int) -> int:
    """Grow the tokenizer to ``size`` entries; returns its final size.

    Stdlib docstrings support only about 11,000 BPE entries. The rest never occur in the data, but
    they size the embedding and output layers, and those layers are what the vocabulary
    contributes to step time, memory and model FLOPs.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    missing = size - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<|unused_{i}|>" for i in range(missing)], special_tokens=True)
        tokenizer.save_pretrained(tokenizer_dir)
    return len(tokenizer)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


if __name__ == "__main__":
    main()
