"""What a token cache is built with and what it comes to: `CacheConfig` (the settings that decide
its rows and its identity), the validation minimum applied to it, and `CacheStats` (a cache root's
totals, as its manifest gives them).

A module of its own so that the encoding, the assembly and the entry points (`cache.py`), which
all take these, import them without a cycle.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Literal

from marin_resources.config_identity import config_identity, identity
from marin_resources.splits import corpus_threshold
from marin_resources.typed_config import typed_config

# The identities a cache config's fields belong to (marin_resources/config_identity.py): the cache's
# artifact (tokenized/), the rows it holds (its manifest's, `row_identity`), and one shard's encoded rows
# (token_shards/, `encoding_identity`: the fields of every identity).
TOKENIZED = "tokenized"
ROWS = "cache_rows"

MESSAGES_COLUMN = "messages"  # a chat source's documents: the turns, as JSON (docs/post-training.md)
# Levanter's ChatProcessor asks the same of a template (transformers' assistant mask needs it).
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%}")


@typed_config
@dataclass(frozen=True)
class ChatCacheConfig:
    """How a chat source's conversations become rows (docs/post-training.md#the-chat-token-cache):
    rendered through a chat template into `input_ids`, with `assistant_masks` 1 on the tokens the
    template's `{% generation %}` blocks produce, as Levanter's `ChatProcessor` writes them."""

    template: str | None = identity(None)
    """A Jinja chat template; None: the tokenizer's own (`chat_template` of its tokenizer_config.json)."""
    seq_len: int = identity(1024)
    """The training sequence length: a longer conversation is cut or quarantined (`overflow`)."""
    overflow: Literal["truncate", "quarantine"] = identity("truncate")
    """`truncate`: keep the longest run of leading turns, ending on an assistant turn, that fits
    (counted as `truncated_conversations`); where even the first assistant turn does not fit, or with
    `quarantine`, the conversation is quarantined as `too_long`."""

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {self.seq_len}")
        if self.template is not None and not GENERATION_TAG.search(self.template):
            raise ValueError("template has no {% generation %} block: the assistant mask is what it marks "
                             "(Levanter refuses such a template too)")


