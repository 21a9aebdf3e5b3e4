"""A training step's memory per device: `marin_assets.training.memory`'s estimate beside XLA's own.

For a model shape and batch, the run's compute setting (from the flags; ``auto`` ones planned by
`plan_compute` against this device's memory) is rendered into its Levanter config
(`levanter_config.build_train_config`), parsed as the training process parses it, and Levanter's real
train step (`Trainer._train_step`, its state donated as Levanter's own jit does) is lowered and
compiled for this machine's devices from abstract shapes: no weights are allocated and no step runs.
XLA's compiled memory analysis then gives the argument, output, aliased, temporary and generated-code
bytes; the peak is argument + output - alias + temp. A program over the device's memory is refused by
XLA:TPU at compile time; its refusal's figure for the temporaries is reported instead (plus the
arguments). ``--peak-buffers N`` also dumps XLA's buffer assignment and lists its N largest buffers:
those live at the peak on CPU, the temporary allocation's on TPU (whose dump has no peak listing).

Shapes (vocabulary: Marin's Llama 3 tokenizer, 128,256, except the CPU-sized two):
  tiny        hidden 64, intermediate 256, 2 layers, 4 heads, seq 128, vocab 1,024
  small       hidden 256, intermediate 1,024, 4 layers, 4 heads, seq 256, vocab 4,096
  llama_150m  hidden 512, intermediate 1,792, 6 layers, 8 heads, seq 1,024 (Marin's ladder)
  llama_600m  hidden 1,024, intermediate 3,584, 24 layers, 16 heads (8 key/value), seq 1,024 (Marin's ladder)

Usage: python -m benchmarks.memory_fit --shape llama_150m --batch 16 [--checkpointing on|off|auto]
           [--ce-block N|none|auto] [--fused-loss] [--attention BACKEND] [--peak-buffers N]
The last line of output is one JSON object.
"""

from __future__ import annotations

import sys

# Sibling scripts (benchmarks/tokenize.py) shadow stdlib modules when this file is run as a script.
if sys.path and sys.path[0].rstrip("/").endswith("benchmarks"):
    sys.path.pop(0)

import argparse
import dataclasses
import functools
import glob
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from marin_assets.training.memory import (  # noqa: E402
    GIB,
    ComputeSettings,
    estimate_memory,
    plan_compute,
    unplanned_settings,
)
from marin_assets.training.spec import (  # noqa: E402
    ComputeSpec,
    ModelSpec,
    OptimizerSpec,
    ResourceSpec,
    RunSpec,
    RunSpecError,
    validate_run,
)


@dataclass(frozen=True)
class Shape:
    model: ModelSpec
    vocab_size: int


SHAPES = {
    "tiny": Shape(ModelSpec(hidden_dim=64, intermediate_dim=256, num_layers=2, num_heads=4, num_kv_heads=4,
                            seq_len=128), 1024),
    "small": Shape(ModelSpec(hidden_dim=256, intermediate_dim=1024, num_layers=4, num_heads=4, num_kv_heads=4,
                             seq_len=256), 4096),
    "llama_150m": Shape(ModelSpec(hidden_dim=512, intermediate_dim=1792, num_layers=6, num_heads=8, num_kv_heads=8,
                                  seq_len=1024), 128_256),
    "llama_600m": Shape(ModelSpec(hidden_dim=1024, intermediate_dim=3584, num_layers=24, num_heads=16,
                                  num_kv_heads=8, seq_len=1024), 128_256),
}
SWITCH = {"on": True, "off": False, "auto": "auto"}


def run_spec(shape: Shape, batch: int, compute: ComputeSpec, accelerator: str, devices: int) -> RunSpec:
    """The run whose step is measured, on this machine's devices (one replica each)."""
    resources = ResourceSpec(accelerator=accelerator, device_count=devices,
                             tpu_type=f"v5litepod-{devices}" if accelerator == "tpu" else None)
    spec = RunSpec(name="memory-fit", model=shape.model, mixture="memory-fit", tokenizer="memory-fit",
                   optimizer=OptimizerSpec(learning_rate=1e-3), train_batch_size=batch, num_train_steps=100,
                   watch_every=0, resources=resources, compute=compute)
    validate_run(spec)
    return spec


def levanter_config(spec: RunSpec, settings: ComputeSettings, workdir: str):
    """The run's rendered config, parsed with Levanter's own parser (no data is read)."""
    from marin_assets.training.levanter_config import build_train_config, parse_train_config, write_train_config

    data = {"configs": {"memory-fit": {"cache_dir": os.path.join(workdir, "no-cache")}},
            "train_weights": {"memory-fit": 1.0}}
    config = build_train_config(spec, data, os.path.join(workdir, "no-tokenizer"), workdir, compute=settings)
    return parse_train_config(write_train_config(config, os.path.join(workdir, "train_config.yaml")))


