"""Exact and fuzzy (MinHash LSH, verified) deduplication of one source's shards.

Pure logic: polars frames in, polars frames out, no Dagster. See docs/dedup.md for the design.

Order of operations in ``dedup_source``:

1. Exact: documents with the same ``id`` (hex sha256 of the text) are copies; the copy that comes
   first by (shard_key, row position within the shard) is kept.
2. Fuzzy, on the exact-unique documents that have at least one token: datasketch ``MinHashLSH``
   with ``bands x rows`` proposes candidate pairs from the cached signatures; each candidate pair
   is verified by exact Jaccard of the two shingle sets (threshold ``jaccard_threshold``);
   verified pairs are edges of a union-find; each connected component keeps one representative:
   the longest text (in characters), ties broken by the smallest id.
3. Every dropped row points at the kept document that replaced it, with the exact Jaccard between
   the two shingle sets (1.0 for identical text) and the reason (``exact`` when the text is
   identical to the kept one, else ``fuzzy``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import polars as pl
from datasketch import LeanMinHash, MinHashLSH

from marin_assets.curation.minhash import (
    MinHashConfig,
    SignatureTable,
    empty_signature_mask,
    exact_jaccard,
    shingle_sets,
)

REQUIRED_COLUMNS = ("id", "text", "source", "source_id", "metadata")
SHARD_KEY_COLUMN = "shard_key"
# datasketch's own scheme name for the permutations minhash.py reproduces.
_DATASKETCH_SCHEME = "affine32"

DUPLICATES_SCHEMA = {
    "dropped_id": pl.Utf8,
    "dropped_shard": pl.Utf8,
    "dropped_source_id": pl.Utf8,
    "kept_id": pl.Utf8,
    "kept_shard": pl.Utf8,
    "kept_source_id": pl.Utf8,
    "jaccard": pl.Float64,
    "reason": pl.Utf8,
}


def lsh_threshold(bands: int, rows: int) -> float:
    """Jaccard similarity where the LSH S-curve is steepest: (1/bands)**(1/rows)."""
    return (1.0 / bands) ** (1.0 / rows)


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
    """Probability that two sets with this Jaccard share at least one band: 1-(1-s**r)**b."""
    return 1.0 - (1.0 - similarity**rows) ** bands


@dataclass(frozen=True)
class DedupConfig:
    """Deduplication of one source. ``bands * rows`` must not exceed ``minhash.num_perm``.

    The default 12 bands x 10 rows puts the S-curve midpoint at 0.78, a little under the 0.8
    verification threshold, so pairs right at the threshold are still proposed with probability
    0.75 and pairs at 0.9 with 0.994; verification removes the extra candidates below 0.8.
    """

    minhash: MinHashConfig = field(default_factory=MinHashConfig)
    bands: int = 12
    rows: int = 10
    jaccard_threshold: float = 0.8
    fuzzy: bool = True

    def __post_init__(self) -> None:
        if self.bands < 2 or self.rows < 1:
            raise ValueError(f"need bands >= 2 and rows >= 1, got bands={self.bands} rows={self.rows}")
        if self.bands * self.rows > self.minhash.num_perm:
            raise ValueError(
                f"bands * rows = {self.bands * self.rows} exceeds num_perm = {self.minhash.num_perm}"
            )
        if not 0.0 < self.jaccard_threshold <= 1.0:
            raise ValueError(f"jaccard_threshold must be in (0, 1], got {self.jaccard_threshold}")


class Shard(NamedTuple):
    """One shard of a source: its key (sorts in ingestion order), documents and signatures."""

    shard_key: str
    docs: pl.DataFrame
    signatures: SignatureTable


@dataclass(frozen=True)
class DedupResult:
    kept: pl.DataFrame  # input columns plus shard_key, ordered by (shard_key, row position)
    duplicates: pl.DataFrame  # DUPLICATES_SCHEMA, one row per dropped input row
    stats: dict[str, int | float]


class _UnionFind:
    def __init__(self, size: int) -> None:
        self.parent = list(range(size))

    def find(self, node: int) -> int:
        parent = self.parent
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def union(self, a: int, b: int) -> None:
        root_a, root_b = self.find(a), self.find(b)
        if root_a != root_b:
            # Smaller root wins so the structure does not depend on edge order.
            self.parent[max(root_a, root_b)] = min(root_a, root_b)


def _validate_shards(shards: Sequence[Shard], config: DedupConfig) -> list[Shard]:
    shards = [Shard(*shard) for shard in shards]
    keys = [shard.shard_key for shard in shards]
    if len(set(keys)) != len(keys):
        raise ValueError(f"shard keys must be unique, got duplicates in {sorted(keys)}")
    for shard in shards:
        missing = [column for column in REQUIRED_COLUMNS if column not in shard.docs.columns]
        if missing:
            raise ValueError(f"shard {shard.shard_key!r} lacks columns {missing}")
        if SHARD_KEY_COLUMN in shard.docs.columns:
            raise ValueError(f"shard {shard.shard_key!r} already has a {SHARD_KEY_COLUMN!r} column")
        for column in ("id", "text"):
            # Null dtype is what polars infers for an empty column; it casts to String losslessly.
            if shard.docs.schema[column] not in (pl.Utf8, pl.Null):
                raise ValueError(
                    f"shard {shard.shard_key!r} column {column!r} must be String, got {shard.docs.schema[column]}"
                )
        if shard.docs["id"].null_count() or shard.docs["text"].null_count():
            raise ValueError(f"shard {shard.shard_key!r} has null id or text values")
        if shard.signatures.config != config.minhash:
            raise ValueError(
                f"shard {shard.shard_key!r} signatures were computed with {shard.signatures.config}, "
                f"expected {config.minhash}"
            )
        if len(shard.signatures) != len(shard.docs) or not np.array_equal(
            shard.signatures.ids, shard.docs["id"].to_numpy().astype(object)
        ):
            raise ValueError(
                f"shard {shard.shard_key!r} signatures are not row-aligned with its documents "
                "(stale cache?): recompute them with compute_signatures"
            )
    return sorted(shards, key=lambda shard: shard.shard_key)


def _combine(shards: list[Shard]) -> tuple[pl.DataFrame, np.ndarray]:
    """All rows in (shard_key, row) order with shard_key and position; signatures stacked alike."""
    frames = [
        shard.docs.with_columns(
            pl.col("id", "text").cast(pl.Utf8), pl.lit(shard.shard_key, dtype=pl.Utf8).alias(SHARD_KEY_COLUMN)
        )
        for shard in shards
    ]
    combined = pl.concat(frames, how="diagonal_relaxed").with_row_index("_position")
    hashvalues = np.concatenate([shard.signatures.hashvalues for shard in shards], axis=0)
    return combined, hashvalues


def _verified_components(
    hashvalues: np.ndarray, eligible: np.ndarray, texts: pl.Series, config: DedupConfig, stats: dict
) -> tuple[_UnionFind, dict[int, np.ndarray]]:
    """Union-find over LSH candidate pairs (i < j, in sorted order) that pass exact Jaccard, and the
    shingle sets of every row that has a candidate."""
    lsh = MinHashLSH(num_perm=config.minhash.num_perm, params=(config.bands, config.rows))
    sketches = {
        int(row): LeanMinHash(seed=config.minhash.seed, hashvalues=hashvalues[row], scheme=_DATASKETCH_SCHEME)
        for row in eligible
    }
    with lsh.insertion_session() as session:
        for row, sketch in sketches.items():
            session.insert(row, sketch, check_duplication=False)
    # Two query passes instead of materializing all pairs: a cluster of k near-copies has k**2/2
    # pairs, too many to hold, but only k rows whose shingle sets are needed.
    involved = [row for row, sketch in sketches.items() if len(lsh.query(sketch)) > 1]
    sets = dict(zip(involved, shingle_sets(texts.gather(involved).to_list(), config.minhash.shingle_size)))
    union_find = _UnionFind(len(texts))
    for row in involved:
        for other in sorted(other for other in lsh.query(sketches[row]) if other > row):
            stats["lsh_candidate_pairs"] += 1
            if union_find.find(row) == union_find.find(other):
                # The edge cannot change the components; skipping it keeps big clusters linear.
                stats["pairs_already_connected"] += 1
            elif exact_jaccard(sets[row], sets[other]) >= config.jaccard_threshold:
                stats["verified_pairs"] += 1
                union_find.union(row, other)
            else:
                stats["rejected_pairs"] += 1
    return union_find, sets


def dedup_source(
    shards: Sequence[Shard | tuple[str, pl.DataFrame, SignatureTable]], config: DedupConfig
) -> DedupResult:
    """Deduplicate all shards of one source; the result does not depend on the order of ``shards``."""
    ordered = _validate_shards(shards, config)
    stats: dict[str, int | float] = {
        "input_docs": sum(len(shard.docs) for shard in ordered),
        "lsh_bands": config.bands,
        "lsh_rows": config.rows,
        "lsh_threshold": lsh_threshold(config.bands, config.rows),
        "jaccard_threshold": config.jaccard_threshold,
    }
    stats.update(_zero_counts())
    if not ordered:
        empty = pl.DataFrame(schema={column: pl.Utf8 for column in (*REQUIRED_COLUMNS, SHARD_KEY_COLUMN)})
        return DedupResult(empty, pl.DataFrame(schema=DUPLICATES_SCHEMA), stats)

    combined, hashvalues = _combine(ordered)
    ids = combined["id"].to_numpy().astype(object)
    texts = combined["text"]

    # Exact: the first row (in shard_key, row order) of every id is the unique copy.
    unique_rows = combined.group_by("id", maintain_order=True).agg(pl.col("_position").first())["_position"]
    unique_rows = np.sort(unique_rows.to_numpy())
    first_row_of_id = dict(zip(ids[unique_rows], unique_rows.tolist()))
    exact_rep = np.array([first_row_of_id[doc_id] for doc_id in ids], dtype=np.int64)
    mismatched = combined.filter(texts != texts.gather(exact_rep))
    if len(mismatched):
        raise ValueError(
            f"{len(mismatched)} rows share an id with a different text (id must be the sha256 of the text), "
            f"e.g. id {mismatched['id'][0]}"
        )

    # Fuzzy: candidates from LSH, verified edges, components over exact-unique rows.
    final_rep = {row: row for row in unique_rows.tolist()}  # unique row -> kept unique row
    jaccard_to_kept: dict[int, float] = {}
    if config.fuzzy:
        eligible = unique_rows[~empty_signature_mask(hashvalues[unique_rows])]
        stats["docs_without_tokens"] = int(len(unique_rows) - len(eligible))
        union_find, sets = _verified_components(hashvalues, eligible, texts, config, stats)
        components: dict[int, list[int]] = {}
        for row in sets:
            components.setdefault(union_find.find(row), []).append(row)
        lengths = texts.str.len_chars().cast(pl.Int64).to_numpy()
        for members in components.values():
            if len(members) < 2:
                continue
            stats["fuzzy_components"] += 1
            representative = min(members, key=lambda row: (-lengths[row], ids[row]))
            for row in members:
                if row != representative:
                    final_rep[row] = representative
                    jaccard_to_kept[row] = exact_jaccard(sets[row], sets[representative])
                    if jaccard_to_kept[row] < config.jaccard_threshold:
                        stats["dropped_below_threshold_via_chain"] += 1

    kept_row = np.array([final_rep[int(rep)] for rep in exact_rep], dtype=np.int64)
    is_kept = kept_row == np.arange(len(combined))
    dropped = np.flatnonzero(~is_kept)
    dropped_unique = exact_rep[dropped]  # the exact-unique copy of each dropped row
    same_text = dropped_unique == kept_row[dropped]
    jaccard = np.array(
        [1.0 if same else jaccard_to_kept[int(unique)] for same, unique in zip(same_text, dropped_unique)],
        dtype=np.float64,
    )
    shard_keys = combined[SHARD_KEY_COLUMN]
    source_ids = combined["source_id"].cast(pl.Utf8)
    duplicates = pl.DataFrame(
        {
            "dropped_id": ids[dropped].tolist(),
            "dropped_shard": shard_keys.gather(dropped),
            "dropped_source_id": source_ids.gather(dropped),
            "kept_id": ids[kept_row[dropped]].tolist(),
            "kept_shard": shard_keys.gather(kept_row[dropped]),
            "kept_source_id": source_ids.gather(kept_row[dropped]),
            "jaccard": jaccard,
            "reason": np.where(same_text, "exact", "fuzzy").tolist(),
        },
        schema=DUPLICATES_SCHEMA,
    )
    kept = combined.filter(pl.Series(is_kept)).drop("_position")
    stats["exact_duplicates"] = int(same_text.sum())
    stats["fuzzy_duplicates"] = int((~same_text).sum())
    stats["kept_docs"] = len(kept)
    return DedupResult(kept=kept, duplicates=duplicates, stats=stats)


def _zero_counts() -> dict[str, int]:
    return {
        "docs_without_tokens": 0,
        "lsh_candidate_pairs": 0,
        "pairs_already_connected": 0,
        "verified_pairs": 0,
        "rejected_pairs": 0,
        "fuzzy_components": 0,
        "dropped_below_threshold_via_chain": 0,
        "exact_duplicates": 0,
        "fuzzy_duplicates": 0,
        "kept_docs": 0,
    }
