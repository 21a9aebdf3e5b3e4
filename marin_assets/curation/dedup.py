"""Exact and fuzzy (MinHash LSH, Jaccard-verified) deduplication: incremental, out of core.

Pure logic over polars, numpy and an fsspec directory (the index); no Dagster. See docs/dedup.md.
This module decides which documents are kept and runs the updates of the index; the index as it is
stored is `dedup_index.py`, the passes that build it `dedup_passes.py`.

One ``update_index`` call adds shards that the index has not seen:

1. Order. New shards get sequence numbers after every registered one, sorted by
   ``(shard_key, source)``; a document's order is ``(seq, row)``, packed as ``seq << 32 | row``.
   Earlier documents win ("first seen is kept"), so decisions about registered shards never change.
2. Keys (per new shard, one unit of work each: ``shard_keys_pass``): exact and LSH band keys,
   spilled into the index by bucket-hash range.
3. Collisions (per partition: ``partition_pass``): the new keys matched against that partition's
   runs of kept documents, as independent units of work merged in partition order.
4. Centre assignment (new documents in order): a document is dropped if it is an exact copy of a
   kept document (a "centre"), or else if its exact Jaccard with a colliding centre reaches the
   threshold (the earliest such centre is kept in its place); otherwise it becomes a centre. Only
   centres are ever candidates, so every dropped document is verified against the very document
   kept in its place: no drops by chaining.
5. Commit (per batch of shards): decisions per new shard, the kept documents' keys as one sorted
   run per partition, then the registry entry last. A batch without its registry entry does not
   exist; its files are removed by the next update, which redoes it.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from marin_assets.arrays import sorted_unique
from marin_assets.curation.dedup_index import (
    REQUIRED_COLUMNS,
    ROW_BITS,
    ROW_MASK,
    DedupConfig,
    IndexDir,
    RegisteredShard,
    ShardInput,
    open_index,
    parquet_bytes,
    registry_path,
)
from marin_assets.curation.dedup_passes import (
    KEY_BYTES,
    CollisionPass,
    KeysPass,
    RunCommit,
    partition_commit_pass,
    partition_pass,
    shard_keys_pass,
)
from marin_assets.curation.minhash import SignatureTable, exact_jaccard, shingle_sets
from marin_resources.parallel_map import ParallelMap, in_process_map

SHARD_KEY_COLUMN = "shard_key"

DUPLICATES_SCHEMA = {
    "dropped_id": pl.Utf8,
    "dropped_source": pl.Utf8,
    "dropped_shard": pl.Utf8,
    "dropped_source_id": pl.Utf8,
    "kept_id": pl.Utf8,
    "kept_source": pl.Utf8,
    "kept_shard": pl.Utf8,
    "kept_source_id": pl.Utf8,
    "jaccard": pl.Float64,
    "reason": pl.Utf8,
}
# A shard's decisions: its dropped rows (by position in the shard) and what replaced each.
DECISION_SCHEMA = {"dropped_row": pl.UInt32, **DUPLICATES_SCHEMA}


def lsh_threshold(bands: int, rows: int) -> float:
    """Jaccard similarity where the LSH S-curve is steepest: (1/bands)**(1/rows)."""
    return (1.0 / bands) ** (1.0 / rows)


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
    """Probability that two sets with this Jaccard share at least one band: 1-(1-s**r)**b."""
    return 1.0 - (1.0 - similarity**rows) ** bands


class Shard(NamedTuple):
    """One shard held in memory: its key (sorts in ingestion order), documents and signatures."""

    shard_key: str
    docs: pl.DataFrame
    signatures: SignatureTable
    source: str = ""


@dataclass(frozen=True)
class IndexUpdate:
    new_shards: list[RegisteredShard]
    stats: dict[str, int | float]
    reset_reason: str | None  # why the index started over, or None
    # The index files this update wrote (path: size, sha256 of the bytes written), for the commit.
    files_written: dict[str, tuple[int, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class DedupResult:
    kept: pl.DataFrame  # input columns plus shard_key, ordered by (shard order, row position)
    duplicates: pl.DataFrame  # DUPLICATES_SCHEMA, one row per dropped input row
    stats: dict[str, int | float]


def decision_path(seq: int) -> str:
    return f"decisions/{seq:06d}.parquet"


INVOLVED_COLUMNS = ("id", "text", "source_id")
# Rows per Parquet row group of a shard's documents (`filtered/`), so that reading a few colliding
# documents of an earlier shard reads a few groups of this many, not the shard.
DOCUMENT_ROW_GROUP = 256


def read_parquet_rows(handle, rows: Sequence[int], columns: Sequence[str] = INVOLVED_COLUMNS) -> pl.DataFrame:
    """Rows ``rows`` (positions in the file, in the order given) of a Parquet file, reading only the
    row groups that hold them."""
    parquet = pq.ParquetFile(handle)
    sizes = np.array([parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    wanted = np.asarray(rows, dtype=np.int64)
    if wanted.size and (wanted.min() < 0 or wanted.max() >= starts[-1]):
        raise IndexError(f"rows {wanted.min()}..{wanted.max()} asked of a Parquet file of {starts[-1]} rows")
    group_of = np.searchsorted(starts, wanted, side="right") - 1
    groups = sorted_unique(group_of)
    # Where each read group starts in the concatenation of the groups read.
    base = np.zeros(len(sizes), dtype=np.int64)
    base[groups] = np.concatenate([[0], np.cumsum(sizes[groups])[:-1]])
    frame = pl.from_arrow(parquet.read_row_groups(groups.tolist(), columns=list(columns)))
    return frame[(base[group_of] + wanted - starts[group_of]).tolist()]


# ---------------------------------------------------------------------------------------------
# Centre assignment over verified edges
# ---------------------------------------------------------------------------------------------


@dataclass
class _Involved:
    """What verification and the duplicates table need about documents that collide."""

    ids: dict[int, str] = field(default_factory=dict)
    source_ids: dict[int, str] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)  # only for exact-key collisions
    sets: dict[int, np.ndarray] = field(default_factory=dict)


def _load_involved(
    docs: set[int], exact_docs: set[int], shard_by_seq: dict[int, ShardInput], shingle_size: int
) -> _Involved:
    involved = _Involved()
    by_seq: dict[int, list[int]] = {}
    for doc in sorted(docs):
        by_seq.setdefault(doc >> ROW_BITS, []).append(doc)
    for seq, members in by_seq.items():
        # One shard at a time; only the colliding rows are kept (and, where it can, read).
        shard, wanted = ShardInput(*shard_by_seq[seq]), [doc & ROW_MASK for doc in members]
        rows = shard.load_rows(wanted) if shard.load_rows is not None else \
            shard.load_docs().select(*INVOLVED_COLUMNS)[wanted]
        texts = rows["text"].to_list()
        for doc, doc_id, source_id, text, shingles in zip(
            members, rows["id"], rows["source_id"].cast(pl.Utf8), texts, shingle_sets(texts, shingle_size)
        ):
            involved.ids[doc] = doc_id
            involved.source_ids[doc] = source_id
            involved.sets[doc] = shingles
            if doc in exact_docs:
                involved.texts[doc] = text
    return involved


# Colliding documents per unit of centre assignment when a batch is spread (whole components each).
CENTRE_UNIT_DOCS = 20_000
CENTRE_COUNTS = ("lsh_candidate_pairs", "verified_pairs", "rejected_pairs")


class CentreUnit(NamedTuple):
    """Whole connected components of a batch's collision graph: each colliding bucket's documents
    (sorted) and whether it is the exact band, and the shards that hold those documents, by seq."""

    groups: list[tuple[list[int], bool]]
    shards: dict[int, ShardInput]


class CentreAssignment(NamedTuple):
    """(dropped doc, kept doc, jaccard, reason) for every dropped new document of a unit, in document
    order; the ids and source ids of those documents; and the verification counts."""

    drops: list[tuple[int, int, float, str]]
    ids: dict[int, str]
    source_ids: dict[int, str]
    counts: dict[str, int]


@dataclass(frozen=True)
class CentreJob:
    """What every centre unit of a batch shares: the batch's first document and the config."""

    first_new_doc: int
    config: DedupConfig


