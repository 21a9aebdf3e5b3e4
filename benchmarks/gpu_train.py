"""Training throughput and MFU of Marin's llama_150m shape, data parallel and FSDP, with Levanter.

Trains hidden 512 / intermediate 1792 / 8 heads / 6 layers / seq 1024 for a fixed number of
steps through ``marin_assets.training.train_main`` (the process the ``checkpoint`` asset
launches, running Levanter's ``train_lm`` unchanged) on a Levanter token cache built from
stdlib docstrings. The vocabulary has Marin's Llama 3 tokenizer size, 128,256 entries (untied
embeddings: 154M parameters, hence the name): a byte-level BPE trained on the docstrings,
padded with entries the data never uses, so the embedding and output layers have their real size.

Each variant is one training over all the devices, at the same global batch:
  data_parallel  every device holds the whole model and optimizer state (parallelism data=N)
  fsdp           parameters and optimizer state sharded over the devices (parallelism fsdp=N)
On one device the two are the same computation.

The figures are Levanter's own. Its performance hook logs, per step, ``throughput/tokens_per_second``
and ``throughput/gflops_per_second`` (model FLOPs from Levanter's flop counter: 3 x forward,
attention included, recomputation not counted). MFU here is the median model FLOP/s over the
steps after the first two (which include XLA compilation) divided by the device's dense bf16
peak times the device count (on CPU, the host's peak, which its virtual devices share); the peak
comes from the explicit table below. Levanter's own
``throughput/mfu`` is reported next to it when Levanter knows the device (its table has no
entry that H200's device kind maps to, so on H200 it is null).

Sizes:
  llama_150m  the shape above, batch 64 x 1024 tokens, 50 steps, bf16 compute (default; needs a GPU/TPU)
  tiny        CPU-sized: hidden 64, 2 layers, seq 128, batch 8, 8 steps, f32 (the test suite runs it)

Usage: python benchmarks/gpu_train.py [--size llama_150m|tiny] [--variants data_parallel,fsdp] [--devices N]
                                      [--steps N] [--batch-size B] [--accelerator gpu|tpu|cpu]
                                      [--gradient-checkpointing] [--profile STEPS] [--workdir DIR]
The last line of output is one JSON object, with one entry per variant under ``variants``.
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
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import device_trace  # noqa: E402
from benchmarks.train import WARMUP_STEPS, load_fixtures, steady_step_metrics  # noqa: E402
from marin_assets.training.accelerator import (  # noqa: E402
    AcceleratorError,
    held_message,
    probe,
    tpu_type_for,
)
from marin_assets.training.commands import train_command  # noqa: E402
from marin_assets.training.levanter_config import build_train_config, write_train_config  # noqa: E402
from marin_assets.training.memory import ComputePlan, plan_run  # noqa: E402
from marin_assets.training.metrics import PEAK_FLOPS_BY_DEVICE_KIND, median, peak_flops_total  # noqa: E402
from marin_assets.training.spec import (  # noqa: E402
    ComputeSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelismSpec,
    ResourceSpec,
    RunSpec,
    RunSpecError,
    validate_run,
)
from marin_assets.training.train_main import SUMMARY_FILE  # noqa: E402
from marin_resources.process_commands import build_command_and_env  # noqa: E402

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
    # Marin's llama_300m layers (hidden 1,024, 24 layers, 16 query and 8 key/value heads) with the
    # 128,256-entry vocabulary: 603M parameters, the largest of the ladder whose f32 weights, gradients and
    # Adam moments (9.6 GB) leave a 16 GB TPU v5e chip room for a batch's activations.
    "llama_600m": Size(ModelSpec(hidden_dim=1024, intermediate_dim=3584, num_layers=24, num_heads=16, num_kv_heads=8,
                                 seq_len=1024),
                       batch_size=16, steps=30, vocab_size=128256, accelerator="tpu"),
    "tiny": Size(ModelSpec(hidden_dim=64, intermediate_dim=224, num_layers=2, num_heads=2, num_kv_heads=2,
                           seq_len=128),
                 batch_size=8, steps=8, vocab_size=512, accelerator="cpu"),
}


VARIANTS = {
    "data_parallel": lambda devices: ParallelismSpec(data=devices, fsdp=1),
    "fsdp": lambda devices: ParallelismSpec(data=1, fsdp=devices),
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
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default: both)")
    parser.add_argument("--devices", type=int,
                        help="devices to train on (default: all the accelerator's; on CPU, this many virtual "
                             "devices, default 1)")
    parser.add_argument("--steps", type=int, help="training steps (the first two are warm-up and not measured)")
    parser.add_argument("--batch-size", type=int, help="sequences per step, over all devices")
    parser.add_argument("--vocab-size", type=int, help="tokenizer size (default: Marin's Llama 3 tokenizer's 128,256)")
    parser.add_argument("--accelerator", choices=("gpu", "tpu", "cpu"))
    parser.add_argument("--tpu-type", help="Cloud TPU type of the devices (default: from the device kind and count, "
                                           "e.g. v5litepod-1 for one v5e chip)")
    parser.add_argument("--fused-loss", nargs="?", const="on", default="auto", choices=("on", "off", "auto"),
                        help="the loss through the Pallas head-and-cross-entropy kernels (one TPU device); "
                             "default auto: where the memory planner picks it")
    parser.add_argument("--train-lm", action="store_true",
                        help="also run the same config through Levanter's train_lm directly, as the baseline of "
                             "the project's training process")
    parser.add_argument("--gradient-checkpointing", nargs="?", const="on", default="auto",
                        choices=("on", "off", "auto"),
                        help="recompute activations; default auto: only where nothing else fits (recomputed FLOPs "
                             "are not model FLOPs, so it lowers MFU)")
    parser.add_argument("--attn-backend", help="Levanter attention backend (default: Levanter's for the device)")
    parser.add_argument("--cross-entropy-block-size", type=block_size, default="auto",
                        help="N, none or auto: compute the loss over vocabulary blocks of N entries (Levanter's "
                             "option; saves the memory of full batch x seq x vocab logits); default auto")
    parser.add_argument("--peak-flops", type=float, help="override the per-device peak FLOP/s")
    parser.add_argument("--profile", type=int, metavar="STEPS",
                        help="trace this many steps before the last with JAX's profiler and print where the "
                             "device's time went, per step (benchmarks/device_trace.py); traced steps run slower and "
                             "count in the medians, so take MFU from a run without it")
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
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        parser.error(f"--variants: {unknown or 'none given'}; choose from {', '.join(VARIANTS)}")
    if steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    if args.profile is not None and not 0 < args.profile <= steps - WARMUP_STEPS - 1:
        parser.error(f"--profile: between 1 and {steps - WARMUP_STEPS - 1} steps (after the warm-up, before the last)")
    if args.tpu_type and accelerator != "tpu":
        parser.error("--tpu-type is for --accelerator tpu")
    try:
        devices, tpu_type = accelerator_devices(accelerator, args.devices, args.tpu_type)
    except AcceleratorError as exc:
        print(f"gpu_train: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    switch = {"on": True, "off": False, "auto": "auto"}
    compute = ComputeSpec(gradient_checkpointing=switch[args.gradient_checkpointing],
                          cross_entropy_block_size=args.cross_entropy_block_size, attention=args.attn_backend,
                          fused_loss=switch[args.fused_loss])
    vocab_size = args.vocab_size or size.vocab_size
    specs, plans = {}, {}
    for variant in variants:
        spec = RunSpec(
            name=f"bench-{args.size}-{variant}", model=size.model, mixture="stdlib-docs", tokenizer="stdlib-docs",
            optimizer=OptimizerSpec(learning_rate=3e-3, warmup=0.1), train_batch_size=batch, num_train_steps=steps,
            steps_per_eval=10 * steps, max_eval_batches=1, checkpoint_every=10 * steps,
            # No gradient-norm logging, which compiles a second train step.
            watch_every=0, resources=ResourceSpec(accelerator=accelerator, device_count=devices, tpu_type=tpu_type),
            parallelism=VARIANTS[variant](devices), compute=compute)
        try:
            validate_run(spec)  # e.g. a batch the devices do not divide
            # The memory plan, before any data is built or any process opens the chip.
            plans[variant] = plan_run(spec, vocab_size, os.environ.get("MARIN_GPU_TYPE", ""))
        except RunSpecError as exc:
            print(f"gpu_train: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        specs[variant] = spec
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-gpu-train-")).resolve()  # processes run in REPO

    fixtures = load_fixtures()
    data_started = time.time()
    needed_tokens = int((steps + 1) * batch * size.model.seq_len * 1.05)
    cache_root, tokenizer_dir, vocab_size = training_data(fixtures, work / "data", vocab_size, needed_tokens)
    data_seconds = time.time() - data_started
    mixture = fixtures.single_cache_mixture("stdlib-docs", cache_root, tokenizer_dir)

    for variant, plan in plans.items():
        print(f"{variant}: {plan.describe()}", flush=True)
    results = {variant: run_variant(spec, plans[variant], mixture, tokenizer_dir, work / variant, args)
               for variant, spec in specs.items()}
    first = next(iter(results.values()))
    result = {
        "benchmark": "gpu_train",
        "size": args.size,
        "model": {"hidden_dim": size.model.hidden_dim, "intermediate_dim": size.model.intermediate_dim,
                  "num_heads": size.model.num_heads, "num_layers": size.model.num_layers,
                  "seq_len": size.model.seq_len},
        "accelerator": accelerator,
        "device_kind": first["device_kind"],
        "device_count": first["device_count"],
        "peak_flops_per_device": first["peak_flops_per_device"],
        "parameter_count": first["parameter_count"],
        "vocab_size": vocab_size,
        "batch_size": batch,
        "steps": steps,
        "mixed_precision": first["mixed_precision"],
        "tpu_type": tpu_type,
        "data_build_seconds": data_seconds,
        "workdir": str(work),
        "variants": {variant: {k: v for k, v in r.items()
                               if k not in ("device_kind", "peak_flops_per_device", "parameter_count",
                                            "mixed_precision")}
                     for variant, r in results.items()},
    }
    precision = "bf16" if "bfloat16" in first["mixed_precision"] else "f32"
    print(f"device {first['device_kind']} x{first['device_count']}, peak "
          f"{first['peak_flops_per_device'] / 1e12:.3g} TFLOP/s per device ({precision} dense)")
    print(f"{args.size}: {first['parameter_count']} params, batch {batch} x {size.model.seq_len} tokens, "
          f"{steps} steps ({first['steady_steps']} measured)")
    for variant, r in results.items():
        flops = r["model_flops_per_second"]
        print(f"{variant:14} tokens/s {_fmt(r['tokens_per_second'], '.0f')}   model TFLOP/s "
              f"{_fmt(flops and flops / 1e12, '.2f')}   MFU {_fmt(r['mfu'], '.1%')}   "
              f"(Levanter's own MFU {_fmt(r['levanter_mfu'], '.1%')})")
    print(json.dumps(result))
    return result


def run_variant(spec: RunSpec, plan: ComputePlan, mixture: dict, tokenizer_dir: str, run_dir: Path, args) -> dict:
    """Train ``spec`` once through ``train_main``, computing as ``plan`` says; its throughput figures and MFU.
    A run directory left by an earlier invocation is cleared: its checkpoints would be resumed."""
    shutil.rmtree(run_dir, ignore_errors=True)
    config = build_train_config(spec, mixture, tokenizer_dir, str(run_dir), compute=plan.settings)
    config["trainer"]["tracker"] = [config["trainer"]["tracker"], {"type": "json_logger"}]
    if args.profile:
        # The last traced step ends before the final one, whose checkpoint save would be traced too.
        config["trainer"].update(profiler=True, profiler_num_steps=args.profile, log_dir=str(run_dir / "logs"),
                                 profiler_start_step=spec.num_train_steps - args.profile - 1)
    config_path = write_train_config(config, run_dir / "train_config.yaml")

    resources = spec.resources
    launch = build_command_and_env(train_command(config_path, str(run_dir), fused_loss=plan.settings.fused_loss),
                                   accelerator=resources.accelerator, cpu_devices=resources.device_count)
    started = time.time()
    log_text = run_logged("training", launch.command, launch.env, run_dir / "train_output.log")
    wall = time.time() - started

    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    if summary["device_count"] != resources.device_count:
        raise SystemExit(f"{spec.name} trained on {summary['device_count']} devices, not the "
                         f"{resources.device_count} asked for")
    figures = levanter_figures(log_text)
    device_kind, device_count = summary["device_kind"], summary["device_count"]
    peak = args.peak_flops * device_count if args.peak_flops else peak_flops_total(device_kind, device_count, 1)
    if peak is None:
        raise SystemExit(f"no bf16 peak for device kind {device_kind!r}: add it to PEAK_FLOPS_BY_DEVICE_KIND "
                         "(marin_assets/training/metrics.py) or pass --peak-flops")
    return {
        "device_kind": device_kind,
        "device_count": device_count,
        "mesh": {"data": summary["mesh_data"], "fsdp": summary["mesh_fsdp"], "tensor": summary["mesh_tensor"]},
        "sharded_weight": summary.get("sharded_weight"),
        "peak_flops_per_device": peak / device_count,
        "parameter_count": summary.get("parameter_count"),
        "mixed_precision": config["trainer"]["mp"],
        "final_step": summary["final_step"],
        "compute": plan.metadata(),
        "loss_kernel": summary.get("loss_kernel"),
        "rotary_matmul": summary.get("rotary_matmul"),
        # Step 0 is XLA's compilation of the train step plus one step.
        "first_step_seconds": summary.get("first_step_seconds"),
        "peak_device_memory_bytes": summary.get("peak_device_memory_bytes"),
        **with_mfu(figures, peak),
        "train_wall_seconds": wall,
        **({"profile": traced_ops(run_dir / "logs", args.profile)} if args.profile else {}),
        **({"train_lm": train_lm_directly(config, run_dir / "train_lm", launch.env, peak)} if args.train_lm else {}),
    }


def traced_ops(log_dir: Path, steps: int) -> dict:
    """Where the device's time went in the traced steps, per step; printed as it is read."""
    summary = device_trace.summarize(device_trace.find_trace(log_dir), top=25, steps=steps)
    print(device_trace.render(summary), flush=True)
    return summary


