"""Training runs as data: typed run specs, their fingerprint, and the run registry.

A ``RunSpec`` says *what* is trained (model shape, data mixture, tokenizer, optimizer,
batch/steps/seed, evaluation sets, checkpoint cadence). Its ``resources`` say *where*
it runs and its ``compute`` *how* (recomputation, cross-entropy blocks, attention kernel);
they are runtime choices and never enter ``identity()``/``fingerprint()``, so moving a run
from CPU to a TPU pool, or letting it recompute activations to fit, does not invalidate its
artifacts.

No Dagster, JAX or Levanter import here: this module is pure and loads instantly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from marin_resources.config_identity import config_identity, identity, runtime
from marin_resources.placement import PlacementError, ResourceSpec, tpu_slice_geometry
from marin_resources.typed_config import ConfigError, FieldProblem, decode, resolve_bases, typed_config
from scaling.flops import MIXTURE_OF_EXPERTS_FAMILIES, ModelDims, ModelFamily

DEFAULT_RUNS_YAML = Path(__file__).with_name("runs.yaml")

LrSchedule = Literal["cosine", "linear", "constant"]
OptimizerType = Literal["adam", "lion"]
AttentionBackendName = Literal["default", "vanilla", "jax_flash", "splash", "nvte"]
"""Levanter's ``attn_backend`` values: its accelerator default, plain softmax(QK)V, its pure-JAX
flash attention, the Pallas splash kernel (TPU), Transformer Engine (GPU)."""


class RunSpecError(ConfigError):
    """A run spec is invalid; the message names the run and the offending field."""

    def __init__(self, run: str, field_path: str, problem: str, origin: str | None = None):
        self.run, self.field_path, self.problem = run, field_path, problem
        super().__init__(f"{f'{origin}: ' if origin else ''}run {run!r}: field {field_path!r}: {problem}")


MAX_TRAIN_STEPS = 2**31 - 1
"""Optax counts a run's updates in int32 (its schedules stop at this count), so no run takes more steps."""
EVAL = "eval"
"""The identity scope of eval/<run> (`RunSpec.eval_identity`): the run's, and what it measures."""
HEAD_DIM_FAMILIES = ("llama", "qwen", "qwen3")
"""Families whose Levanter config honours an explicit ``head_dim`` (OLMo 2's and Mixtral's derive it)."""


@typed_config
@dataclass(frozen=True)
class ModelSpec:
    """The architecture: a Levanter decoder family and its shape fields."""

    hidden_dim: int = identity()
    intermediate_dim: int = identity()
    num_layers: int = identity()
    num_heads: int = identity()
    num_kv_heads: int = identity()
    seq_len: int = identity()
    head_dim: int | None = identity(None)
    tie_word_embeddings: bool = identity(False)
    initializer_range: float = identity(0.02)
    layer_norm_epsilon: float = identity(1e-5)
    rope_theta: float = identity(10000.0)
    family: ModelFamily = identity("llama", omit="default")
    """Levanter's config class, by the name Levanter registers it under: ``llama``; ``qwen`` (Qwen 2:
    biases on the query/key/value projections); ``qwen3`` (query/key RMSNorm); ``olmo2`` (norms after
    attention and MLP, query/key RMSNorm); ``mixtral`` (a routed mixture of expert MLPs)."""
    num_experts: int | None = identity(None, omit="default")
    """``mixtral`` only (and required there): expert MLPs per layer, each ``intermediate_dim`` wide."""
    experts_per_token: int | None = identity(None, omit="default")
    """``mixtral`` only (and required there): experts the router sends each token to (its top-k)."""

    @property
    def effective_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_dim // self.num_heads

    def dims(self, vocab_size: int) -> ModelDims:
        """This shape in the scaling library's terms (its FLOPs and parameter counts)."""
        return ModelDims(hidden_dim=self.hidden_dim, intermediate_dim=self.intermediate_dim,
                         num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                         vocab_size=vocab_size, tie_word_embeddings=self.tie_word_embeddings, family=self.family,
                         num_experts=self.num_experts or 1, experts_per_token=self.experts_per_token or 1,
                         head_size=self.head_dim)

    def parameter_count(self, vocab_size: int) -> int:
        """Exact parameter count of the model Levanter builds (embeddings and norms included)."""
        return self.dims(vocab_size).param_count()


