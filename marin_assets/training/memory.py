"""Memory of one Levanter training step on one device, known before any process opens it, and the
compute setting a run gets from it.

`estimate_memory` adds up what one device holds at the step's peak for a run and a `ComputeSettings`:
the f32 weights and optimizer state (FSDP-sharded over the mesh's fsdp axis, replicated over data),
the compute-dtype copy of the weights, the activations saved for the backward pass (every layer's
intermediates, or only each layer's input with gradient checkpointing), the working set of the layer
being differentiated, the gradients, and the logits (whole, in vocabulary blocks, or none with the
fused loss). A step has three candidate peaks: at the logits (forward done, every activation saved),
inside the backward of the last layer, and at the optimizer update; the estimate is the largest.

`plan_compute` picks, for a run's ``compute: auto`` fields, the fastest setting whose estimate fits
the device with a margin, in the order nothing recomputed and no blocks; cross-entropy blocks (or
the fused loss on a TPU); checkpointing; both. Or it refuses in one line naming the estimate and the
device's memory. A CPU run keeps what CPU runs always did (no checkpointing, cross-entropy blocks of
`CPU_CROSS_ENTROPY_BLOCK`); a device of unknown memory keeps the accelerator default and is not checked.

Pure: no JAX or Levanter import. The terms follow Levanter's code (levanter/models/llama.py,
levanter/models/loss.py, levanter/layers/attention.py, haliax/_src/scan.py: what JAX saves for the
backward pass) and are compared with XLA's compiled memory analysis by benchmarks/memory_fit.py
(docs/training.md, "Memory").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from marin_assets.training.spec import AttentionBackendName, RunSpec, RunSpecError
from marin_resources.placement import device_memory

CPU_CROSS_ENTROPY_BLOCK = 256
"""Cross-entropy vocabulary block on CPU: the whole [tokens, vocab] logits do not fit the cache, and the
CPU's memory bandwidth then sets the step time (benchmarks/cpu_step.py, docs/training.md)."""
ACCELERATOR_CROSS_ENTROPY_BLOCK = 4096
"""Vocabulary block an accelerator run gets when the whole logits do not fit: a multiple of the TPU's
128 lanes, wide enough that each block's product keeps the chip busy."""
MEMORY_MARGIN = 0.10
"""Share of a device's memory the plan leaves free: the estimate's error, XLA's fragmentation and
what the runtime reserves (a v5e chip lets XLA use 15.75 of its 16 GiB)."""
FLASH_BLOCK = 1024
"""Levanter's pure-JAX flash attention block (levanter.models.flash_attention.BLOCK_SIZE)."""
STATS_LANES = 128
"""The fused loss keeps its per-token statistics as [tokens, 128] f32 rows (a TPU vector register)."""
GIB = 2**30

Phase = Literal["logits", "layers", "update"]
AttentionMemory = Literal["scores", "blocks", "kernel"]
"""How attention holds its softmax: every [seq, seq] score matrix (plain attention), one block of
them at a time (Levanter's pure-JAX flash attention), or only per-row statistics (splash, TE)."""


@dataclass(frozen=True)
class ComputeSettings:
    """A run's resolved `ComputeSpec`: what the Levanter config gets and the checkpoint records."""

    gradient_checkpointing: bool
    cross_entropy_block_size: int | None
    fused_loss: bool = False
    attention: AttentionBackendName | None = None

    def describe(self) -> str:
        loss = ("the fused loss" if self.fused_loss else
                f"cross-entropy blocks of {self.cross_entropy_block_size:,}" if self.cross_entropy_block_size else
                "whole logits")
        attention = f", {self.attention} attention" if self.attention else ""
        return f"{'checkpointing' if self.gradient_checkpointing else 'no checkpointing'}, {loss}{attention}"

    def as_dict(self) -> dict[str, bool | int | str | None]:
        return asdict(self)


