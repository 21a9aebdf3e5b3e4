"""Render a RunSpec plus a tokenized mixture into a Levanter ``TrainLmConfig`` (as a plain dict/YAML).

The dict is exactly what ``python -m levanter.main.train_lm --config_path cfg.yaml`` accepts, so
the same file drives our Pipes-wrapped ``train_main`` and a plain Levanter run.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from marin_assets.tokenization.mixture import chat_format
from marin_assets.training.init_weights import InitWeights, levanter_reference
from marin_assets.training.memory import ComputeSettings, unplanned_settings
from marin_assets.training.spec import HEAD_DIM_FAMILIES, TENSOR_PARALLEL_AXES, ModelSpec, RunSpec
from scaling.flops import MIXTURE_OF_EXPERTS_FAMILIES

WandbMode = Literal["offline", "online", "disabled"]
TRAIN_CONFIG_FILE = "train_config.yaml"
DEFAULT_MIXTURE_BLOCK_SIZE = 2048
"""Levanter's ``LMMixtureDatasetConfig.mixture_block_size`` default."""
"""The rendered Levanter config, in the run's directory (eval reads it back from the checkpoint artifact)."""


@dataclass(frozen=True)
class WandbSettings:
    """Tracker settings that go into the config. The API key never does: launchers pass it via env."""

    project: str = "marin"
    entity: str | None = None
    mode: WandbMode = "offline"
    tags: tuple[str, ...] = ()


def run_id_for(spec: RunSpec, init_weights: InitWeights | None = None) -> str:
    """Stable Levanter/W&B run id: a relaunch of the same spec (and initial weights) resumes the same W&B run."""
    return f"{spec.name}-{spec.fingerprint(init_weights.sha256 if init_weights else None)[:8]}"


def checkpoint_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def _prepare_data_config(spec: RunSpec, data_config: Mapping[str, Any], tokenizer_dir: str) -> dict[str, Any]:
    data = copy.deepcopy(dict(data_config))
    configs = data.get("configs")
    if not isinstance(configs, Mapping) or not configs:
        raise ValueError("data_config must be a Levanter mixture config with a non-empty 'configs' mapping")
    weights = data.get("train_weights")
    if not isinstance(weights, Mapping) or not any(w > 0 for w in weights.values()):
        raise ValueError("data_config['train_weights'] must give a positive weight to at least one component")
    unknown_weights = sorted(set(weights) - set(configs))
    if unknown_weights:
        raise ValueError(f"train_weights name components missing from configs: {unknown_weights}")

    for name, component in configs.items():
        # Training must read the caches that were built, never tokenize: with URLs present Levanter
        # would build (or silently rebuild) a cache from them.
        if component.get("train_urls") or component.get("validation_urls") or component.get("id"):
            raise ValueError(f"mixture component {name!r} has a raw-data source; training expects pre-built "
                             "caches only")
        if component.get("cache_dir") is None and data.get("cache_dir") is None:
            raise ValueError(f"mixture component {name!r} has no cache_dir and the mixture has no cache_dir")

    given_tokenizer = data.get("tokenizer")
    if given_tokenizer is not None and os.path.normpath(str(given_tokenizer)) != os.path.normpath(tokenizer_dir):
        raise ValueError(f"data_config tokenizer {given_tokenizer!r} differs from tokenizer_dir {tokenizer_dir!r}")
    data["tokenizer"] = tokenizer_dir

    if spec.mixture_weights is not None:
        weights = data["train_weights"] = run_weights(spec, "mixture_weights", spec.mixture_weights, configs)
    if spec.mixture_schedule:
        data["train_weights"], data["mixture_block_size"] = scheduled_weights(spec, weights, configs, data)
    if spec.eval_sets:
        missing = sorted(set(spec.eval_sets) - set(configs))
        if missing:
            raise ValueError(f"run {spec.name!r}: eval_sets {missing} are not components of the mixture "
                             f"{sorted(configs)}")
        # Levanter evaluates every configured component; drop those neither trained on nor evaluated.
        keep = trained_components(data["train_weights"]) | set(spec.eval_sets)
        data["configs"] = {n: c for n, c in configs.items() if n in keep}
    # Sequences are cut from concatenated documents in cache order; shuffle them unless the
    # mixture says otherwise. Feistel is Levanter's recommended permutation.
    data.setdefault("shuffle", True)
    data.setdefault("permutation_type", "feistel")
    return data


