"""The fused head-and-cross-entropy kernels (marin_assets/training/fused_loss.py) against XLA's loss.

For a head of ``--hidden`` x ``--vocab`` over ``--tokens`` tokens in bf16, times one forward and
backward (loss, dh, dW) of:
  fused   the Pallas kernels (on a TPU; anywhere else in interpret mode, which times nothing useful)
  xla     the logits as one matrix product in f32, log-sum-exp and its gradient by XLA
and checks the fused values against XLA's on the first ``--check-tokens`` tokens (loss and dh per token;
dW summed over those tokens only). FLOPs counted: 3 x 2 x tokens x hidden x vocab (the head's model
FLOPs, as MFU counts them); the fused kernels do 4/3 of that, XLA with its logits in HBM 3/3.

Usage: python benchmarks/fused_loss.py [--tokens 65536] [--hidden 512] [--vocab 128256] [--repeats 5]
The last line is one JSON object.
"""

from __future__ import annotations

import sys

if sys.path and sys.path[0].rstrip("/").endswith("benchmarks"):
    sys.path.pop(0)

import argparse
import functools
import json
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--xla-tokens", type=int, default=16384,
                        help="tokens for XLA's timing (its f32 logits must fit the device; scaled per token)")
    parser.add_argument("--check-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiles", nargs="*", default=[],
                        help="also time these tilings, each TOKENSxVOCAB (e.g. 2048x512); default: choose_tiles's")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from marin_assets.training.fused_loss import Tiles, choose_tiles, fused_cross_entropy

    interpret = jax.default_backend() != "tpu"
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    h = (jax.random.normal(keys[0], (args.tokens, args.hidden), jnp.float32)).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (args.vocab, args.hidden), jnp.float32) * args.hidden**-0.5).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[2], (args.tokens,), 0, args.vocab)

    def xla_loss(h, w, labels):
        logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=1)
        return lse - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0]

    def fused(h, w, labels, tiles=None):
        return fused_cross_entropy(h, w, labels, tiles=tiles, interpret=interpret)

    def step(loss_fn):
        def total(h, w, labels):
            return jnp.mean(loss_fn(h, w, labels))

        return jax.jit(jax.value_and_grad(total, argnums=(0, 1)))

    def timed(fn, *operands) -> tuple[float, float]:
        started = time.perf_counter()
        jax.block_until_ready(fn(*operands))
        compile_and_first = time.perf_counter() - started
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            jax.block_until_ready(fn(*operands))
            times.append(time.perf_counter() - started)
        return compile_and_first, sorted(times)[len(times) // 2]

    n = args.check_tokens
    fused_check = jax.jit(jax.grad(lambda h, w: jnp.sum(fused(h, w, labels[:n])), argnums=(0, 1)))(h[:n], w)
    xla_check = jax.jit(jax.grad(lambda h, w: jnp.sum(xla_loss(h, w, labels[:n])), argnums=(0, 1)))(h[:n], w)
    loss_error = float(jnp.max(jnp.abs(fused(h[:n], w, labels[:n]) - xla_loss(h[:n], w, labels[:n]))))

    def relative(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    head_flops = 3 * 2 * args.hidden * args.vocab
    fused_first, fused_s = timed(step(fused), h, w, labels)
    tilings = {}
    for text in args.tiles:
        tiles = Tiles(*(int(part) for part in text.split("x")))
        seconds = timed(step(functools.partial(fused, tiles=tiles)), h, w, labels)[1]
        tilings[text] = {"seconds": seconds, "model_tflops": head_flops * args.tokens / seconds / 1e12}
        print(f"fused tiles {text:>10}  {seconds * 1e3:8.2f} ms  model {tilings[text]['model_tflops']:6.1f} TFLOP/s")
    xla_tokens = min(args.xla_tokens, args.tokens)
    xla_first, xla_s = timed(step(xla_loss), h[:xla_tokens], w, labels[:xla_tokens])
    result = {
        "benchmark": "fused_loss",
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
        "tiles": choose_tiles(args.tokens, args.hidden, args.vocab).__dict__,
        "max_loss_error": loss_error,
        "dh_relative_error": relative(fused_check[0], xla_check[0]),
        "dw_relative_error": relative(fused_check[1], xla_check[1]),
        "fused": {"seconds": fused_s, "first_call_seconds": fused_first,
                  "model_tflops": head_flops * args.tokens / fused_s / 1e12, "tilings": tilings},
        "xla": {"tokens": xla_tokens, "seconds": xla_s, "first_call_seconds": xla_first,
                "model_tflops": head_flops * xla_tokens / xla_s / 1e12},
    }
    print(f"{result['device_kind']}: head {args.hidden} x {args.vocab}, loss and gradients in bf16")
    print(f"fused  {args.tokens:6d} tokens  {fused_s * 1e3:8.2f} ms  model {result['fused']['model_tflops']:6.1f} "
          "TFLOP/s")
    print(f"xla    {xla_tokens:6d} tokens  {xla_s * 1e3:8.2f} ms  model {result['xla']['model_tflops']:6.1f} TFLOP/s")
    print(f"fused vs xla on {n} tokens: loss max |diff| {loss_error:.2e}, dh rel {result['dh_relative_error']:.2e}, "
          f"dW rel {result['dw_relative_error']:.2e}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
