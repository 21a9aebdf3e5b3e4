"""Tokenize curated documents into a Levanter cache root (`<root>/train`, `<root>/validation`).

Encoding uses HF `tokenizers` directly (`encode_batch_fast`: multithreaded Rust), not Levanter's Ray
pipeline, one shard at a time as its own unit of work (see "Per-shard encoding"): in the build's
process, or spread over workers by the `parallel_map` a caller passes (one Ray task per shard).
Assembly then moves the encoded rows into the cache in ledger order, one shard file per unit.
Writing uses tensorstore directly, in the layout of Levanter's `TreeStore` and
`CacheLedger` (see "Levanter's on-disk format" below), so appending a shard does not import Levanter
(and JAX); `TreeCache.load` and Levanter's trainer read the cache unchanged, which the Levanter
tests check. Levanter itself is imported once per cache, to derive the metadata its loader expects.

Each split is a TreeCache whose single field is `input_ids` (int32), one row per document:
`[BOS] + ids(text) + [EOS]`. A document goes to validation when
`int(sha256(id)[:8], 16) / 2**32 < validation_fraction`.

Incremental builds: the ledger of a Levanter cache records rows per named shard, and the jagged
arrays can be appended to and trimmed at a row boundary, but rows cannot be removed from the middle.
So each upstream Parquet file is a ledger shard, kept in the order it was first committed: a rebuild
keeps the longest run of committed ledger shards (in ledger order) whose files are still wanted and
unchanged, trims anything after it, and appends the remaining files, encoded once. A new file is
therefore always appended, wherever its name sorts. A manifest next to the splits
(`marin_tokenize_manifest.json`) is the record of which shards are committed; see docs/tokenization.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from marin_assets.tokenization.shard_files import ShardFileWriter, ShardLayout
from marin_assets.tokenization.tokenizer import local_tokenizer_dir, tokenizer_json_sha256
from marin_resources.parallel_map import ParallelMap, in_process_map
from marin_resources.progress import ProgressMeter
from marin_resources.splits import (
    ID_HASH_DTYPE,
    corpus_threshold,
    fraction_holds_enough,
    id_hashes,
    in_validation,
    is_validation_document,
    raised_threshold,
)
from marin_resources.typed_config import typed_config

SPLITS = ("train", "validation")
INPUT_IDS = "input_ids"
MANIFEST_NAME = "marin_tokenize_manifest.json"
# Bump when the meaning of rows changes, so old caches are rebuilt rather than appended to.
CACHE_FORMAT_VERSION = 1
TOKEN_DTYPE = np.int32


@typed_config
@dataclass(frozen=True)
class CacheConfig:
    """How documents become cache rows.

    `batch_rows` is both the Parquet read batch and the encode batch. `flush_tokens` bounds the
    values an assembly unit holds and writes at once; Levanter's zarr3 arrays are stored in large
    shard files that are rewritten on each write, so fewer, larger writes are much cheaper. Peak
    memory of a unit is about 2 x flush_tokens x 4 bytes; an encoding worker holds a few batches.
    Neither changes the cache's bytes.
    """

    validation_fraction: float = 0.01
    validation_min_documents: int | None = None
    """At least this many documents go to validation (the lowest id hashes), where the fraction
    gives fewer; capped at half the corpus. None: the fraction alone (and no change of identity)."""
    batch_rows: int = 1024
    flush_tokens: int = 16_000_000
    id_column: str = "id"
    text_column: str = "text"
    incremental: bool = True

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
        return {k: v for k, v in asdict(self).items() if k != "validation_min_documents" or v is not None}

    def encoding_identity(self) -> dict:
        """What decides one shard's encoded rows (`encode_shard_rows`): a validation minimum is applied
        when the shards are assembled, so it is not here."""
        return {k: v for k, v in self.row_identity().items() if k != "validation_min_documents"}

    def row_identity(self) -> dict:
        """The settings that decide which rows a cache holds; a change forces a full rebuild. With
        a minimum, `validation_fraction` is the threshold `with_validation_minimum` worked out."""
        return {
            "validation_fraction": self.validation_fraction,
            "id_column": self.id_column,
            "text_column": self.text_column,
            **({"validation_min_documents": self.validation_min_documents}
               if self.validation_min_documents is not None else {}),
        }


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


@dataclass(frozen=True)
class RoundtripFailure:
    doc_id: str
    split: str
    row: int
    reason: str


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


def parquet_ids(doc_files: Sequence[str], cfg: CacheConfig) -> Iterator[str]:
    """The ids of the documents a cache of these Parquet files holds (rows `_clean` keeps)."""
    for uri in doc_files:
        for batch in _parquet_shard(os.fspath(uri), cfg).open_batches():
            yield from _clean(batch, cfg).ids


# ---------------------------------------------------------------------------------------------
# Document sources


@dataclass(frozen=True)
class ShardSpec:
    """A Parquet document file to encode, as a worker is told it: its ledger key, content fingerprint
    and URI."""

    key: str
    fingerprint: str | None
    uri: str


@dataclass(frozen=True)
class _Shard:
    key: str
    fingerprint: str | None  # None: contents unknown, never reused
    open_batches: Callable[[], Iterator[pa.RecordBatch]]
    file: ShardSpec | None = None  # how a worker elsewhere opens it; None: documents held in this process


@dataclass
class _DocBatch:
    ids: list[str]
    texts: list[str]
    text_bytes: int
    skipped: int


def _file_fingerprint(fs, path: str) -> str:
    info = fs.info(path)
    # Prefer content hashes / object generations that object stores expose; fall back to mtime.
    for key in ("md5Hash", "ETag", "etag", "md5", "generation", "crc32c", "mtime", "LastModified", "updated"):
        if info.get(key) is not None:
            return f"size={info.get('size')};{key}={info[key]}"
    return f"size={info.get('size')}"


def _parquet_shard(uri: str, cfg: CacheConfig, fingerprint: str | None = None, key: str | None = None) -> _Shard:
    """A Parquet document file; `fingerprint` (e.g. the sha256 its producer recorded) replaces the
    size/mtime fingerprint, so a file rewritten with the same bytes is still recognised. `key` names
    it in the ledger (default: its URI)."""
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise FileNotFoundError(f"document file not found: {uri}")

    def open_batches() -> Iterator[pa.RecordBatch]:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            names = set(pf.schema_arrow.names)
            missing = {cfg.id_column, cfg.text_column} - names
            if missing:
                raise ValueError(f"{uri}: missing column(s) {sorted(missing)}; has {sorted(names)}")
            yield from pf.iter_batches(batch_size=cfg.batch_rows, columns=[cfg.id_column, cfg.text_column])

    fingerprint = fingerprint or _file_fingerprint(fs, path)
    key = key or uri
    return _Shard(key=key, fingerprint=fingerprint, open_batches=open_batches, file=ShardSpec(key, fingerprint, uri))


def _iterator_shard(documents: Iterable[tuple[str, str]], name: str, cfg: CacheConfig) -> _Shard:
    used = False

    def open_batches() -> Iterator[pa.RecordBatch]:
        nonlocal used
        if used:
            raise RuntimeError("an iterator of documents can only be read once")
        used = True
        it = iter(documents)
        while chunk := list(itertools.islice(it, cfg.batch_rows)):
            ids, texts = zip(*chunk)
            yield pa.record_batch(
                [pa.array(ids, pa.string()), pa.array(texts, pa.string())], names=[cfg.id_column, cfg.text_column]
            )

    return _Shard(key=name, fingerprint=None, open_batches=open_batches)


def _clean(batch: pa.RecordBatch, cfg: CacheConfig) -> _DocBatch:
    """Drop rows without an id or with null/empty text (counted in `skipped`)."""
    ids = batch.column(cfg.id_column)
    texts = batch.column(cfg.text_column)
    if not pa.types.is_string(texts.type) and not pa.types.is_large_string(texts.type):
        raise ValueError(f"text column must be a string column, got {texts.type}")
    nbytes = pc.binary_length(texts)
    keep = pc.and_(pc.and_(pc.is_valid(ids), pc.is_valid(texts)), pc.greater(pc.fill_null(nbytes, 0), 0))
    kept = pc.sum(keep).as_py() or 0
    if kept != len(batch):
        ids, texts, nbytes = pc.filter(ids, keep), pc.filter(texts, keep), pc.filter(nbytes, keep)
    return _DocBatch(
        ids=ids.cast(pa.string()).to_pylist(),
        texts=texts.to_pylist(),
        text_bytes=int(pc.sum(nbytes).as_py() or 0),
        skipped=len(batch) - kept,
    )


def _prefetch(it: Iterator, depth: int = 2) -> Iterator:
    """Run `it` in a background thread (Parquet decode overlaps encoding); re-raise its errors."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def run() -> None:
        try:
            for item in itertools.chain(it, [done]):
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():  # consumer went away: stop reading
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            q.put(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def _iter_clean_batches(shard: _Shard, cfg: CacheConfig) -> Iterator[_DocBatch]:
    for batch in _prefetch(shard.open_batches()):
        yield _clean(batch, cfg)


# ---------------------------------------------------------------------------------------------
# Manifest: which shards are committed (the source of truth on resume)


def _read_json(uri: str) -> dict | None:
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return json.load(f)


def _write_json(uri: str, obj: dict) -> None:
    fs, path = fsspec.core.url_to_fs(uri)
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with fs.open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    fs.mv(tmp, path)


def _manifest_identity(tokenizer_sha: str, bos: int, eos: int, cfg: CacheConfig) -> dict:
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "tokenizer_json_sha256": tokenizer_sha,
        "bos_token_id": bos,
        "eos_token_id": eos,
        **cfg.row_identity(),
    }