def scheduled_weights(spec: RunSpec, weights: Mapping[str, float], configs: Mapping[str, Any],
                      data: Mapping[str, Any]) -> tuple[list[list[Any]], int]:
    """Levanter's varying mixture for ``spec.mixture_schedule``: ``[[step, {component: weight}], ...]``
    from step 0 (the mixture's own ``weights``), and the mixing block size. Levanter switches weights
    only at a block boundary (its stages start at a sequence index that the block size divides), so the
    block shrinks to the largest size that divides every switch's sequence index."""
    stages = [[0, {name: float(weights.get(name, 0.0)) for name in configs}]]
    for stage in spec.mixture_schedule:
        stages.append([stage.step, run_weights(spec, "mixture_schedule", stage.weights, configs)])
    block = math.gcd(int(data.get("mixture_block_size", DEFAULT_MIXTURE_BLOCK_SIZE)),
                     *(stage.step * spec.train_batch_size for stage in spec.mixture_schedule))
    return stages, block


def run_weights(spec: RunSpec, field_name: str, weights: Mapping[str, float],
                configs: Mapping[str, Any]) -> dict[str, float]:
    """``weights`` over every component of the mixture (0 for one not named); ValueError for a name
    that is not one."""
    unknown = sorted(set(weights) - set(configs))
    if unknown:
        raise ValueError(f"run {spec.name!r}: {field_name} weighs {unknown}, not components of the mixture "
                         f"{sorted(configs)}")
    return {name: float(weights.get(name, 0.0)) for name in configs}


def trained_components(train_weights: Mapping[str, float] | list[list[Any]]) -> set[str]:
    """Components some stage of Levanter's ``train_weights`` (fixed, or ``[[step, weights], ...]``) draws from."""
    stages = [train_weights] if isinstance(train_weights, Mapping) else [w for _, w in train_weights]
    return {name for weights in stages for name, weight in weights.items() if weight > 0}


def model_config(m: ModelSpec, tokenizer_dir: str, compute: ComputeSettings) -> dict[str, Any]:
    """Levanter's model config for ``m``: its family's registered config class (the ``type``) and
    the fields that class has, computed as ``compute`` says (recomputation, loss blocks, attention)."""
    config: dict[str, Any] = {
        "type": m.family,
        "seq_len": m.seq_len,
        "hidden_dim": m.hidden_dim,
        "intermediate_dim": m.intermediate_dim,
        "num_layers": m.num_layers,
        "num_heads": m.num_heads,
        "num_kv_heads": m.num_kv_heads,
    }
    if m.family in HEAD_DIM_FAMILIES:  # the others' config classes have no head_dim to set
        config["head_dim"] = m.head_dim
    if m.family in MIXTURE_OF_EXPERTS_FAMILIES:
        config["n_routed_experts"] = m.num_experts
        config["num_experts_per_tok"] = m.experts_per_token
    config.update({
        "tie_word_embeddings": m.tie_word_embeddings,
        "initializer_range": m.initializer_range,
        "layer_norm_epsilon": m.layer_norm_epsilon,
        "rope": {"type": "default", "theta": m.rope_theta},
        # Local tokenizer: Levanter otherwise consults the HF hub for the reference checkpoint's.
        "tokenizer": tokenizer_dir,
        "gradient_checkpointing": compute.gradient_checkpointing,
        "cross_entropy_block_size": compute.cross_entropy_block_size,
    })
    if compute.attention is not None:
        config["attn_backend"] = compute.attention
    return config


