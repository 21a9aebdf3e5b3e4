"""Step time of a run's model on CPU with haliax's products as they are and as `flat_dots` runs them.

One forward and backward of the run's Levanter model (random tokens, its batch and sequence length),
timed in fresh processes, alternating: `baseline` (haliax's products as XLA gets them) and `flat`
(`marin_assets.training.flat_dots.use_flat_dots`). Each process compiles once, then takes the median of
``--steps`` timed steps; a mode's figure is the median over its ``--repeats`` processes. Prints
both, the speedup, the loss difference, the count of transposes XLA kept in the compiled step, and
a final JSON line.

Usage: python -m benchmarks.flat_dots [--run nano-shakespeare] [--family llama] [--vocab 4096]
                                      [--steps 10] [--repeats 3]
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


def measure(run: str, family: str | None, vocab: int, steps: int, flat: bool) -> dict:
    """Time the run's training step in this process (called in a child: `use_flat_dots` is process-wide)."""
    import dataclasses

    import draccus
    import equinox as eqx
    import haliax as hax
    import jax
    from levanter.models.lm_model import LmConfig, LmExample, compute_next_token_loss

    from marin_assets.training.flat_dots import use_flat_dots
    from marin_assets.training.levanter_config import model_config
    from marin_assets.training.spec import load_run_registry

    spec = load_run_registry()[run]
    model_spec = spec.model if family is None else dataclasses.replace(spec.model, family=family)
    fields = {k: v for k, v in model_config(model_spec, "unused", gradient_checkpointing=False).items()
              if k != "tokenizer"}
    config = draccus.decode(LmConfig, fields)
    if flat:
        use_flat_dots()
    Vocab, Batch = hax.Axis("vocab", vocab), hax.Axis("batch", spec.train_batch_size)
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    tokens = hax.random.randint(jax.random.PRNGKey(1), (Batch, config.Pos), 0, vocab)
    example = hax.vmap(LmExample.causal, Batch)(tokens)

    def loss(m, ex):
        return compute_next_token_loss(m, ex).scalar()

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    value, grads = step(model, example)
    jax.block_until_ready(grads)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        value, grads = step(model, example)
        jax.block_until_ready(grads)
        times.append(time.perf_counter() - started)
    dynamic, static = eqx.partition(model, eqx.is_array)
    compiled = jax.jit(lambda d, ex: jax.value_and_grad(lambda d2: loss(eqx.combine(d2, static), ex))(d)
                       ).lower(dynamic, example).compile().as_text()
    return {"step_ms": 1000 * statistics.median(times), "loss": float(value),
            "transposes": compiled.count(" transpose(")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="nano-shakespeare", help="a run of marin_assets/training/runs.yaml")
    parser.add_argument("--family", help="another model family at the run's shape (llama, qwen, olmo2, mixtral...)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size (the demo tokenizer's: 4096)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per process")
    parser.add_argument("--repeats", type=int, default=3, help="processes per mode, alternating")
    parser.add_argument("--child", choices=("baseline", "flat"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.run, args.family, args.vocab, args.steps, args.child == "flat")))
        return
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    runs: dict[str, list[dict]] = {"baseline": [], "flat": []}
    for _ in range(args.repeats):  # alternated, so a change in the machine's load hits both alike
        for mode in runs:
            command = [sys.executable, "-m", "benchmarks.flat_dots", "--run", args.run, "--vocab", str(args.vocab),
                       "--steps", str(args.steps), "--child", mode] + (["--family", args.family] if args.family else [])
            out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = {mode: {**measured[0], "step_ms": statistics.median(r["step_ms"] for r in measured)}
               for mode, measured in runs.items()}
    base, flat = results["baseline"], results["flat"]
    print(f"run {args.run} (family {args.family or 'as declared'}), vocab {args.vocab}, forward + backward on "
          f"{os.cpu_count()} CPU cores, median of {args.steps} steps in each of {args.repeats} processes a mode")
    print(f"{'':10} {'step ms':>9} {'transposes':>11} {'loss':>12}")
    for mode, r in results.items():
        print(f"{mode:10} {r['step_ms']:9.1f} {r['transposes']:11d} {r['loss']:12.6f}")
    summary = {"speedup": base["step_ms"] / flat["step_ms"], "loss_difference": abs(base["loss"] - flat["loss"]),
               **{f"{mode}_{k}": v for mode, r in results.items() for k, v in r.items()}}
    print(f"speedup {summary['speedup']:.2f}x, loss difference {summary['loss_difference']:.2e}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
