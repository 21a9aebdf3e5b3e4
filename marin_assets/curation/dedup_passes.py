"""The index passes of one batch of new shards: per shard, its keys (`shard_keys_pass`); per
bucket-hash range, the candidate step (`partition_pass`) and the new run of kept keys
(`partition_commit_pass`). `dedup.py` runs them and decides, from the collisions they find, which
documents are kept. Kept apart from those decisions because each pass is a unit of work on its own:
a worker imports it by name and runs it against the index's files.

Keys (per new shard, one unit of work each): one exact key (the first 64 bits of the hex sha256
``id``) and, for documents with tokens, one LSH key per band of the cached MinHash signature. Keys
are split by bucket-hash range into ``index_partitions`` partitions and spilled into the index's
``pending/``.

Collisions (per partition): the new keys, spilled to the index by partition, are matched against
that partition's runs of kept documents, one run file at a time; groups of two or more documents
with at least one new document survive. Each partition's pass is a pure function of that
partition's files, so the passes are independent units of work (``parallel_map``: in turn in one
process, or one Ray task each); their outputs are merged in partition order. Peak memory of a pass
is one partition, not the corpus.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from marin_assets.arrays import sorted_unique
from marin_assets.curation.bucket_filters import build_filters, filter_path, filters_bytes, may_hold, read_filters
from marin_assets.curation.dedup_index import (
    REQUIRED_COLUMNS,
    ROW_BITS,
    ROW_MASK,
    DedupConfig,
    IndexDir,
    ShardInput,
    parquet_bytes,
)
from marin_assets.curation.minhash import SignatureTable, band_hashes, empty_signature_mask

KEY_SCHEMA = {"band": pl.UInt16, "bucket": pl.UInt64, "doc": pl.UInt64}
# Keys per row group of an index run: small enough that a lookup of a few keys reads little.
RUN_ROW_GROUP_KEYS = 8192
# Above this many new buckets per row group of a run (on average), most groups pass their filter
# by chance (at 16, about 30% do), and reading the filters (7.7% of the run) is not worth it.
FILTER_KEYS_PER_GROUP = 16
KEY_BYTES = 18  # a (band, bucket, doc) key: uint16 + uint64 + uint64


def _key_run_path(partition: int, batch: int) -> str:
    return f"keys/p{partition:04d}/{batch:06d}.parquet"


def _pending_keys_dir(partition: int) -> str:
    """Where the batch being decided spills its new shards' keys of one partition: in the index
    itself, so that a partition's pass can run on any worker that reaches the store."""
    return f"pending/p{partition:04d}"


# ---------------------------------------------------------------------------------------------
# Keys and the partitioned candidate step
# ---------------------------------------------------------------------------------------------


def _id_prefixes(ids: Sequence[str]) -> np.ndarray:
    """First 64 bits of each hex sha256 id, as uint64."""
    try:
        return np.fromiter((int(doc_id[:16], 16) for doc_id in ids), dtype=np.uint64, count=len(ids))
    except ValueError:
        bad = next(doc_id for doc_id in ids if not _is_hex_id(doc_id))
        raise ValueError(f"document id {bad!r} is not a hex sha256 of the text") from None


def _is_hex_id(doc_id: str) -> bool:
    try:
        int(doc_id[:16], 16)
    except ValueError:
        return False
    return len(doc_id) >= 16


def shard_keys(signatures: SignatureTable, seq: int, config: DedupConfig) -> tuple[pl.DataFrame, int]:
    """(KEY_SCHEMA frame of one shard's exact and LSH band keys, documents without tokens)."""
    count = len(signatures)
    docs = (np.uint64(seq) << np.uint64(ROW_BITS)) | np.arange(count, dtype=np.uint64)
    bands = [np.full(count, config.exact_band, dtype=np.uint16)]
    buckets = [_id_prefixes(signatures.ids)]
    owners = [docs]
    without_tokens = empty_signature_mask(signatures.hashvalues)
    if config.fuzzy:
        eligible = ~without_tokens
        hashes = band_hashes(signatures.hashvalues[eligible], config.bands, config.rows)
        bands.append(np.tile(np.arange(config.bands, dtype=np.uint16), int(eligible.sum())))
        buckets.append(hashes.reshape(-1))
        owners.append(np.repeat(docs[eligible], config.bands))
    keys = pl.DataFrame(
        {"band": np.concatenate(bands), "bucket": np.concatenate(buckets), "doc": np.concatenate(owners)},
        schema=KEY_SCHEMA,
    )
    return keys, int(without_tokens.sum())


