"""Training runs as data: typed run specs, their fingerprint, and the run registry.

A ``RunSpec`` says *what* is trained (model shape, data mixture, tokenizer, optimizer,
batch/steps/seed, evaluation sets, checkpoint cadence). Its ``resources`` say *where*
it runs; they are runtime choices and never enter ``identity()``/``fingerprint()``, so
moving a run from CPU to a TPU pool does not invalidate its artifacts.

No Dagster, JAX or Levanter import here: this module is pure and loads instantly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from marin_resources.placement import ResourceSpec
from marin_resources.typed_config import FieldProblem, decode, typed_config

DEFAULT_RUNS_YAML = Path(__file__).with_name("runs.yaml")

LrSchedule = Literal["cosine", "linear", "constant"]


class RunSpecError(ValueError):
    """A run spec is invalid; the message names the run and the offending field."""

    def __init__(self, run: str, field_path: str, problem: str):
        self.run = run
        self.field_path = field_path
        super().__init__(f"run {run!r}: field {field_path!r}: {problem}")


@typed_config
@dataclass(frozen=True)
class ModelSpec:
    """Levanter ``LlamaConfig`` shape fields (the subset that defines the architecture)."""

    hidden_dim: int
    intermediate_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    seq_len: int
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    layer_norm_epsilon: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def effective_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_dim // self.num_heads

    def parameter_count(self, vocab_size: int) -> int:
        """Exact parameter count of Levanter's Llama for this shape (embeddings and norms included)."""
        d, hd = self.hidden_dim, self.effective_head_dim
        attention = d * hd * self.num_heads * 2 + d * hd * self.num_kv_heads * 2  # q, o and k, v
        mlp = 3 * d * self.intermediate_dim  # gate, up, down
        norms = 2 * d
        embeddings = vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attention + mlp + norms) + d + embeddings


