"""Chat data as a source format (``format: chat``): one conversation per JSONL line (or Parquet row),
``{"messages": [{"role": ..., "content": ...}, ...]}`` as OpenAI's and Hugging Face's chat data hold it.

A conversation is checked here (`check_conversation`) and becomes a document with two views of it:
``messages``, the turns as JSON (the structure a chat token cache renders through a chat template,
with its assistant loss mask), and ``text``, a plain rendering of the turns (`render_text`) that the
text steps (exact and fuzzy dedup, decontamination n-grams) read. PII is replaced in each turn's
content and the text rendered again from the turns, so the two never disagree. See docs/post-training.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MESSAGES_FIELD = "messages"
MESSAGES_COLUMN = "messages"
# OpenAI's chat roles (Hugging Face chat templates use the same names). `tool` holds a tool's output
# as a string; structured tool calls (an assistant turn whose content is null) are not read yet.
ROLES = ("system", "user", "assistant", "tool")
ASSISTANT = "assistant"

# Quarantine reasons of chat records (readers.Reason holds them with the others).
MISSING_MESSAGES = "missing_messages"  # no `messages` field, or not a non-empty list
MALFORMED_MESSAGE = "malformed_message"  # a turn that is not a JSON object
UNKNOWN_ROLE = "unknown_role"  # a turn whose role is missing or not one of ROLES
NON_STRING_CONTENT = "non_string_content"  # a turn whose content is missing, null, a list of parts, ...
NO_ASSISTANT_TURN = "no_assistant_turn"  # nothing to learn from: no assistant turn with text
CHAT_REASONS = (MISSING_MESSAGES, MALFORMED_MESSAGE, UNKNOWN_ROLE, NON_STRING_CONTENT, NO_ASSISTANT_TURN)


@dataclass(frozen=True)
class Refused:
    """Why a record is not a conversation: a quarantine reason and a one-line detail."""

    reason: str
    detail: str


def _type_name(value: Any) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"


def check_conversation(record: dict[str, Any], normalize: Callable[[str], str]) -> list[dict[str, Any]] | Refused:
    """The turns of ``record`` with each content passed through ``normalize``, or why it is refused.

    A turn keeps its other keys (``name``, ``weight``, ``tool_call_id``) as they are, for the chat
    template, except those that are null (a Parquet file's turns have every field of any turn, null
    where a turn has none); only ``content`` is text. A conversation needs an assistant turn with text after
    normalisation: one without is refused (``no_assistant_turn``), never kept as a document with
    nothing to train on."""
    messages = record.get(MESSAGES_FIELD)
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else _type_name(messages)
        return Refused(MISSING_MESSAGES, f"field {MESSAGES_FIELD!r} is {got}, not a list of turns")
    turns = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return Refused(MALFORMED_MESSAGE, f"turn {index} is {_type_name(message)}, not an object")
        role = message.get("role")
        if role not in ROLES:
            shown = "missing" if role is None else repr(role)
            return Refused(UNKNOWN_ROLE, f"turn {index} has role {shown}; known: {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            return Refused(NON_STRING_CONTENT, f"turn {index} ({role}) has content {_type_name(content)}, not a "
                                               "string (content parts and tool calls are not read)")
        turns.append({**{k: v for k, v in message.items() if v is not None}, "content": normalize(content)})
    if not any(turn["role"] == ASSISTANT and turn["content"] for turn in turns):
        return Refused(NO_ASSISTANT_TURN, f"none of its {len(turns)} turn(s) is an assistant turn with text")
    return turns


def render_text(turns: list[dict[str, Any]]) -> str:
    """The plain text of a conversation: each turn as ``role: content``, turns apart by a blank line.
    What dedup hashes and decontamination reads n-grams of; not what a chat model is trained on."""
    return "\n\n".join(f"{turn['role']}: {turn['content']}" for turn in turns)


def messages_json(turns: list[dict[str, Any]]) -> str:
    """The ``messages`` column's value: the turns as compact JSON, keys in their given order."""
    return json.dumps(turns, ensure_ascii=False, separators=(",", ":"))
