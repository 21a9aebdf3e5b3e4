"""The fused head-and-cross-entropy kernels, run by Pallas's interpreter on CPU: the loss and both
gradients against XLA's, and the Levanter drop-in against Levanter's own loss."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from marin_assets.training.fused_loss import Tiles, choose_tiles, fused_cross_entropy, usable  # noqa: E402


def xla_loss(h, w, labels, z):
    logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=1)
    return lse - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0] + z * lse**2


# The TPU host's JAX (0.10) runs these too (.ci/run's second pass): the kernels are its code.
@pytest.mark.jax_compat
@pytest.mark.parametrize("tokens, hidden, vocab, tiles, z, dtype", [
    # Padding on both axes (40 of 48 rows, 300 of 384 columns) and three vocabulary tiles.
    (40, 64, 300, Tiles(16, 128), 0.0, jnp.float32),
    # The z-loss, eight vocabulary tiles.
    (64, 32, 1000, Tiles(32, 128), 1e-3, jnp.float32),
    # The compute dtype of accelerators.
    (48, 64, 200, Tiles(16, 128), 0.0, jnp.bfloat16),
])
def test_loss_and_gradients_match_xla(tokens, hidden, vocab, tiles, z, dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    h = jax.random.normal(keys[0], (tokens, hidden)).astype(dtype)
    w = (jax.random.normal(keys[1], (vocab, hidden)) * 0.3).astype(dtype)
    labels = jax.random.randint(keys[2], (tokens,), 0, vocab)
    weights = jax.random.uniform(keys[3], (tokens,))  # a per-token upstream gradient, as a loss mask gives

    def total(loss):
        return lambda h, w: jnp.sum(weights * loss(h, w))

    fused = total(lambda h, w: fused_cross_entropy(h, w, labels, logsumexp_weight=z, tiles=tiles, interpret=True))
    value, (dh, dw) = jax.value_and_grad(fused, argnums=(0, 1))(h, w)
    expected, (dh_x, dw_x) = jax.value_and_grad(total(lambda h, w: xla_loss(h, w, labels, z)), argnums=(0, 1))(h, w)

    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    assert value == pytest.approx(float(expected), rel=1e-6)
    assert dh.dtype == h.dtype and dw.dtype == w.dtype
    for got, want in ((dh, dh_x), (dw, dw_x)):
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < tolerance


def test_labels_outside_the_vocabulary_add_no_target_logit():
    h = jnp.ones((8, 16), jnp.float32)
    w = jnp.zeros((256, 16), jnp.float32)
    loss = fused_cross_entropy(h, w, jnp.full((8,), -1), tiles=Tiles(8, 128), interpret=True)
    assert jnp.allclose(loss, jnp.log(256.0))  # uniform logits: the log-sum-exp alone


def test_tiles_divide_the_work_and_only_one_tpu_uses_the_kernels():
    assert choose_tiles(65536, 512, 128256) == Tiles(1024, 1024)
    assert choose_tiles(100, 1536, 300) == Tiles(104, 384)
    assert usable("tpu", 1)
    assert not usable("tpu", 4) and not usable("cpu", 1) and not usable("gpu", 1)


@pytest.mark.slow  # imports Levanter and differentiates a Llama through the interpreter: about 18 s
def test_levanter_drop_in_matches_levanters_loss():
    """The training loss and every parameter's gradient of a small Llama, with a loss mask and z-loss."""
    equinox = pytest.importorskip("equinox")
    hax = pytest.importorskip("haliax")
    from levanter.models.llama import LlamaConfig, LlamaLMHeadModel
    from levanter.models.lm_model import LmExample, compute_next_token_loss

    from marin_assets.training.fused_loss import levanter_next_token_loss

    config = LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    Vocab, Batch = hax.Axis("vocab", 300), hax.Axis("batch", 3)
    model = LlamaLMHeadModel.init(Vocab, config, key=jax.random.PRNGKey(0))
    tokens = hax.random.randint(jax.random.PRNGKey(1), (Batch, config.Pos), 0, Vocab.size)
    mask = hax.random.bernoulli(jax.random.PRNGKey(2), (Batch, config.Pos), 0.8)
    example = hax.vmap(lambda t, m: LmExample.causal(t, loss_mask=m), Batch)(tokens, mask)
    fused = levanter_next_token_loss(compute_next_token_loss, interpret=True)

    def value_and_grads(loss):
        return equinox.filter_value_and_grad(lambda m: loss(m, example, logsumexp_weight=1e-3).scalar())(model)

    value, grads = value_and_grads(fused)
    expected, expected_grads = value_and_grads(compute_next_token_loss)
    assert float(value) == pytest.approx(float(expected), rel=1e-6)
    differences = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda a, b: float(jnp.max(jnp.abs(a - b))), grads, expected_grads))
    assert max(differences) < 1e-5
    # Per-token losses (evaluation) are Levanter's own.
    per_token = fused(model, example, reduction=None, reduction_axis=())
    assert jnp.array_equal(per_token.array, compute_next_token_loss(model, example, reduction=None,
                                                                     reduction_axis=()).array)
