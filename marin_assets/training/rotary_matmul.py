"""Rotary position embeddings without half-width slices, for the TPU.

Levanter's rotary embedding rotates each query and key head by ``concatenate(-x[half:], x[:half])``
(``levanter.layers.rotary._rotate_half``). On a TPU an array's last dimension is tiled in lanes of
128; a head of 64 already fills half a tile, and its halves of 32 a quarter, so XLA:TPU's slices,
negations and concatenation of [batch, position, heads, 32] arrays move four times the bytes they hold.
Profiled on one v5e chip (`benchmarks/gpu_train.py --profile`), ten such fusions per step of
`llama_150m` at batch 64 took 48 ms of its 456, more than a tenth of the step, against 58 ms for
the whole forward pass of its six layers.

The same rotation is a product with a signed permutation matrix, which XLA runs on the matrix
unit at the head's full width: ``rotate_half(x) = x @ R`` with ``R[half + i, i] = -1`` and
``R[i, half + i] = 1``. Each output is one input times plus or minus one, summed with zeros, so the
result is exactly Levanter's, bit for bit, in any dtype (HIGHEST precision keeps a float32
product from being rounded to bfloat16 on the TPU). Hence it is no identity: the run computes the
same numbers, only by another instruction.

`use_rotary_matmul` installs it for the whole process on a TPU; elsewhere Levanter's stays (the
CPU gains nothing from it). It replaces one function of Levanter 1.2.dev1644 (the version
pyproject.toml pins); a Levanter whose function changed shape is refused in one line.
"""

from __future__ import annotations

import inspect


def rotate_half_by_matmul(x, HeadSize):
    """``concatenate(HeadSize, (-x[half:], x[:half]))`` as a product with a signed permutation matrix."""
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import numpy as np

    size = HeadSize.size
    half = size // 2
    rotation = np.zeros((size, size), dtype=np.float32)
    rotation[np.arange(half) + half, np.arange(half)] = -1.0
    rotation[np.arange(half), np.arange(half) + half] = 1.0
    axis = x.axis_indices(HeadSize)
    moved = jnp.moveaxis(x.array, axis, -1)
    product = jnp.matmul(moved, jnp.asarray(rotation, dtype=x.dtype), precision=jax.lax.Precision.HIGHEST)
    return hax.named(jnp.moveaxis(product, -1, axis), x.axes)


def use_rotary_matmul() -> bool:
    """Route Levanter's rotary embeddings in this process through `rotate_half_by_matmul` when JAX runs
    on a TPU. Returns whether it did. Call it after `jax.distributed` is initialised and before tracing."""
    import jax

    if jax.default_backend() != "tpu":
        return False
    import levanter.layers.rotary as rotary

    original = getattr(rotary, "_rotate_half", None)
    if original is None or list(inspect.signature(original).parameters) != ["x", "HeadSize"]:
        raise RuntimeError("rotary_matmul: levanter.layers.rotary._rotate_half(x, HeadSize) is gone or changed; "
                           "written for Levanter 1.2.dev1644, see marin_assets/training/rotary_matmul.py")
    rotary._rotate_half = rotate_half_by_matmul
    return True