@typed_config
@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW with warmup and a decay schedule (Levanter ``AdamConfig``)."""

    learning_rate: float
    weight_decay: float = 0.1
    warmup: float = 0.01
    """Fraction of training steps if < 1, otherwise a number of steps."""
    schedule: LrSchedule = "cosine"
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0


@typed_config
@dataclass(frozen=True)
class RunSpec:
    name: str
    model: ModelSpec
    mixture: str
    """Name of the tokenized mixture artifact the run trains on."""
    tokenizer: str
    """Name of the tokenizer artifact; must be the one the mixture was tokenized with."""
    optimizer: OptimizerSpec
    train_batch_size: int
    num_train_steps: int
    seed: int = 0
    eval_sets: tuple[str, ...] = ()
    """Mixture components whose validation split is evaluated; empty means all of them."""
    steps_per_eval: int = 1000
    max_eval_batches: int | None = None
    checkpoint_every: int = 1000
    """Permanent checkpoint cadence in steps (a final checkpoint is always written)."""
    final_eval_examples: int | None = None
    """eval/<run> scores this many validation sequences per set, evenly spaced over the set (the same
    ones for every run of that set), instead of every sequence. Not part of the checkpoint's identity:
    it changes what is measured, not the weights (`eval_identity`)."""
    watch_every: int = 10
    """Steps between Levanter's gradient and parameter norm logs; 0 turns them off, which also saves
    compiling a second variant of the train step. Observability only, so not part of the identity."""
    resources: ResourceSpec = field(default_factory=ResourceSpec)

    @property
    def seq_len(self) -> int:
        return self.model.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.train_batch_size * self.model.seq_len

    def identity(self) -> dict[str, Any]:
        """Everything that determines the trained weights: all fields except ``resources``,
        ``final_eval_examples`` and ``watch_every``."""
        data = dataclasses.asdict(self)
        del data["resources"], data["final_eval_examples"], data["watch_every"]
        return _jsonable(data)

    def eval_identity(self) -> dict[str, Any]:
        """What defines eval/<run>: the run, and the evaluated sample when it is not the whole split
        (absent then, so evaluations of the whole split keep their fingerprint)."""
        data: dict[str, Any] = {"run": self.identity()}
        if self.final_eval_examples is not None:
            data["examples"] = self.final_eval_examples
        return data

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of ``identity()``."""
        canonical = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    @classmethod
    def from_dict(cls, name: str, raw: Mapping[str, Any]) -> "RunSpec":
        """Build and validate a spec from plain data (e.g. one YAML entry); ``name`` is the registry key."""
        if not isinstance(raw, Mapping):
            raise RunSpecError(name, "<run>", f"expected a mapping, got {type(raw).__name__}")
        if "name" in raw and raw["name"] != name:
            raise RunSpecError(name, "name", f"{raw['name']!r} differs from the registry key")
        try:
            spec = decode(cls, {**raw, "name": name})
        except FieldProblem as exc:
            raise RunSpecError(name, exc.dotted or "<run>", exc.problem) from None
        validate_run(spec)
        return spec


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def validate_run(spec: RunSpec) -> None:
    """Semantic checks beyond types; raises RunSpecError naming the run and field."""
    run = spec.name

    def require(condition: bool, path: str, problem: str) -> None:
        if not condition:
            raise RunSpecError(run, path, problem)

    require(bool(spec.name) and spec.name.strip() == spec.name, "name", "must be a non-empty name without spaces around it")
    m = spec.model
    for fname in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "seq_len"):
        require(getattr(m, fname) > 0, f"model.{fname}", f"must be positive, got {getattr(m, fname)}")
    if m.head_dim is None:
        require(m.hidden_dim % m.num_heads == 0, "model.hidden_dim", f"{m.hidden_dim} is not divisible by num_heads={m.num_heads}")
    else:
        require(m.head_dim > 0, "model.head_dim", f"must be positive, got {m.head_dim}")
    require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads", f"num_heads={m.num_heads} is not divisible by {m.num_kv_heads}")
    require(m.effective_head_dim % 2 == 0, "model.head_dim", f"rotary embeddings need an even head dim, got {m.effective_head_dim}")
    o = spec.optimizer
    require(o.learning_rate > 0, "optimizer.learning_rate", f"must be positive, got {o.learning_rate}")
    require(o.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")
    require(o.warmup >= 0, "optimizer.warmup", f"must be >= 0, got {o.warmup}")
    require(o.warmup < 1 or o.warmup <= spec.num_train_steps, "optimizer.warmup", f"{o.warmup} steps exceeds num_train_steps={spec.num_train_steps}")
    require(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    require(0 <= o.beta1 < 1, "optimizer.beta1", f"must be in [0, 1), got {o.beta1}")
    require(0 <= o.beta2 < 1, "optimizer.beta2", f"must be in [0, 1), got {o.beta2}")
    require(o.epsilon > 0, "optimizer.epsilon", f"must be positive, got {o.epsilon}")
    require(o.max_grad_norm is None or o.max_grad_norm > 0, "optimizer.max_grad_norm", "must be positive or null")
    require(bool(spec.mixture), "mixture", "must name a tokenized mixture")
    require(bool(spec.tokenizer), "tokenizer", "must name a tokenizer")
    require(spec.train_batch_size > 0, "train_batch_size", f"must be positive, got {spec.train_batch_size}")
    require(spec.num_train_steps > 0, "num_train_steps", f"must be positive, got {spec.num_train_steps}")
    require(spec.steps_per_eval > 0, "steps_per_eval", f"must be positive, got {spec.steps_per_eval}")
    require(spec.max_eval_batches is None or spec.max_eval_batches > 0, "max_eval_batches", "must be positive or null")
    require(spec.checkpoint_every > 0, "checkpoint_every", f"must be positive, got {spec.checkpoint_every}")
    require(spec.final_eval_examples is None or spec.final_eval_examples > 0, "final_eval_examples",
            "must be positive or null")
    require(spec.watch_every >= 0, "watch_every", f"must be >= 0 (0 turns the norm logs off), got {spec.watch_every}")
    require(len(set(spec.eval_sets)) == len(spec.eval_sets), "eval_sets", "contains duplicates")
    r = spec.resources
    require(r.device_count > 0, "resources.device_count", f"must be positive, got {r.device_count}")
    require(
        spec.train_batch_size % r.device_count == 0,
        "train_batch_size",
        f"{spec.train_batch_size} is not divisible by resources.device_count={r.device_count}",
    )
    require((r.accelerator == "tpu") == (r.tpu_type is not None), "resources.tpu_type", "must be set exactly when accelerator is 'tpu'")


# --- registry -----------------------------------------------------------------------------------


def load_run_registry(path: str | Path = DEFAULT_RUNS_YAML) -> dict[str, RunSpec]:
    """Parse a runs YAML file (``runs: {name: {...}}``) into validated specs keyed by name."""
    with open(path) as f:
        document = yaml.safe_load(f)
    if not isinstance(document, Mapping) or not isinstance(document.get("runs"), Mapping):
        raise ValueError(f"{path}: expected a top-level 'runs:' mapping of run name to spec")
    return {str(name): RunSpec.from_dict(str(name), raw) for name, raw in document["runs"].items()}