@typed_config
@dataclass(frozen=True)
class OptimizerSpec:
    """A Levanter optimizer with warmup and a decay schedule: AdamW (``AdamConfig``) or Lion
    (``LionConfig``, which has no epsilon: it updates by the sign of its momentum)."""

    learning_rate: float = identity()
    weight_decay: float = identity(0.1)
    warmup: float = identity(0.01)
    """Fraction of training steps if < 1, otherwise a number of steps."""
    schedule: LrSchedule = identity("cosine")
    min_lr_ratio: float = identity(0.1)
    beta1: float = identity(0.9)
    beta2: float = identity(0.95)
    epsilon: float = identity(1e-8)
    max_grad_norm: float | None = identity(1.0)
    type: OptimizerType = identity("adam", omit="default")
    """Levanter's optimizer, by its registered name: ``adam`` (AdamW) or ``lion``."""


@typed_config
@dataclass(frozen=True)
class ParallelismSpec:
    """How the run's devices form Levanter's device mesh. An axis left unset is filled from
    ``resources`` (see `MeshShape.resolve`); set ones must multiply to the device count."""

    data: int | None = runtime(None)
    """Replicas: each holds all parameters and takes its share of the batch (Levanter's replica axis)."""
    fsdp: int | None = runtime(None)
    """Parameters and optimizer state sharded over the embed axis, batch split too (Levanter's data axis)."""
    tensor: int = runtime(1)
    """The MLP and key/value heads split across devices (Levanter's model axis)."""


@typed_config
@dataclass(frozen=True)
class ComputeSpec:
    """How a run computes, not what: each choice changes the memory a step needs and its speed, never
    the math beyond float rounding, so like ``resources`` it stays outside the identity. ``auto``
    fields are picked per run by `marin_assets.training.memory.plan_compute`: the fastest setting
    whose estimated memory fits the devices (docs/training.md, "Memory")."""

    gradient_checkpointing: bool | Literal["auto"] = runtime("auto")
    """Recompute each layer's activations in the backward pass, keeping only its input."""
    cross_entropy_block_size: int | None | Literal["auto"] = runtime("auto")
    """Compute the loss over vocabulary blocks of this size instead of the whole [tokens, vocab] logits."""
    attention: AttentionBackendName | None = runtime(None)
    """Levanter's attention backend; None: its default for the accelerator."""
    fused_loss: bool | Literal["auto"] = runtime(False)
    """TPU only: the language-model head and its cross-entropy as one Pallas kernel
    (`marin_assets.training.fused_loss`), which keeps no logits in HBM."""


@typed_config
@dataclass(frozen=True)
class InitFrom:
    """Weights a run starts from instead of a random initialization: exactly one of ``run`` (the
    ``hf_model`` export of another run in the same runs file) or ``path`` (a Hugging Face model
    directory: a local path, a bucket URL such as ``s3://b/dir``, or ``hf://ORG/NAME[@REVISION]``)."""

    run: str | None = identity(None, omit="default")
    path: str | None = identity(None, omit="default")


@typed_config
@dataclass(frozen=True)
class MixtureStage:
    """From ``step`` on, the run draws its training sequences from its mixture's components in these
    proportions (normalised; a component not named gets none), as Levanter's varying mixture does."""

    step: int = identity()
    weights: Mapping[str, float] = identity()


@typed_config
@dataclass(frozen=True)
class Cooldown:
    """Continue run ``run`` of the same file from its checkpoint ``step-<step>`` (weights, optimizer
    state and step count) for this run's ``num_train_steps`` more steps, on this run's mixture, the learning
    rate annealed from this run's ``optimizer.learning_rate`` by its ``optimizer.schedule`` to
    ``min_lr_ratio`` of it. The base checkpoint's fingerprint is part of the identity."""

    run: str = identity()
    step: int = identity()


HF_MODEL_PATH_RE = re.compile(r"^hf://(?P<repo>[^/@]+/[^/@]+)(?:@(?P<rev>[^/]+))?/?$")
"""``hf://ORG/NAME[@REVISION]``: a model repository on the Hub (default revision: main)."""


# Levanter Llama axes split by tensor parallelism (as Levanter's own inference config does); the
# query heads follow the key/value heads they are grouped under.
TENSOR_PARALLEL_AXES = ("mlp", "kv_head")