def assign_centres(unit: CentreUnit, job: CentreJob) -> CentreAssignment:
    """First-seen centre assignment over some components of the collision graph: the colliding
    rows are read (their row groups only, where the shard can) and shingled, then each new document
    in document order is dropped in favour of the first centre of its buckets that it matches
    (exactly, or with Jaccard >= threshold), or becomes a centre of all its buckets.

    A document's candidates are the centres of its own buckets, so the documents of one connected
    component are decided without looking outside it: components are independent units of work, and
    the drops of all units, merged in document order, are those of one pass over the whole batch."""
    config, first_new_doc = job.config, job.first_new_doc
    counts = dict.fromkeys(CENTRE_COUNTS, 0)
    centres: list[list[int]] = []  # per group: its centres so far, in order
    groups_of: dict[int, list[int]] = {}  # new document -> its groups
    exact_docs: set[int] = set()
    involved_docs: set[int] = set()
    for group, (members, is_exact) in enumerate(unit.groups):
        centres.append([doc for doc in members if doc < first_new_doc])  # indexed documents are centres
        involved_docs.update(members)
        for doc in members:
            if doc >= first_new_doc:
                groups_of.setdefault(doc, []).append(group)
        if is_exact:
            exact_docs.update(members)
    involved = _load_involved(involved_docs, exact_docs, unit.shards, config.minhash.shingle_size)
    drops = []
    for doc in sorted(groups_of):
        exact_match = None
        candidates: set[int] = set()
        for group in groups_of[doc]:
            if unit.groups[group][1]:
                same_id = [centre for centre in centres[group] if involved.ids[centre] == involved.ids[doc]]
                exact_match = min(same_id, default=exact_match)
            else:
                candidates.update(centres[group])
        if exact_match is not None:
            if involved.texts[exact_match] != involved.texts[doc]:
                raise ValueError(
                    f"two documents share an id with a different text: {involved.ids[doc]} "
                    "(id must be the sha256 of the text)"
                )
            drops.append((doc, exact_match, 1.0, "exact"))
            continue
        for centre in sorted(candidates):
            counts["lsh_candidate_pairs"] += 1
            similarity = exact_jaccard(involved.sets[doc], involved.sets[centre])
            if similarity >= config.jaccard_threshold:
                counts["verified_pairs"] += 1
                drops.append((doc, centre, similarity, "fuzzy"))
                break
            counts["rejected_pairs"] += 1
        else:
            for group in groups_of[doc]:
                centres[group].append(doc)
    named = {doc for dropped, kept, *_ in drops for doc in (dropped, kept)}
    return CentreAssignment(drops, {doc: involved.ids[doc] for doc in named},
                            {doc: involved.source_ids[doc] for doc in named}, counts)


