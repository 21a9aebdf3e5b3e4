"""Decontamination, pure: the eval texts a deployment holds, the index of their n-grams, and one
shard's training documents checked against it. The assets (`decontamination_assets.py`) only wire
these to the store. See docs/decontamination.md.

Eval texts are (1) the validation split of every tokenized source, decided by the same function the
token cache splits with (`marin_resources.splits`), and (2) eval sets declared as files in the
registry's `decontamination.eval_texts`. A shard's validation documents are never dropped: they are
the reference its training documents are checked against.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marin_assets.arrays import sorted_unique
from marin_assets.tokenization.cache import iter_documents_with_split
from marin_assets.tokenization.cache_config import CacheConfig
from marin_assets.tokenization.encoding import parquet_ids
from marin_assets.tokenization.ngrams import NgramHasher, build_index, overlap
from marin_assets.tokenization.registry import DecontaminationPolicy
from marin_resources.splits import corpus_threshold, id_hashes, in_validation
from marin_resources.typed_config import ConfigError

CONTAMINATED = "contaminated"  # the reason of a dropped row
MATCH_COLUMN = "contaminated_ngrams"  # a contaminated document's count of distinct eval n-grams
BATCH_ROWS = 512


class EvalSetError(ConfigError):
    """An eval set that is missing or damaged: one line naming the file (and line)."""


@dataclass(frozen=True)
class EvalSet:
    name: str
    path: str
    sha256: str


def eval_set(name: str, path: str) -> EvalSet:
    """The eval set at ``path``, checked (every line a JSON object with a string `text`) and hashed."""
    data = _read(name, path)
    for _ in _texts(name, path, data):
        pass
    return EvalSet(name, path, hashlib.sha256(data).hexdigest())


def eval_set_texts(declared: EvalSet) -> list[str]:
    """The texts of an eval set, refused in one line if its bytes changed since it was declared."""
    data = _read(declared.name, declared.path)
    if hashlib.sha256(data).hexdigest() != declared.sha256:
        raise EvalSetError(f"eval set {declared.name!r} ({declared.path}) changed since the code location loaded; "
                           "reload it")
    return list(_texts(declared.name, declared.path, data))


def _read(name: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise EvalSetError(f"eval set {name!r}: cannot read {path}: {exc.strerror or exc}") from None


def _texts(name: str, path: str, data: bytes) -> Iterator[str]:
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise EvalSetError(f"eval set {name!r} ({path}): not UTF-8 ({exc.reason} at byte {exc.start})") from None
    found = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalSetError(f"eval set {name!r} ({path}) line {number}: not JSON: {exc.msg}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise EvalSetError(f"eval set {name!r} ({path}) line {number}: expected an object with a string `text`")
        found += 1
        yield record["text"]
    if not found:
        raise EvalSetError(f"eval set {name!r} ({path}): holds no text")


def validation_threshold_of(doc_files: Sequence[str], cfg: CacheConfig) -> float:
    """The threshold a source's validation split is taken at: the cache's fraction, raised where it
    sets a minimum (`corpus_threshold`, the function the token cache's assembly uses)."""
    if cfg.validation_min_documents is None:
        return cfg.validation_fraction
    return corpus_threshold(cfg.validation_fraction, cfg.validation_min_documents, parquet_ids(doc_files, cfg))


@dataclass(frozen=True)
class SplitNgramsJob:
    """What every unit of `eval_ngrams/<source>` shares: how the source is split, and the n-grams' n."""
    cfg: CacheConfig
    threshold: float
    ngram: int


@dataclass(frozen=True)
class SplitNgrams:
    hashes: np.ndarray
    """Sorted, distinct n-gram hashes of the unit's validation documents."""
    documents: int
    """Validation documents hashed."""
    text_bytes: int
    corpus_documents: int
    """Every document of the unit's files that a cache holds: what a validation minimum counts."""


def split_ngrams(doc_files: Sequence[str], job: SplitNgramsJob) -> SplitNgrams:
    """One unit of work of an eval index: the validation documents of ``doc_files`` (some of a
    source's corpus files) as n-gram hashes. Units are independent, so a step may spread them over
    workers; `merged_index` of every unit's hashes is the index of the whole split."""
    texts, corpus_documents = [], 0
    for _, text, held_out in iter_documents_with_split(doc_files, replace(job.cfg, validation_fraction=job.threshold)):
        corpus_documents += 1
        if held_out:
            texts.append(text)
    return SplitNgrams(build_index(NgramHasher(job.ngram), texts), len(texts),
                       sum(len(t.encode("utf-8")) for t in texts), corpus_documents)


def merged_index(parts: Iterable[np.ndarray]) -> np.ndarray:
    """The sorted, distinct union of sorted hash arrays: the same index as hashing their texts at once."""
    return sorted_unique(np.concatenate([np.empty(0, np.uint64), *parts]))


def index_bytes(index: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, index.astype("<u8", copy=False), allow_pickle=False)
    return buf.getvalue()


def read_index(data: bytes) -> np.ndarray:
    index = np.load(io.BytesIO(data), allow_pickle=False)
    if index.dtype != np.dtype("<u8") or index.ndim != 1 or (index.size > 1 and not (index[1:] > index[:-1]).all()):
        raise ValueError("not a sorted array of distinct uint64 n-gram hashes")
    return index


@dataclass(frozen=True)
class ShardDecontamination:
    kept: pa.Table
    contaminated_rows: pa.Table
    """`id`, `reason` (`contaminated`) and `contaminated_ngrams` of each contaminated training document."""
    documents: int
    validation_documents: int
    contaminated: int
    """Training documents at or over the policy's threshold (dropped, or marked)."""
    matching_ngrams: int


def decontaminate(table: pa.Table, index: np.ndarray, hasher: NgramHasher, threshold: float,
                  policy: DecontaminationPolicy, cfg: CacheConfig) -> ShardDecontamination:
    """One shard's documents checked against the eval index. Training documents (by the id split at
    ``threshold``) with at least ``policy.min_matching_ngrams`` distinct eval n-grams are contaminated:
    dropped, or under `mode: mark` kept as they are (the table is then the input, byte for byte, so a
    changed eval set never re-encodes a marked shard); validation documents are always kept."""
    ids = table.column(cfg.id_column).to_pylist()
    texts = table.column(cfg.text_column).to_pylist()
    n = len(ids)
    matching = np.zeros(n, dtype=np.int64)
    for start in range(0, n, BATCH_ROWS):
        chunk = [t or "" for t in texts[start:start + BATCH_ROWS]]
        matching[start:start + len(chunk)] = overlap(hasher, index, chunk).matching
    # A null id is skipped by the cache, so it is in neither split: checked as training text.
    validation = in_validation(id_hashes(i or "" for i in ids), threshold) & np.array([i is not None for i in ids],
                                                                                        dtype=bool)
    contaminated = (matching >= policy.min_matching_ngrams) & ~validation
    rows = pa.table({"id": pa.array(ids, pa.string()).filter(pa.array(contaminated)),
                     "reason": pa.array([CONTAMINATED] * int(contaminated.sum()), pa.string()),
                     MATCH_COLUMN: pa.array(matching[contaminated], pa.int64())})
    kept = table if policy.mode == "mark" else table.filter(pa.array(~contaminated))
    return ShardDecontamination(kept, rows, n, int(validation.sum()), int(contaminated.sum()),
                                int(matching[contaminated].sum()))


def parquet_bytes(table: pa.Table) -> bytes:
    """Deterministic Parquet bytes (same table, same bytes)."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()