class MeshError(ValueError):
    """Parallelism that does not fit the devices; ``field_path`` names the offending field."""

    def __init__(self, field_path: str, problem: str):
        self.field_path, self.problem = field_path, problem
        super().__init__(f"field {field_path!r}: {problem}")


@dataclass(frozen=True)
class MeshShape:
    """A resolved mesh: data x fsdp x tensor devices."""

    data: int
    fsdp: int
    tensor: int

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def batch_shards(self) -> int:
        """Devices the batch is split over (replicas times FSDP shards; tensor ranks share their rows)."""
        return self.data * self.fsdp

    @classmethod
    def resolve(cls, parallelism: ParallelismSpec, devices: int, processes: int) -> MeshShape:
        """Fill unset axes: on one process every device is a data-parallel replica; across processes
        (hosts) the parameters are FSDP-sharded over all of them. Raises `MeshError`."""
        tensor = parallelism.tensor
        if tensor < 1 or devices % tensor:
            raise MeshError("parallelism.tensor", f"{tensor} does not divide resources.device_count={devices}")
        rest = devices // tensor
        data, fsdp = parallelism.data, parallelism.fsdp
        for name, size in (("data", data), ("fsdp", fsdp)):
            if size is not None and (size < 1 or rest % size):
                raise MeshError(f"parallelism.{name}",
                                f"{size} does not divide resources.device_count={devices} / tensor={tensor}")
        if data is None and fsdp is None:
            data, fsdp = (rest, 1) if processes == 1 else (1, rest)
        elif data is None:
            data = rest // fsdp
        elif fsdp is None:
            fsdp = rest // data
        mesh = cls(data=data, fsdp=fsdp, tensor=tensor)
        if mesh.devices != devices:
            raise MeshError("parallelism", f"data {data} x fsdp {fsdp} x tensor {tensor} = {mesh.devices} devices, "
                                           f"but resources.device_count is {devices}")
        return mesh