def xla_memory(spec: RunSpec, settings: ComputeSettings, vocab_size: int) -> dict[str, int]:
    """XLA's compiled memory analysis of Levanter's train step for ``spec`` computed with ``settings``."""
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from haliax.partitioning import infer_resource_partitions, round_axis_for_partitioning
    from levanter.models.lm_model import LmExample, compute_next_token_loss
    from levanter.tracker import NoopConfig
    from levanter.trainer import Trainer
    from levanter.trainer_state import TrainerState

    from marin_assets.training import jax_compat

    jax_compat.install()  # Levanter on the host's JAX, as the training process runs it
    with tempfile.TemporaryDirectory(prefix="memory-fit-") as workdir:
        config = levanter_config(spec, settings, workdir)
    loss_function = functools.partial(compute_next_token_loss, logsumexp_weight=config.z_loss_weight)
    if settings.fused_loss:
        from marin_assets.training.fused_loss import levanter_next_token_loss

        loss_function = functools.partial(levanter_next_token_loss(compute_next_token_loss),
                                          logsumexp_weight=config.z_loss_weight)
    trainer_config = dataclasses.replace(config.trainer, tracker=NoopConfig())
    optimizer = config.optimizer.build(trainer_config.num_train_steps)
    with Trainer(trainer_config, optimizer, loss_function, add_default_hooks=False) as trainer:
        Vocab = round_axis_for_partitioning(hax.Axis("vocab", vocab_size), trainer.parameter_axis_mapping)
        Batch = hax.Axis(trainer_config.batch_axis, spec.train_batch_size)

        def initial_state():
            model = config.model.build(Vocab, key=jax.random.PRNGKey(0))
            return TrainerState.init(optimizer, model, key=jax.random.PRNGKey(1), is_trainable=True, mp=trainer.mp)

        def example(tokens):
            return hax.vmap(LmExample.causal, Batch)(tokens)

        state = eqx.filter_eval_shape(initial_state)
        tokens = hax.NamedArray(jax.ShapeDtypeStruct((Batch.size, config.model.Pos.size), jnp.int32),
                                (Batch, config.model.Pos))
        batch = eqx.filter_eval_shape(example, tokens)
        # Abstract arrays are not arrays to equinox: split them from the static parts ourselves.
        abstract, static = eqx.partition((state, batch), lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))
        shardings = (infer_resource_partitions(abstract[0], trainer.parameter_axis_mapping,
                                               preserve_existing_shardings=False),
                     infer_resource_partitions(abstract[1], trainer.compute_axis_mapping,
                                               preserve_existing_shardings=False))

        def step(state_arrays, batch_arrays):
            state, batch = eqx.combine((state_arrays, batch_arrays), static)
            return eqx.filter(trainer._train_step(state, (batch,), {}, _no_hooks=True), eqx.is_array)

        lowered = jax.jit(step, donate_argnums=0, in_shardings=shardings).lower(*abstract)
        try:
            compiled = lowered.compile()
        except Exception as exc:  # XLA refuses a program over the device's memory, with its own figure
            argument_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract))
            figures = out_of_memory_figures(str(exc), argument_bytes)
            if figures is None:
                raise
            return figures
    analysis = compiled.memory_analysis()
    figures = {name: int(getattr(analysis, f"{name}_size_in_bytes")) for name in
               ("argument", "output", "alias", "temp", "generated_code")}
    figures["peak"] = figures["argument"] + figures["output"] - figures["alias"] + figures["temp"]
    return figures


UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def out_of_memory_figures(message: str, argument_bytes: int) -> dict[str, int] | None:
    """XLA:TPU's figure from its refusal of a program over the device's memory ("... the total memory
    required for HLO temporaries (21.39G) exceeds available HBM (15.75G)"): the temporaries, and with
    the arguments (``argument_bytes``, donated, so aliased by the outputs) the peak; None for another error."""
    match = re.search(r"HLO temp(?:oraries)?\W+([\d.]+)([KMGT]?)", message)
    if "RESOURCE_EXHAUSTED" not in message or match is None:
        return None
    temp = int(float(match.group(1)) * UNITS[match.group(2)])
    return {"out_of_memory": 1, "argument": argument_bytes, "temp": temp, "peak": argument_bytes + temp}