def key_partition(buckets: np.ndarray, partitions: int) -> np.ndarray:
    """Partition of each bucket hash: its range among ``partitions`` equal ranges of the top 32 bits."""
    return ((buckets >> np.uint64(32)) * np.uint64(partitions)) >> np.uint64(32)


def split_by_partition(keys: pl.DataFrame, partitions: int) -> dict[int, pl.DataFrame]:
    """Non-empty partitions of a key frame, each sorted by (band, bucket, doc)."""
    part = key_partition(keys["bucket"].to_numpy(), partitions)
    return {
        int(index): frame.drop("_partition").sort("band", "bucket", "doc")
        for (index,), frame in keys.with_columns(pl.Series("_partition", part)).group_by("_partition")
    }


def partition_collisions(
    old_runs: Iterable[Callable[[np.ndarray], pl.DataFrame]], new_keys: pl.DataFrame
) -> pl.DataFrame:
    """Keys of one partition whose (band, bucket) holds two or more documents, one of them new.

    ``old_runs`` load the partition's runs of kept documents one at a time, given the sorted new
    bucket hashes (a loader may skip the parts of a run that hold none of them); each run is cut
    down to the buckets the new keys touch before the next is read, so memory is the new keys
    plus one run.
    """
    if new_keys.is_empty():
        return pl.DataFrame(schema=KEY_SCHEMA)
    new_buckets = new_keys.select("band", "bucket").unique()
    sorted_buckets = sorted_unique(new_buckets["bucket"].to_numpy())
    matched = [run(sorted_buckets).join(new_buckets, on=["band", "bucket"], how="semi") for run in old_runs]
    members = pl.concat([*matched, new_keys], how="vertical")
    return members.filter(pl.len().over("band", "bucket") >= 2)


def read_run(index: IndexDir, rel: str, buckets: np.ndarray, stats: dict[str, int | float]) -> pl.DataFrame:
    """The row groups of a key run that may hold one of ``buckets`` (sorted uint64).

    Runs are sorted by bucket and written in small row groups, so a few new keys against a large
    index read a fraction of it: the Parquet min/max statistics say which new buckets fall in a
    group's range, and the run's bucket filters (`bucket_filters`) which of those may be in it. A
    run without filters (an index written before them) is read by its statistics alone, and so is
    one whose groups get more than `FILTER_KEYS_PER_GROUP` new buckets each on average.
    """
    with index.fs.open(f"{index.root}/{rel}", "rb") as handle:
        run = pq.ParquetFile(handle)
        column = run.schema_arrow.get_field_index("bucket")
        worth_filtering = buckets.size <= FILTER_KEYS_PER_GROUP * run.num_row_groups
        filters = _run_filters(index, rel, stats) if worth_filtering else None
        if filters is not None and filters.shape[0] != run.num_row_groups:
            raise ValueError(f"{filter_path(rel)} has {filters.shape[0]} filters for {run.num_row_groups} row groups")
        wanted = []
        for group in range(run.num_row_groups):
            statistics = run.metadata.row_group(group).column(column).statistics
            if statistics is None or not statistics.has_min_max:
                wanted.append(group)
                continue
            first = np.searchsorted(buckets, np.uint64(statistics.min))
            last = np.searchsorted(buckets, np.uint64(statistics.max), side="right")
            if first < last and (filters is None or may_hold(filters, group, buckets[first:last])):
                wanted.append(group)
        stats["index_row_groups"] += run.num_row_groups
        stats["index_row_groups_read"] += len(wanted)
        if not wanted:
            return pl.DataFrame(schema=KEY_SCHEMA)
        return pl.from_arrow(run.read_row_groups(wanted)).cast(KEY_SCHEMA)


def _run_filters(index: IndexDir, rel: str, stats: dict[str, int | float]) -> np.ndarray | None:
    try:
        data = index.read_bytes(filter_path(rel))
    except FileNotFoundError:
        return None
    stats["index_filter_bytes"] += len(data)
    return read_filters(data)


# ---------------------------------------------------------------------------------------------
# The passes: units of work of one batch
# ---------------------------------------------------------------------------------------------