def build_train_config(
    spec: RunSpec,
    data_config: Mapping[str, Any],
    tokenizer_dir: str,
    output_dir: str,
    *,
    wandb: WandbSettings = WandbSettings(),
    temporary_checkpoint_interval: str = "10m",
    init_weights: InitWeights | None = None,
    compute: ComputeSettings | None = None,
    cooldown_from: str | None = None,
) -> dict[str, Any]:
    """Levanter ``TrainLmConfig`` dict for ``spec`` training on ``data_config`` (a mixture dict).

    Checkpoints go to ``{output_dir}/checkpoints/step-N`` (no run-id subdirectory) every
    ``spec.checkpoint_every`` steps, plus a temporary one every ``temporary_checkpoint_interval``
    of wall time, so a relaunch with the same ``output_dir`` resumes. Levanter logs gradient and
    parameter norms every ``spec.watch_every`` steps. The mesh is ``spec.mesh`` (data x fsdp x tensor).
    A run with ``init_weights`` (its resolved ``init_from``) starts from them: Levanter's
    ``initialize_from_hf``, which the training process points at its checked local copy.
    ``compute``: how the model computes, as `marin_assets.training.memory.plan_compute` planned it for
    the devices (None: the setting runs had before planning, `unplanned_settings`).
    A cooldown (``spec.cooldown``) starts from ``cooldown_from``, its base's checkpoint directory at
    the cooldown's step: Levanter's ``initialize_from_checkpoint_path`` restores the weights, the
    optimizer state and the step count (``spec.first_step``), and it trains ``num_train_steps`` more,
    the learning rate held until then (never used) and annealed after (Levanter's ``decay``, in steps).
    """
    if (spec.cooldown is None) != (cooldown_from is None):
        raise ValueError(f"run {spec.name!r}: a cooldown, and only a cooldown, starts from a base checkpoint")
    tokenizer_dir = str(tokenizer_dir)
    output_dir = str(output_dir)
    m, o, r, mesh = spec.model, spec.optimizer, spec.resources, spec.mesh
    run_id = run_id_for(spec, init_weights)
    on_accelerator = r.accelerator != "cpu"
    initialization = {} if init_weights is None else {"initialize_from_hf": levanter_reference(init_weights.uri)}
    if cooldown_from is not None:
        initialization["initialize_from_checkpoint_path"] = cooldown_from
    decay = {} if spec.cooldown is None else {"decay": spec.num_train_steps}
    return {
        **initialization,
        "data": _prepare_data_config(spec, data_config, tokenizer_dir),
        "model": model_config(m, tokenizer_dir, compute or unplanned_settings(spec)),
        "optimizer": {
            "type": o.type,
            "learning_rate": o.learning_rate,
            "weight_decay": o.weight_decay,
            "warmup": o.warmup,
            "lr_schedule": o.schedule,
            "min_lr_ratio": o.min_lr_ratio,
            "beta1": o.beta1,
            "beta2": o.beta2,
            "epsilon": o.epsilon,
            "max_grad_norm": o.max_grad_norm,
            **decay,
        },
        "trainer": {
            "id": run_id,
            "seed": spec.seed,
            # bf16 compute is the accelerator norm; on CPU it is slower than f32, so keep f32 there.
            "mp": "p=f32,c=bfloat16" if on_accelerator else "f32",
            "train_batch_size": spec.train_batch_size,
            # Levanter's mesh is (replica, data, model): our data axis is its replica axis, tensor its
            # model axis, and FSDP its data axis, which it sizes itself as devices / (replica x model).
            # The batch is split over replica x data; parameters shard their embed axis over data.
            "replica_ici_axis_size": mesh.data,
            "model_axis_size": mesh.tensor,
            "batch_axis": "batch",
            "fsdp_axis": "embed",
            "tensor_parallel_axes": list(TENSOR_PARALLEL_AXES) if mesh.tensor > 1 else None,
            "num_train_steps": spec.first_step + spec.num_train_steps,
            "steps_per_eval": spec.steps_per_eval,
            "max_eval_batches": spec.max_eval_batches,
            "require_accelerator": on_accelerator,
            "ray": {"auto_start_cluster": False},
            "log_dir": os.path.join(output_dir, "logs"),
            "watch": {"interval": spec.watch_every},
            "log_jaxprs": False,
            "log_xla_hlo": False,
            "tracker": {
                "type": "wandb",
                "project": wandb.project,
                "entity": wandb.entity,
                "name": spec.name,
                "id": run_id,
                "mode": wandb.mode,
                "tags": list(wandb.tags),
                "resume": "allow",
                "save_code": False,
            },
            "checkpointer": {
                "base_path": checkpoint_dir(output_dir),
                "append_run_id_to_base_path": False,
                "save_interval": temporary_checkpoint_interval,
                "keep": [{"every": spec.checkpoint_every}],
            },
        },
    }