def centre_units(collisions: pl.DataFrame, exact_band: int, shard_by_seq: dict[int, ShardInput],
                 unit_docs: int | None) -> list[CentreUnit]:
    """The batch's colliding buckets cut into units of whole connected components (documents linked
    by a shared bucket), of about ``unit_docs`` documents each, in order of their first document;
    None: one unit. Only integers are handled here: no text is read."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    if collisions.is_empty():
        return []
    groups = collisions.group_by("band", "bucket", maintain_order=True).agg(pl.col("doc").sort())
    members_of = groups["doc"].to_list()
    is_exact = (groups["band"] == exact_band).to_list()
    docs = sorted_unique(collisions["doc"].to_numpy())
    # Link each bucket's documents to its first one; the components are the independent units.
    lengths = np.array([len(members) for members in members_of])
    member_nodes = np.searchsorted(docs, np.concatenate([np.asarray(m, dtype=np.uint64) for m in members_of]))
    group_first_nodes = member_nodes[np.concatenate([[0], np.cumsum(lengths)[:-1]])]
    graph = coo_matrix((np.ones(len(member_nodes), dtype=np.int8),
                        (np.repeat(group_first_nodes, lengths), member_nodes)), shape=(len(docs), len(docs)))
    _, label = connected_components(graph, directed=False)
    group_component = label[group_first_nodes]
    # Components in order of their first document (docs are sorted, so a label's first node is it).
    _, first_node_of_label = np.unique(label, return_index=True)
    order = np.argsort(first_node_of_label, kind="stable")
    sizes = np.bincount(label)
    unit_of_component = np.empty(len(sizes), dtype=np.int64)
    unit, filled = 0, 0
    for component in order:
        if unit_docs is not None and filled and filled + sizes[component] > unit_docs:
            unit, filled = unit + 1, 0
        unit_of_component[component] = unit
        filled += sizes[component]
    units = [CentreUnit([], {}) for _ in range(unit + 1)]
    for members, exact, component in zip(members_of, is_exact, group_component):
        target = units[unit_of_component[component]]
        target.groups.append((members, exact))
        for doc in members:
            seq = doc >> ROW_BITS
            if seq not in target.shards:
                target.shards[seq] = shard_by_seq[seq]
    return units


# ---------------------------------------------------------------------------------------------
# One update of the index
# ---------------------------------------------------------------------------------------------


def _zero_counts() -> dict[str, int | float]:
    return {
        "input_docs": 0,
        "docs_without_tokens": 0,
        "colliding_keys": 0,
        "colliding_shards": 0,
        "centre_units": 0,
        "max_partition_keys": 0,
        "index_row_groups": 0,
        "index_row_groups_read": 0,
        "index_filter_bytes": 0,
        "lsh_candidate_pairs": 0,
        "verified_pairs": 0,
        "rejected_pairs": 0,
        "exact_duplicates": 0,
        "fuzzy_duplicates": 0,
        "dropped_below_threshold_via_chain": 0,
        "kept_docs": 0,
        "seconds_keys": 0.0,
        "seconds_passes": 0.0,
        "seconds_components": 0.0,
        "seconds_centres": 0.0,
        "seconds_commit": 0.0,
    }


def _index_batch(
    index: IndexDir,
    batch: list[RegisteredShard],
    batch_number: int,
    shard_by_seq: dict[int, ShardInput],
    config: DedupConfig,
    stats: dict[str, int | float],
    parallel_map: ParallelMap,
    worth_spreading: Callable[[int], bool],
) -> None:
    partitions = config.index_partitions
    new_keys = 0
    clock = time.monotonic()

    def lap(phase: str) -> None:  # wall seconds per phase: which part of an update is serial
        nonlocal clock
        now = time.monotonic()
        stats[f"seconds_{phase}"] += round(now - clock, 3)
        clock = now

    # Keys: one unit of work per new shard, each spilling its keys into the index by partition.
    expected_keys = sum(shard_by_seq[shard.seq].documents or 0 for shard in batch) * (config.bands + 1)
    spread = parallel_map if worth_spreading(expected_keys * KEY_BYTES) else in_process_map
    counted = spread(shard_keys_pass, [(shard.seq, shard_by_seq[shard.seq]) for shard in batch],
                     KeysPass(index, config))
    for shard, (docs, without_tokens, keys) in zip(batch, counted):
        shard.docs = docs
        stats["input_docs"] += docs
        stats["docs_without_tokens"] += without_tokens
        new_keys += keys

    lap("keys")
    # Candidate step: one bucket range per unit of work, merged in partition order. A batch whose
    # keys are worth spreading spreads its colliding rows' reads and its run writes too.
    spread = parallel_map if worth_spreading(new_keys * KEY_BYTES) else in_process_map
    collisions = []
    for found, costs in spread(partition_pass, list(range(partitions)), CollisionPass(index, batch_number)):
        stats["index_row_groups"] += costs["index_row_groups"]
        stats["index_row_groups_read"] += costs["index_row_groups_read"]
        stats["index_filter_bytes"] += costs["index_filter_bytes"]
        stats["max_partition_keys"] = max(stats["max_partition_keys"], costs["partition_keys"])
        collisions.append(found)
    colliding = pl.concat(collisions)
    stats["colliding_keys"] += len(colliding)
    lap("passes")

    spread_units = spread is not in_process_map
    units = centre_units(colliding, config.exact_band, shard_by_seq, CENTRE_UNIT_DOCS if spread_units else None)
    stats["centre_units"] += len(units)
    stats["colliding_shards"] += len({seq for unit in units for seq in unit.shards})
    lap("components")
    # Centre assignment: whole components per unit, merged in document order.
    assigned = spread(assign_centres, units, CentreJob(batch[0].seq << ROW_BITS, config))
    drops = sorted(drop for unit in assigned for drop in unit.drops)
    ids = {doc: doc_id for unit in assigned for doc, doc_id in unit.ids.items()}
    source_ids = {doc: source_id for unit in assigned for doc, source_id in unit.source_ids.items()}
    for unit in assigned:
        for name, count in unit.counts.items():
            stats[name] += count
    lap("centres")

    def where(doc: int) -> tuple[str, str]:
        owner = shard_by_seq[doc >> ROW_BITS]
        return owner.source, owner.shard_key

    rows_by_seq: dict[int, list[dict[str, Any]]] = {shard.seq: [] for shard in batch}
    for dropped, kept, similarity, reason in drops:
        dropped_source, dropped_shard = where(dropped)
        kept_source, kept_shard = where(kept)
        rows_by_seq[dropped >> ROW_BITS].append({
            "dropped_row": dropped & ROW_MASK,
            "dropped_id": ids[dropped],
            "dropped_source": dropped_source,
            "dropped_shard": dropped_shard,
            "dropped_source_id": source_ids[dropped],
            "kept_id": ids[kept],
            "kept_source": kept_source,
            "kept_shard": kept_shard,
            "kept_source_id": source_ids[kept],
            "jaccard": similarity,
            "reason": reason,
        })
        stats["exact_duplicates" if reason == "exact" else "fuzzy_duplicates"] += 1
        stats["dropped_below_threshold_via_chain"] += int(similarity < config.jaccard_threshold)
    index.write_many({
        decision_path(shard.seq): parquet_bytes(pl.DataFrame(rows_by_seq[shard.seq], schema=DECISION_SCHEMA))
        for shard in batch})
    for shard in batch:
        shard.kept = shard.docs - len(rows_by_seq[shard.seq])
        stats["kept_docs"] += shard.kept
    dropped_docs = np.sort(np.array([dropped for dropped, *_ in drops], dtype=np.uint64))
    runs = spread(partition_commit_pass, list(range(partitions)), RunCommit(index, batch_number, dropped_docs))
    index.written |= {rel: entry for files in runs for rel, entry in files}  # written by the units, wherever they ran
    # Written last: the batch exists from here on.
    body = {"batch": batch_number, "config": config.to_json(), "shards": [asdict(shard) for shard in batch]}
    index.write_bytes(registry_path(batch_number), json.dumps(body, indent=1, sort_keys=True).encode())
    index.remove_many(index.files("pending"))
    lap("commit")


def update_index(
    index: IndexDir, shards: Sequence[ShardInput], config: DedupConfig, *, batch_shards: int = 8,
    parallel_map: ParallelMap = in_process_map, worth_spreading: Callable[[int], bool] = lambda nbytes: True,
) -> IndexUpdate:
    """Add every shard the index has not registered; decisions about registered shards stay fixed.

    ``shards`` are all current shards of the dedup group (registered ones are read only when a new
    document collides with one of their kept documents). ``batch_shards`` bounds how many new shards
    are decided together (memory); the decisions do not depend on it. ``parallel_map`` runs a batch's
    units of work: each new shard's keys (`shard_keys_pass`), each bucket range's candidate pass
    (`partition_pass`), the centre assignment of whole components of the collision graph
    (`assign_centres`, about `CENTRE_UNIT_DOCS` colliding documents a unit) and each bucket range's
    new run (`partition_commit_pass`); one after another here by default, or spread over workers,
    for a batch whose keys (in bytes) ``worth_spreading`` accepts; a smaller batch does not pay for
    starting workers and runs its units here, its centres as one unit. This process only finds the
    components (integers) and merges. The decisions depend on neither.
    """
    if batch_shards < 1:
        raise ValueError(f"batch_shards must be >= 1, got {batch_shards}")
    inputs: dict[tuple[str, str], ShardInput] = {}
    for shard in shards:
        shard = ShardInput(*shard)
        if (shard.source, shard.shard_key) in inputs:
            raise ValueError(f"shard keys must be unique within a source, got {shard.source}/{shard.shard_key} twice")
        inputs[(shard.source, shard.shard_key)] = shard
    index.written.clear()
    registered, batches, reset_reason = open_index(index, config, inputs)
    known = {(shard.source, shard.shard_key) for shard in registered}
    new = sorted((key for key in inputs if key not in known), key=lambda key: (key[1], key[0]))
    shard_by_seq = {shard.seq: inputs[(shard.source, shard.shard_key)] for shard in registered}
    stats: dict[str, int | float] = _zero_counts()
    added: list[RegisteredShard] = []
    next_seq = len(registered)
    for start in range(0, len(new), batch_shards):
        batch = []
        for source, shard_key in new[start : start + batch_shards]:
            batch.append(RegisteredShard(next_seq, source, shard_key, inputs[(source, shard_key)].version))
            shard_by_seq[next_seq] = inputs[(source, shard_key)]
            next_seq += 1
        _index_batch(index, batch, batches, shard_by_seq, config, stats, parallel_map, worth_spreading)
        added.extend(batch)
        batches += 1
    return IndexUpdate(new_shards=added, stats=stats, reset_reason=reset_reason, files_written=dict(index.written))


# ---------------------------------------------------------------------------------------------
# Applying decisions; the in-memory entry point
# ---------------------------------------------------------------------------------------------


def apply_decisions(docs: pl.DataFrame, decisions: pl.DataFrame) -> pl.DataFrame:
    """The shard's documents without its dropped rows, in their original order."""
    keep = np.ones(len(docs), dtype=bool)
    keep[decisions["dropped_row"].to_numpy()] = False
    return docs.filter(pl.Series(keep))


