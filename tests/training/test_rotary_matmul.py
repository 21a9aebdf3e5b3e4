"""The rotary embedding's rotation as a signed-permutation product equals Levanter's, bit for bit."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers import rotary
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig

from marin_assets.training.rotary_matmul import rotate_half_by_matmul, use_rotary_matmul

Batch, Pos = hax.Axis("batch", 2), hax.Axis("position", 16)
Heads, HeadSize = hax.Axis("heads", 3), hax.Axis("head_size", 8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("axes", [(Batch, Pos, Heads, HeadSize), (Batch, HeadSize, Pos)])
def test_the_product_is_levanters_rotation_exactly(dtype, axes):
    x = hax.random.normal(jax.random.PRNGKey(0), axes).astype(dtype) * 1e3
    ours, theirs = rotate_half_by_matmul(x, HeadSize), rotary._rotate_half(x, HeadSize)
    assert ours.axes == theirs.axes and ours.dtype == theirs.dtype
    np.testing.assert_array_equal(np.asarray(ours.array, np.float32), np.asarray(theirs.array, np.float32))


def test_rotary_embeddings_and_their_gradient_are_unchanged():
    embed = DefaultRotaryEmbeddingsConfig().build(HeadSize)
    q = hax.random.normal(jax.random.PRNGKey(1), (Batch, Pos, Heads, HeadSize))
    positions = hax.arange(Pos)

    def loss(q, rotate):
        original = rotary._rotate_half
        rotary._rotate_half = rotate
        try:
            return (embed(q, positions) ** 2).sum().scalar()
        finally:
            rotary._rotate_half = original

    theirs = jax.value_and_grad(loss)(q, rotary._rotate_half)
    for a, b in zip(theirs, jax.value_and_grad(loss)(q, rotate_half_by_matmul)):
        np.testing.assert_array_equal(np.asarray(getattr(a, "array", a)), np.asarray(getattr(b, "array", b)))


def test_it_is_installed_on_a_tpu_only():
    assert jax.default_backend() == "cpu"
    original = rotary._rotate_half
    assert use_rotary_matmul() is False
    assert rotary._rotate_half is original


def test_a_changed_levanter_function_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(rotary, "_rotate_half", lambda x, axis, extra=None: x)
    with pytest.raises(RuntimeError, match="_rotate_half.*gone or changed"):
        use_rotary_matmul()
