"""Mixtures of tokenized caches, rendered to Levanter's `LMMixtureDatasetConfig` (the `data:` section).

Every component points at a cache root built by `build_levanter_cache` (`<root>/train`,
`<root>/validation`). The rendered config has no `train_urls`/`validation_urls`, so Levanter has no
source to tokenize from and only loads the finished caches (`TreeCache.load`); it never rebuilds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import yaml

from marin_assets.tokenization.cache_config import MESSAGES_COLUMN

STOP_STRATEGIES = ("restart", "first_exhausted", "all_exhausted")


@dataclass(frozen=True)
class MixtureComponent:
    """One cache in a mixture. weight 0 means validation-only (Levanter skips it for training)."""

    cache_root: str
    weight: float = 1.0
    tags: tuple[str, ...] = ()
    chat_template: str | None = None
    """A chat cache's template (as its manifest records it): Levanter reads the component as chat
    data (`format: chat`), its loss on the assistant mask. None: a text cache."""

    def __post_init__(self) -> None:
        if not self.cache_root:
            raise ValueError("cache_root must be set")
        if not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(f"weight must be finite and >= 0, got {self.weight}")


@dataclass(frozen=True)
class MixtureSpec:
    """A training mixture over tokenized caches.

    `seq_len` is not part of Levanter's data config: the launcher sets it as `model.seq_len`.
    `shuffle`: True shuffles each component fully; an int shuffles in eras of that many sequences.
    """

    name: str
    components: Mapping[str, MixtureComponent]
    tokenizer_dir: str
    seq_len: int = 1024
    mixture_block_size: int = 2048
    shuffle: bool | int = True
    permutation_type: Literal["feistel", "linear"] = "feistel"
    stop_strategy: str = "restart"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("mixture name must be set")
        if not self.components:
            raise ValueError(f"mixture {self.name!r} has no components")
        for comp_name, comp in self.components.items():
            if not comp_name or "/" in comp_name:
                raise ValueError(f"component name {comp_name!r} must be non-empty and contain no '/'")
            if not isinstance(comp, MixtureComponent):
                raise TypeError(f"component {comp_name!r} must be a MixtureComponent, got {type(comp).__name__}")
        if not any(c.weight > 0 for c in self.components.values()):
            raise ValueError(f"mixture {self.name!r} needs at least one component with weight > 0")
        if self.seq_len < 1 or self.mixture_block_size < 1:
            raise ValueError("seq_len and mixture_block_size must be positive")
        if self.stop_strategy not in STOP_STRATEGIES:
            raise ValueError(f"stop_strategy must be one of {STOP_STRATEGIES}, got {self.stop_strategy!r}")
        if self.permutation_type not in ("feistel", "linear"):
            raise ValueError(f"permutation_type must be 'feistel' or 'linear', got {self.permutation_type!r}")
        if not self.tokenizer_dir:
            raise ValueError("tokenizer_dir must be set")

    @staticmethod
    def from_dict(d: Mapping) -> MixtureSpec:
        """Build from plain data, e.g.
        `{"name":..., "tokenizer_dir":..., "components": {n: {"cache_root":..., "weight":...}}}`."""
        d = dict(d)
        comps = {
            name: MixtureComponent(
                cache_root=c["cache_root"], weight=float(c.get("weight", 1.0)), tags=tuple(c.get("tags", ()))
            )
            for name, c in d.pop("components").items()
        }
        return MixtureSpec(components=comps, **d)

    @property
    def train_components(self) -> list[str]:
        return sorted(n for n, c in self.components.items() if c.weight > 0)

    @property
    def validation_only_components(self) -> list[str]:
        return sorted(n for n, c in self.components.items() if c.weight == 0)


def _sorted_dict(d: Mapping) -> dict:
    return {k: _sorted_dict(v) if isinstance(v, Mapping) else v for k, v in sorted(d.items())}


def chat_format(template: str) -> dict:
    """The ``format`` of a chat cache's component in Levanter's data config: its ChatProcessor's fields, read
    by its MultiturnChatDataset with the loss on the assistant's tokens. The template is the cache's own (its
    manifest's), so the metadata matches the cache's ledger."""
    return {"type": "chat", "chat_template": template, "messages_field": MESSAGES_COLUMN, "mask_user_turns": True,
            "pack": True, "single_turn": False}


def render_levanter_data_config(spec: MixtureSpec) -> dict:
    """Render `spec` as the dict for Levanter's `LMMixtureDatasetConfig` (TrainLmConfig.data).

    Weights are passed as given; Levanter normalises them. Keys are sorted at every level so the
    same spec always renders to the same dict, YAML and JSON.
    """
    configs = {
        name: {
            "cache_dir": comp.cache_root.rstrip("/"),
            "tags": sorted(set(comp.tags)),
            # No URLs: Levanter finds no source and only loads the finished cache at cache_dir/<split>.
            "train_urls": [],
            "validation_urls": [],
            **({"format": chat_format(comp.chat_template)} if comp.chat_template is not None else {}),
        }
        for name, comp in spec.components.items()
    }
    return _sorted_dict(
        {
            # Every component sets its own cache_dir; no shared default directory is used.
            "cache_dir": None,
            "configs": configs,
            "train_weights": {name: float(comp.weight) for name, comp in spec.components.items()},
            "tokenizer": spec.tokenizer_dir,
            # Our caches already end every document with EOS; this keeps Levanter's loader metadata
            # (append_eos) the same as what the builder recorded.
            "enforce_eos": True,
            "shuffle": spec.shuffle,
            "permutation_type": spec.permutation_type,
            "mixture_block_size": spec.mixture_block_size,
            "stop_strategy": spec.stop_strategy,
        }
    )


def render_levanter_data_config_yaml(spec: MixtureSpec) -> str:
    return yaml.safe_dump(render_levanter_data_config(spec), sort_keys=True, default_flow_style=False)
