"""FLOPs and parameter counts for Levanter Llama-style decoder models.

Convention (the same as ``levanter.utils.flop_utils.lm_flops_per_token``, so our budgets agree
with the throughput numbers Levanter logs):

* a matrix multiply of an ``m x n`` weight costs ``2 * m * n`` FLOPs per token (multiply + add);
* attention counts the full ``seq_len x seq_len`` score matrix (no causal halving), plus
  3 FLOPs per score for masking/softmax;
* the MLP is a gated (GLU/SwiGLU) block with three ``hidden x intermediate`` matrices;
* the LM head counts, the input embedding lookup does not;
* training costs 3x the forward pass (backward is twice the forward).

Parameter counts follow ``LlamaConfig.total_trainable_params``: input and output embeddings
(one matrix when tied) and two RMSNorm weight vectors per layer plus a final one. Tying
does not change FLOPs: the LM head matmul runs either way.
"""

from __future__ import annotations

from dataclasses import dataclass

TRAINING_TO_FORWARD = 3.0


@dataclass(frozen=True)
class ModelDims:
    """Shape of a Llama decoder, as far as FLOPs and parameters are concerned."""

    hidden_dim: int
    intermediate_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def head_dim(self) -> float:
        return self.hidden_dim / self.num_heads

    def forward_flops_per_token(self, seq_len: int) -> float:
        return forward_flops_per_token(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
            seq_len=seq_len,
        )

    def training_flops_per_token(self, seq_len: int) -> float:
        return TRAINING_TO_FORWARD * self.forward_flops_per_token(seq_len)

    def param_count(self) -> int:
        return param_count(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
        )

    def non_embedding_param_count(self) -> int:
        embedding_matrices = 1 if self.tie_word_embeddings else 2
        return self.param_count() - embedding_matrices * self.vocab_size * self.hidden_dim


def forward_flops_per_token(
    *,
    hidden_dim: int,
    intermediate_dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    seq_len: int,
) -> float:
    """Forward-pass FLOPs per token of a Llama decoder with a gated MLP."""
    head_dim = hidden_dim / num_heads
    mlp = 2 * 3 * hidden_dim * intermediate_dim
    qkv = 2 * hidden_dim * (num_heads + 2 * num_kv_heads) * head_dim
    out_proj = 2 * hidden_dim * hidden_dim
    # Whole-sequence attention costs, amortised over the seq_len tokens of the sequence.
    scores = 2 * seq_len * seq_len * num_heads * head_dim
    softmax_and_mask = 3 * seq_len * seq_len * num_heads
    weighted_values = 2 * seq_len * seq_len * num_heads * head_dim
    attention = (scores + softmax_and_mask + weighted_values) / seq_len
    lm_head = 2 * hidden_dim * vocab_size
    return num_layers * (mlp + qkv + out_proj + attention) + lm_head


def training_flops_per_token(**dims: int) -> float:
    """Training FLOPs per token: forward plus a backward pass costing twice the forward."""
    return TRAINING_TO_FORWARD * forward_flops_per_token(**dims)


def param_count(
    *,
    hidden_dim: int,
    intermediate_dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    tie_word_embeddings: bool = False,
) -> int:
    """Trainable parameters of a Llama decoder with RMSNorm (untied embeddings by default)."""
    head_dim = hidden_dim // num_heads
    attention = hidden_dim * head_dim * (2 * num_heads + 2 * num_kv_heads)
    mlp = 3 * hidden_dim * intermediate_dim
    norms = 2 * hidden_dim
    embeddings = (1 if tie_word_embeddings else 2) * vocab_size * hidden_dim
    return num_layers * (attention + mlp + norms) + hidden_dim + embeddings