def set_checkpoint_base(config_path: str | os.PathLike, base_path: str) -> None:
    """Point a written config's checkpointer at ``base_path`` (e.g. the artifact's directory in a bucket)."""
    with open(config_path) as f:
        config = yaml.safe_load(f)
    config["trainer"]["checkpointer"]["base_path"] = base_path
    write_train_config(config, config_path)


def validation_only_config(text: str, caches: Mapping[str, str],
                           chat_templates: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A run's Levanter config (its YAML text) with its data replaced by ``caches`` ({eval set name:
    token cache root}), to score its checkpoint on validation sets it never trained on: the model,
    the tokenizer and the checkpoint stay the run's, and its own mixture's caches are not read. A chat
    cache (its template in ``chat_templates``) is read as chat data, as an SFT run's mixture reads it:
    the loss on the assistant's tokens, so a base model and its fine-tuned run are scored alike."""
    config = yaml.safe_load(text)
    data = config["data"]
    data.pop("cache_dir", None)
    templates = chat_templates or {}
    data["configs"] = {name: {"cache_dir": root, "train_urls": [], "validation_urls": [],
                              **({"format": chat_format(templates[name])} if name in templates else {})}
                       for name, root in caches.items()}
    data["train_weights"] = {name: 1.0 for name in caches}
    return config


def write_train_config(config: Mapping[str, Any], path: str | os.PathLike) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(dict(config), f, sort_keys=False)
    return str(path)


def render_train_config(spec: RunSpec, data_config: Mapping[str, Any], tokenizer_dir: str, output_dir: str,
                        wandb: WandbSettings, init_weights: InitWeights | None = None,
                        compute: ComputeSettings | None = None, cooldown_from: str | None = None) -> str:
    """Render ``spec`` into ``{output_dir}/train_config.yaml``; returns its path."""
    config = build_train_config(spec, data_config, tokenizer_dir, output_dir, wandb=wandb, init_weights=init_weights,
                                compute=compute, cooldown_from=cooldown_from)
    return write_train_config(config, Path(output_dir) / TRAIN_CONFIG_FILE)


def levanter_block_size(block: int | None, vocab_size: int) -> int | None:
    """A cross-entropy block over which Levanter's blockwise loss is right for ``vocab_size``, as near
    ``block`` as that allows. Levanter's (`_block_cross_entropy_forward` and `_backward`) takes a
    vocabulary of one whole block and a remainder as one block of the whole vocabulary, then the remainder
    again: the remainder's logits count twice, and a target among them gets a loss below its own, negative
    once the model is sure of it (measured: an SFT run on a 300-token vocabulary with blocks of 256 ended
    at -0.87). Half the vocabulary makes two blocks and a remainder, which it computes right."""
    if block is not None and block < vocab_size < 2 * block and vocab_size % block:
        return vocab_size // 2
    return block


def parse_train_config(path: str | os.PathLike):
    """Parse a config file with Levanter's own draccus parser into a ``TrainLmConfig`` (imports Levanter),
    its cross-entropy block one Levanter computes right for the tokenizer's vocabulary (`levanter_block_size`:
    how the loss computes, never what it is, so the config file keeps the planned one)."""
    import dataclasses

    import draccus
    from levanter.main.train_lm import TrainLmConfig

    config = draccus.parse(TrainLmConfig, config_path=str(path), args=[])
    block = getattr(config.model, "cross_entropy_block_size", None)
    if block is not None:
        try:
            vocab_size = len(config.data.the_tokenizer)
        except (OSError, ValueError):
            return config  # an unreadable tokenizer: the process's own check refuses it, in one line
        safe = levanter_block_size(block, vocab_size)
        if safe != block:
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, cross_entropy_block_size=safe))
    return config