@typed_config
@dataclass(frozen=True)
class RunSpec:
    name: str = identity()
    model: ModelSpec = identity()
    mixture: str = identity()
    """Name of the tokenized mixture artifact the run trains on."""
    tokenizer: str = identity()
    """Name of the tokenizer artifact; must be the one the mixture was tokenized with."""
    optimizer: OptimizerSpec = identity()
    train_batch_size: int = identity()
    num_train_steps: int = identity()
    seed: int = identity(0)
    eval_sets: tuple[str, ...] = identity(())
    """Mixture components whose validation split is evaluated; empty means all of them."""
    steps_per_eval: int = identity(1000)
    max_eval_batches: int | None = identity(None)
    checkpoint_every: int = identity(1000)
    """Permanent checkpoint cadence in steps (a final checkpoint is always written)."""
    final_eval_examples: int | None = identity(None, scopes=[EVAL])
    """eval/<run> scores this many validation sequences per set, evenly spaced over the set (the same
    ones for every run of that set), instead of every sequence. Not part of the checkpoint's identity:
    it changes what is measured, not the weights (`eval_identity`)."""
    watch_every: int = runtime(10)
    """Steps between Levanter's gradient and parameter norm logs; 0 turns them off, which also saves
    compiling a second variant of the train step. Observability only, so not part of the identity."""
    resources: ResourceSpec = runtime(default_factory=ResourceSpec)
    parallelism: ParallelismSpec = runtime(default_factory=ParallelismSpec)
    """The device mesh. Like ``resources``, outside the identity: the global batch is
    ``train_batch_size`` however it is split, so the mesh changes no result beyond float rounding."""
    compute: ComputeSpec = runtime(default_factory=ComputeSpec)
    """How the step computes (recomputation, loss blocks, attention kernel). Outside the identity."""
    mixture_weights: Mapping[str, float] | None = identity(None, omit="empty")
    """The run's own weights over its mixture's components, in place of the mixture's (a component not
    named gets none): how a mixture-weight sweep's runs differ. None: the mixture's."""
    mixture_schedule: tuple[MixtureStage, ...] = identity((), omit="empty")
    """Changes of the mixture's weights during training, by step: the run starts on the mixture's own
    weights and switches at each stage's step (empty: the mixture's weights throughout)."""
    cooldown: Cooldown | None = identity(None, omit="empty")
    """Continue another run's checkpoint from a step and anneal (see `Cooldown`); ``num_train_steps``
    counts the cooldown's own steps."""
    init_from: InitFrom | None = identity(None, omit="empty")
    """Start from these weights (continued pretraining) instead of a random initialization. Their
    content hash, resolved when the run is built, is part of the identity (see `identity`)."""

    @property
    def mesh(self) -> MeshShape:
        """The resolved mesh over ``resources``' devices (validated by `validate_run`)."""
        return MeshShape.resolve(self.parallelism, self.resources.device_count, self.resources.process_count)

    @property
    def seq_len(self) -> int:
        return self.model.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.train_batch_size * self.model.seq_len

    @property
    def first_step(self) -> int:
        """Updates done before training starts: a cooldown's base checkpoint ``step-S`` holds S + 1
        (Levanter names a checkpoint by the index of its last step, counted from 0), else none."""
        return self.cooldown.step + 1 if self.cooldown is not None else 0

    def identity(self, init_weights: str | None = None, cooldown_base: str | None = None) -> dict[str, Any]:
        """Everything that determines the trained weights: the fields declared ``identity()`` (the
        others, ``resources``, ``parallelism``, ``compute`` and ``watch_every``, are runtime;
        ``final_eval_examples`` is in `eval_identity` only). Fields added since runs were first
        fingerprinted are declared to be left out while they hold their defaults (or are empty), so
        runs keep the identity they had before those fields existed: a Llama trained with Adam before
        families and optimizers, a run from scratch before ``init_from``, one on fixed weights before
        ``mixture_weights`` and ``mixture_schedule``. ``init_from`` is set with ``init_weights``, the
        content hash of the weights it resolved to (`marin_assets.training.init_weights`), as
        ``init_from.sha256``: other weights under the same name are another run. A cooldown's
        ``cooldown_base`` is the fingerprint of the base checkpoint it continues, as
        ``cooldown.checkpoint``."""
        data = config_identity(self)
        if self.cooldown is not None and cooldown_base is not None:
            data["cooldown"]["checkpoint"] = cooldown_base
        if self.init_from is not None and init_weights is not None:
            data["init_from"]["sha256"] = init_weights
        return data

    def eval_identity(self) -> dict[str, Any]:
        """What defines eval/<run>: the run, and the evaluated sample when it is not the whole split
        (absent then, so evaluations of the whole split keep their fingerprint)."""
        data: dict[str, Any] = {"run": self.identity()}
        if self.final_eval_examples is not None:
            data["examples"] = self.final_eval_examples
        return data

    def fingerprint(self, init_weights: str | None = None, cooldown_base: str | None = None) -> str:
        """sha256 of the canonical JSON of ``identity(init_weights, cooldown_base)``."""
        canonical = json.dumps(self.identity(init_weights, cooldown_base), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    @classmethod
    def from_dict(cls, name: str, raw: Mapping[str, Any]) -> RunSpec:
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


def validate_run(spec: RunSpec) -> None:
    """Semantic checks beyond types; raises RunSpecError naming the run and field."""
    run = spec.name

    def require(condition: bool, path: str, problem: str) -> None:
        if not condition:
            raise RunSpecError(run, path, problem)

    require(bool(spec.name) and spec.name.strip() == spec.name, "name",
            "must be a non-empty name without spaces around it")
    m = spec.model
    for fname in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "seq_len"):
        require(getattr(m, fname) > 0, f"model.{fname}", f"must be positive, got {getattr(m, fname)}")
    if m.head_dim is None:
        require(m.hidden_dim % m.num_heads == 0, "model.hidden_dim",
                f"{m.hidden_dim} is not divisible by num_heads={m.num_heads}")
    else:
        require(m.head_dim > 0, "model.head_dim", f"must be positive, got {m.head_dim}")
    require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
            f"num_heads={m.num_heads} is not divisible by {m.num_kv_heads}")
    require(m.effective_head_dim % 2 == 0, "model.head_dim",
            f"rotary embeddings need an even head dim, got {m.effective_head_dim}")
    if m.family in MIXTURE_OF_EXPERTS_FAMILIES:
        require(m.num_experts is not None, "model.num_experts", f"required for family {m.family!r}")
        require(m.num_experts >= 2, "model.num_experts", f"a mixture needs at least 2 experts, got {m.num_experts}")
        require(m.experts_per_token is not None, "model.experts_per_token", f"required for family {m.family!r}")
        require(1 <= m.experts_per_token <= m.num_experts, "model.experts_per_token",
                f"must be in [1, num_experts={m.num_experts}], got {m.experts_per_token}")
    else:
        for fname in ("num_experts", "experts_per_token"):
            require(getattr(m, fname) is None, f"model.{fname}",
                    f"only for family {' or '.join(map(repr, MIXTURE_OF_EXPERTS_FAMILIES))}, not {m.family!r}")
    require(m.head_dim is None or m.family in HEAD_DIM_FAMILIES, "model.head_dim",
            f"family {m.family!r} takes its head size from hidden_dim / num_heads; leave head_dim unset")
    o = spec.optimizer
    require(o.learning_rate > 0, "optimizer.learning_rate", f"must be positive, got {o.learning_rate}")
    require(o.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")
    require(o.warmup >= 0, "optimizer.warmup", f"must be >= 0, got {o.warmup}")
    require(o.warmup < 1 or o.warmup <= spec.num_train_steps, "optimizer.warmup",
            f"{o.warmup} steps exceeds num_train_steps={spec.num_train_steps}")
    require(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    require(0 <= o.beta1 < 1, "optimizer.beta1", f"must be in [0, 1), got {o.beta1}")
    require(0 <= o.beta2 < 1, "optimizer.beta2", f"must be in [0, 1), got {o.beta2}")
    require(o.epsilon > 0, "optimizer.epsilon", f"must be positive, got {o.epsilon}")
    require(o.max_grad_norm is None or o.max_grad_norm > 0, "optimizer.max_grad_norm", "must be positive or null")
    require(bool(spec.mixture), "mixture", "must name a tokenized mixture")
    require(bool(spec.tokenizer), "tokenizer", "must name a tokenizer")
    require(spec.train_batch_size > 0, "train_batch_size", f"must be positive, got {spec.train_batch_size}")
    require(spec.num_train_steps > 0, "num_train_steps", f"must be positive, got {spec.num_train_steps}")
    require(spec.num_train_steps <= MAX_TRAIN_STEPS, "num_train_steps",
            f"must be at most {MAX_TRAIN_STEPS} (optax counts updates in int32), got {spec.num_train_steps}")
    require(spec.steps_per_eval > 0, "steps_per_eval", f"must be positive, got {spec.steps_per_eval}")
    require(spec.max_eval_batches is None or spec.max_eval_batches > 0, "max_eval_batches", "must be positive or null")
    require(spec.checkpoint_every > 0, "checkpoint_every", f"must be positive, got {spec.checkpoint_every}")
    require(spec.final_eval_examples is None or spec.final_eval_examples > 0, "final_eval_examples",
            "must be positive or null")
    require(spec.watch_every >= 0, "watch_every", f"must be >= 0 (0 turns the norm logs off), got {spec.watch_every}")
    require(len(set(spec.eval_sets)) == len(spec.eval_sets), "eval_sets", "contains duplicates")
    previous = 0
    for i, stage in enumerate(spec.mixture_schedule):
        require(previous < stage.step < spec.num_train_steps, f"mixture_schedule[{i}].step",
                f"must lie after the previous stage's step ({previous}) and before num_train_steps="
                f"{spec.num_train_steps}, got {stage.step}")
        previous = stage.step
    for at, weights in declared_weights(spec):
        require(all(w >= 0 for w in weights.values()), at, "must all be >= 0")
        require(any(w > 0 for w in weights.values()), at, "must give some component a weight > 0")
    r = spec.resources
    require(r.device_count > 0, "resources.device_count", f"must be positive, got {r.device_count}")
    require((r.accelerator == "tpu") == (r.tpu_type is not None), "resources.tpu_type",
            "must be set exactly when accelerator is 'tpu'")
    require(r.processes is None or r.processes > 0, "resources.processes", f"must be positive, got {r.processes}")
    try:
        hosts = tpu_slice_geometry(r.tpu_type)[2] if r.tpu_type else None
    except PlacementError as exc:
        raise RunSpecError(run, "resources.tpu_type", str(exc)) from None
    require(r.processes is None or hosts is None or r.processes == hosts, "resources.processes",
            f"{r.tpu_type} has {hosts} hosts, one process each, not {r.processes}")
    processes = r.process_count
    require(r.device_count % processes == 0, "resources.device_count",
            f"{r.device_count} devices cannot be spread evenly over {processes} processes")
    try:
        mesh = spec.mesh
    except MeshError as exc:
        raise RunSpecError(run, exc.field_path, exc.problem) from None
    require(spec.train_batch_size % mesh.batch_shards == 0, "train_batch_size",
            f"{spec.train_batch_size} is not divisible by data {mesh.data} x fsdp {mesh.fsdp} = {mesh.batch_shards} "
            "batch shards")
    local_devices = r.device_count // processes
    require(local_devices % mesh.tensor == 0 or mesh.tensor % local_devices == 0, "parallelism.tensor",
            f"{mesh.tensor} and the {local_devices} devices of each of {processes} processes must divide one another")
    require(m.hidden_dim % mesh.fsdp == 0, "parallelism.fsdp",
            f"{mesh.fsdp} does not divide model.hidden_dim={m.hidden_dim} (FSDP shards the embed axis)")
    require(m.intermediate_dim % mesh.tensor == 0, "parallelism.tensor",
            f"{mesh.tensor} does not divide model.intermediate_dim={m.intermediate_dim}")
    require(m.num_kv_heads % mesh.tensor == 0, "parallelism.tensor",
            f"{mesh.tensor} does not divide model.num_kv_heads={m.num_kv_heads}")
    c = spec.compute
    block = c.cross_entropy_block_size
    require(not isinstance(block, int) or block > 0, "compute.cross_entropy_block_size",
            f"must be positive, null or 'auto', got {block}")
    require(c.fused_loss is not True or r.accelerator == "tpu", "compute.fused_loss",
            f"the fused loss is a TPU kernel; this run's accelerator is {r.accelerator!r}")
    for backend, accelerator in (("splash", "tpu"), ("nvte", "gpu")):
        require(c.attention != backend or r.accelerator == accelerator, "compute.attention",
                f"{backend!r} attention runs on a {accelerator.upper()}, not on {r.accelerator!r}")
    if spec.cooldown is not None:
        require(spec.init_from is None, "init_from",
                "a cooldown starts from its base run's checkpoint; give cooldown or init_from, not both")
        require(spec.cooldown.step > 0, "cooldown.step", f"must be positive, got {spec.cooldown.step}")
        require(spec.cooldown.run != spec.name, "cooldown.run", "a run cannot cool down from itself")
        # Levanter reads a decay of 1 as a fraction: the whole run.
        require(spec.num_train_steps >= 2, "num_train_steps", "a cooldown anneals over at least 2 steps")
        require(spec.optimizer.warmup == 0, "optimizer.warmup",
                f"a cooldown continues at its base's step without warmup: set it to 0, not {spec.optimizer.warmup}")
        require(not spec.mixture_schedule, "mixture_schedule",
                "a cooldown trains on its own mixture's weights; schedule the base run instead")
    init = spec.init_from
    if init is not None:
        require((init.run is None) != (init.path is None), "init_from", "give exactly one of run or path")
        require(init.run != spec.name, "init_from.run", "a run cannot start from its own export")
        require(init.path is None or "://" in init.path or os.path.isabs(init.path), "init_from.path",
                f"a local directory must be an absolute path, got {init.path!r}")
        require(init.path is None or not init.path.startswith("hf://") or bool(HF_MODEL_PATH_RE.match(init.path)),
                "init_from.path", f"expected hf://ORG/NAME[@REVISION] for a Hub model, got {init.path!r}")


def declared_weights(spec: RunSpec) -> list[tuple[str, Mapping[str, float]]]:
    """(field path, weights) of each set of mixture weights the run declares itself."""
    own = [("mixture_weights", spec.mixture_weights)] if spec.mixture_weights is not None else []
    return own + [(f"mixture_schedule[{i}].weights", stage.weights) for i, stage in enumerate(spec.mixture_schedule)]


def validate_mixture_components(spec: RunSpec, components: Mapping[str, float]) -> None:
    """The weights the run declares (``mixture_weights``, each schedule stage's) weigh components of
    its mixture (``components``: their declared weights); RunSpecError otherwise."""
    for at, weights in declared_weights(spec):
        unknown = sorted(set(weights) - set(components))
        if unknown:
            raise RunSpecError(spec.name, at, f"{unknown} are not components of mixture {spec.mixture!r} "
                                              f"(components: {', '.join(sorted(components))})")


def weights_source(spec: RunSpec) -> tuple[str, str] | None:
    """(field, run) of the run of the same file whose weights ``spec`` starts from: the export
    ``init_from.run`` names, or the checkpoint ``cooldown.run`` names; None for neither."""
    if spec.cooldown is not None:
        return "cooldown.run", spec.cooldown.run
    if spec.init_from is not None and spec.init_from.run is not None:
        return "init_from.run", spec.init_from.run
    return None


def validate_init_sources(runs: Mapping[str, RunSpec]) -> None:
    """A run that starts from another run's export or checkpoint names a run of the same file, with
    the same model architecture (the sequence length may differ) and tokenizer, and no chain of them
    loops. A cooldown also starts at a step its base keeps a checkpoint of, with the same optimizer."""
    for name, spec in runs.items():
        source = weights_source(spec)
        if source is None:
            continue
        field_path, base = source
        if base not in runs:
            raise RunSpecError(name, field_path, f"no run named {base!r} in this file; known: {sorted(runs)}")
        theirs = runs[base]
        whose = f"of run {base!r}, whose {'checkpoint' if spec.cooldown else 'export'} it starts from"
        for fname in (f.name for f in dataclasses.fields(ModelSpec) if f.name != "seq_len"):
            if getattr(theirs.model, fname) != getattr(spec.model, fname):
                raise RunSpecError(name, f"model.{fname}", f"{getattr(spec.model, fname)} differs from "
                                                           f"{getattr(theirs.model, fname)} {whose}")
        if theirs.tokenizer != spec.tokenizer:
            raise RunSpecError(name, "tokenizer", f"{spec.tokenizer!r} differs from {theirs.tokenizer!r} {whose}")
        if spec.cooldown is not None:
            validate_cooldown_start(spec, theirs)
        chain = [name]
        while source is not None:
            if source[1] in chain:
                raise RunSpecError(name, field_path, f"runs start from each other in a loop: "
                                                     f"{' -> '.join([*chain, source[1]])}")
            chain.append(source[1])
            source = weights_source(runs[source[1]])


def validate_cooldown_start(spec: RunSpec, base: RunSpec) -> None:
    """``spec`` cools down from a checkpoint ``base`` keeps, ``step-S`` (Levanter names it by the index
    of its last step: every ``checkpoint_every``-th index and the last, ``num_train_steps - 1``), whose
    optimizer state is of the same optimizer."""
    step, last = spec.cooldown.step, base.num_train_steps - 1
    if not (step == last or (step < last and step % base.checkpoint_every == 0)):
        raise RunSpecError(spec.name, "cooldown.step",
                           f"run {base.name!r} keeps checkpoints step-S every {base.checkpoint_every} steps and its "
                           f"last, step-{last}; not step-{step}")
    if spec.optimizer.type != base.optimizer.type:
        raise RunSpecError(spec.name, "optimizer.type", f"{spec.optimizer.type!r} differs from "
                                                        f"{base.optimizer.type!r} of run {base.name!r}, whose "
                                                        "optimizer state it continues")


# --- registry -----------------------------------------------------------------------------------


def load_run_registry(path: str | Path = DEFAULT_RUNS_YAML) -> dict[str, RunSpec]:
    """Parse a runs YAML file (``runs: {name: {...}}``) into validated specs keyed by name."""
    try:
        with open(path) as f:
            document = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the run registry: {exc}") from None
    if not isinstance(document, Mapping) or not isinstance(document.get("runs"), Mapping):
        raise ConfigError(f"{path}: expected a top-level 'runs:' mapping of run name to spec")
    return extend_run_registry({}, document["runs"], str(path))


def extend_run_registry(runs: Mapping[str, RunSpec], raw: Mapping[str, Any], origin: str) -> dict[str, RunSpec]:
    """``runs`` with the specs of ``raw`` (``{name: {...}}``) added, each replacing the run of its name;
    a run may start from any run of the result, and be declared as a difference from (``base:``) a run
    of ``raw`` or ``runs`` (`resolve_bases`). Errors name ``origin``."""
    try:
        bodies = resolve_bases({str(name): body for name, body in raw.items()}, runs, RunSpecError)
        merged = {**runs, **{name: RunSpec.from_dict(name, body) for name, body in bodies.items()}}
        validate_init_sources(merged)
        return merged
    except RunSpecError as exc:
        raise RunSpecError(exc.run, exc.field_path, exc.problem, origin=origin) from None