def _stats_from_manifest(cache_root: str, manifest: dict, reused: int) -> CacheStats:
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


def read_cache_stats(cache_root: str) -> CacheStats:
    """Stats of a finished cache root built by `build_levanter_cache`."""
    manifest = _read_json(f"{cache_root.rstrip('/')}/{MANIFEST_NAME}")
    if manifest is None or not manifest.get("finished"):
        raise FileNotFoundError(f"no finished tokenized cache at {cache_root}")
    return _stats_from_manifest(cache_root, manifest, reused=len(manifest["shards"]))


def cache_shard_order(cache_root: str) -> list[str]:
    """Keys (document file URIs) of the ledger shards of a finished cache root, in row order."""
    manifest = _read_json(f"{cache_root.rstrip('/')}/{MANIFEST_NAME}")
    if manifest is None or not manifest.get("finished"):
        raise FileNotFoundError(f"no finished tokenized cache at {cache_root}")
    return [s["key"] for s in manifest["shards"]]


# ---------------------------------------------------------------------------------------------
# Encoding


def _frame_rows(flat: np.ndarray, lengths: np.ndarray, bos: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated token ids of n docs -> concatenated `[BOS] ids [EOS]` rows and their lengths."""
    row_lengths = lengths + 2
    ends = np.cumsum(row_lengths)
    starts = ends - row_lengths
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=TOKEN_DTYPE)
    is_text = np.ones(out.size, dtype=bool)
    is_text[starts] = False
    is_text[ends - 1] = False
    out[starts] = bos
    out[ends - 1] = eos
    out[is_text] = flat
    return out, row_lengths


class _Encoder:
    def __init__(self, tokenizer_json: str, bos: int, eos: int, cfg: CacheConfig):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_json)
        # Text that happens to spell a special token (e.g. "<|eos|>") is encoded as plain text, so
        # documents cannot inject control tokens and decode(ids) reproduces them.
        self.tok.encode_special_tokens = True
        self.bos, self.eos = bos, eos
        self.fraction = cfg.validation_fraction

    def encode_texts(self, texts: list[str]) -> list:
        # Releases the GIL: runs in a worker thread while the main thread frames the previous batch.
        return self.tok.encode_batch_fast(texts, add_special_tokens=False)

    def frame(self, batch: _DocBatch, encodings: list) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """Encodings of a batch -> per split, (concatenated [BOS] ids [EOS] rows, row lengths); and the
        documents' id hashes, in document order (what a validation minimum is decided from)."""
        ids = [e.ids for e in encodings]
        n = len(ids)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=n)
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=TOKEN_DTYPE, count=int(lengths.sum()))
        hashes = id_hashes(batch.ids, n)
        in_val = in_validation(hashes, self.fraction)
        out = {}
        for split, mask in (("train", ~in_val), ("validation", in_val)):
            if mask.all():
                out[split] = _frame_rows(flat, lengths, self.bos, self.eos)
            elif mask.any():
                out[split] = _frame_rows(flat[np.repeat(mask, lengths)], lengths[mask], self.bos, self.eos)
            else:
                out[split] = (np.empty(0, TOKEN_DTYPE), np.empty(0, np.int64))
        return out, hashes