def _validated(shard: ShardInput, config: DedupConfig) -> tuple[pl.DataFrame, SignatureTable]:
    docs, signatures = shard.load_docs(), shard.load_signatures()
    where = f"shard {shard.source}/{shard.shard_key}"
    missing = [column for column in REQUIRED_COLUMNS if column not in docs.columns]
    if missing:
        raise ValueError(f"{where} lacks columns {missing}")
    for column in ("id", "text"):
        # Null dtype is what polars infers for an empty column; it casts to String losslessly.
        if docs.schema[column] not in (pl.Utf8, pl.Null):
            raise ValueError(f"{where} column {column!r} must be String, got {docs.schema[column]}")
    if docs["id"].null_count() or docs["text"].null_count():
        raise ValueError(f"{where} has null id or text values")
    if len(docs) > ROW_MASK:
        raise ValueError(f"{where} has {len(docs)} rows; at most {ROW_MASK} per shard")
    if signatures.config != config.minhash:
        raise ValueError(f"{where} signatures were computed with {signatures.config}, expected {config.minhash}")
    if len(signatures) != len(docs) or not np.array_equal(signatures.ids, docs["id"].to_numpy().astype(object)):
        raise ValueError(
            f"{where} signatures are not row-aligned with its documents (stale cache?): "
            "recompute them with compute_signatures"
        )
    return docs, signatures


@dataclass(frozen=True)
class KeysPass:
    """A batch's key step, shared by its shards' units: the index the keys are spilled into."""

    index: IndexDir
    config: DedupConfig


def shard_keys_pass(item: tuple[int, ShardInput], job: KeysPass) -> tuple[int, int, int]:
    """One new shard (its sequence number and input): its documents checked against its signatures,
    its exact and band keys (`shard_keys`) spilled into the index by partition. Returns (documents,
    documents without tokens, keys). Shards are independent, so a batch's shards are units of work
    (one Ray task each when Ray is chosen)."""
    seq, shard = item
    docs, signatures = _validated(ShardInput(*shard), job.config)
    keys, without_tokens = shard_keys(signatures, seq, job.config)
    job.index.write_many({f"{_pending_keys_dir(partition)}/{seq:06d}.parquet": parquet_bytes(frame)
                          for partition, frame in split_by_partition(keys, job.config.index_partitions).items()})
    return len(docs), without_tokens, len(keys)


@dataclass(frozen=True)
class CollisionPass:
    """One batch's candidate step, shared by its partitions' passes: the index, and how many
    committed batches (key runs per partition) the new keys are matched against."""

    index: IndexDir
    committed_batches: int


def _spilled_keys(index: IndexDir, partition: int) -> pl.DataFrame:
    """The keys the batch being decided spilled into one partition."""
    spilled = index.files(_pending_keys_dir(partition))
    return pl.concat([pl.read_parquet(io.BytesIO(data)) for data in index.read_many(spilled)]) if spilled \
        else pl.DataFrame(schema=KEY_SCHEMA)


def partition_pass(partition: int, job: CollisionPass) -> tuple[pl.DataFrame, dict[str, int]]:
    """The candidate step of one bucket-hash range: its colliding keys (`partition_collisions`) and
    what reading the index cost. A pure function of the partition's files, so the partitions of a
    batch are independent units of work (one Ray task each when Ray is chosen)."""
    stats = {"index_row_groups": 0, "index_row_groups_read": 0, "index_filter_bytes": 0}
    keys = _spilled_keys(job.index, partition)
    old_runs = [
        (lambda buckets, rel=_key_run_path(partition, number): read_run(job.index, rel, buckets, stats))  # noqa: B008 - binds this batch's path
        for number in range(job.committed_batches)
    ]
    found = partition_collisions(old_runs, keys)
    return found, {**stats, "partition_keys": len(keys) + len(found)}


@dataclass(frozen=True)
class RunCommit:
    """One batch's commit of its key runs, shared by its partitions' units: the index, the batch's
    number, and its dropped documents (sorted), whose keys stay out of the index."""

    index: IndexDir
    batch_number: int
    dropped_docs: np.ndarray


def partition_commit_pass(partition: int, job: RunCommit) -> list[tuple[str, tuple[int, str]]]:
    """One bucket range's new run: the batch's spilled keys of the partition less its dropped
    documents', sorted and written in small row groups, and the run's bucket filters, one per row
    group as written. Returns each file's path, size and sha256. Independent of the other
    partitions, so a batch's run writes are units of work too."""
    keys = _spilled_keys(job.index, partition)
    kept = keys.filter(~pl.col("doc").is_in(pl.Series(job.dropped_docs, dtype=pl.UInt64).implode()))
    rel = _key_run_path(partition, job.batch_number)
    run = kept.sort("bucket", "band", "doc")
    data = parquet_bytes(run, RUN_ROW_GROUP_KEYS)
    metadata = pq.ParquetFile(io.BytesIO(data)).metadata
    group_rows = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
    filters = filter_path(rel)
    job.index.write_many({rel: data, filters: filters_bytes(build_filters(run["bucket"].to_numpy(), group_rows))})
    return [(path, job.index.written[path]) for path in (rel, filters)]