@dataclass(frozen=True)
class MemoryBreakdown:
    """What one device holds at the step's estimated peak, in bytes; terms not live there are 0."""

    phase: Phase
    """Where the peak is: at the logits, in the backward of the last layer, or at the optimizer update."""
    parameters: int
    """f32 master weights."""
    optimizer: int
    """Adam's two moments or Lion's one, f32."""
    gradients: int
    compute_weights: int
    """The weights cast to the compute dtype (bf16 on accelerators; none in f32 on CPU)."""
    activations: int
    """Saved for the backward pass: every layer's intermediates, or only each layer's input with
    gradient checkpointing; plus the embeddings' and final norm's."""
    layer: int
    """The layer being differentiated: its recomputed intermediates (with checkpointing) and their gradients."""
    logits: int
    """The loss's [tokens, vocab] logits and their gradient, one vocabulary block of them, or the fused
    loss's per-token statistics."""
    update: int = 0
    """The optimizer's update, computed whole before it is applied: one f32 array of the weights' size."""

    TERMS = ("parameters", "optimizer", "gradients", "compute_weights", "activations", "layer", "logits", "update")

    @property
    def total(self) -> int:
        return sum(self.terms().values())

    def terms(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.TERMS}

    def largest(self, count: int = 3) -> list[tuple[str, int]]:
        return sorted(((n, b) for n, b in self.terms().items() if b), key=lambda term: -term[1])[:count]

    def describe(self, count: int = len(TERMS)) -> str:
        """One line: ``12.3 GiB at the logits (logits 8.0, activations 2.1, ...)``, largest terms first."""
        terms = ", ".join(f"{name.replace('_', ' ')} {gib(size)}" for name, size in self.largest(count))
        return f"{gib(self.total)} GiB at the {self.phase} ({terms})"


def gib(size: int) -> str:
    return f"{size / GIB:,.2f}"


def compute_dtype_bytes(spec: RunSpec) -> int:
    """bf16 on accelerators, f32 on CPU: the mixed precision `levanter_config.build_train_config` renders."""
    return 4 if spec.resources.accelerator == "cpu" else 2


def attention_memory(spec: RunSpec, attention: AttentionBackendName | None) -> AttentionMemory:
    """How Levanter's attention (levanter.layers.attention.dot_product_attention) holds the softmax for
    ``attention`` on this run's accelerator: its default is splash on a TPU (sequences a multiple of
    128), Transformer Engine on a GPU and its pure-JAX flash attention elsewhere, which falls back to
    plain attention for sequences shorter than its block."""
    seq, accelerator = spec.model.seq_len, spec.resources.accelerator
    if attention in (None, "default"):
        attention = {"tpu": "splash" if seq % 128 == 0 else "jax_flash", "gpu": "nvte"}.get(accelerator, "jax_flash")
    if attention in ("splash", "nvte"):
        return "kernel"
    if attention == "jax_flash" and seq >= FLASH_BLOCK and seq % FLASH_BLOCK == 0:
        return "blocks"
    return "scores"