def _encode_ahead(encoder: _Encoder, batches: Iterator[_DocBatch]) -> Iterator[tuple[_DocBatch, list]]:
    """Yield (batch, encodings) while the next batch is already being encoded."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
        ahead: tuple[_DocBatch, Future | None] | None = None
        for batch in batches:
            job = pool.submit(encoder.encode_texts, batch.texts) if batch.texts else None
            if ahead is not None:
                yield ahead[0], ahead[1].result() if ahead[1] is not None else []
            ahead = (batch, job)
        if ahead is not None:
            yield ahead[0], ahead[1].result() if ahead[1] is not None else []


# ---------------------------------------------------------------------------------------------
# Per-shard encoding: the unit of work that fans out
#
# Each shard is encoded on its own into plain row files in a folder of its own: per split, the rows'
# tokens (int32, little-endian, BOS and EOS included) and their lengths (int64), split by the
# fraction alone; and every document's id hash (uint32, document order), from which assembly
# applies a validation minimum without encoding again. Assembly then only moves those bytes into
# Levanter's arrays, in ledger order. The folder is either the shard's own artifact
# (`encode_shard_rows`: `token_shards/<source>`, one partition per shard) or, for a build that
# encodes its own shards (`build_levanter_cache`), `<cache root>/.encoded/<shard digest>/<attempt>/`
# with `<shard digest>/entry.json`, the shard's ledger entry and the attempt it vouches for, written
# last: a build killed after some shards were encoded finds them again (same cache identity, same
# file fingerprint) and encodes only the rest; `.encoded` is removed when the cache is finished.

ENCODED_DIR = ".encoded"
_ENCODED_ENTRY = "entry.json"
_ROWS_AT = "encoded_as"  # the attempt folder an encoded shard's entry vouches for; not in the ledger
# In an encoded shard's entry, beside its ledger fields: where its row files are, and the identity
# it was encoded with (its split at that identity's fraction).
ROWS, ENCODING = "rows", "encoding"
_ROW_FILES = {"tokens": np.dtype("<i4"), "lengths": np.dtype("<i8")}
ID_HASHES = "id_hashes"


@dataclass(frozen=True)
class EncodeJob:
    """What the encoding of every shard of one build shares (shipped once to each worker)."""

    tokenizer_dir: str
    bos: int
    eos: int
    cfg: CacheConfig
    identity: dict
    encoded_root: str

    def shard_dir(self, key: str, fingerprint: str | None) -> str:
        digest = hashlib.sha256(json.dumps([self.identity, key, fingerprint], sort_keys=True).encode()).hexdigest()
        return f"{self.encoded_root}/{digest[:32]}"


class ShardEncodingError(ValueError):
    """Some shards could not be encoded; the others were, and are kept for the rerun."""


def encode_parquet_shard(spec: ShardSpec, job: EncodeJob) -> dict:
    """Encode one Parquet shard into its row files; returns its ledger entry, or `{"key", "error"}`
    when it fails, so that one bad shard is reported alone while its siblings finish."""
    try:
        return _encode_shard(_parquet_shard(spec.uri, job.cfg, spec.fingerprint, spec.key), job)
    except Exception as exc:  # noqa: BLE001 - reported per shard by the build
        return {"key": spec.key, "error": f"{type(exc).__name__}: {exc}"}


def encode_shard_rows(spec: ShardSpec, tokenizer_dir: str, rows_uri: str, cfg: CacheConfig) -> dict:
    """Encode one Parquet shard into row files under ``rows_uri`` (a shard's own artifact), for
    `assemble_levanter_cache` to move into a cache later; returns its entry (ledger fields, `rows`,
    `encoding`). Split by ``cfg.validation_fraction`` alone: a `validation_min_documents` needs the
    whole corpus, so assembly applies it (from the id hashes written here), and no shard is encoded
    again when the corpus grows."""
    split_by_fraction = replace(cfg, validation_min_documents=None)
    with local_tokenizer_dir(tokenizer_dir) as local_tok:
        bos_eos = _special_token_ids(local_tok) or _levanter_preprocessor_metadata(tokenizer_dir, local_tok)[1:3]
        encoding = _manifest_identity(tokenizer_json_sha256(local_tok), *bos_eos, split_by_fraction)
        encoder = _Encoder(os.path.join(local_tok, "tokenizer.json"), *bos_eos, split_by_fraction)
    shard = _parquet_shard(spec.uri, split_by_fraction, spec.fingerprint, spec.key)
    return {**_encode_rows(shard, encoder, split_by_fraction, rows_uri), ROWS: rows_uri.rstrip("/"), ENCODING: encoding}


def _encode_shard(shard: _Shard, job: EncodeJob) -> dict:
    out = job.shard_dir(shard.key, shard.fingerprint)
    if shard.fingerprint is not None and (done := _read_json(f"{out}/{_ENCODED_ENTRY}")) is not None:
        return {**done, ROWS: f"{out}/{done[_ROWS_AT]}", ENCODING: job.identity}  # an earlier, interrupted build's
    # Each attempt writes its own folder and `entry.json` names the one it vouches for: a retried
    # task never writes into files that a presumed-dead earlier attempt may still be writing.
    attempt = uuid.uuid4().hex[:16]
    with local_tokenizer_dir(job.tokenizer_dir) as local_tok:
        encoder = _Encoder(os.path.join(local_tok, "tokenizer.json"), job.bos, job.eos, job.cfg)
    entry = _encode_rows(shard, encoder, job.cfg, f"{out}/{attempt}")
    _write_json(f"{out}/{_ENCODED_ENTRY}", {**entry, _ROWS_AT: attempt})
    return {**entry, ROWS: f"{out}/{attempt}", ENCODING: job.identity}


def _encode_rows(shard: _Shard, encoder: _Encoder, cfg: CacheConfig, rows_uri: str) -> dict:
    """Write a shard's row files under ``rows_uri``; returns its ledger entry."""
    fs, path = fsspec.core.url_to_fs(rows_uri)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # keep Rust threads on in forked workers
    fs.makedirs(path, exist_ok=True)
    entry = _shard_entry(shard)
    with contextlib.ExitStack() as files:
        rows = {(split, kind): files.enter_context(fs.open(f"{path}/{split}.{kind}", "wb"))
                for split in SPLITS for kind in _ROW_FILES}
        id_hashes = files.enter_context(fs.open(f"{path}/{ID_HASHES}", "wb"))
        for batch, encodings in _encode_ahead(encoder, _iter_clean_batches(shard, cfg)):
            entry["skipped_documents"] += batch.skipped
            if not batch.texts:
                continue
            entry["text_bytes"] += batch.text_bytes
            framed, hashes = encoder.frame(batch, encodings)
            id_hashes.write(hashes.astype(ID_HASH_DTYPE, copy=False).tobytes())
            for split, (data, lengths) in framed.items():
                rows[split, "tokens"].write(data.astype(_ROW_FILES["tokens"], copy=False).tobytes())
                rows[split, "lengths"].write(lengths.astype(_ROW_FILES["lengths"], copy=False).tobytes())
                entry[f"{split}_documents"] += int(lengths.size)
                entry[f"{split}_tokens"] += int(data.size)
    return entry


def _read_rows(rows_uri: str, name: str, dtype: np.dtype) -> np.ndarray:
    with fsspec.open(f"{rows_uri}/{name}", "rb") as fh:
        return np.frombuffer(fh.read(), dtype=dtype)


def validation_threshold(cfg: CacheConfig, encoded: Sequence[dict]) -> float:
    """The fraction a cache of these encoded shards (every shard of it, each split by
    ``cfg.validation_fraction``) is split at: ``with_validation_minimum`` over the corpus, from the
    shards' counts, and only where the fraction holds out too few, from their id hashes."""
    documents, held_out = _split_counts(encoded)

    def id_hashes() -> np.ndarray:
        _require_rows(encoded, "a raised validation threshold reads every shard's id hashes")
        return np.concatenate([np.empty(0, ID_HASH_DTYPE)]
                              + [_read_rows(e[ROWS], ID_HASHES, ID_HASH_DTYPE) for e in encoded])

    return raised_threshold(cfg.validation_fraction, cfg.validation_min_documents, documents, held_out, id_hashes)


def split_by_fraction_alone(cfg: CacheConfig, encoded: Sequence[dict]) -> bool:
    """Whether a cache of these shards is split at ``cfg.validation_fraction`` itself, as their counts
    show (no validation minimum, or the fraction holds out enough): its assembly then reads no
    shard's id hashes, and keeps the shards its ledger holds without their rows."""
    return fraction_holds_enough(cfg.validation_min_documents, *_split_counts(encoded))


def _split_counts(encoded: Sequence[dict]) -> tuple[int, int]:
    """(documents, validation documents) of these shards, each split by the cache's own fraction."""
    return (sum(e["train_documents"] + e["validation_documents"] for e in encoded),
            sum(e["validation_documents"] for e in encoded))


def _require_rows(entries: Sequence[dict], why: str) -> None:
    """Refuse entries given without row files (ledger entries of shards a cache holds) where ``why``
    needs their rows: the cache would otherwise be assembled with a hole."""
    held = [e["key"] for e in entries if ROWS not in e]
    if held:
        raise ValueError(f"{len(held)} shard(s) were given as held by the cache, without their row files "
                         f"({', '.join(held[:5])}), but {why}; give their encoded rows")


def _resplit(entry: dict, fraction: float, rows_uri: str) -> dict:
    """An encoded shard's rows split again at ``fraction`` (a raised validation minimum) into row files
    under ``rows_uri``: the same rows, in document order within each split; no encoding."""
    was = entry[ENCODING]["validation_fraction"]
    hashes = _read_rows(entry[ROWS], ID_HASHES, ID_HASH_DTYPE).astype(np.float64) / 2**32
    rows = {}  # split -> its rows as they are, in document order
    for split in SPLITS:
        tokens = _read_rows(entry[ROWS], f"{split}.tokens", _ROW_FILES["tokens"])
        lengths = _read_rows(entry[ROWS], f"{split}.lengths", _ROW_FILES["lengths"])
        rows[split] = np.split(tokens, np.cumsum(lengths)[:-1]) if lengths.size else []
    # Document d is row `position[d]` of the split it was in.
    was_validation = hashes < was
    position = np.empty(hashes.size, dtype=np.int64)
    for mask in (~was_validation, was_validation):
        position[mask] = np.arange(int(mask.sum()))
    fs, path = fsspec.core.url_to_fs(rows_uri)
    fs.makedirs(path, exist_ok=True)
    out = {**entry, ROWS: rows_uri, ENCODING: {**entry[ENCODING], "validation_fraction": fraction}}
    now_validation = hashes < fraction
    for split, mask in (("train", ~now_validation), ("validation", now_validation)):
        moved = [rows["validation" if was_validation[d] else "train"][position[d]] for d in np.flatnonzero(mask)]
        tokens = np.concatenate([np.empty(0, _ROW_FILES["tokens"])] + moved)
        with fs.open(f"{path}/{split}.tokens", "wb") as fh:
            fh.write(tokens.tobytes())
        with fs.open(f"{path}/{split}.lengths", "wb") as fh:
            fh.write(np.array([r.size for r in moved], dtype=_ROW_FILES["lengths"]).tobytes())
        out[f"{split}_documents"], out[f"{split}_tokens"] = len(moved), int(tokens.size)
    with fs.open(f"{path}/{ID_HASHES}", "wb") as fh:
        fh.write(_read_rows(entry[ROWS], ID_HASHES, ID_HASH_DTYPE).tobytes())
    return out


# ---------------------------------------------------------------------------------------------
# Assembly: the encoded rows moved into the cache, one shard file per unit of work
#
# The new rows of a split take positions [tokens before, tokens after) of its `data` array and
# [rows before + 1, rows after + 1) of its `offsets` array (offsets[1 + row] is where a row ends).
# Every shard file of an array those ranges touch is one unit: it is written by one worker, from the
# row files of the shards that fall in it, so the units are independent and can run anywhere the
# store is reachable. The row count (offsets[0]) and the ledgers are written after every unit, so
# until then a reader sees the cache as it was. While units run, the manifest records how far they
# write (`assembling`), so that a rerun with fewer shards zeroes what a killed one left beyond.

_ASSEMBLING = "assembling"


@dataclass(frozen=True)
class FileUnit:
    """Positions [start, stop) of one array of one split, all in one of its shard files."""

    split: str
    array: str  # "data" (tokens) or "offsets" (row ends)
    start: int
    stop: int


@dataclass(frozen=True)
class AssemblyJob:
    """What every unit of one assembly shares: the encoded shards in ledger order (each entry names
    its row files, `rows`), and where each split's arrays stood before them."""

    out_root: str
    entries: tuple[dict, ...]
    base: dict[str, tuple[int, int]]  # split -> (rows, tokens) before this assembly
    layouts: dict[str, ShardLayout]  # "<split>/<array>" -> the array's layout
    piece_values: int  # values held and written at once

    def starts(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """Per encoded shard, its first row and first token in the split's arrays, then the ends."""
        rows, tokens = self.base[split]
        return (rows + np.cumsum([0] + [e[f"{split}_documents"] for e in self.entries], dtype=np.int64),
                tokens + np.cumsum([0] + [e[f"{split}_tokens"] for e in self.entries], dtype=np.int64))

    def ends(self, split: str) -> tuple[int, int]:
        rows, tokens = self.starts(split)
        return int(rows[-1]), int(tokens[-1])

    def units(self, split: str) -> list[FileUnit]:
        (rows, tokens), (rows_end, tokens_end) = self.base[split], self.ends(split)
        units = []
        for array, low, high in (("data", tokens, tokens_end), ("offsets", rows + 1, rows_end + 1)):
            length = self.layouts[f"{split}/{array}"].shard_length
            units += [FileUnit(split, array, max(low, k * length), min(high, (k + 1) * length))
                      for k in range(low // length, (high - 1) // length + 1)] if high > low else []
        return units


def assemble_file(unit: FileUnit, job: AssemblyJob) -> dict[str, tuple[int, str] | None]:
    """Write one unit from the row files, in pieces of at most `piece_values` values (each piece
    rewrites the shard file once); returns the shard file it wrote, with its size and sha256 hashed
    from the bytes written (`ShardFileWriter.written`)."""
    writer = ShardFileWriter(f"{job.out_root}/{unit.split}/{INPUT_IDS}/{unit.array}",
                             job.layouts[f"{unit.split}/{unit.array}"])
    pending, position = [], unit.start
    for values in _unit_values(unit, job):
        pending.append(values)
        if sum(v.size for v in pending) >= job.piece_values:
            joined = np.concatenate(pending)
            writer.write(position, joined)
            pending, position = [], position + joined.size
    if pending:
        writer.write(position, np.concatenate(pending))
    return writer.written


def _unit_values(unit: FileUnit, job: AssemblyJob) -> Iterator[np.ndarray]:
    """The values of positions [start, stop) of the unit's array, in order, a bounded piece at a time."""
    rows, tokens = job.starts(unit.split)
    width = _ROW_FILES["tokens"].itemsize
    for i, entry in enumerate(job.entries):
        fs, base = fsspec.core.url_to_fs(f"{entry[ROWS]}/{unit.split}")
        if unit.array == "data":
            low, high = max(unit.start, int(tokens[i])), min(unit.stop, int(tokens[i + 1]))
            if low >= high:
                continue
            with fs.open(f"{base}.tokens", "rb") as fh:
                fh.seek((low - int(tokens[i])) * width)
                for first in range(low, high, job.piece_values):
                    count = min(job.piece_values, high - first)
                    data = np.frombuffer(fh.read(count * width), dtype=_ROW_FILES["tokens"])
                    if data.size != count:
                        raise ValueError(f"{fs.unstrip_protocol(base)}.tokens is shorter than its entry says")
                    yield data.astype(TOKEN_DTYPE, copy=False)
        else:
            low, high = max(unit.start, int(rows[i]) + 1), min(unit.stop, int(rows[i + 1]) + 1)
            if low >= high:
                continue
            with fs.open(f"{base}.lengths", "rb") as fh:
                lengths = np.frombuffer(fh.read(), dtype=_ROW_FILES["lengths"])
            if lengths.size != entry[f"{unit.split}_documents"] or int(lengths.sum()) != entry[f"{unit.split}_tokens"]:
                raise ValueError(f"{fs.unstrip_protocol(base)}.lengths does not match its entry: {lengths.size} rows, "
                                 f"{int(lengths.sum())} tokens")
            row_ends = int(tokens[i]) + np.cumsum(lengths, dtype=np.int64)
            first_row = int(rows[i]) + 1
            yield row_ends[low - first_row:high - first_row]


# ---------------------------------------------------------------------------------------------
# Levanter's on-disk format, written with tensorstore alone

# A split directory as Levanter 1.2's TreeStore lays it out (levanter.store.tree_store and
# jagged_array): per field a JaggedArrayStore, `<field>/offsets` (int64: [0] = rows, [i] = end of
# row i in `data`) and `<field>/data`, each a zarr3 array of shape [2**54] stored in shard files of
# SHARD_CHUNK elements made of ROW_CHUNK-element blosc chunks; next to them `shard_ledger.json`.
# Written here without importing Levanter (and with it JAX and Ray: ~4 s of CPU in every process
# that appends a shard); Levanter's TreeCache and trainer read it unchanged, which
# tests/tokenization/test_tokenization_levanter.py checks on fresh and appended caches.
ROW_CHUNK = 256 * 1024
SHARD_CHUNK = ROW_CHUNK * 512
LEDGER_NAME = "shard_ledger.json"
_ARRAY_LENGTH = 2**54


def _zarr3_array(url: str, dtype: str, fresh: bool):
    """Open (``fresh``: replace) one of a JaggedArrayStore's arrays, created as Levanter creates it."""
    import tensorstore as ts

    from marin_resources.storage.object_stores import tensorstore_kvstore

    kvstore = tensorstore_kvstore(url)
    if kvstore["driver"] == "file":
        os.makedirs(os.path.dirname(kvstore["path"]), exist_ok=True)
    spec = {"driver": "zarr3", "kvstore": kvstore, "metadata": {
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [SHARD_CHUNK]}},
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [ROW_CHUNK], "codecs": [{"name": "blosc", "configuration": {"clevel": 5}}]}}]}}
    mode = {"create": True, "delete_existing": True} if fresh else {"create": True, "open": True}
    return ts.open(spec, dtype=dtype, shape=[_ARRAY_LENGTH], **mode).result()


