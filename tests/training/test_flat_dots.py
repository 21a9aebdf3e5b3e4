"""flat_dots: the same products as jax.lax.dot_general, and on CPU a Linear's gradient with no transposes."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import SUBPROCESS_ENV

from marin_assets.training.flat_dots import flat_dot_general

# (lhs shape, rhs shape, ((lhs contracting, rhs contracting), (lhs batch, rhs batch)))
PRODUCTS = [
    ((4, 5, 6), (6, 7), (((2,), (0,)), ((), ()))),  # a Linear: [batch, pos, embed] x [embed, mlp]
    ((4, 5, 6), (7, 6), (((2,), (1,)), ((), ()))),  # out-first weight
    ((4, 5, 6), (4, 5, 7), (((0, 1), (0, 1)), ((), ()))),  # its weight gradient: over batch and pos
    ((2, 3, 4, 5), (2, 3, 5, 6), (((3,), (2,)), ((0, 1), (0, 1)))),  # two leading batch axes
    ((2, 4, 3, 5), (2, 3, 5, 6), (((3,), (2,)), ((0, 2), (0, 1)))),  # interleaved batch axes: as given
    ((4, 5, 6), (6, 5, 7), (((1, 2), (1, 0)), ((), ()))),  # contracting axes paired out of order: as given
    ((3, 4), (4, 5), (((1,), (0,)), ((), ()))),  # already two-dimensional
    ((2, 3, 4, 5), (4, 5, 2, 3), (((2, 3), (0, 1)), ((), ()))),  # several free axes on both sides
]


@pytest.mark.parametrize("lhs_shape, rhs_shape, dimension_numbers", PRODUCTS)
def test_flat_dot_general_is_dot_general(lhs_shape, rhs_shape, dimension_numbers):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=lhs_shape), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=rhs_shape), jnp.float32)
    expected = jax.lax.dot_general(lhs, rhs, dimension_numbers)
    got = flat_dot_general(lhs, rhs, dimension_numbers)
    assert got.shape == expected.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


LINEAR_GRADIENT = """
import json, sys
import haliax as hax, haliax.nn as hnn, jax, numpy as np
from marin_assets.training.flat_dots import use_flat_dots

# Before anything is traced: jnp.einsum caches its traces by the (unchanged) Linear's product op.
installed = use_flat_dots() if sys.argv[1] == "flat" else False
Batch, Pos, Embed, Mlp = hax.Axis("batch", 8), hax.Axis("position", 32), hax.Axis("embed", 16), hax.Axis("mlp", 64)
up = hnn.Linear.init(Embed, Mlp, key=jax.random.PRNGKey(0))
down = hnn.Linear.init(Mlp, Embed, key=jax.random.PRNGKey(1))
x = hax.random.normal(jax.random.PRNGKey(2), (Batch, Pos, Embed))

def loss(layers):
    hidden = hax.dot(layers[0](x), layers[0].weight, axis=Mlp)  # hax.dot as well as Linear
    return hax.sum(layers[1](hnn.silu(layers[0](x))) ** 2).scalar() + hax.sum(hidden).scalar()

step = jax.jit(jax.grad(loss))
grads = step((up, down))
print(json.dumps({"installed": installed, "grads": [np.asarray(g.weight.array).tolist() for g in grads],
                  "transposes": step.lower((up, down)).compile().as_text().count(" transpose(")}))
"""


def linear_gradient(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", LINEAR_GRADIENT, mode], env=SUBPROCESS_ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_on_cpu_a_linear_gradient_needs_no_transpose():
    plain, flat = linear_gradient("plain"), linear_gradient("flat")
    assert flat["installed"] is True
    # XLA's CPU compiler transposes the [batch, position, feature] operands of the weight gradients...
    assert plain["transposes"] > 0
    # ...and none once the products are two-dimensional.
    assert flat["transposes"] == 0
    for a, b in zip(plain["grads"], flat["grads"]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