def estimate_memory(spec: RunSpec, vocab_size: int, settings: ComputeSettings) -> MemoryBreakdown:
    """Bytes one device holds at the peak of one training step of ``spec`` computed with ``settings``."""
    m, mesh, c = spec.model, spec.mesh, compute_dtype_bytes(spec)
    dims = m.dims(vocab_size)
    hidden, layers, tensor = m.hidden_dim, m.num_layers, mesh.tensor
    # Per device: FSDP shards every weight's embed axis; tensor parallelism splits the MLP and the heads.
    embedding_params = dims.param_count() - dims.non_embedding_param_count()
    layer_params = dims.non_embedding_param_count() - hidden
    params = (embedding_params + layer_params / tensor) / mesh.fsdp + hidden
    head_params = vocab_size * hidden / mesh.fsdp
    tokens = spec.train_batch_size * m.seq_len / mesh.batch_shards
    heads = m.num_heads / tensor
    q_width, kv_width = heads * m.effective_head_dim, m.num_kv_heads * m.effective_head_dim / tensor
    mlp = m.intermediate_dim * (m.experts_per_token or 1) / tensor
    seq = m.seq_len
    softmax = attention_memory(spec, settings.attention)

    # What JAX saves of one layer for the backward pass, per token (jax.ad_checkpoint.saved_residuals of
    # Levanter's LlamaDecoderLayer): the MLP's gate, up, activation and product (six [mlp] arrays); six
    # [hidden] arrays in f32 inside the two RMS norms and six in the compute dtype (norm outputs,
    # residual sums); queries, keys, values and the attention output; the norms' statistics.
    layer_saved = c * (6 * mlp + 6 * hidden + 2 * q_width + 2 * kv_width) + 4 * (6 * hidden + 2)
    # Plain attention keeps each head's scores and probabilities ([seq, seq] per query) and their row
    # statistics; a flash kernel keeps its own copies of the queries, keys, values and output (in its
    # [batch, heads, seq, head] layout) and a log-sum-exp per head.
    layer_saved += c * 2 * heads * (seq + 1) if softmax == "scores" else c * (2 * q_width + 2 * kv_width) + 4 * heads
    # Outside the layers: the embeddings' and final norm's arrays (used up before the layers' backward);
    # without checkpointing also the rotary tables and, for plain attention, the causal mask Levanter
    # broadcasts to [batch, heads, seq, seq], which every layer's backward reads.
    final = 3 * hidden * (4 + c)
    mask = heads * seq * (1 + c) if softmax == "scores" else 0
    shared = 0 if settings.gradient_checkpointing else 2 * c * (q_width + kv_width) + mask
    saved = layers * (c * hidden if settings.gradient_checkpointing else layer_saved) + shared

    # The layer being differentiated: its gradients, at the larger of the MLP's (four [mlp] arrays) and
    # attention's (the scores' and probabilities' gradients in f32), and four f32 [hidden] arrays. With
    # checkpointing also what its recomputed forward holds for the rest of its backward: the MLP's gate
    # and up projections, the queries, keys, values and output, plain attention's scores and mask.
    softmax_width = {"scores": seq, "blocks": FLASH_BLOCK, "kernel": 0}[softmax]
    working = max(4 * c * mlp, 2 * 4 * heads * softmax_width) + 4 * 4 * hidden
    if settings.gradient_checkpointing:
        working += c * (2 * mlp + 2 * q_width + 2 * kv_width) + (c * 2 * heads * seq + mask if mask else 0)

    if settings.fused_loss:  # per-token statistics and the softmax-weighted head rows, f32
        logits = 3 * 4 * STATS_LANES + 2 * 4 * hidden
    elif settings.cross_entropy_block_size and settings.cross_entropy_block_size < vocab_size:
        # One block's logits in f32 and their gradient in the compute dtype; the hidden states' gradient.
        logits = (4 + c) * (settings.cross_entropy_block_size + hidden)
    elif spec.resources.accelerator == "cpu":
        # XLA's CPU backend keeps the f32 logits, their shifted and exponentiated copies, the one-hot
        # targets and the gradient as separate [tokens, vocab] arrays (measured).
        logits = 4 * 4 * vocab_size
    else:
        # A TPU fuses the softmax, the targets and the gradient into the head's product: XLA holds one or
        # two bf16 [tokens, vocab] arrays (measured: 2 bytes a logit for llama_600m, 3.7 for llama_150m).
        logits = 3 * vocab_size

    state_bytes = {"adam": 8, "lion": 4}[spec.optimizer.type]
    weights = int(c * params) if c < 4 else 0
    base = dict(parameters=int(4 * params), optimizer=int(state_bytes * params), compute_weights=weights)
    phases = [
        MemoryBreakdown("logits", **base, gradients=int(c * head_params), activations=int(tokens * (saved + final)),
                        layer=0, logits=int(tokens * logits)),
        MemoryBreakdown("layers", **base, gradients=int(c * (layer_params / tensor / mesh.fsdp + head_params)),
                        activations=int(tokens * saved), layer=int(tokens * working), logits=0),
        MemoryBreakdown("update", **{**base, "compute_weights": 0}, gradients=int(4 * params), activations=0,
                        layer=0, logits=0, update=int(4 * params)),
    ]
    return max(phases, key=lambda breakdown: breakdown.total)


def unplanned_settings(spec: RunSpec) -> ComputeSettings:
    """The setting of a run not planned against a device's memory: its explicit ``compute`` fields and,
    for ``auto`` ones, what runs computed before there was a plan: on CPU no checkpointing and the
    loss in blocks of `CPU_CROSS_ENTROPY_BLOCK`, on an accelerator checkpointing and whole logits."""
    compute, on_cpu = spec.compute, spec.resources.accelerator == "cpu"
    return ComputeSettings(
        not on_cpu if compute.gradient_checkpointing == "auto" else compute.gradient_checkpointing,
        (CPU_CROSS_ENTROPY_BLOCK if on_cpu else None) if compute.cross_entropy_block_size == "auto"
        else compute.cross_entropy_block_size,
        compute.fused_loss is True, compute.attention)


