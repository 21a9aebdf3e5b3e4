"""Exact paragraph deduplication, as Marin does it (after Dolma): a paragraph is a line; the first
occurrence of a line's exact text is kept and every later occurrence, in the same document or a
later one, is removed as a span. Blank lines are never duplicates. Pure logic; ``refine.py`` runs it
shard by shard in the dedup index's order and persists each shard's first-seen hashes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import polars as pl

SPANS_SCHEMA = {"id": pl.String, "start": pl.Int64, "end": pl.Int64, "paragraph_hash": pl.UInt64}


def paragraph_hash(paragraph: str) -> int:
    return int.from_bytes(hashlib.blake2b(paragraph.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass
class ParagraphDedupResult:
    documents: pl.DataFrame  # texts without their duplicate paragraphs; emptied documents left out
    emptied: pl.DataFrame  # documents every one of whose paragraphs was a duplicate
    spans: pl.DataFrame  # SPANS_SCHEMA: removed spans, character offsets into the original text
    new_hashes: np.ndarray  # uint64: paragraphs first seen in this batch, in order


def remove_duplicate_paragraphs(docs: pl.DataFrame, seen: set[int]) -> ParagraphDedupResult:
    """Remove from ``docs`` (in row order) every line whose text is in ``seen`` or occurred earlier;
    ``seen`` is updated in place with the new lines' hashes."""
    texts, ids = docs["text"].to_list(), docs["id"].to_list()
    new_texts: list[str] = []
    span_rows: list[tuple[str, int, int, int]] = []
    new_hashes: list[int] = []
    for doc_id, text in zip(ids, texts, strict=True):
        kept: list[str] = []
        offset = 0
        for line in text.split("\n"):
            end = offset + len(line) + 1  # with its newline
            if line.strip():
                digest = paragraph_hash(line)
                if digest in seen:
                    span_rows.append((doc_id, offset, min(end, len(text)), digest))
                    offset = end
                    continue
                seen.add(digest)
                new_hashes.append(digest)
            kept.append(line)
            offset = end
        new_texts.append("\n".join(kept).strip() if len(kept) < text.count("\n") + 1 else text)
    updated = docs.with_columns(pl.Series("text", new_texts, dtype=pl.String))
    empty = updated["text"].str.strip_chars() == ""
    spans = pl.DataFrame(span_rows, schema=SPANS_SCHEMA, orient="row")
    return ParagraphDedupResult(updated.filter(~empty), updated.filter(empty), spans,
                                np.array(new_hashes, dtype=np.uint64))