def _read_zarr3_array(url: str):
    import tensorstore as ts

    from marin_resources.storage.object_stores import tensorstore_kvstore

    return ts.open({"driver": "zarr3", "kvstore": tensorstore_kvstore(url)}, open=True).result()


class _JaggedArrayWriter:
    """One field's offsets and data arrays (JaggedArrayStore's layout): opened or created, their row
    and token counts, trimmed; assembly writes them through `offsets` and `data`.

    Tensorstore creates the arrays and reads them; the writes go through `ShardFileWriter`, which
    rewrites a shard file holding one inner chunk in memory, where tensorstore would hold the whole
    file (up to 512 MB of tokens for the tail shard of a large cache)."""

    def __init__(self, field_url: str, fresh: bool):
        offsets = _zarr3_array(f"{field_url}/offsets", "int64", fresh)
        data = _zarr3_array(f"{field_url}/data", np.dtype(TOKEN_DTYPE).name, fresh)
        self.rows = int(offsets[0].read().result())
        self.size = int(offsets[self.rows].read().result()) if self.rows else 0
        self._offsets_at = lambda row: int(offsets[row].read().result())
        self.offsets = ShardFileWriter(f"{field_url}/offsets", ShardLayout.of(offsets.spec().to_json()["metadata"]))
        self.data = ShardFileWriter(f"{field_url}/data", ShardLayout.of(data.spec().to_json()["metadata"]))
        for files in (self.offsets, self.data):
            files.remove_staged()  # a killed run's half-written shard file

    def trim_to(self, rows: int) -> None:
        """Drop the rows after the first ``rows`` (zero-filled, as Levanter's trim leaves them)."""
        if rows >= self.rows:
            return
        size = self._offsets_at(rows) if rows else 0
        self.offsets.write(0, np.array([rows], dtype=np.int64))
        self.data.zero(size, self.size)
        self.offsets.zero(rows + 1, self.rows + 1)
        self.rows, self.size = rows, size


