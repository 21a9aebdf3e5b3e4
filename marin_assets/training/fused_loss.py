"""The language-model head and its cross-entropy as Pallas kernels on TPU: the logits never reach HBM.

Why: at a 128,256-entry vocabulary the head is most of a small Llama's FLOPs (69% of ``llama_150m``'s),
and its logits are the largest tensor of the step: [tokens, vocab] floats, 33.6 GB in f32 at batch 64 x
1,024. XLA computes them as a matrix product written to HBM, then reads them back for the log-sum-exp,
again for the softmax's gradient, and again for the two gradient products. Levanter's blockwise
cross-entropy (``cross_entropy_block_size``) bounds their memory, not that traffic, and with a
hidden size of 512 each logit costs only 1,024 FLOPs to compute, so the step waits on HBM.

Here each tile of logits lives in VMEM only, as flash attention keeps its scores:
- forward, grid (token tiles, vocabulary tiles): the tile's product, then an online log-sum-exp, the
  target's logit and, when a gradient is wanted, ``E = softmax @ W``, the softmax-weighted head rows
  (attention's output, with the head as the values);
- backward: ``dh = g (1 + 2 z lse) E - g W[label]`` needs no kernel, and ``dW += dlogits^T @ h`` is one
  kernel on the grid (vocabulary tiles, token tiles) that recomputes each tile's logits, with the
  dW block in VMEM across the tokens.
That is four products of the head's size per step where the minimum is three, as with XLA's
recomputed blocks, but none of them reads or writes logits.

The math is the cross-entropy of Levanter's ``compute_next_token_loss`` (with its z-loss,
``logsumexp_weight``): products in the compute dtype with f32 accumulation, statistics in f32,
``dlogits`` rounded to the compute dtype for the gradient products as XLA's would be. Only the
summation order differs, so it is a runtime choice and never enters a run's identity.

Pallas's TPU lowering needs no TPU to test: ``interpret=True`` runs the same kernels on CPU
(tests/training/test_fused_loss.py). `install` swaps it into Levanter's ``train_lm`` for one process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

LANES = 128
"""Per-token statistics travel as [tokens, 128] rows, the value repeated on every lane: a TPU vector
register's width, the layout Pallas's own flash attention uses for its softmax statistics."""
VMEM_LIMIT_BYTES = 64 * 2**20
"""The kernels' VMEM budget: `choose_tiles` keeps a step's buffers to about 30 MiB of it (v5e's
scoped default is 16 MiB of 128)."""


@dataclass(frozen=True)
class Tiles:
    """Rows of tokens and vocabulary entries per kernel step."""

    tokens: int
    vocab: int


def choose_tiles(tokens: int, hidden: int, vocab: int) -> Tiles:
    """Tiles large enough to be compute-bound: a dW step does 4 x tokens x hidden x vocab FLOPs and
    moves a token tile of activations and four lane-wide statistics rows per token, so a wide
    vocabulary tile pays for them; f32 temporaries of one [tokens, vocab] tile and double-buffered
    inputs keep a step within about 30 MiB of VMEM."""
    tile_tokens = 1024 if tokens >= 1024 else _round_up(tokens, 8)
    tile_vocab = 1024 if hidden <= 1024 else 512
    return Tiles(tile_tokens, min(tile_vocab, _round_up(vocab, LANES)))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _compiler_params(semantics: tuple[str, ...]):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT_BYTES)


def _lanes(values, rows: int):
    """[rows] -> [rows, LANES], each value repeated across the lanes (see `LANES`)."""
    import jax

    return jax.lax.broadcast_in_dim(values, (rows, LANES), (0,))


# --- kernels --------------------------------------------------------------------------------------


def _tile_logits(h_ref, w_ref, vocab_tile, vocab_size: int):
    """This step's [tokens, vocab] logits in f32, the padding columns past ``vocab_size`` at -inf, and
    the tile's column ids."""
    import jax
    import jax.numpy as jnp

    logits = jax.lax.dot_general(h_ref[...], w_ref[...], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    columns = vocab_tile * w_ref.shape[0] + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    return jnp.where(columns < vocab_size, logits, -jnp.inf), columns


def _forward_kernel(h_ref, w_ref, labels_ref, lse_ref, target_ref, *rest, vocab_size: int, with_expected: bool):
    """Online log-sum-exp and target logit over the vocabulary tiles; with ``with_expected``, also
    ``softmax @ W`` (rescaled as the maximum grows, normalised at the end)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    if with_expected:
        expected_ref, max_scratch, sum_scratch, target_scratch, expected_scratch = rest
    else:
        max_scratch, sum_scratch, target_scratch = rest
    vocab_tile = pl.program_id(1)

    @pl.when(vocab_tile == 0)
    def _start():
        max_scratch[...] = jnp.full(max_scratch.shape, -jnp.inf, jnp.float32)
        sum_scratch[...] = jnp.zeros(sum_scratch.shape, jnp.float32)
        target_scratch[...] = jnp.zeros(target_scratch.shape, jnp.float32)
        if with_expected:
            expected_scratch[...] = jnp.zeros(expected_scratch.shape, jnp.float32)

    logits, columns = _tile_logits(h_ref, w_ref, vocab_tile, vocab_size)
    previous_max = max_scratch[...][:, :1]
    new_max = jnp.maximum(previous_max, jnp.max(logits, axis=1, keepdims=True))
    rescale = jnp.exp(previous_max - new_max)
    weights = jnp.exp(logits - new_max)
    total = sum_scratch[...][:, :1] * rescale + jnp.sum(weights, axis=1, keepdims=True)
    target = target_scratch[...][:, :1] + jnp.sum(
        jnp.where(columns == labels_ref[...][:, :1], logits, 0.0), axis=1, keepdims=True)
    max_scratch[...] = jnp.broadcast_to(new_max, max_scratch.shape)
    sum_scratch[...] = jnp.broadcast_to(total, sum_scratch.shape)
    target_scratch[...] = jnp.broadcast_to(target, target_scratch.shape)
    if with_expected:
        expected_scratch[...] = expected_scratch[...] * rescale + jax.lax.dot_general(
            weights.astype(w_ref.dtype), w_ref[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(vocab_tile == pl.num_programs(1) - 1)
    def _finish():
        lse_ref[...] = max_scratch[...] + jnp.log(sum_scratch[...])
        target_ref[...] = target_scratch[...]
        if with_expected:
            expected_ref[...] = expected_scratch[...] / sum_scratch[...][:, :1]


def _dw_kernel(h_ref, w_ref, labels_ref, lse_ref, scale_ref, grad_ref, dw_ref, dw_scratch, *, vocab_size: int):
    """dW on the grid (vocabulary tiles, token tiles): each tile's logits again, its
    ``dlogits = scale * softmax - grad * onehot(label)`` in the compute dtype (``scale = grad (1 + 2 z lse)``
    carries the z-loss), and ``dlogits^T @ h`` summed in VMEM across the token tiles."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    token_tile = pl.program_id(1)
    logits, columns = _tile_logits(h_ref, w_ref, pl.program_id(0), vocab_size)
    probabilities = jnp.exp(logits - lse_ref[...][:, :1])  # 0 on the padding columns (exp(-inf))
    dlogits = (scale_ref[...][:, :1] * probabilities
               - jnp.where(columns == labels_ref[...][:, :1], grad_ref[...][:, :1], 0.0)).astype(h_ref.dtype)
    dw = jax.lax.dot_general(dlogits, h_ref[...], (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(token_tile == 0)
    def _start():
        dw_scratch[...] = dw

    @pl.when(token_tile > 0)
    def _accumulate():
        dw_scratch[...] += dw

    @pl.when(token_tile == pl.num_programs(1) - 1)
    def _finish():
        dw_ref[...] = dw_scratch[...]


# --- calls --------------------------------------------------------------------------------------------


def _forward(h, w, labels, vocab_size: int, tiles: Tiles, interpret: bool, with_expected: bool):
    """(lse, target logit), each [tokens, LANES] f32, and with ``with_expected`` ``softmax @ W`` [tokens,
    hidden] f32, for padded ``h`` [T, D], ``w`` [Vp, D] and ``labels`` [T, LANES]."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    tokens, hidden = h.shape
    rows = pl.BlockSpec((tiles.tokens, hidden), lambda i, j: (i, 0))
    stats = pl.BlockSpec((tiles.tokens, LANES), lambda i, j: (i, 0))
    stat_shape = jax.ShapeDtypeStruct((tokens, LANES), jnp.float32)
    scratch = [pltpu.VMEM((tiles.tokens, LANES), jnp.float32)] * 3
    out_specs, out_shape = [stats, stats], [stat_shape, stat_shape]
    if with_expected:
        out_specs.append(rows)
        out_shape.append(jax.ShapeDtypeStruct((tokens, hidden), jnp.float32))
        scratch.append(pltpu.VMEM((tiles.tokens, hidden), jnp.float32))
    return pl.pallas_call(
        functools.partial(_forward_kernel, vocab_size=vocab_size, with_expected=with_expected),
        grid=(tokens // tiles.tokens, w.shape[0] // tiles.vocab),
        in_specs=[rows, pl.BlockSpec((tiles.vocab, hidden), lambda i, j: (j, 0)), stats],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=_compiler_params(("parallel", "arbitrary")),
        interpret=interpret,
    )(h, w, labels)


def _weight_gradient(h, w, labels, lse, scale, grad, vocab_size: int, tiles: Tiles, interpret: bool):
    """dW [Vp, D] in f32; the statistics are [T, LANES] rows."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    tokens, hidden = h.shape
    stats = pl.BlockSpec((tiles.tokens, LANES), lambda j, i: (i, 0))
    weights = pl.BlockSpec((tiles.vocab, hidden), lambda j, i: (j, 0))
    return pl.pallas_call(
        functools.partial(_dw_kernel, vocab_size=vocab_size),
        grid=(w.shape[0] // tiles.vocab, tokens // tiles.tokens),
        in_specs=[pl.BlockSpec((tiles.tokens, hidden), lambda j, i: (i, 0)), weights, stats, stats, stats, stats],
        out_specs=weights,
        out_shape=jax.ShapeDtypeStruct(w.shape, jnp.float32),
        scratch_shapes=[pltpu.VMEM((tiles.vocab, hidden), jnp.float32)],
        compiler_params=_compiler_params(("parallel", "arbitrary")),
        interpret=interpret,
    )(h, w, labels, lse, scale, grad)


@functools.cache
def _cross_entropy_fn(logsumexp_weight: float, tiles: Tiles | None, interpret: bool):
    """The per-token loss function with its custom gradient, for one z-loss weight and tiling."""
    import jax
    import jax.numpy as jnp

    def padded(h, w, labels):
        """Operands padded to whole tiles; padding rows get label -1 (no column matches it) and, in the
        backward pass, a zero gradient; padding columns are masked to -inf in the kernels."""
        tokens, hidden = h.shape
        t = tiles or choose_tiles(tokens, hidden, w.shape[0])
        rows, columns = _round_up(tokens, t.tokens), _round_up(w.shape[0], t.vocab)
        labels_p = jnp.pad(labels.astype(jnp.int32), (0, rows - tokens), constant_values=-1)
        return (jnp.pad(h, ((0, rows - tokens), (0, 0))), jnp.pad(w, ((0, columns - w.shape[0]), (0, 0))),
                _lanes(labels_p, rows), t)

    def loss(h, w, labels, *, with_expected: bool):
        h_p, w_p, labels_p, t = padded(h, w, labels)
        lse, target, *expected = _forward(h_p, w_p, labels_p, w.shape[0], t, interpret, with_expected)
        tokens = h.shape[0]
        lse, target = lse[:tokens, 0], target[:tokens, 0]
        return lse - target + logsumexp_weight * lse**2, lse, [e[:tokens] for e in expected]

    @jax.custom_vjp
    def cross_entropy(h, w, labels):
        return loss(h, w, labels, with_expected=False)[0]

    def forward(h, w, labels):
        per_token, lse, (expected,) = loss(h, w, labels, with_expected=True)
        return per_token, (h, w, labels, lse, expected)

    def backward(residuals, grad):
        h, w, labels, lse, expected = residuals
        grad = grad.astype(jnp.float32)
        scale = grad * (1.0 + 2.0 * logsumexp_weight * lse)
        # d/dh of lse is softmax @ W; of the target logit, W's row of the label.
        target_rows = jnp.take(w, labels, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
        dh = scale[:, None] * expected - grad[:, None] * target_rows
        h_p, w_p, labels_p, t = padded(h, w, labels)
        rows, extra = h_p.shape[0], h_p.shape[0] - h.shape[0]
        dw = _weight_gradient(h_p, w_p, labels_p, _lanes(jnp.pad(lse, (0, extra)), rows),
                              _lanes(jnp.pad(scale, (0, extra)), rows), _lanes(jnp.pad(grad, (0, extra)), rows),
                              w.shape[0], t, interpret)
        return dh.astype(h.dtype), dw[: w.shape[0]].astype(w.dtype), None

    cross_entropy.defvjp(forward, backward)
    return cross_entropy


def fused_cross_entropy(h, w, labels, *, logsumexp_weight: float = 0.0, tiles: Tiles | None = None,
                        interpret: bool = False):
    """Per-token ``logsumexp(h @ w.T) - (h @ w.T)[label] + logsumexp_weight * logsumexp**2``, f32 [tokens].

    ``h``: [tokens, hidden]; ``w``: [vocab, hidden], both in the compute dtype; ``labels``: [tokens]
    int. Differentiable in ``h`` and ``w``; a label outside [0, vocab) contributes no target logit."""
    return _cross_entropy_fn(float(logsumexp_weight), tiles, interpret)(h, w, labels)


# --- Levanter -------------------------------------------------------------------------------------


def usable(backend: str, device_count: int) -> bool:
    """Whether the kernels can serve a process: Mosaic compiles them for TPUs only, and one device
    holds the whole batch and head (under a mesh of several, the custom call would be replicated)."""
    return backend == "tpu" and device_count == 1


def levanter_next_token_loss(original, *, interpret: bool = False):
    """A drop-in for Levanter's ``compute_next_token_loss`` (``original``) that computes the training
    loss, a mean over every token, with `fused_cross_entropy`. Anything else (per-token losses for
    evaluation, a reduction axis, a logit soft cap) goes to ``original`` unchanged."""
    import haliax as hax
    import jax.numpy as jnp

    def next_token_loss(model, example, *, key=None, reduction=hax.mean, reduction_axis=None,
                        logsumexp_weight=None, loss_dtype=jnp.float32, logit_soft_cap=None):
        if reduction is not hax.mean or reduction_axis is not None or logit_soft_cap is not None:
            return original(model, example, key=key, reduction=reduction, reduction_axis=reduction_axis,
                            logsumexp_weight=logsumexp_weight, loss_dtype=loss_dtype, logit_soft_cap=logit_soft_cap)
        activations = model.activations(example.tokens, example.attn_mask, key=key)
        aux_loss = 0
        if isinstance(activations, tuple):
            activations, aux_loss = activations
        Embed, Vocab = model.Embed, model.Vocab
        Pos = activations.resolve_axis(model.Pos.name)
        token_axes = tuple(axis for axis in activations.axes if axis.name != Embed.name)
        # As Levanter's loss: each position predicts the next token; the last position predicts nothing.
        mask = 1 - hax.nn.one_hot(-1, Pos, dtype=jnp.float32)
        if example.loss_mask is not None:
            mask = example.loss_mask * mask
        h = activations.rearrange((*token_axes, Embed)).array.reshape(-1, Embed.size)
        w = model.get_lm_head().rearrange((Vocab, Embed)).array.astype(h.dtype)
        targets = hax.roll(example.tokens, -1, Pos).broadcast_to(token_axes).rearrange(token_axes).array.reshape(-1)
        weights = hax.broadcast_to(mask, token_axes).rearrange(token_axes).array.reshape(-1)
        per_token = fused_cross_entropy(h, w, targets, logsumexp_weight=logsumexp_weight or 0.0, interpret=interpret)
        return hax.named(jnp.sum(per_token * weights) / jnp.sum(weights), ()) + aux_loss

    return next_token_loss
