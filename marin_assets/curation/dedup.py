"""Exact and fuzzy (MinHash LSH, Jaccard-verified) deduplication: incremental, out of core.

Pure logic over polars, numpy and an fsspec directory (the index); no Dagster. See docs/dedup.md.

One ``update_index`` call adds shards that the index has not seen:

1. Order. New shards get sequence numbers after every registered one, sorted by
   ``(shard_key, source)``; a document's order is ``(seq, row)``, packed as ``seq << 32 | row``.
   Earlier documents win ("first seen is kept"), so decisions about registered shards never change.
2. Keys (per new shard, one unit of work each: ``shard_keys_pass``): one exact key (the first 64
   bits of the hex sha256 ``id``) and, for documents with tokens, one LSH key per band of the cached
   MinHash signature. Keys are split by bucket-hash range into ``index_partitions`` partitions and
   spilled into the index's ``pending/``.
3. Collisions (per partition): the new keys, spilled to the index by partition, are matched
   against that partition's runs of kept documents, one run file at a time; groups of two or more
   documents with at least one new document survive. Each partition's pass (``partition_pass``)
   is a pure function of that partition's files, so the passes are independent units of work
   (``parallel_map``: in turn in one process, or one Ray task each); their outputs are merged in
   partition order. Peak memory of a pass is one partition, not the corpus.
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
import io
import json
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import fsspec
import numpy as np
import polars as pl
import pyarrow.parquet as pq

from marin_assets.curation.minhash import (
    MinHashConfig,
    SignatureTable,
    band_hashes,
    empty_signature_mask,
    exact_jaccard,
    shingle_sets,
)
from marin_resources.parallel_map import ParallelMap, in_process_map

REQUIRED_COLUMNS = ("id", "text", "source", "source_id", "metadata")
SHARD_KEY_COLUMN = "shard_key"
_ROW_BITS = 32
_ROW_MASK = (1 << _ROW_BITS) - 1

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
KEY_SCHEMA = {"band": pl.UInt16, "bucket": pl.UInt64, "doc": pl.UInt64}
# Keys per row group of an index run: small enough that a lookup of a few keys reads little.
RUN_ROW_GROUP_KEYS = 8192
KEY_BYTES = 18  # a (band, bucket, doc) key: uint16 + uint64 + uint64


def lsh_threshold(bands: int, rows: int) -> float:
    """Jaccard similarity where the LSH S-curve is steepest: (1/bands)**(1/rows)."""
    return (1.0 / bands) ** (1.0 / rows)


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
    """Probability that two sets with this Jaccard share at least one band: 1-(1-s**r)**b."""
    return 1.0 - (1.0 - similarity**rows) ** bands


@dataclass(frozen=True)
class DedupConfig:
    """Deduplication of one dedup group. ``bands * rows`` must not exceed ``minhash.num_perm``.

    The default 12 bands x 10 rows puts the S-curve midpoint at 0.78, a little under the 0.8
    verification threshold, so pairs right at the threshold are still proposed with probability
    0.75 and pairs at 0.9 with 0.994; verification removes the extra candidates below 0.8.
    ``index_partitions`` is the number of bucket-hash ranges the index is split into: the
    candidate step holds one range at a time.
    """

    minhash: MinHashConfig = field(default_factory=MinHashConfig)
    bands: int = 12
    rows: int = 10
    jaccard_threshold: float = 0.8
    fuzzy: bool = True
    index_partitions: int = 16

    def __post_init__(self) -> None:
        if self.bands < 2 or self.rows < 1:
            raise ValueError(f"need bands >= 2 and rows >= 1, got bands={self.bands} rows={self.rows}")
        if self.bands * self.rows > self.minhash.num_perm:
            raise ValueError(
                f"bands * rows = {self.bands * self.rows} exceeds num_perm = {self.minhash.num_perm}"
            )
        if not 0.0 < self.jaccard_threshold <= 1.0:
            raise ValueError(f"jaccard_threshold must be in (0, 1], got {self.jaccard_threshold}")
        if not 1 <= self.index_partitions <= 4096:
            raise ValueError(f"index_partitions must be in [1, 4096], got {self.index_partitions}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @property
    def exact_band(self) -> int:
        """The band number of exact keys, after the LSH bands."""
        return self.bands


class Shard(NamedTuple):
    """One shard held in memory: its key (sorts in ingestion order), documents and signatures."""

    shard_key: str
    docs: pl.DataFrame
    signatures: SignatureTable
    source: str = ""


class ShardInput(NamedTuple):
    """One shard as the index sees it: loaded on demand, so a run never holds the corpus.

    ``version`` is the content version of the shard (its upstream data version); when a registered
    shard's version changes or it disappears, earlier decisions no longer hold and the index starts over.
    """

    source: str
    shard_key: str
    version: str
    load_docs: Callable[[], pl.DataFrame]
    load_signatures: Callable[[], SignatureTable]
    # Some rows' `id`, `text`, `source_id`, in the order asked (`read_parquet_rows`): an earlier shard
    # holding a few documents a new shard collides with is read for those, not whole. None: load_docs.
    load_rows: Callable[[Sequence[int]], pl.DataFrame] | None = None
    # How many documents it holds, if known before loading it: whether its keys are worth a worker.
    documents: int | None = None


@dataclass
class RegisteredShard:
    seq: int
    source: str
    shard_key: str
    version: str
    docs: int = 0
    kept: int = 0


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


def _registry_path(batch: int) -> str:
    return f"registry/{batch:06d}.json"


def _key_run_path(partition: int, batch: int) -> str:
    return f"keys/p{partition:04d}/{batch:06d}.parquet"


def _pending_keys_dir(partition: int) -> str:
    """Where the batch being decided spills its new shards' keys of one partition: in the index
    itself, so that a partition's pass can run on any worker that reaches the store."""
    return f"pending/p{partition:04d}"