def _write_ledger(split_dir: str, shards: list[dict], split: str, metadata: dict, finished: bool) -> None:
    """Levanter's CacheLedger of one split as its JSON encoding spells it, for these ledger shards;
    `is_finished` is what TreeCache.load asks."""
    rows = {entry["key"]: entry[f"{split}_documents"] for entry in shards}
    _write_json(f"{split_dir}/{LEDGER_NAME}", {
        "total_num_rows": sum(rows.values()), "shard_rows": rows, "is_finished": finished,
        "finished_shards": list(rows), "field_counts": {}, "metadata": {"preprocessor_metadata": metadata}})


def tokenizer_ledger_name(local_dir: str) -> str:
    """How a ledger names its tokenizer: by its files' hash, never by where they are, so a cache's
    bytes are the same on every prefix and a relocated cache still names its tokenizer truly. A
    trainer gives the tokenizer it loads the same name (:func:`name_tokenizer_as_ledgers_do`)."""
    return f"sha256:{_tokenizer_files_sha256(local_dir)}"


def name_tokenizer_as_ledgers_do(data_config) -> None:
    """Levanter compares a cache ledger's metadata with its loaded tokenizer's, where ``tokenizer`` is
    the loaded tokenizer's ``name_or_path``: the URI it was read from. Named by its files' hash, as
    ledgers name it, it matches a cache built under any prefix."""
    with local_tokenizer_dir(data_config.tokenizer) as local:
        data_config.the_tokenizer.name_or_path = tokenizer_ledger_name(local)


def _levanter_preprocessor_metadata(tokenizer_dir: str, local_dir: str) -> tuple[dict, int, int]:
    """Metadata Levanter's loader will expect, plus BOS/EOS ids; checks the cache exemplar fits."""
    from levanter.data.text import BatchTokenizer
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(local_dir)
    if hf_tok.bos_token_id is None or hf_tok.eos_token_id is None:
        raise ValueError(f"tokenizer at {tokenizer_dir} must define both bos_token and eos_token")
    processor = BatchTokenizer(hf_tok, enforce_bos=True, enforce_eos=True)
    fields = sorted(processor.output_exemplar)
    if fields != [INPUT_IDS]:
        raise ValueError(
            f"Levanter expects cache fields {fields} for tokenizer {tokenizer_dir}; this cache stores only "
            f"{INPUT_IDS!r}. Set tokenizer.model_input_names to ['input_ids', 'attention_mask'] (adopt_tokenizer does)."
        )
    metadata = dict(processor.metadata)
    metadata["tokenizer"] = tokenizer_ledger_name(local_dir)  # Levanter puts the path it was loaded from here
    return metadata, int(hf_tok.bos_token_id), int(hf_tok.eos_token_id)


def _special_token_ids(local_dir: str) -> tuple[int, int] | None:
    """(BOS, EOS) ids as the tokenizer's own files give them, without importing transformers:
    `tokenizer_config.json` names the tokens and `tokenizer.json` numbers them. None where they do
    not say (transformers then decides)."""
    from tokenizers import Tokenizer

    try:
        with open(os.path.join(local_dir, "tokenizer_config.json")) as f:
            config = json.load(f)
        tokenizer = Tokenizer.from_file(os.path.join(local_dir, "tokenizer.json"))
    except Exception:  # noqa: BLE001 - a file it cannot read: transformers decides
        return None
    ids = []
    for name in ("bos_token", "eos_token"):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token_id is None:
            return None
        ids.append(token_id)
    return ids[0], ids[1]