def train_lm_directly(config: dict, run_dir: Path, env: dict[str, str], peak: float) -> dict:
    """The same config through Levanter's own ``train_lm`` (its checkpoints apart): the baseline of the
    project's training process. Only what the host needs to run Levanter at all is added: the JAX
    compatibility fixes, and no ``jax.distributed`` on one host (what train_main decides at run time)."""
    config = json.loads(json.dumps(config))
    config["trainer"]["checkpointer"]["base_path"] = str(run_dir / "checkpoints")
    config["trainer"].setdefault("distributed", {})["initialize_jax_distributed"] = False
    config_path = write_train_config(config, run_dir / "train_config.yaml")
    code = ("import sys; from marin_assets.training import jax_compat; jax_compat.install(); "
            "import levanter.config; from levanter.main import train_lm; "
            "sys.argv[1:] = ['--config_path', sys.argv[1]]; levanter.config.main(train_lm.main)()")
    log_text = run_logged("train_lm", [sys.executable, "-c", code, config_path], env, run_dir / "train_output.log")
    return with_mfu(levanter_figures(log_text), peak)


def run_logged(label: str, command: list[str], env: dict[str, str], log_path: Path, program: str = "gpu_train") -> str:
    """Run one of the project's processes with its output in ``log_path``; the log's text. A TPU another
    process holds ends ``program`` in one line, exit 2; any other failure with the log's last lines."""
    with open(log_path, "w") as log:
        proc = subprocess.run(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    log_text = log_path.read_text()
    if proc.returncode != 0:
        held = held_message(log_text)
        if held:
            print(f"{program}: {held}", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(f"{label} failed (exit {proc.returncode}); last lines of {log_path}:\n"
                         + "\n".join(log_text.splitlines()[-40:]))
    return log_text


def with_mfu(figures: dict, peak: float) -> dict:
    """Levanter's figures and the MFU of their model FLOP/s against ``peak``."""
    flops = figures["model_flops_per_second"]
    return {**figures, "mfu": None if flops is None else flops / peak}


def accelerator_devices(accelerator: str, asked: int | None, tpu_type: str | None) -> tuple[int, str | None]:
    """(devices to train on, Cloud TPU type or None). With both given (or on CPU) nothing is probed;
    otherwise a child process asks JAX (`accelerator.probe`), and a count over the host's is refused.
    The host's TPU_ACCELERATOR_TYPE is not trusted: a one-chip v5e host was seen to say v5litepod-4."""
    if accelerator == "cpu":
        return asked or 1, None
    if asked and (accelerator == "gpu" or tpu_type):
        return asked, tpu_type
    found = probe(accelerator)
    if asked and asked > found.count:
        raise AcceleratorError(f"--devices {asked}: this host has {found.count} {found.kind} device(s)")
    count = asked or found.count
    return count, (tpu_type or tpu_type_for(found.kind, count)) if accelerator == "tpu" else None


def block_size(text: str) -> int | None | str:
    """--cross-entropy-block-size: a positive number of vocabulary entries, ``none`` or ``auto``."""
    if text in ("none", "auto"):
        return None if text == "none" else text
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, none or auto, got {text!r}")
    return int(text)


def training_data(fixtures, data_dir: Path, vocab_size: int, needed_tokens: int) -> tuple[str, str, int]:
    """(cache root, tokenizer directory, vocabulary size) of stdlib docstrings tokenized into ``data_dir``,
    built once per workdir: a later run reuses them when they hold enough tokens at that vocabulary."""
    record = data_dir / "built.json"
    if record.exists():
        built = json.loads(record.read_text())
        if built["asked_vocab_size"] == vocab_size and built["min_train_tokens"] >= needed_tokens:
            return built["cache_root"], built["tokenizer_dir"], built["vocab_size"]
    cache_root, tokenizer_dir = fixtures.build_tokenized_artifact(
        fixtures.stdlib_docstrings(), data_dir, vocab_size=vocab_size, min_train_tokens=needed_tokens)
    padded = pad_vocabulary(tokenizer_dir, vocab_size)
    record.write_text(json.dumps({"asked_vocab_size": vocab_size, "min_train_tokens": needed_tokens,
                                  "cache_root": cache_root, "tokenizer_dir": tokenizer_dir, "vocab_size": padded}))
    return cache_root, tokenizer_dir, padded


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
