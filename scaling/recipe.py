"""IsoFLOP sweep recipes: map a compute budget C to candidate training configurations.

In the spirit of Marin's CompletedAdamH heuristic:

* a grid of widths; depth follows width through an aspect ratio (width per layer) that grows
  slowly with width; heads from a fixed head size; MLP width from a ratio;
* tokens = C / (3 * forward FLOPs per token), so every candidate of a budget spends the
  same training compute (see ``scaling.flops`` for the FLOPs convention);
* batch size from a target number of optimizer steps, rounded to a power of two;
* AdamW hyperparameters transferred from one tuned reference point: with
  r = batch tokens / training tokens (= 1 / steps), learning rate ~ sqrt(r) (and ~ 1/width),
  epsilon ~ 1/sqrt(r), and beta2 = beta2_ref ** (batch tokens / reference batch tokens), which
  keeps the second-moment averaging window constant in tokens;
* candidates outside [min, max] tokens per parameter, or with too few steps, are dropped
  (and reported in ``BudgetPlan.rejected``).

``Recipe`` carries Delphi-scale defaults (3e18..1e23 FLOPs); ``MicroRecipe`` carries defaults
for CPU-sized sweeps (1e12..1e16 FLOPs). Both are frozen dataclasses: fork one with
``dataclasses.replace(recipe, vocab_size=..., seq_len=...)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .flops import TRAINING_TO_FORWARD, ModelDims


@dataclass(frozen=True)
class Candidate:
    """One training run of an isoFLOP sweep."""

    recipe: str
    budget: float
    hidden_dim: int
    intermediate_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    seq_len: int
    batch_size: int
    steps: int
    tokens: int
    params: int
    non_embedding_params: int
    forward_flops_per_token: float
    flops: float  # realised training FLOPs: 3 * forward FLOPs per token * tokens
    learning_rate: float
    beta1: float
    beta2: float
    epsilon: float
    weight_decay: float
    warmup: int  # steps
    max_grad_norm: float

    @property
    def dims(self) -> ModelDims:
        return ModelDims(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
        )

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params

    @property
    def run_name(self) -> str:
        return f"{self.recipe}-{self.budget:.0e}-d{self.hidden_dim}-L{self.num_layers}-B{self.batch_size}"

    def to_dict(self) -> dict[str, float | int | str | bool]:
        return {**asdict(self), "run_name": self.run_name, "tokens_per_param": self.tokens_per_param}


@dataclass(frozen=True)
class Rejection:
    hidden_dim: int
    reason: str


@dataclass(frozen=True)
class BudgetPlan:
    budget: float
    candidates: tuple[Candidate, ...]
    rejected: tuple[Rejection, ...]


def _delphi_widths() -> tuple[int, ...]:
    # Four widths per octave, all multiples of the 128-wide heads.
    return (256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584,
            4096, 5120, 6144, 7168, 8192, 10240, 12288)  # fmt: skip


@dataclass(frozen=True)
class Recipe:
    name: str = "delphi"
    vocab_size: int = 128_256
    tie_word_embeddings: bool = False
    seq_len: int = 4096
    widths: tuple[int, ...] = field(default_factory=_delphi_widths)

    # Architecture.
    head_dim: int = 128
    query_heads_per_kv_head: int = 1
    mlp_ratio: float = 4.0
    mlp_multiple: int = 128
    # Depth: layers = width / aspect, aspect = aspect_at_reference + aspect_per_doubling *
    # log2(width / aspect_reference_width): wider models are also (more slowly) deeper.
    aspect_reference_width: int = 512
    aspect_at_reference: float = 80.0
    aspect_per_doubling: float = 4.0
    min_layers: int = 2

    # Batch size: a power of two near tokens / (target_steps * seq_len).
    target_steps: int = 2**16
    min_batch_size: int = 8
    max_batch_size: int = 8192
    min_steps: int = 1000

    # Optimizer reference point (a tuned small run) and the transfer rules' limits.
    reference_batch_tokens: float = 8 * 4096
    reference_tokens: float = 1e9
    reference_width: int = 512
    learning_rate_at_reference: float = 3e-3
    learning_rate_width_exponent: float = 1.0
    max_learning_rate: float = 1e-2
    epsilon_at_reference: float = 1e-8
    beta1: float = 0.9
    beta2_at_reference: float = 0.9998
    min_beta2: float = 0.9
    max_beta2: float = 0.9999
    weight_decay: float = 0.1
    warmup_fraction: float = 0.1
    max_grad_norm: float = 1.0

    # Which (budget, model) pairs are worth training.
    min_tokens_per_param: float = 2.0
    max_tokens_per_param: float = 500.0

    def __post_init__(self) -> None:
        if not self.widths:
            raise ValueError("widths must not be empty")
        for width in self.widths:
            if width <= 0 or width % self.head_dim:
                raise ValueError(f"width {width} is not a positive multiple of head_dim {self.head_dim}")
            heads = width // self.head_dim
            if heads % self.query_heads_per_kv_head:
                raise ValueError(
                    f"width {width}: {heads} heads not divisible by query_heads_per_kv_head "
                    f"{self.query_heads_per_kv_head}"
                )
        if not 0 < self.min_tokens_per_param <= self.max_tokens_per_param:
            raise ValueError("need 0 < min_tokens_per_param <= max_tokens_per_param")
        if not 0 < self.min_batch_size <= self.max_batch_size:
            raise ValueError("need 0 < min_batch_size <= max_batch_size")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError("warmup_fraction must be in [0, 1)")

    # --- architecture -------------------------------------------------------------------

    def num_layers(self, width: int) -> int:
        aspect = self.aspect_at_reference + self.aspect_per_doubling * math.log2(width / self.aspect_reference_width)
        return max(self.min_layers, round(width / max(aspect, 1.0)))

    def dims(self, width: int) -> ModelDims:
        heads = width // self.head_dim
        intermediate = self.mlp_multiple * max(1, round(self.mlp_ratio * width / self.mlp_multiple))
        return ModelDims(
            hidden_dim=width,
            intermediate_dim=intermediate,
            num_layers=self.num_layers(width),
            num_heads=heads,
            num_kv_heads=heads // self.query_heads_per_kv_head,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
        )

    # --- optimizer transfer rules -------------------------------------------------------

    def _batch_ratio(self, batch_size: int, tokens: float) -> float:
        """(batch tokens / tokens) relative to the reference run's ratio."""
        return (batch_size * self.seq_len / tokens) / (self.reference_batch_tokens / self.reference_tokens)

    def learning_rate(self, batch_size: int, tokens: float, width: int) -> float:
        """Uncapped; candidates whose learning rate exceeds ``max_learning_rate`` get a smaller batch."""
        width_factor = (self.reference_width / width) ** self.learning_rate_width_exponent
        return self.learning_rate_at_reference * math.sqrt(self._batch_ratio(batch_size, tokens)) * width_factor

    def epsilon(self, batch_size: int, tokens: float) -> float:
        return self.epsilon_at_reference / math.sqrt(self._batch_ratio(batch_size, tokens))

    def beta2(self, batch_size: int) -> float:
        """Unclipped; candidates below ``min_beta2`` get a smaller batch."""
        return min(self.max_beta2, self.beta2_at_reference ** (batch_size * self.seq_len / self.reference_batch_tokens))

    def batch_size(self, tokens: float, width: int) -> int:
        exact = tokens / (self.target_steps * self.seq_len)
        batch = 2 ** max(0, round(math.log2(exact))) if exact > 1 else 1
        batch = min(max(batch, self.min_batch_size), self.max_batch_size)
        # Smaller batches mean a lower learning rate and a higher beta2: shrink until both are legal.
        while batch > self.min_batch_size and (
            self.learning_rate(batch, tokens, width) > self.max_learning_rate or self.beta2(batch) < self.min_beta2
        ):
            batch //= 2
        return batch

    # --- candidates ---------------------------------------------------------------------

    def plan(self, budget: float) -> BudgetPlan:
        if not (budget > 0 and math.isfinite(budget)):
            raise ValueError(f"budget must be positive finite FLOPs, got {budget!r}")
        candidates: list[Candidate] = []
        rejected: list[Rejection] = []
        for width in self.widths:
            result = self._candidate(budget, width)
            if isinstance(result, Candidate):
                candidates.append(result)
            else:
                rejected.append(Rejection(width, result))
        return BudgetPlan(budget, tuple(candidates), tuple(rejected))

    def candidates(self, budget: float) -> list[Candidate]:
        return list(self.plan(budget).candidates)

    def _candidate(self, budget: float, width: int) -> Candidate | str:
        dims = self.dims(width)
        params = dims.param_count()
        forward = dims.forward_flops_per_token(self.seq_len)
        tokens_exact = budget / (TRAINING_TO_FORWARD * forward)
        tokens_per_param = tokens_exact / params
        if tokens_per_param < self.min_tokens_per_param:
            return f"{tokens_per_param:.3g} tokens/param < min {self.min_tokens_per_param:g}"
        if tokens_per_param > self.max_tokens_per_param:
            return f"{tokens_per_param:.3g} tokens/param > max {self.max_tokens_per_param:g}"
        batch = self.batch_size(tokens_exact, width)
        steps = round(tokens_exact / (batch * self.seq_len))
        if steps < self.min_steps:
            return f"{steps} steps < min {self.min_steps} (batch {batch})"
        learning_rate = self.learning_rate(batch, tokens_exact, width)
        beta2 = self.beta2(batch)
        if learning_rate > self.max_learning_rate:
            return f"learning rate {learning_rate:.3g} > max {self.max_learning_rate:g} even at batch {batch}"
        if beta2 < self.min_beta2:
            return f"beta2 {beta2:.4g} < min {self.min_beta2:g} even at batch {batch}"
        tokens = steps * batch * self.seq_len
        return Candidate(
            recipe=self.name,
            budget=budget,
            hidden_dim=dims.hidden_dim,
            intermediate_dim=dims.intermediate_dim,
            num_layers=dims.num_layers,
            num_heads=dims.num_heads,
            num_kv_heads=dims.num_kv_heads,
            vocab_size=dims.vocab_size,
            tie_word_embeddings=dims.tie_word_embeddings,
            seq_len=self.seq_len,
            batch_size=batch,
            steps=steps,
            tokens=tokens,
            params=params,
            non_embedding_params=dims.non_embedding_param_count(),
            forward_flops_per_token=forward,
            flops=TRAINING_TO_FORWARD * forward * tokens,
            learning_rate=learning_rate,
            beta1=self.beta1,
            beta2=beta2,
            epsilon=self.epsilon(batch, tokens_exact),
            weight_decay=self.weight_decay,
            warmup=max(1, round(self.warmup_fraction * steps)) if self.warmup_fraction > 0 else 0,
            max_grad_norm=self.max_grad_norm,
        )


def _micro_widths() -> tuple[int, ...]:
    return (16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class MicroRecipe(Recipe):
    """CPU-sized sweeps: budgets 1e12..1e16 FLOPs, widths 16..256, short sequences.

    ``vocab_size`` must match the tokenizer actually used (fork with ``dataclasses.replace``);
    with a small vocabulary the embeddings still dominate parameters at these widths, so they
    are tied by default.
    """

    name: str = "micro"
    vocab_size: int = 4096
    tie_word_embeddings: bool = True
    seq_len: int = 128
    widths: tuple[int, ...] = field(default_factory=_micro_widths)
    head_dim: int = 16
    mlp_multiple: int = 16
    aspect_reference_width: int = 32
    aspect_at_reference: float = 16.0
    aspect_per_doubling: float = 8.0
    min_layers: int = 2
    target_steps: int = 500
    min_batch_size: int = 4
    max_batch_size: int = 256
    min_steps: int = 20
    reference_batch_tokens: float = 16 * 128
    reference_tokens: float = 1e7
    reference_width: int = 128
    learning_rate_at_reference: float = 3e-3
    max_learning_rate: float = 3e-2
    min_tokens_per_param: float = 1.0
    max_tokens_per_param: float = 1000.0