def _tokenizer_files_sha256(local_dir: str) -> str:
    """One hash of every file of a tokenizer directory (names and bytes). Dot files are the store's
    bookkeeping (the artifact's manifest, with its build times, and its lease), not the tokenizer:
    hashing them made two builds of the same cache differ."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(local_dir)):
        path = os.path.join(local_dir, name)
        if os.path.isfile(path) and not name.startswith("."):
            digest.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def _preprocessor_metadata(tokenizer_dir: str, local_dir: str, previous: dict | None) -> tuple[dict, int, int, str]:
    """(Levanter metadata, BOS, EOS, tokenizer files' hash). A cache whose manifest recorded them
    for the same tokenizer files reuses them: Levanter (and transformers) are imported only to start
    a cache, not to append a shard to it. One that named its tokenizer by path (before ledgers named
    it by hash) gets the new name."""
    files_sha = _tokenizer_files_sha256(local_dir)
    if previous is not None and previous.get("tokenizer_files_sha256") == files_sha \
            and (previous.get("levanter_metadata") or {}).get("tokenizer") == f"sha256:{files_sha}":
        identity = previous["identity"]
        return previous["levanter_metadata"], identity["bos_token_id"], identity["eos_token_id"], files_sha
    return (*_levanter_preprocessor_metadata(tokenizer_dir, local_dir), files_sha)


def _shard_entry(shard: _Shard) -> dict:
    return {
        "key": shard.key,
        "fingerprint": shard.fingerprint,
        "train_documents": 0,
        "train_tokens": 0,
        "validation_documents": 0,
        "validation_tokens": 0,
        "text_bytes": 0,
        "skipped_documents": 0,
    }


def _reuse_plan(manifest: dict | None, identity: dict, shards: Sequence[_Shard | dict]) -> tuple[int, list]:
    """(committed ledger shards to keep, shards to encode or assemble after them, in order); a shard is
    a `_Shard` or an encoded shard's entry.

    Kept: the longest run of committed shards, in ledger order, that are still wanted with the same
    fingerprint. Rows cannot leave the middle of a Levanter store, so a removed or changed file
    re-encodes every shard committed after it; a new file is appended whatever its position in
    `shards`, so an append-only corpus encodes each file exactly once."""
    if manifest is None or manifest.get("identity") != identity:
        return 0, list(shards)
    keep = _kept_count(manifest, dict(_key_and_fingerprint(s) for s in shards))
    kept = {e["key"] for e in manifest["shards"][:keep]}
    return keep, [s for s in shards if _key_and_fingerprint(s)[0] not in kept]


def _kept_count(manifest: dict, wanted: Mapping[str, str | None]) -> int:
    """How many of the manifest's ledger shards, from the first, are still wanted (key -> fingerprint)
    with the fingerprint they were committed with."""
    keep = 0
    for old in manifest["shards"]:
        fingerprint = wanted.get(old["key"])
        if fingerprint is None or fingerprint != old["fingerprint"]:
            break
        keep += 1
    return keep


def held_shards(cache_root: str, wanted: Mapping[str, str | None], cfg: CacheConfig, *, sha256: str) -> list[dict]:
    """The ledger entries of the cache at ``cache_root`` that an assembly of the shards ``wanted`` (key ->
    fingerprint) keeps without reading their rows: the longest run, in ledger order, still wanted with
    the same fingerprint, as `_reuse_plan` keeps them. None of them where its manifest is not the committed one
    (``sha256``, as the artifact's manifest records it: a build stopped between its assembly and its
    commit) or not finished, or the cache was split at a raised threshold (a validation minimum), which
    the next assembly decides again from every shard's id hashes. One read, whatever the corpus."""
    fs, path = fsspec.core.url_to_fs(f"{cache_root.rstrip('/')}/{MANIFEST_NAME}")
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return []
    if hashlib.sha256(data).hexdigest() != sha256:
        return []
    manifest = json.loads(data)
    if not manifest.get("finished") or manifest["identity"].get("validation_fraction") != cfg.validation_fraction:
        return []
    return manifest["shards"][:_kept_count(manifest, wanted)]


def _key_and_fingerprint(shard: _Shard | dict) -> tuple[str, str | None]:
    return (shard["key"], shard["fingerprint"]) if isinstance(shard, dict) else (shard.key, shard.fingerprint)


def _encode_all(todo: Sequence[_Shard], job: EncodeJob, parallel_map: ParallelMap,
                progress: ProgressMeter | None = None) -> list[dict]:
    """Ledger entries of `todo`, in order, each shard encoded as its own unit of work; `progress`
    counts their documents and text bytes (after each shard in this process, after all of them on
    workers). Raises `ShardEncodingError` naming every shard that failed, after the others were encoded."""
    if all(shard.file is not None for shard in todo):
        files = [shard.file for shard in todo]
        batches = [[f] for f in files] if progress is not None and parallel_map is in_process_map else [files]
        entries = []
        for batch in batches:
            done = parallel_map(encode_parquet_shard, batch, job)
            entries += done
            if progress is not None:
                progress.add(documents=sum(e.get("train_documents", 0) + e.get("validation_documents", 0)
                                           for e in done), nbytes=sum(e.get("text_bytes", 0) for e in done))
    else:  # documents held in this process (an iterator) cannot be shipped to a worker
        entries = [_encode_shard(shard, job) for shard in todo]
    failed = [entry for entry in entries if "error" in entry]
    if failed:
        listed = "; ".join(f"{entry['key']}: {entry['error']}" for entry in failed[:5])
        raise ShardEncodingError(f"{len(failed)} of {len(todo)} shard(s) could not be encoded ({listed}); "
                                 f"the other {len(todo) - len(failed)} are encoded and kept for the rerun")
    return entries


def _build(shards: Sequence[_Shard], tokenizer_dir: str, out_root: str, cfg: CacheConfig,
           parallel_map: ParallelMap = in_process_map, progress: ProgressMeter | None = None) -> CacheStats:
    _require_distinct([s.key for s in shards])
    out_root = out_root.rstrip("/")
    with local_tokenizer_dir(tokenizer_dir) as local_tok, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="levanter-metadata") as background:
        tok_sha = tokenizer_json_sha256(local_tok)
        old = _read_json(f"{out_root}/{MANIFEST_NAME}") if cfg.incremental else None
        # Levanter's metadata for a new cache imports Levanter and transformers (seconds): it is worked
        # out while the shards are encoded with the BOS/EOS ids the tokenizer's own files give, and the
        # two must agree before anything is written.
        levanter = background.submit(_preprocessor_metadata, tokenizer_dir, local_tok, old)
        bos_eos = _special_token_ids(local_tok) or levanter.result()[1:3]
        identity = _manifest_identity(tok_sha, *bos_eos, cfg)

        reuse, todo = _reuse_plan(old, identity, shards)
        if old is not None and not todo and reuse == len(old["shards"]) and old.get("finished"):
            return _stats_from_manifest(out_root, old, reused=reuse)

        job = EncodeJob(tokenizer_dir, *bos_eos, cfg, identity, f"{out_root}/{ENCODED_DIR}")
        # Encoding first, every shard as its own unit: the cache is not touched until all are encoded,
        # so a shard that fails leaves the previous cache as it was, and never a hole in a new one.
        started = time.monotonic()
        encoded = _encode_all(todo, job, parallel_map, progress)
        encode_seconds = time.monotonic() - started
        metadata, bos, eos, files_sha = levanter.result()
    if (bos, eos) != tuple(bos_eos):
        raise ValueError(f"tokenizer at {tokenizer_dir}: its files give BOS/EOS ids {tuple(bos_eos)}, transformers "
                         f"{(bos, eos)}")
    stats = _assemble(out_root, identity, metadata, files_sha, old, reuse, encoded, cfg.flush_tokens, parallel_map)
    return replace(stats, encode_seconds=round(encode_seconds, 3))


def _require_distinct(keys: list[str]) -> None:
    if not keys:
        raise ValueError("no documents to tokenize: the shard list is empty")
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate document files in the input list")


