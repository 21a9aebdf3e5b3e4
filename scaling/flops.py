"""FLOPs and parameter counts for Levanter's decoder families: Llama, Qwen (2 and 3), OLMo 2 and Mixtral.

Convention (the same as ``levanter.utils.flop_utils.lm_flops_per_token``, so our budgets agree
with the throughput numbers Levanter logs):

* a matrix multiply of an ``m x n`` weight costs ``2 * m * n`` FLOPs per token (multiply + add);
* attention counts the full ``seq_len x seq_len`` score matrix (no causal halving), plus
  3 FLOPs per score for masking/softmax;
* the MLP is a gated (GLU/SwiGLU) block with three ``hidden x intermediate`` matrices; in a
  mixture of experts (Mixtral) each token runs ``experts_per_token`` of them, plus the router's
  ``hidden x num_experts`` matrix;
* the LM head counts, the input embedding lookup does not; biases and norms cost nothing;
* training costs 3x the forward pass (backward is twice the forward).

Parameter counts are those of the model Levanter builds (tests/scaling compares them with an
initialized one): input and output embeddings (one matrix when tied), two RMSNorm weight vectors
per layer plus a final one, and per family: Qwen 2's query/key/value biases, Qwen 3's query and
key norms over the head size, OLMo 2's query and key norms over all heads, Mixtral's router and
``num_experts`` MLPs per layer. Tying does not change FLOPs: the LM head matmul runs either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

TRAINING_TO_FORWARD = 3.0

ModelFamily = Literal["llama", "qwen", "qwen3", "olmo2", "mixtral"]
"""Decoder families, by the names Levanter registers their configs under (``LmConfig`` choices)."""
FAMILIES: tuple[str, ...] = get_args(ModelFamily)
MIXTURE_OF_EXPERTS_FAMILIES = ("mixtral",)


@dataclass(frozen=True)
class ModelDims:
    """Shape of a decoder, as far as FLOPs and parameters are concerned."""

    hidden_dim: int
    intermediate_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    family: str = "llama"
    num_experts: int = 1
    """MLPs per layer a router chooses from (mixture-of-experts families); 1 for a dense MLP."""
    experts_per_token: int = 1
    """MLPs each token runs (the router's top-k)."""
    head_size: int | None = None
    """Attention head size when it is not ``hidden_dim / num_heads`` (Levanter's ``head_dim``). It
    changes the parameters; Levanter's FLOPs convention assumes the default."""

    def __post_init__(self) -> None:
        for name in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
                     "num_experts", "experts_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not one of {FAMILIES}")
        if self.family in MIXTURE_OF_EXPERTS_FAMILIES:
            if self.num_experts < 2 or self.experts_per_token > self.num_experts:
                raise ValueError(f"{self.family} needs 2 or more experts and at most that many per token, got "
                                 f"num_experts={self.num_experts}, experts_per_token={self.experts_per_token}")
        elif (self.num_experts, self.experts_per_token) != (1, 1):
            raise ValueError(f"{self.family} has a dense MLP: num_experts and experts_per_token must be 1")
        if self.head_size is not None and self.head_size <= 0:
            raise ValueError(f"head_size must be a positive integer or None, got {self.head_size!r}")

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
            num_experts=self.num_experts,
            experts_per_token=self.experts_per_token,
        )

    def training_flops_per_token(self, seq_len: int) -> float:
        return TRAINING_TO_FORWARD * self.forward_flops_per_token(seq_len)

    def param_count(self) -> int:
        """Trainable parameters of the model Levanter builds for this shape and family."""
        d, layers = self.hidden_dim, self.num_layers
        head = self.head_size or d // self.num_heads
        q_width, kv_width = head * self.num_heads, head * self.num_kv_heads
        attention = 2 * d * q_width + 2 * d * kv_width  # q, o and k, v
        if self.family == "qwen":
            attention += q_width + 2 * kv_width  # biases on the q, k and v projections
        elif self.family == "qwen3":
            attention += 2 * head  # q and k RMSNorm over the head size, shared by the heads
        elif self.family == "olmo2":
            attention += q_width + kv_width  # q and k RMSNorm over every head
        mlp = 3 * d * self.intermediate_dim * self.num_experts
        if self.family in MIXTURE_OF_EXPERTS_FAMILIES:
            mlp += d * self.num_experts  # the router
        norms = 2 * d
        embeddings = (1 if self.tie_word_embeddings else 2) * self.vocab_size * d
        return layers * (attention + mlp + norms) + d + embeddings

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
    num_experts: int = 1,
    experts_per_token: int = 1,
) -> float:
    """Forward-pass FLOPs per token of a decoder with a gated MLP (or a routed mixture of them)."""
    head_dim = hidden_dim / num_heads
    mlp = 2 * 3 * hidden_dim * intermediate_dim * experts_per_token
    if num_experts > 1:
        mlp += 2 * hidden_dim * num_experts  # the router
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
    return ModelDims(hidden_dim=hidden_dim, intermediate_dim=intermediate_dim, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, vocab_size=vocab_size,
                     tie_word_embeddings=tie_word_embeddings).param_count()