@typed_config
@dataclass(frozen=True)
class CacheConfig:
    """How documents become cache rows.

    `batch_rows` is both the Parquet read batch and the encode batch. `flush_tokens` bounds the
    values an assembly unit holds and writes at once; Levanter's zarr3 arrays are stored in large
    shard files that are rewritten on each write, so fewer, larger writes are much cheaper. Peak
    memory of a unit is about 2 x flush_tokens x 4 bytes; an encoding worker holds a few batches.
    Neither changes the cache's bytes, yet both (and `incremental`) were in the cache's identity from
    the start, so they stay there: moving them out would give every cache a new directory.
    """

    validation_fraction: float = identity(0.01)
    validation_min_documents: int | None = identity(None, scopes=[TOKENIZED, ROWS], omit="default")
    """At least this many documents go to validation (the lowest id hashes), where the fraction
    gives fewer; capped at half the corpus. None: the fraction alone (and no change of identity)."""
    batch_rows: int = identity(1024, scopes=[TOKENIZED])
    flush_tokens: int = identity(16_000_000, scopes=[TOKENIZED])
    id_column: str = identity("id")
    text_column: str = identity("text")
    incremental: bool = identity(True, scopes=[TOKENIZED])
    chat: ChatCacheConfig | None = identity(None, omit="empty")
    """Set for a chat source (the registry sets it): rows are conversations rendered through a chat
    template, with an assistant mask beside `input_ids`."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in [0, 1), got {self.validation_fraction}")
        if self.batch_rows < 1 or self.flush_tokens < 1:
            raise ValueError("batch_rows and flush_tokens must be positive")
        if self.validation_min_documents is not None and self.validation_min_documents < 1:
            raise ValueError(f"validation_min_documents must be at least 1, got {self.validation_min_documents}")

    def identity(self) -> dict:
        """What defines the cache's artifact: every field, the minimum only where it is set (so a
        config without one keeps the fingerprint it had before the field existed)."""
        return config_identity(self, TOKENIZED)

    def encoding_identity(self) -> dict:
        """What decides one shard's encoded rows (`encode_shard_rows`): a validation minimum is applied
        when the shards are assembled, so it is not here."""
        return config_identity(self)

    def row_identity(self) -> dict:
        """The settings that decide which rows a cache holds; a change forces a full rebuild. With
        a minimum, `validation_fraction` is the threshold `with_validation_minimum` worked out."""
        return config_identity(self, ROWS)


@dataclass(frozen=True)
class SplitStats:
    documents: int
    tokens: int


@dataclass(frozen=True)
class CacheStats:
    """Totals for a whole cache root (reused shards included).

    `tokens` counts stored tokens (BOS and EOS included); `text_tokens` excludes them, and
    `bytes_per_token` = text_bytes / text_tokens is the tokenizer's compression on this corpus.
    """

    cache_root: str
    documents: int
    tokens: int
    text_tokens: int
    text_bytes: int
    bytes_per_token: float
    train: SplitStats
    validation: SplitStats
    skipped_documents: int
    shards: int
    shards_reused: int
    shards_encoded: int
    # Documents encoded by this build (0 when everything was reused): one new shard's documents on an append.
    documents_encoded: int = 0
    tokens_encoded: int = 0
    # Wall seconds of the two phases of this build: the shards' encoding, and moving their rows into the cache.
    encode_seconds: float = 0.0
    assembly_seconds: float = 0.0
    # The shard files this build wrote, as they stand at its end: (path under the cache root, bytes,
    # sha256 of the bytes written). The commit takes them instead of reading the files back.
    files_written: tuple[tuple[str, int, str], ...] = ()

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "files_written"}


def with_validation_minimum(cfg: CacheConfig, doc_ids: Iterable[str]) -> CacheConfig:
    """``cfg`` with its validation threshold raised, where the fraction holds out fewer than
    ``validation_min_documents`` of ``doc_ids``, to just above the id hash of the minimum-th lowest:
    those documents, the same whatever order they come in, go to validation. At most half the
    documents are held out. A growing corpus lowers that hash, so the threshold (in the cache's
    row identity) moves and the cache is rebuilt, until the fraction alone holds out enough."""
    if cfg.validation_min_documents is None:
        return cfg
    return replace(cfg, validation_fraction=corpus_threshold(cfg.validation_fraction, cfg.validation_min_documents,
                                                             doc_ids))


def stats_from_manifest(cache_root: str, manifest: dict, reused: int) -> CacheStats:
    """Totals of a cache root whose first `reused` ledger shards were kept and the rest encoded."""
    shards = manifest["shards"]
    encoded = shards[reused:]

    def total(field_name: str) -> int:
        return sum(s[field_name] for s in shards)

    train = SplitStats(total("train_documents"), total("train_tokens"))
    val = SplitStats(total("validation_documents"), total("validation_tokens"))
    docs = train.documents + val.documents
    tokens = train.tokens + val.tokens
    text_tokens = tokens - 2 * docs
    text_bytes = total("text_bytes")
    return CacheStats(
        cache_root=cache_root,
        documents=docs,
        tokens=tokens,
        text_tokens=text_tokens,
        text_bytes=text_bytes,
        bytes_per_token=text_bytes / text_tokens if text_tokens else 0.0,
        train=train,
        validation=val,
        skipped_documents=total("skipped_documents"),
        shards=len(shards),
        shards_reused=reused,
        shards_encoded=len(encoded),
        documents_encoded=sum(s["train_documents"] + s["validation_documents"] for s in encoded),
        tokens_encoded=sum(s["train_tokens"] + s["validation_tokens"] for s in encoded),
    )