def assemble_levanter_cache(encoded: Sequence[dict], tokenizer_dir: str, out_root: str, cfg: CacheConfig,
                            parallel_map: ParallelMap = in_process_map) -> CacheStats:
    """Assemble the Levanter cache root ``out_root`` from shards encoded elsewhere (`encode_shard_rows`:
    each entry names its row files): every shard of the cache, in order, as `build_levanter_cache`
    takes its files. Only moves bytes: ledger shards already committed with the same fingerprint are
    kept (as `build_levanter_cache` keeps them) and the others' rows are appended, one unit of work
    per zarr shard file through ``parallel_map``. A validation minimum is decided here, over every
    shard (`validation_threshold`); where it raises the threshold, the shards' rows are split again
    (no encoding). The cache is byte-identical to `build_levanter_cache`'s on the same files.

    A shard the cache already holds may be given as its ledger entry, without row files (`held_shards`):
    one of the 74,500 shards of a large corpus is then not looked up again to append one. Such a
    shard must be one this assembly keeps; where it is not (a changed identity, a shard before it
    removed or changed, a raised validation threshold), this raises naming it, and nothing is written."""
    _require_distinct([e["key"] for e in encoded])
    out_root = out_root.rstrip("/")
    split_by_fraction = replace(cfg, validation_min_documents=None)
    split = replace(cfg, validation_fraction=validation_threshold(cfg, encoded))
    with local_tokenizer_dir(tokenizer_dir) as local_tok:
        tok_sha = tokenizer_json_sha256(local_tok)
        old = _read_json(f"{out_root}/{MANIFEST_NAME}") if cfg.incremental else None
        metadata, bos, eos, files_sha = _preprocessor_metadata(tokenizer_dir, local_tok, old)
    wanted = _manifest_identity(tok_sha, bos, eos, split_by_fraction)
    # A held shard passed this check when its cache took it: it is kept only under the same identity.
    foreign = [e["key"] for e in encoded if ROWS in e and e[ENCODING] != wanted]
    if foreign:
        raise ValueError(f"{len(foreign)} shard(s) were encoded with another tokenizer or settings than this cache's "
                         f"({', '.join(foreign[:5])}); encode them again")
    identity = _manifest_identity(tok_sha, bos, eos, split)
    reuse, todo = _reuse_plan(old, identity, encoded)
    _require_rows(todo, "the cache does not keep them (its identity changed, or a shard before them was removed "
                        "or changed)")
    if old is not None and not todo and reuse == len(old["shards"]) and old.get("finished"):
        return _stats_from_manifest(out_root, old, reused=reuse)
    if split.validation_fraction != cfg.validation_fraction:
        todo = [_resplit(e, split.validation_fraction, f"{out_root}/{ENCODED_DIR}/resplit/{i}")
                for i, e in enumerate(todo)]
    return _assemble(out_root, identity, metadata, files_sha, old, reuse, todo, cfg.flush_tokens, parallel_map)


def _assemble(out_root: str, identity: dict, metadata: dict, files_sha: str, old: dict | None, reuse: int,
              encoded: Sequence[dict], flush_tokens: int, parallel_map: ParallelMap) -> CacheStats:
    """Keep the first ``reuse`` ledger shards of the cache at ``out_root`` (its manifest ``old``) and
    append the ``encoded`` shards' rows after them; the manifest and Levanter's ledgers move last."""
    manifest_uri = f"{out_root}/{MANIFEST_NAME}"
    fs, root_path = fsspec.core.url_to_fs(out_root)
    started = time.monotonic()
    if reuse == 0:
        for name in (*SPLITS, MANIFEST_NAME):
            if fs.exists(f"{root_path}/{name}"):
                fs.rm(f"{root_path}/{name}", recursive=True)
        entries: list[dict] = []
    else:
        entries = old["shards"][:reuse]
    manifest = {"identity": identity, "levanter_metadata": metadata, "tokenizer_files_sha256": files_sha,
                "finished": False, "shards": entries, "appended_from": reuse}
    arrays = {split: _JaggedArrayWriter(f"{out_root}/{split}/{INPUT_IDS}", fresh=reuse == 0) for split in SPLITS}
    base = {}
    for split, array in arrays.items():
        array.trim_to(sum(e[f"{split}_documents"] for e in entries))  # rows of shards no longer wanted
        base[split] = (array.rows, array.size)
    assembly = AssemblyJob(out_root, tuple(encoded), base,
                           {f"{split}/{name}": getattr(array, name).layout for split, array in arrays.items()
                            for name in ("data", "offsets")}, flush_tokens)
    ends = {split: assembly.ends(split) for split in SPLITS}
    for split, array in arrays.items():
        # Values a killed assembly wrote past where this one ends (it had more shards) are zeroed.
        rows_were, tokens_were = ((old or {}).get(_ASSEMBLING) or {}).get(split, (0, 0)) if reuse else (0, 0)
        array.data.zero(ends[split][1], max(tokens_were, ends[split][1]))
        array.offsets.zero(ends[split][0] + 1, max(rows_were + 1, ends[split][0] + 1))
    # Until the row counts move, Levanter reads the cache as it was: an append leaves its ledger alone,
    # and a build that changed what is committed (fresh, or shards dropped) marks it unfinished.
    if reuse == 0 or reuse < len(old["shards"]) or not old.get("finished"):
        for split in SPLITS:
            _write_ledger(f"{out_root}/{split}", entries, split, metadata, finished=False)
    manifest[_ASSEMBLING] = {split: list(ends[split]) for split in SPLITS}
    _write_json(manifest_uri, manifest)

    # Assembly: every shard file the new rows touch is one unit of work, written from the row files.
    units = [unit for split in SPLITS for unit in assembly.units(split)]
    spread = parallel_map if sum(e["train_tokens"] + e["validation_tokens"] for e in encoded) >= SHARD_CHUNK \
        else in_process_map  # under one shard file of tokens, workers cost more than they save
    for files in (files for array in arrays.values() for files in (array.offsets, array.data)):
        files.written.clear()  # what the units write next replaces what was trimmed or zeroed before
    written: dict[str, tuple[int, str] | None] = {}
    for unit_written in spread(assemble_file, units, assembly):
        written |= unit_written

    for split, array in arrays.items():
        # The ledger goes through fsspec, the arrays through tensorstore: a tensorstore path
        # that resolves elsewhere (as s3:// once did, to ./s3:/) must not leave a finished
        # ledger over no data.
        zarr_json = f"{root_path}/{split}/{INPUT_IDS}/offsets/zarr.json"
        if not fs.exists(zarr_json):
            raise RuntimeError(f"cache {out_root}/{split}: Levanter wrote its rows, but "
                               f"{fs.unstrip_protocol(zarr_json)} is not in the store; tensorstore wrote them "
                               "elsewhere")
        # The row count last: from here a reader sees the new rows, whose tokens are all there.
        array.offsets.write(0, np.array([ends[split][0]], dtype=np.int64))
        written |= array.offsets.written
    manifest["shards"] = entries + [{k: v for k, v in e.items() if k not in (_ROWS_AT, ROWS, ENCODING)}
                                    for e in encoded]
    del manifest[_ASSEMBLING]
    for split in SPLITS:
        _write_ledger(f"{out_root}/{split}", manifest["shards"], split, metadata, finished=True)
    manifest["finished"] = True
    _write_json(manifest_uri, manifest)
    if fs.exists(f"{root_path}/{ENCODED_DIR}"):
        fs.rm(f"{root_path}/{ENCODED_DIR}", recursive=True)
    return replace(_stats_from_manifest(out_root, manifest, reused=reuse),
                   assembly_seconds=round(time.monotonic() - started, 3),
                   files_written=tuple((path[len(root_path) + 1:], *entry) for path, entry in sorted(written.items())
                                       if entry is not None))


def build_levanter_cache(doc_files: Sequence[str], tokenizer_dir: str, out_root: str, cfg: CacheConfig,
                         fingerprints: Mapping[str, str] | None = None,
                         parallel_map: ParallelMap = in_process_map, keys: Mapping[str, str] | None = None,
                         progress: ProgressMeter | None = None) -> CacheStats:
    """Tokenize Parquet document files into the Levanter cache root `out_root`.

    On a fresh build `doc_files` order is the row order. With `cfg.incremental`, ledger shards already
    in `out_root` whose files are unchanged stay where they are (see `_reuse_plan`) and only the other
    files are encoded, appended in `doc_files` order. `fingerprints` maps a file to a content
    fingerprint (the sha256 its producer recorded); files without one are fingerprinted by size and
    mtime/ETag. `parallel_map` runs the shards' encoding (`encode_parquet_shard`, one call per file
    to encode): one after another here by default, or spread over workers (a Ray cluster); the
    cache's bytes do not depend on it. `keys` names files in the ledger (default: their URIs); the
    assets give store-relative names, so a cache's bytes do not depend on the store's prefix.
    `progress` counts the documents and text bytes encoded.
    """
    if isinstance(doc_files, str):
        raise TypeError("doc_files must be a list of Parquet paths/URIs, not a single string")
    fingerprints, keys = fingerprints or {}, keys or {}
    cfg = with_validation_minimum(cfg, parquet_ids(doc_files, cfg) if cfg.validation_min_documents else ())
    shards = [_parquet_shard(os.fspath(u), cfg, fingerprints.get(os.fspath(u)), keys.get(os.fspath(u)))
              for u in doc_files]
    return _build(shards, tokenizer_dir, out_root, cfg, parallel_map, progress)


