"""The dedup index as it is stored: its settings (`DedupConfig`), the shards it is given
(`ShardInput`) and holds (`RegisteredShard`, read from its registry), and its directory (`IndexDir`).

A document is numbered ``seq << ROW_BITS | row`` (its shard's sequence number, its row in the
shard), the order in which documents are decided. The directory holds ``registry/<batch>.json``
(the shards each committed batch added, written last), ``decisions/<seq>.parquet`` (a shard's
dropped rows), ``keys/p<partition>/<batch>.parquet`` (the kept documents' keys, one sorted run per
partition and batch, with its bucket filters in ``<batch>.filter.npy``, see `bucket_filters.py`)
and ``pending/`` (the keys of the batch being decided). A module of its own
so that the index passes (`dedup_passes.py`) and the decisions (`dedup.py`), which both read and
write the index, import it without a cycle. See docs/dedup.md.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import fsspec
import polars as pl

from marin_assets.curation.minhash import MinHashConfig, SignatureTable
from marin_resources.config_identity import identity

REQUIRED_COLUMNS = ("id", "text", "source", "source_id", "metadata")
ROW_BITS = 32
ROW_MASK = (1 << ROW_BITS) - 1


@dataclass(frozen=True)
class DedupConfig:
    """Deduplication of one dedup group. ``bands * rows`` must not exceed ``minhash.num_perm``.

    The default 12 bands x 10 rows puts the S-curve midpoint at 0.78, a little under the 0.8
    verification threshold, so pairs right at the threshold are still proposed with probability
    0.75 and pairs at 0.9 with 0.994; verification removes the extra candidates below 0.8.
    ``index_partitions`` is the number of bucket-hash ranges the index is split into: the
    candidate step holds one range at a time.
    """

    minhash: MinHashConfig = identity(default_factory=MinHashConfig)
    bands: int = identity(12)
    rows: int = identity(10)
    jaccard_threshold: float = identity(0.8)
    fuzzy: bool = identity(True)
    index_partitions: int = identity(16)

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


def registry_path(batch: int) -> str:
    return f"registry/{batch:06d}.json"


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
        if rel != registry_path(expected):
            raise ValueError(f"index registry is not contiguous: found {rel}, expected {registry_path(expected)}")
        body = json.loads(index.read_bytes(rel))
        body["shards"] = [RegisteredShard(**shard) for shard in body["shards"]]
        bodies.append(body)
    return bodies


def open_index(
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
