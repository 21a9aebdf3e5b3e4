"""The `filtered/<source>` step as pure functions: heuristic rules, the optional quality model
and MinHash signatures over a frame of documents, one chunk at a time, and the merge of the
chunks into the shard's outputs.

A shard filtered in one piece or as row ranges on Ray (`marin_resources.data_parallel`) gives
the same frames row for row, so the same Parquet bytes and data version: every decision is
per document, and the merge puts the rows back in one-piece order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from marin_assets.curation.filters import FilterConfig, apply_filters
from marin_assets.curation.minhash import MinHashConfig, SignatureTable, compute_signatures
from marin_assets.curation.quality import QualityModel, score


@dataclass(frozen=True)
class FilterTask:
    """What filtering a shard needs besides its documents; sent once to every chunk's worker."""

    filters: FilterConfig
    minhash: MinHashConfig
    quality: QualityModel | None = None
    quality_threshold: float | None = None


@dataclass
class FilteredChunk:
    kept: pl.DataFrame
    dropped_by_rules: pl.DataFrame  # with a null quality_score column when a quality model is used
    dropped_by_quality: pl.DataFrame | None
    counts: dict[str, int]
    hashvalues: np.ndarray  # MinHash signatures of `kept`, row-aligned


@dataclass
class FilteredShard:
    kept: pl.DataFrame
    dropped: pl.DataFrame
    counts: dict[str, int]  # rule (or "quality") -> documents it dropped
    signatures: SignatureTable


def filter_chunk(docs: pl.DataFrame, task: FilterTask) -> FilteredChunk:
    """Rules, then the quality model on what the rules kept, then signatures of what is left."""
    result = apply_filters(docs, task.filters)
    kept, dropped = result.kept, result.dropped
    counts = dict(result.per_rule_drop_counts)
    low = None
    if task.quality is not None:
        scores = score(task.quality, kept["text"].to_list()) if kept.height else np.zeros(0)
        scored = kept.with_columns(pl.Series("quality_score", scores, dtype=pl.Float64))
        low = scored.filter(pl.col("quality_score") < task.quality_threshold)
        kept = scored.filter(pl.col("quality_score") >= task.quality_threshold)
        dropped = dropped.with_columns(pl.lit(None, pl.Float64).alias("quality_score"))
        low = low.with_columns(pl.lit("quality").alias("reason"), pl.lit(["quality"]).alias("failed_rules")) \
            .select(dropped.columns)
        counts["quality"] = low.height
    return FilteredChunk(kept, dropped, low, counts, compute_signatures(kept, task.minhash).hashvalues)


def merge_chunks(chunks: list[FilteredChunk], task: FilterTask) -> FilteredShard:
    """The chunks of one shard, in row order, as the shard's outputs. Dropped documents list the
    rules' drops first, then the quality model's, as when the shard is filtered in one piece."""
    kept = pl.concat([c.kept for c in chunks], how="vertical").rechunk()
    dropped = pl.concat([c.dropped_by_rules for c in chunks], how="vertical")
    if task.quality is not None:
        low = pl.concat([c.dropped_by_quality for c in chunks], how="vertical")
        dropped = pl.concat([dropped, low], how="diagonal_relaxed")
    counts: dict[str, int] = {}
    for chunk in chunks:
        for rule, n in chunk.counts.items():
            counts[rule] = counts.get(rule, 0) + n
    hashvalues = np.concatenate([c.hashvalues for c in chunks]).astype(np.uint32, copy=False)
    signatures = SignatureTable(ids=kept["id"].to_numpy().astype(object), hashvalues=hashvalues, config=task.minhash)
    return FilteredShard(kept, dropped.rechunk(), counts, signatures)
