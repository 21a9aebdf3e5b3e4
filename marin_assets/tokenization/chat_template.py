"""Rendering a conversation through a chat template into a chat cache's row: its `input_ids` and
`assistant_masks`, exactly as Levanter's `ChatProcessor` makes them (transformers'
`apply_chat_template` with `return_assistant_tokens_mask`), or the reason it cannot be a row.
No Dagster, no Levanter: the encoding of a shard calls it (docs/post-training.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import numpy as np

from marin_assets.tokenization.cache_config import GENERATION_TAG, CacheConfig, ChatCacheConfig

MASK_DTYPE = np.dtype("<i4")  # Levanter's ChatProcessor: assistant_masks int32, as input_ids
# Why a conversation is not a row (each counted in its shard's ledger entry as `quarantined_<reason>`).
TEMPLATE_ERROR = "template_error"  # the template raised on it
TOO_LONG = "too_long"  # over seq_len, and no leading turns ending on an assistant turn fit
NO_ASSISTANT_TOKENS = "no_assistant_tokens"  # nothing to train on (Levanter raises on such a row)
BAD_MESSAGES = "bad_messages"  # the messages column is not a JSON list of turns
QUARANTINE_REASONS = (TEMPLATE_ERROR, TOO_LONG, NO_ASSISTANT_TOKENS, BAD_MESSAGES)
TRUNCATED = "truncated_conversations"
QUARANTINE_FILE = "quarantine.jsonl"  # a chat shard's row files: one {"id", "reason", "detail"} per line


def chat_counts() -> dict[str, int]:
    """A chat shard's ledger counts beside the pretraining ones (all zero to start)."""
    return {TRUNCATED: 0, **{f"quarantined_{reason}": 0 for reason in QUARANTINE_REASONS}}


def tokenizer_chat_template(local_tok: str) -> str | None:
    """The tokenizer's own template, as transformers saves it: `chat_template.jinja`, or the
    `chat_template` of tokenizer_config.json."""
    jinja = os.path.join(local_tok, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    try:
        with open(os.path.join(local_tok, "tokenizer_config.json")) as f:
            template = json.load(f).get("chat_template")
    except FileNotFoundError:
        return None
    return template if isinstance(template, str) else None


def resolved(cfg: CacheConfig, local_tok: str) -> CacheConfig:
    """``cfg`` with its chat template spelled out (the tokenizer's own where it declares none): the
    template the rows are rendered with is part of the cache's identity, whichever file holds it."""
    if cfg.chat is None or cfg.chat.template is not None:
        return cfg
    template = tokenizer_chat_template(local_tok)
    if template is None:
        raise ValueError("the tokenizer has no chat template; declare one as `chat: {template: ...}` on the "
                         "source's tokenized entry (docs/post-training.md)")
    if not GENERATION_TAG.search(template):
        raise ValueError("the tokenizer's chat template has no {% generation %} block, which marks the assistant "
                         "mask; declare one as `chat: {template: ...}` on the source's tokenized entry")
    return replace(cfg, chat=replace(cfg.chat, template=template))


@dataclass(frozen=True)
class Rendered:
    """One conversation: its row (`ids`, `mask`), or why it is none (`reason`, `detail`)."""

    ids: list[int] | None = None
    mask: list[int] | None = None
    truncated: bool = False
    reason: str | None = None
    detail: str = ""


class ChatRenderer:
    """A tokenizer directory and a resolved chat config: conversations -> rows."""

    def __init__(self, local_tok: str, chat: ChatCacheConfig):
        from transformers import AutoTokenizer

        if chat.template is None:
            raise ValueError("ChatRenderer needs a resolved template (chat_template.resolved)")
        self.tok = AutoTokenizer.from_pretrained(local_tok)
        self.chat = chat

    def _apply(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        out = self.tok.apply_chat_template(messages, tokenize=True, chat_template=self.chat.template,
                                           return_assistant_tokens_mask=True, return_dict=True)
        return list(out["input_ids"]), list(out["assistant_masks"])

    def render(self, messages_json: str) -> Rendered:
        try:
            messages = json.loads(messages_json)
        except ValueError as exc:
            return Rendered(reason=BAD_MESSAGES, detail=str(exc))
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return Rendered(reason=BAD_MESSAGES, detail="not a list of turns")
        try:
            ids, mask = self._apply(messages)
        except Exception as exc:  # noqa: BLE001 - a template's error is this conversation's, quarantined with it
            return Rendered(reason=TEMPLATE_ERROR, detail=f"{type(exc).__name__}: {exc}"[:500])
        if len(ids) > self.chat.seq_len:
            return self._cut(messages, len(ids))
        if not any(mask):
            return Rendered(reason=NO_ASSISTANT_TOKENS, detail="the template marked no assistant tokens")
        return Rendered(ids, mask)

    def _cut(self, messages: list[dict], tokens: int) -> Rendered:
        """A conversation over seq_len: its longest run of leading turns ending on an assistant turn
        that fits (found by bisection: a run's rendering grows with it), else quarantined."""
        too_long = Rendered(reason=TOO_LONG, detail=f"{tokens} tokens > seq_len {self.chat.seq_len}")
        if self.chat.overflow == "quarantine":
            return too_long
        ends = [i + 1 for i, m in enumerate(messages[:-1]) if m.get("role") == "assistant"]
        best, kept, low, high = None, 0, 0, len(ends) - 1
        while low <= high:
            middle = (low + high) // 2
            try:
                ids, mask = self._apply(messages[:ends[middle]])
            except Exception:  # noqa: BLE001 - a prefix the template refuses (it may require a last user turn)
                high = middle - 1
                continue
            if len(ids) <= self.chat.seq_len:
                best, kept, low = (ids, mask), ends[middle], middle + 1
            else:
                high = middle - 1
        if best is None or not any(best[1]):
            return too_long
        return Rendered(*best, truncated=True, detail=f"{too_long.detail}: kept the first {kept} of "
                                                      f"{len(messages)} turns")