def candidate_settings(spec: RunSpec, vocab_size: int) -> list[ComputeSettings]:
    """The settings `plan_compute` tries for ``spec`` on a device of known memory, fastest first: its
    explicit ``compute`` fields hold, its ``auto`` ones vary (nothing recomputed and whole logits; the
    loss bounded, by the fused kernel on a TPU, then by blocks; checkpointing; both). A CPU run's
    ``auto`` is what CPU runs always did (`unplanned_settings`)."""
    compute, accelerator = spec.compute, spec.resources.accelerator
    if accelerator == "cpu":
        return [unplanned_settings(spec)]
    checkpointing = [False, True] if compute.gradient_checkpointing == "auto" else [compute.gradient_checkpointing]
    blocks = [None, ACCELERATOR_CROSS_ENTROPY_BLOCK] if compute.cross_entropy_block_size == "auto" \
        else [compute.cross_entropy_block_size]
    blocks = [b for b in blocks if b is None or b < vocab_size] or [None]  # a block as wide as the vocab is none
    # The kernels serve one TPU device (`fused_loss.usable`); a mesh of several computes XLA's loss.
    one_tpu = accelerator == "tpu" and spec.resources.device_count == 1
    fused = ([False, True] if one_tpu else [False]) if compute.fused_loss == "auto" else [compute.fused_loss]
    # The fused kernel's config keeps Levanter's blocks, which a process without the kernel computes.
    fused_block = next((b for b in blocks if b is not None), ACCELERATOR_CROSS_ENTROPY_BLOCK)
    losses = ([(None, False)] if None in blocks and False in fused else []) + \
        ([(fused_block, True)] if True in fused else []) + \
        ([(b, False) for b in blocks if b is not None] if False in fused else [])
    return [ComputeSettings(recompute, block, fused_loss, compute.attention)
            for recompute in checkpointing for block, fused_loss in losses]


def plan_compute(spec: RunSpec, vocab_size: int, device_memory_bytes: int | None,
                 device_label: str) -> tuple[ComputeSettings, MemoryBreakdown]:
    """The fastest of `candidate_settings` whose `estimate_memory` fits ``device_memory_bytes`` (per device)
    less `MEMORY_MARGIN`, and its estimate; None for the memory: `unplanned_settings`, unchecked. Raises `RunSpecError`
    in one line, naming the smallest estimate, its largest terms and the device (``device_label``)."""
    if device_memory_bytes is None:
        settings = unplanned_settings(spec)
        return settings, estimate_memory(spec, vocab_size, settings)
    estimates = [(settings, estimate_memory(spec, vocab_size, settings))
                 for settings in candidate_settings(spec, vocab_size)]
    budget = device_memory_bytes * (1 - MEMORY_MARGIN)
    fitting = [(settings, estimate) for settings, estimate in estimates if estimate.total <= budget]
    if fitting:
        return fitting[0]
    settings, smallest = min(estimates, key=lambda pair: pair[1].total)
    raise RunSpecError(spec.name, "model", (
        f"does not fit its resources: a training step needs about {smallest.describe(3)} per device with "
        f"{settings.describe()} at batch {spec.train_batch_size} x {spec.model.seq_len} tokens, vocab "
        f"{vocab_size:,}; more than {1 - MEMORY_MARGIN:.0%} of {device_label}"))


@dataclass(frozen=True)
class ComputePlan:
    """A run's settings, their estimate and the device memory they were checked against (None: unknown)."""

    settings: ComputeSettings
    estimate: MemoryBreakdown
    device_memory: int | None
    device_label: str

    def describe(self) -> str:
        """One line for the launch log."""
        checked = f"against {self.device_label}" if self.device_memory is not None else \
            f"not checked: {self.device_label}"
        return f"compute: {self.settings.describe()}; estimate {self.estimate.describe(4)} per device, {checked}"

    def metadata(self) -> dict[str, object]:
        """What the checkpoint records of how it was computed (never part of its identity)."""
        return {**self.settings.as_dict(), "memory_estimate_bytes": self.estimate.total,
                "memory_estimate": self.estimate.describe(4), "device_memory_bytes": self.device_memory}


def plan_run(spec: RunSpec, vocab_size: int, gpu_type: str) -> ComputePlan:
    """`plan_compute` against the memory of one device ``spec.resources`` name (``gpu_type``: the GKE
    label of the cluster's GPUs, MARIN_GPU_TYPE); a device not in the tables is not checked."""
    memory = device_memory(spec.resources, gpu_type)
    if memory is None:
        kind = gpu_type if spec.resources.accelerator == "gpu" else spec.resources.tpu_type
        memory_bytes, label = None, f"the memory of {kind!r} is not known"
    else:
        memory_bytes, label = memory
    settings, estimate = plan_compute(spec, vocab_size, memory_bytes, label)
    return ComputePlan(settings, estimate, memory_bytes, label)