class IndexDir:
    """An index directory on any fsspec filesystem (the `dedup_index` artifact, or a temp dir)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs, self.root = fs, root.rstrip("/")
        self.written: dict[str, tuple[int, str]] = {}
        """Files written through this object since an update began, and still there: size and sha256
        of the bytes written."""

    @classmethod
    def local(cls, path: str | Path) -> IndexDir:
        return cls(fsspec.filesystem("file"), str(Path(path).resolve()))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(f"{self.root}/{rel}")

    def read_parquet(self, rel: str) -> pl.DataFrame:
        return pl.read_parquet(io.BytesIO(self.read_bytes(rel)))

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = f"{self.root}/{rel}"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(path, "wb") as handle:
            handle.write(data)
        self.written[rel] = (len(data), hashlib.sha256(data).hexdigest())

    def write_parquet(self, rel: str, frame: pl.DataFrame, row_group_size: int | None = None) -> None:
        self.write_bytes(rel, parquet_bytes(frame, row_group_size))

    # Many small files at once: one call, which fsspec's object-store filesystems run as concurrent
    # requests (a batch spills, reads and removes thousands of them at scale).

    def read_many(self, rels: Sequence[str]) -> list[bytes]:
        paths = [f"{self.root}/{rel}" for rel in rels]
        found = self.fs.cat(paths) if paths else {}
        return [found[self.fs._strip_protocol(path)] for path in paths]

    def write_many(self, files: dict[str, bytes]) -> None:
        for folder in {f"{self.root}/{rel}".rsplit("/", 1)[0] for rel in files}:
            self.fs.makedirs(folder, exist_ok=True)
        if files:
            self.fs.pipe({f"{self.root}/{rel}": data for rel, data in files.items()})
        self.written |= {rel: (len(data), hashlib.sha256(data).hexdigest()) for rel, data in files.items()}

    def remove_many(self, rels: Sequence[str]) -> None:
        if rels:
            self.fs.rm([f"{self.root}/{rel}" for rel in rels])
        for rel in rels:
            self.written.pop(rel, None)

    def files(self, under: str = "") -> list[str]:
        base = f"{self.root}/{under}".rstrip("/")
        try:
            found = self.fs.find(base, withdirs=False)
        except FileNotFoundError:
            return []
        # Dot files belong to whoever hosts the directory (the store's lease and manifest).
        return sorted(rel for rel in (path[len(self.root) + 1 :] for path in found) if not rel.startswith("."))

    def remove(self, rel: str) -> None:
        self.fs.rm_file(f"{self.root}/{rel}")
        self.written.pop(rel, None)


def parquet_bytes(frame: pl.DataFrame, row_group_size: int | None = None) -> bytes:
    """Parquet bytes of ``frame``; the same frame always gives the same bytes (no timestamps).

    zstd at level 1: on a shard of documents it costs about half the CPU of the default level 3
    (0.08 against 0.15 s per 25 MB) for files about a fifth larger. Every per-shard artifact is
    written once and read a few times, so the CPU matters more than the bytes."""
    buffer = io.BytesIO()
    frame.write_parquet(buffer, compression="zstd", compression_level=1, row_group_size=row_group_size)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# Registry: which shards the index holds, in order
# ---------------------------------------------------------------------------------------------


def read_registry(index: IndexDir) -> list[RegisteredShard]:
    """Registered shards in order; only committed batches (those with a registry entry) count."""
    return [shard for body in _registry_bodies(index) for shard in body["shards"]]


def _registry_bodies(index: IndexDir) -> list[dict[str, Any]]:
    bodies = []
    for expected, rel in enumerate(index.files("registry")):
        if rel != _registry_path(expected):
            raise ValueError(f"index registry is not contiguous: found {rel}, expected {_registry_path(expected)}")
        body = json.loads(index.read_bytes(rel))
        body["shards"] = [RegisteredShard(**shard) for shard in body["shards"]]
        bodies.append(body)
    return bodies


def _open_index(
    index: IndexDir, config: DedupConfig, inputs: dict[tuple[str, str], ShardInput]
) -> tuple[list[RegisteredShard], int, str | None]:
    """(registered shards, committed batches, reset reason), after removing uncommitted leftovers."""
    bodies = _registry_bodies(index)
    reason = None
    if bodies and bodies[0]["config"] != config.to_json():
        reason = "the dedup config changed"
    registered = [shard for body in bodies for shard in body["shards"]]
    for shard in registered if reason is None else []:
        current = inputs.get((shard.source, shard.shard_key))
        if current is None:
            reason = f"registered shard {shard.source}/{shard.shard_key} is no longer an input"
        elif current.version != shard.version:
            reason = f"registered shard {shard.source}/{shard.shard_key} changed (version {current.version})"
        if reason:
            break
    if reason is not None:
        for rel in index.files():
            index.remove(rel)
        return [], 0, reason
    batches, next_seq = len(bodies), len(registered)
    for rel in index.files():
        # A batch interrupted before its registry entry left files that do not count: remove them.
        folder, name = rel.split("/", 1)[0], rel.rsplit("/", 1)[-1]
        number = int(name.split(".")[0]) if name.split(".")[0].isdigit() else None
        stale = (folder == "keys" and (number is None or number >= batches)) or (
            folder == "decisions" and (number is None or number >= next_seq)
        )
        if stale:
            index.remove(rel)
        elif folder == "pending":  # the keys of a batch that never committed
            index.remove(rel)
        elif folder not in ("keys", "decisions", "registry"):
            raise ValueError(f"unexpected file {rel} in the dedup index")
    return registered, batches, None


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
    docs = (np.uint64(seq) << np.uint64(_ROW_BITS)) | np.arange(count, dtype=np.uint64)
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
    sorted_buckets = np.unique(new_buckets["bucket"].to_numpy())
    matched = [run(sorted_buckets).join(new_buckets, on=["band", "bucket"], how="semi") for run in old_runs]
    members = pl.concat([*matched, new_keys], how="vertical")
    return members.filter(pl.len().over("band", "bucket") >= 2)


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
    groups = np.unique(group_of)
    # Where each read group starts in the concatenation of the groups read.
    base = np.zeros(len(sizes), dtype=np.int64)
    base[groups] = np.concatenate([[0], np.cumsum(sizes[groups])[:-1]])
    frame = pl.from_arrow(parquet.read_row_groups(groups.tolist(), columns=list(columns)))
    return frame[(base[group_of] + wanted - starts[group_of]).tolist()]


def read_run(index: IndexDir, rel: str, buckets: np.ndarray, stats: dict[str, int | float]) -> pl.DataFrame:
    """The row groups of a key run whose bucket range holds one of ``buckets`` (sorted uint64).

    Runs are sorted by bucket and written in small row groups, so a few new keys against a large
    index read a fraction of it; the Parquet min/max statistics say which groups to read.
    """
    with index.fs.open(f"{index.root}/{rel}", "rb") as handle:
        run = pq.ParquetFile(handle)
        column = run.schema_arrow.get_field_index("bucket")
        wanted = []
        for group in range(run.num_row_groups):
            statistics = run.metadata.row_group(group).column(column).statistics
            if statistics is None or not statistics.has_min_max:
                wanted.append(group)
                continue
            first = np.searchsorted(buckets, np.uint64(statistics.min))
            if first < buckets.size and buckets[first] <= np.uint64(statistics.max):
                wanted.append(group)
        stats["index_row_groups"] += run.num_row_groups
        stats["index_row_groups_read"] += len(wanted)
        if not wanted:
            return pl.DataFrame(schema=KEY_SCHEMA)
        return pl.from_arrow(run.read_row_groups(wanted)).cast(KEY_SCHEMA)


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
        by_seq.setdefault(doc >> _ROW_BITS, []).append(doc)
    for seq, members in by_seq.items():
        # One shard at a time; only the colliding rows are kept (and, where it can, read).
        shard, wanted = ShardInput(*shard_by_seq[seq]), [doc & _ROW_MASK for doc in members]
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
    docs = np.unique(collisions["doc"].to_numpy())
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
            seq = doc >> _ROW_BITS
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
    if len(docs) > _ROW_MASK:
        raise ValueError(f"{where} has {len(docs)} rows; at most {_ROW_MASK} per shard")
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
    stats = {"index_row_groups": 0, "index_row_groups_read": 0}
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


def partition_commit_pass(partition: int, job: RunCommit) -> tuple[str, tuple[int, str]]:
    """One bucket range's new run: the batch's spilled keys of the partition less its dropped
    documents', sorted and written in small row groups. Returns the run's path, size and sha256.
    Independent of the other partitions, so a batch's run writes are units of work too."""
    keys = _spilled_keys(job.index, partition)
    kept = keys.filter(~pl.col("doc").is_in(pl.Series(job.dropped_docs, dtype=pl.UInt64).implode()))
    rel = _key_run_path(partition, job.batch_number)
    job.index.write_parquet(rel, kept.sort("bucket", "band", "doc"), row_group_size=RUN_ROW_GROUP_KEYS)
    return rel, job.index.written[rel]


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
    assigned = spread(assign_centres, units, CentreJob(batch[0].seq << _ROW_BITS, config))
    drops = sorted(drop for unit in assigned for drop in unit.drops)
    ids = {doc: doc_id for unit in assigned for doc, doc_id in unit.ids.items()}
    source_ids = {doc: source_id for unit in assigned for doc, source_id in unit.source_ids.items()}
    for unit in assigned:
        for name, count in unit.counts.items():
            stats[name] += count
    lap("centres")

    def where(doc: int) -> tuple[str, str]:
        owner = shard_by_seq[doc >> _ROW_BITS]
        return owner.source, owner.shard_key

    rows_by_seq: dict[int, list[dict[str, Any]]] = {shard.seq: [] for shard in batch}
    for dropped, kept, similarity, reason in drops:
        dropped_source, dropped_shard = where(dropped)
        kept_source, kept_shard = where(kept)
        rows_by_seq[dropped >> _ROW_BITS].append({
            "dropped_row": dropped & _ROW_MASK,
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
    index.written |= dict(runs)  # written by the units, wherever they ran
    # Written last: the batch exists from here on.
    body = {"batch": batch_number, "config": config.to_json(), "shards": [asdict(shard) for shard in batch]}
    index.write_bytes(_registry_path(batch_number), json.dumps(body, indent=1, sort_keys=True).encode())
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
    registered, batches, reset_reason = _open_index(index, config, inputs)
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