def duplicates_table(decisions: pl.DataFrame) -> pl.DataFrame:
    return decisions.select(list(DUPLICATES_SCHEMA))


def decisions_digest(entries: Iterable[tuple[str, str, str]]) -> str:
    """sha256 over (shard key, shard version, decision file sha256): equal digests, equal outputs."""
    digest = hashlib.sha256()
    for entry in sorted(entries):
        digest.update("\0".join(entry).encode() + b"\n")
    return digest.hexdigest()


def dedup_source(shards: Sequence[Shard | tuple], config: DedupConfig, *, batch_shards: int = 8) -> DedupResult:
    """Deduplicate in-memory shards in one update of a fresh index in a temp dir.

    Shard order is ``(shard_key, source)``, so the result does not depend on the order of ``shards``.
    """
    shards = [Shard(*shard) for shard in shards]
    inputs = [
        ShardInput(shard.source, shard.shard_key, "", lambda docs=shard.docs: docs, lambda sigs=shard.signatures: sigs)
        for shard in shards
    ]
    with tempfile.TemporaryDirectory(prefix="marin-dedup-index-") as tmp:
        index = IndexDir.local(tmp)
        update = update_index(index, inputs, config, batch_shards=batch_shards)
        by_key = {(shard.source, shard.shard_key): shard for shard in shards}
        kept, duplicates = [], []
        for registered in update.new_shards:
            shard = by_key[(registered.source, registered.shard_key)]
            decisions = index.read_parquet(decision_path(registered.seq))
            kept.append(
                apply_decisions(shard.docs, decisions).with_columns(
                    pl.col("id", "text").cast(pl.Utf8), pl.lit(shard.shard_key, pl.Utf8).alias(SHARD_KEY_COLUMN)
                )
            )
            duplicates.append(duplicates_table(decisions))
    stats = {
        **update.stats,
        "lsh_bands": config.bands,
        "lsh_rows": config.rows,
        "lsh_threshold": lsh_threshold(config.bands, config.rows),
        "jaccard_threshold": config.jaccard_threshold,
    }
    if not kept:
        empty = pl.DataFrame(schema={column: pl.Utf8 for column in (*REQUIRED_COLUMNS, SHARD_KEY_COLUMN)})
        return DedupResult(empty, pl.DataFrame(schema=DUPLICATES_SCHEMA), stats)
    return DedupResult(pl.concat(kept, how="diagonal_relaxed"), pl.concat(duplicates), stats)
