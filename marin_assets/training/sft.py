"""Supervised fine-tuning runs (docs/post-training.md#sft_checkpoint): what sets them apart from
pretraining runs, as pure checks of their specs against the tokenization registry.

An SFT run is a `RunSpec` like any other, declared in the project file's ``sft_runs:`` section; it is
trained by the same assets (`assets.build_run_assets`) under its own keys and partitions
(``sft_checkpoint[run]``, ``sft_eval[run]``). What differs is refused here, in one line, before
anything launches: it starts from pretrained weights (``init_from``), trains on a mixture of chat
caches (whose rows carry the assistant mask Levanter's chat dataset turns into the loss mask), and its
sequence holds a whole cached conversation.

No Dagster, JAX or Levanter import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from marin_assets.tokenization.registry import MixtureEntry, TokenizedEntry
from marin_assets.training.spec import RunSpec, RunSpecError, extend_run_registry

SFT_RUNS_SECTION = "sft_runs"
SFT_CHECKPOINT_KEY = "sft_checkpoint"
SFT_EVAL_KEY = "sft_eval"
SFT_HF_MODEL_KEY = "sft_hf_model"


def extend_sft_runs(runs: Mapping[str, RunSpec], raw: Mapping[str, Any], origin: str) -> dict[str, RunSpec]:
    """The SFT runs of ``raw`` (``{name: {...}}``, the ``sft_runs:`` section), each of which may start from
    (``init_from.run``) or be declared as a difference from (``base:``) a pretraining run of ``runs``.
    RunSpecError naming ``origin`` for a run without initial weights or named as a pretraining run."""
    merged = extend_run_registry(runs, raw, origin)  # checks init_from.run's architecture and tokenizer
    sft = {name: merged[name] for name in map(str, raw)}
    for name, spec in sft.items():
        if name in runs:
            raise RunSpecError(name, "name", f"a pretraining run is named {name!r} too; an SFT run needs its own "
                                             "name (marin compare and the UI tell runs apart by name)", origin)
        if spec.init_from is None:
            raise RunSpecError(name, "init_from", "an SFT run fine-tunes pretrained weights: give init_from.run (a "
                                                  "pretraining run's hf_model) or init_from.path", origin)
        if spec.init_from.run is not None and spec.init_from.run not in runs:
            raise RunSpecError(name, "init_from.run", f"{spec.init_from.run!r} is not a pretraining run (runs: "
                                                      f"{', '.join(sorted(runs)) or 'none'}); an SFT run starts from "
                                                      "a pretraining run's hf_model", origin)
        if spec.cooldown is not None:
            raise RunSpecError(name, "cooldown", "an SFT run starts from weights (init_from), not from a "
                                                 "checkpoint's optimizer state", origin)
    return sft


def validate_sft_data(spec: RunSpec, mixture: MixtureEntry, tokenized: Mapping[str, TokenizedEntry]) -> None:
    """RunSpecError (one line) unless ``spec`` trains on a chat mixture (``format: chat`` or ``mixed``)
    whose chat caches' rows all fit its sequence: a row longer than ``model.seq_len`` would be sliced by
    Levanter's packing, cutting an answer from its prompt."""
    if mixture.format == "text":
        raise RunSpecError(spec.name, "mixture", f"{mixture.name!r} is a text mixture; an SFT run trains on chat "
                                                 "caches (a mixture of format: chat, or mixed)")
    for component in sorted(mixture.weights):
        chat = tokenized[component].cache.chat if component in tokenized else None
        if chat is not None and chat.seq_len > spec.model.seq_len:
            raise RunSpecError(spec.name, "model.seq_len",
                               f"{spec.model.seq_len} is shorter than the rows of chat cache {component!r} "
                               f"(chat.seq_len {chat.seq_len}); Levanter would cut conversations mid-turn: set "
                               f"model.seq_len to at least {chat.seq_len}")
