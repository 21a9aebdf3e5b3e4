"""Matrix products that XLA's CPU backend runs without transposing their operands.

haliax contracts named axes with ``jax.lax.dot_general`` on operands of three or more dimensions:
[batch, position, embed] against [embed, mlp]. The gradient of such a weight contracts over batch
*and* position, and XLA's CPU compiler in jaxlib 0.7.2 canonicalises that product by physically
transposing the [batch, position, feature] operand (a `copy` of a `transpose`, at about 60 million
floats a second on the 2-core VM it was profiled on): in the demo's nano Llama the backward pass
took six times the forward. Merged into one axis by a reshape (free on a row-major array), every
such product is two-dimensional, and XLA hands a 2-D product to Eigen with transpose flags instead
of copying.

The math is the same product; only the summation order inside it may differ, as between any two
matmul kernels. `benchmarks/cpu_step.py` measures the step time with and without it.

`use_flat_dots` installs it for the whole process, on CPU only: GPU and TPU compilers take these
products as they are. It replaces two defaults of haliax 1.4.dev453 (the version pyproject.toml
pins): `haliax.dot`'s ``dot_general`` keyword and `DefaultDotGeneralOp`, which every `hnn.Linear`
calls. A haliax that changes either fails here in one line, and tests/training/test_flat_dots.py
fails with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def _consecutive(dims: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in zip(dims, dims[1:]))


def flat_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """``jax.lax.dot_general``, with each operand's batch, free and contracting axes merged into one
    axis apiece where they are already adjacent and in order (a reshape, no copy). Products that are
    already at most one axis per group, or whose axes are interleaved, go to ``dot_general`` as given."""
    import jax

    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = (tuple(map(tuple, pair)) for pair in dimension_numbers)
    lhs_free = tuple(d for d in range(lhs.ndim) if d not in lhs_contract and d not in lhs_batch)
    rhs_free = tuple(d for d in range(rhs.ndim) if d not in rhs_contract and d not in rhs_batch)
    lhs_groups = [g for g in (lhs_batch, lhs_free, lhs_contract) if g]
    rhs_groups = [g for g in (rhs_batch, rhs_free, rhs_contract) if g]
    # Ascending runs on both sides keep the i-th batch and contracting axes of lhs paired with rhs's.
    groups = lhs_groups + rhs_groups
    if not all(_consecutive(g) for g in groups) or all(len(g) == 1 for g in groups):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)

    def merged(operand, groups):
        in_order = sorted(groups)
        position = {group: i for i, group in enumerate(in_order)}
        return operand.reshape([math.prod(operand.shape[d] for d in g) for g in in_order]), position

    lhs2, lhs_at = merged(lhs, lhs_groups)
    rhs2, rhs_at = merged(rhs, rhs_groups)
    contract = ((lhs_at[lhs_contract],), (rhs_at[rhs_contract],)) if lhs_contract else ((), ())
    batch = ((lhs_at[lhs_batch],), (rhs_at[rhs_batch],)) if lhs_batch else ((), ())
    product = jax.lax.dot_general(lhs2, rhs2, (contract, batch), precision=precision,
                                  preferred_element_type=preferred_element_type, **kwargs)
    # dot_general's output order: batch axes, then lhs's free axes, then rhs's.
    shape = [lhs.shape[d] for d in (*lhs_batch, *lhs_free)] + [rhs.shape[d] for d in rhs_free]
    return product.reshape(shape)


def _linear_dot_general(self: Any, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    return flat_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


def use_flat_dots() -> bool:
    """Route haliax's products in this process through `flat_dot_general` when JAX runs on CPU.
    Returns whether it did. Call it after `jax.distributed` is initialised and before tracing."""
    import jax

    if jax.default_backend() != "cpu":
        return False
    import haliax._src.dot as haliax_dot
    import haliax.quantization as haliax_quantization

    defaults = haliax_dot.dot.__kwdefaults__ or {}
    linear_op = getattr(haliax_quantization, "DefaultDotGeneralOp", None)
    if "dot_general" not in defaults or linear_op is None:
        raise RuntimeError("flat_dots: haliax.dot has no dot_general keyword or DefaultDotGeneralOp is gone; "
                           "written for haliax 1.4.dev453, see marin_assets/training/flat_dots.py")
    defaults["dot_general"] = flat_dot_general
    linear_op.__call__ = _linear_dot_general
    return True
