"""Training-step time of a run's model on CPU: as Levanter runs it, and with each of our CPU choices.

One forward and backward of the run's Levanter model (random tokens, its batch and sequence length
unless given), timed in fresh processes, alternating between the modes:

- `baseline`: haliax's products as XLA gets them, the whole [tokens, vocab] logits at once;
- `flat`: `marin_assets.training.flat_dots.use_flat_dots` (two-dimensional products);
- `flat+blockwise`: that, and the cross-entropy over vocabulary blocks of `--block` (the training
  config's `cross_entropy_block_size` on CPU, `memory.CPU_CROSS_ENTROPY_BLOCK`): what a
  CPU run does now.

Each process compiles once, then takes the median of ``--steps`` timed steps (forward+backward, and
forward alone); a mode's figure is the median over its ``--repeats`` processes. Prints the modes side
by side with the speedup over the baseline, the loss, the transposes XLA kept, and a final JSON line.

Usage: python -m benchmarks.cpu_step [--run nano-shakespeare] [--family llama] [--width W --layers L]
                                     [--batch B] [--seq-len S] [--vocab 4096] [--steps 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("baseline", "flat", "flat+blockwise")


def measure(args: argparse.Namespace) -> dict:
    """Time the step in this process (a child: `use_flat_dots` is process-wide)."""
    import dataclasses

    import draccus
    import equinox as eqx
    import haliax as hax
    import jax
    from levanter.models.lm_model import LmConfig, LmExample, compute_next_token_loss

    from marin_assets.training.flat_dots import use_flat_dots
    from marin_assets.training.levanter_config import model_config
    from marin_assets.training.memory import unplanned_settings
    from marin_assets.training.spec import load_run_registry

    spec = load_run_registry()[args.run]
    shape = {k: v for k, v in {"family": args.family, "hidden_dim": args.width, "num_layers": args.layers,
                               "seq_len": args.seq_len}.items() if v is not None}
    if args.width is not None:  # a sweep-like shape: 4-wide heads, a 4x MLP
        shape.update(intermediate_dim=4 * args.width, num_heads=max(1, args.width // 4),
                     num_kv_heads=max(1, args.width // 4))
    model_spec = dataclasses.replace(spec.model, **shape)
    fields = {k: v for k, v in model_config(model_spec, "unused", unplanned_settings(spec)).items() if k != "tokenizer"}
    fields["cross_entropy_block_size"] = args.block if args.child == "flat+blockwise" else None
    config = draccus.decode(LmConfig, fields)
    if args.child != "baseline":
        use_flat_dots()
    Vocab, Batch = hax.Axis("vocab", args.vocab), hax.Axis("batch", args.batch or spec.train_batch_size)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    tokens = hax.random.randint(jax.random.PRNGKey(1), (Batch, config.Pos), 0, args.vocab)
    example = hax.vmap(LmExample.causal, Batch)(tokens)

    def loss(m, ex):
        return compute_next_token_loss(m, ex).scalar()

    def median_ms(fn) -> float:
        jax.block_until_ready(fn(model, example))  # compile
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            jax.block_until_ready(fn(model, example))
            times.append(time.perf_counter() - started)
        return 1000 * statistics.median(times)

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    result = {"step_ms": median_ms(step), "forward_ms": median_ms(eqx.filter_jit(loss)),
              "loss": float(step(model, example)[0])}
    dynamic, static = eqx.partition(model, eqx.is_array)
    compiled = jax.jit(lambda d, ex: jax.value_and_grad(lambda d2: loss(eqx.combine(d2, static), ex))(d)
                       ).lower(dynamic, example).compile().as_text()
    return {**result, "transposes": compiled.count(" transpose(")}


def main() -> None:
    from marin_assets.training.memory import CPU_CROSS_ENTROPY_BLOCK

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="nano-shakespeare", help="a run of marin_assets/training/runs.yaml")
    parser.add_argument("--family", help="another model family at the run's shape (llama, qwen, olmo2, mixtral...)")
    parser.add_argument("--width", type=int, help="hidden width instead of the run's (4-wide heads, a 4x MLP)")
    parser.add_argument("--layers", type=int, help="layers instead of the run's")
    parser.add_argument("--batch", type=int, help="sequences a step instead of the run's batch")
    parser.add_argument("--seq-len", type=int, help="tokens a sequence instead of the run's")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size (the demo tokenizer's: 4096)")
    parser.add_argument("--block", type=int, default=CPU_CROSS_ENTROPY_BLOCK, help="cross-entropy vocabulary block")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per process")
    parser.add_argument("--repeats", type=int, default=3, help="processes per mode, alternating")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    passed = sys.argv[1:]
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):  # alternated, so a change in the machine's load hits every mode alike
        for mode in MODES:
            command = [sys.executable, "-m", "benchmarks.cpu_step", *passed, "--child", mode]
            out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    timed = ("step_ms", "forward_ms")
    results = {mode: {**measured[0], **{k: statistics.median(r[k] for r in measured) for k in timed}}
               for mode, measured in runs.items()}
    base = results["baseline"]["step_ms"]
    print(f"run {args.run}{' ' + ' '.join(passed) if passed else ''}: forward + backward on {os.cpu_count()} CPU "
          f"cores, median of {args.steps} steps in each of {args.repeats} processes a mode")
    print(f"{'mode':16} {'step ms':>9} {'forward ms':>11} {'speedup':>8} {'transposes':>11} {'loss':>10}")
    for mode, r in results.items():
        print(f"{mode:16} {r['step_ms']:9.1f} {r['forward_ms']:11.1f} {base / r['step_ms']:7.2f}x "
              f"{r['transposes']:11d} {r['loss']:10.5f}")
    print(json.dumps({"args": passed, **results}))


if __name__ == "__main__":
    main()