def largest_buffers(dump_dir: str, count: int) -> tuple[str, list[tuple[int, str, str]]]:
    """The ``count`` largest (bytes, shape, producer) buffers of XLA's buffer assignment for the step just
    compiled: those live at its peak where the backend lists them (CPU), else those of its temporary
    allocation, whenever they are live (TPU); and which of the two."""
    files = glob.glob(os.path.join(dump_dir, "*step*buffer-assignment.txt"))
    if not files:
        return "no buffer assignment was dumped", []
    text = Path(max(files, key=os.path.getmtime)).read_text()
    values = {m.group(1): (int(m.group(2)), int(m.group(3)), m.group(4)) for m in re.finditer(
        r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): ([^{\s]+)", text)}
    live = re.search(r"Live ranges at \d+ \(peak\):\n(.*?)\n\s*Stack trace", text, re.S)
    if live is not None:
        buffers: Counter[tuple[str, str]] = Counter()
        for line in live.group(1).splitlines():
            match = re.match(r"\s+(\S+): (\d+) bytes", line)
            if match:
                name = match.group(1).split("{")[0]
                buffers[(values.get(name, (0, 0, "?"))[2], name)] += int(match.group(2))
        return "live at XLA's peak", [(size, shape, name) for (shape, name), size in buffers.most_common(count)]
    temp = re.search(r"allocation \d+: size \d+, preallocated-temp:\n(.*?)(?=\nallocation |\Z)", text, re.S)
    if temp is None:
        return "no temporary allocation in the dump", []
    distinct = {}  # one row per (offset, size): values sharing a buffer are one buffer
    for name in re.findall(r"value: <\d+ (\S+) @\d+>", temp.group(1)):
        size, offset, shape = values[name]
        distinct.setdefault((offset, size), (size, shape, name))
    return "in XLA's temporary allocation", sorted(distinct.values(), reverse=True)[:count]


def device_memory_limit() -> tuple[str, int, int | None]:
    """(JAX platform, device count, bytes one device lets XLA use; None on CPU)."""
    import jax

    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit") if device.platform != "cpu" else None
    return device.platform, jax.device_count(), limit


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--batch", type=int, help="sequences a step (default: 8, or 16 for the Marin shapes)")
    parser.add_argument("--checkpointing", choices=sorted(SWITCH), default="auto")
    parser.add_argument("--ce-block", default="auto", help="cross-entropy vocabulary block: N, none or auto")
    parser.add_argument("--fused-loss", action="store_true", help="the fused head and loss kernel (TPU)")
    parser.add_argument("--attention", help="Levanter's attention backend (default: its choice for the device)")
    parser.add_argument("--peak-buffers", type=int, default=0,
                        help="list this many of XLA's largest buffers (at its peak, where the backend says)")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    batch = args.batch or (8 if args.shape in ("tiny", "small") else 16)
    if args.ce_block not in ("none", "auto") and not args.ce_block.isdigit():
        parser.error(f"--ce-block: expected a positive integer, none or auto, got {args.ce_block!r}")
    block = {"none": None, "auto": "auto"}[args.ce_block] if args.ce_block in ("none", "auto") else int(args.ce_block)
    compute = ComputeSpec(gradient_checkpointing=SWITCH[args.checkpointing], cross_entropy_block_size=block,
                          fused_loss=args.fused_loss, attention=args.attention)

    # XLA reads its flags when JAX starts its backend: a dump folder already named there is used.
    named = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    dump_dir = named.group(1) if named else tempfile.mkdtemp(prefix="memory-fit-dump-") if args.peak_buffers else None
    if args.peak_buffers and not named:
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} "
                                   "--xla_dump_hlo_module_re=.*step.*")
    platform, devices, limit = device_memory_limit()
    try:
        spec = run_spec(shape, batch, compute, platform, devices)
        if "auto" in (compute.gradient_checkpointing, compute.cross_entropy_block_size):
            label = f"{(limit or 0) / GIB:.2f} GiB ({platform})"
            settings, estimate = plan_compute(spec, shape.vocab_size, limit, label)
        else:  # measured even where it cannot fit: XLA's refusal states its own figure
            settings = unplanned_settings(spec)
            estimate = estimate_memory(spec, shape.vocab_size, settings)
    except RunSpecError as exc:
        raise SystemExit(f"memory_fit: {exc}") from None
    xla = xla_memory(spec, settings, shape.vocab_size)
    title, buffers = largest_buffers(dump_dir, args.peak_buffers) if args.peak_buffers else ("", [])
    if dump_dir is not None and not named:
        shutil.rmtree(dump_dir)

    ratio = estimate.total / xla["peak"]
    print(f"{args.shape} batch {batch} x {shape.model.seq_len} on {devices} {platform} device(s), "
          f"{settings.describe()}")
    print(f"  estimate  {estimate.describe()}")
    if xla.get("out_of_memory"):
        print(f"  XLA       {xla['peak'] / GIB:,.2f} GiB, refused as over the device's memory: temp "
              f"{xla['temp'] / GIB:,.2f} + argument {xla['argument'] / GIB:,.2f}")
    else:
        print(f"  XLA       {xla['peak'] / GIB:,.2f} GiB peak = argument {xla['argument'] / GIB:,.2f} + output "
              f"{xla['output'] / GIB:,.2f} - alias {xla['alias'] / GIB:,.2f} + temp {xla['temp'] / GIB:,.2f} "
              f"(generated code {xla['generated_code'] / 2**20:,.1f} MiB)")
    print(f"  estimate / XLA peak = {ratio:.3f}" + (f"; device limit {limit / GIB:,.2f} GiB" if limit else ""))
    if args.peak_buffers:
        print(f"  largest buffers {title}:")
    for size, buffer_shape, name in buffers:
        print(f"    {size / 2**20:10,.1f} MiB  {buffer_shape:32} {name}")
    result = {"shape": args.shape, "batch": batch, "seq_len": shape.model.seq_len, "vocab_size": shape.vocab_size,
              "platform": platform, "devices": devices, "device_limit_bytes": limit,
              "settings": settings.as_dict(), "estimate": {**estimate.terms(), "phase": estimate.phase,
                                                           "total": estimate.total},
              "xla": xla, "estimate_over_xla": round(ratio, 4)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