def build_levanter_cache_from_documents(
    documents: Iterable[tuple[str, str]],
    tokenizer_dir: str,
    out_root: str,
    cfg: CacheConfig,
    source_name: str = "documents",
) -> CacheStats:
    """Like `build_levanter_cache` for an in-memory iterator of (id, text); always a full rebuild."""
    if cfg.validation_min_documents is not None:
        documents = list(documents)
        cfg = with_validation_minimum(cfg, (doc_id for doc_id, _ in documents))
    return _build([_iterator_shard(documents, source_name, cfg)], tokenizer_dir, out_root, cfg)


# ---------------------------------------------------------------------------------------------
# Verification


def iter_parquet_texts(doc_files: Sequence[str], cfg: CacheConfig | None = None) -> Iterator[str]:
    """Texts of the documents a cache would hold, in cache order (e.g. to train a tokenizer)."""
    cfg = cfg or CacheConfig()
    for uri in doc_files:
        for batch in _iter_clean_batches(_parquet_shard(os.fspath(uri), cfg), cfg):
            yield from batch.texts


def cache_config_of(cache_root: str) -> tuple[CacheConfig, dict]:
    """How a finished cache split and read its documents, and its recorded identity."""
    manifest = _read_json(f"{cache_root.rstrip('/')}/{MANIFEST_NAME}")
    if manifest is None or not manifest.get("finished"):
        raise FileNotFoundError(f"no finished tokenized cache at {cache_root}")
    ident = manifest["identity"]
    cfg = CacheConfig(validation_fraction=ident["validation_fraction"], id_column=ident["id_column"],
                      text_column=ident["text_column"])
    return cfg, ident


def iter_split_documents(doc_files: Sequence[str], cfg: CacheConfig, split: str) -> Iterator[tuple[str, str]]:
    """(id, text) of the documents a cache puts in ``split``, in cache order: e.g. the held-out
    documents a downstream task may be built from without touching what the model trained on."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for uri in doc_files:
        for batch in _iter_clean_batches(_parquet_shard(os.fspath(uri), cfg), cfg):
            for doc_id, text in zip(batch.ids, batch.texts):
                if is_validation_document(doc_id, cfg.validation_fraction) == (split == "validation"):
                    yield doc_id, text


def decode_roundtrip_check(
    cache_root: str, tokenizer_dir: str, doc_files: Sequence[str], sample_n: int = 100, seed: int = 0,
    keys: Mapping[str, str] | None = None,
) -> list[RoundtripFailure]:
    """Check ledger shards of a finished cache against their document files, reading rows back.

    `doc_files` are the files of some of the cache's ledger shards, in any order: each shard's rows
    are located from the manifest's per-shard counts, so only these files are read (checking the
    shards a build appended costs those shards, not the corpus). Per file: its documents per split
    match the ledger's count. For a random sample of their documents: the row starts with BOS, ends
    with EOS, and decode(row[1:-1]) == text. For the whole cache: each split's row count, in the
    arrays and in Levanter's ledger, matches the manifest. `keys` gives the files' ledger keys as
    the build was given them. Returns the failures (empty: all good).
    """
    from tokenizers import Tokenizer

    cache_root = cache_root.rstrip("/")
    cfg, ident = cache_config_of(cache_root)
    manifest = _read_json(f"{cache_root}/{MANIFEST_NAME}")
    failures: list[RoundtripFailure] = []
    first_row: dict[str, dict[str, int]] = {split: {} for split in SPLITS}  # shard key -> its first row
    expected: dict[str, dict[str, int]] = {split: {} for split in SPLITS}  # shard key -> its rows
    arrays = {}
    for split in SPLITS:
        row = 0
        for entry in manifest["shards"]:
            first_row[split][entry["key"]], expected[split][entry["key"]] = row, entry[f"{split}_documents"]
            row += entry[f"{split}_documents"]
        arrays[split] = (_read_zarr3_array(f"{cache_root}/{split}/{INPUT_IDS}/offsets"),
                         _read_zarr3_array(f"{cache_root}/{split}/{INPUT_IDS}/data"))
        stored = int(arrays[split][0][0].read().result())
        ledger = _read_json(f"{cache_root}/{split}/{LEDGER_NAME}") or {}
        if stored != row or ledger.get("total_num_rows") != row or not ledger.get("is_finished"):
            failures.append(RoundtripFailure("", split, -1, f"the manifest gives {row} rows, the arrays hold {stored}, "
                                             f"Levanter's ledger says {ledger.get('total_num_rows')} "
                                             f"(finished: {ledger.get('is_finished')})"))

    rng = random.Random(seed)
    sample: list[tuple[str, int, str, str]] = []  # (split, row, id, text): reservoir sample
    seen = 0
    for uri in doc_files:
        key = (keys or {}).get(os.fspath(uri), os.fspath(uri))
        if key not in first_row["train"]:
            failures.append(RoundtripFailure("", "", -1, f"{key} is not a ledger shard of {cache_root}"))
            continue
        rows = {split: 0 for split in SPLITS}
        for batch in _iter_clean_batches(_parquet_shard(os.fspath(uri), cfg), cfg):
            for doc_id, text in zip(batch.ids, batch.texts):
                split = "validation" if is_validation_document(doc_id, cfg.validation_fraction) else "train"
                item = (split, first_row[split][key] + rows[split], doc_id, text)
                rows[split] += 1
                seen += 1
                if len(sample) < sample_n:
                    sample.append(item)
                elif (j := rng.randrange(seen)) < sample_n:
                    sample[j] = item
        for split in SPLITS:
            if rows[split] != expected[split][key]:
                failures.append(RoundtripFailure("", split, -1, f"{key}: {rows[split]} documents, the ledger holds "
                                                 f"{expected[split][key]} rows"))

    with local_tokenizer_dir(tokenizer_dir) as local_tok:
        tok = Tokenizer.from_file(os.path.join(local_tok, "tokenizer.json"))
    bos, eos = ident["bos_token_id"], ident["eos_token_id"]
    for split, row, doc_id, text in sorted(sample):
        offsets, data = arrays[split]
        if row >= int(offsets[0].read().result()):
            continue  # counted above
        bounds = offsets[row:row + 2].read().result()
        ids = data[int(bounds[0]) if row else 0:int(bounds[1])].read().result()
        if ids.size < 2 or ids[0] != bos or ids[-1] != eos:
            failures.append(RoundtripFailure(doc_id, split, row, "row does not start with BOS and end with EOS"))
            continue
        decoded = tok.decode(ids[1:-1].tolist(), skip_special_tokens=False)
        if decoded != text:
            failures.append(
                RoundtripFailure(doc_id, split, row, f"decoded text differs ({len(decoded)} vs {len(text)} chars)")
            )
    return failures


def appended_shard_keys(cache_root: str) -> list[str]:
    """Keys of the ledger shards the cache's last build encoded (every shard of a fresh build)."""
    manifest = _read_json(f"{cache_root.rstrip('/')}/{MANIFEST_NAME}")
    if manifest is None or not manifest.get("finished"):
        raise FileNotFoundError(f"no finished tokenized cache at {cache_root}")
    return [s["key"] for s in manifest["shards"][manifest.get("appended_from", 0):]]
