"""Reading document shards and encoding each into row files: the unit of work that fans out.

Encoding uses HF `tokenizers` directly (`encode_batch_fast`: multithreaded Rust), not Levanter's Ray
pipeline, one shard at a time as its own unit of work (see "Per-shard encoding"): in the build's
process, or spread over workers by the `parallel_map` a caller passes (one Ray task per shard).
Here: the document sources (Parquet files, or documents held in memory), their cleaning, the
encoding of a shard into `[BOS] + ids(text) + [EOS]` rows split by the validation fraction, and the
row files that assembly (`assembly.py`) moves into the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from marin_assets.tokenization import chat_template
from marin_assets.tokenization.cache_config import MESSAGES_COLUMN, CacheConfig
from marin_assets.tokenization.cache_format import (
    INPUT_IDS,
    SPLITS,
    TOKEN_DTYPE,
    levanter_preprocessor_metadata,
    manifest_identity,
    read_json,
    special_token_ids,
    write_json,
)
from marin_assets.tokenization.tokenizer import local_tokenizer_dir, tokenizer_json_sha256
from marin_resources.parallel_map import ParallelMap, in_process_map
from marin_resources.progress import ProgressMeter
from marin_resources.splits import ID_HASH_DTYPE, id_hashes, in_validation

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
class DocumentShard:
    """A shard of documents to encode (a ledger shard): its key, fingerprint and how its batches are read."""

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
    messages: list[str] | None = None  # a chat cache's: each document's turns, as JSON


def _file_fingerprint(fs, path: str) -> str:
    info = fs.info(path)
    # Prefer content hashes / object generations that object stores expose; fall back to mtime.
    for key in ("md5Hash", "ETag", "etag", "md5", "generation", "crc32c", "mtime", "LastModified", "updated"):
        if info.get(key) is not None:
            return f"size={info.get('size')};{key}={info[key]}"
    return f"size={info.get('size')}"


def parquet_shard(uri: str, cfg: CacheConfig, fingerprint: str | None = None, key: str | None = None,
                  rows: tuple[int, int] | None = None) -> DocumentShard:
    """A Parquet document file; `fingerprint` (e.g. the sha256 its producer recorded) replaces the
    size/mtime fingerprint, so a file rewritten with the same bytes is still recognised. `key` names
    it in the ledger (default: its URI). `rows`: only the rows ``[start, end)`` of the file (reading
    only the row groups that hold them)."""
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise FileNotFoundError(f"document file not found: {uri}")

    def open_batches() -> Iterator[pa.RecordBatch]:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            names = set(pf.schema_arrow.names)
            columns = document_columns(cfg)
            missing = set(columns) - names
            if missing:
                raise ValueError(f"{uri}: missing column(s) {sorted(missing)}; has {sorted(names)}")
            if rows is None:
                yield from pf.iter_batches(batch_size=cfg.batch_rows, columns=columns)
                return
            start, end = rows
            groups, position = [], None  # the row groups overlapping [start, end); the first one's first row
            offset = 0
            for group in range(pf.metadata.num_row_groups):
                size = pf.metadata.row_group(group).num_rows
                if offset < end and offset + size > start:
                    groups.append(group)
                    position = offset if position is None else position
                offset += size
            for batch in pf.iter_batches(batch_size=cfg.batch_rows, columns=columns, row_groups=groups):
                lo, hi = max(start - position, 0), min(end - position, len(batch))
                position += len(batch)
                if lo < hi:
                    yield batch.slice(lo, hi - lo)

    fingerprint = fingerprint or _file_fingerprint(fs, path)
    key = key or uri
    return DocumentShard(key=key, fingerprint=fingerprint, open_batches=open_batches,
                         file=ShardSpec(key, fingerprint, uri))


def document_columns(cfg: CacheConfig) -> list[str]:
    """The columns a cache reads of a document file: a chat cache reads the turns beside the text."""
    return [cfg.id_column, cfg.text_column] + ([MESSAGES_COLUMN] if cfg.chat is not None else [])


def iterator_shard(documents: Iterable[tuple[str, str]], name: str, cfg: CacheConfig) -> DocumentShard:
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

    return DocumentShard(key=name, fingerprint=None, open_batches=open_batches)


def _clean(batch: pa.RecordBatch, cfg: CacheConfig) -> _DocBatch:
    """Drop rows without an id or with null/empty text (counted in `skipped`)."""
    ids = batch.column(cfg.id_column)
    texts = batch.column(cfg.text_column)
    if not pa.types.is_string(texts.type) and not pa.types.is_large_string(texts.type):
        raise ValueError(f"text column must be a string column, got {texts.type}")
    nbytes = pc.binary_length(texts)
    keep = pc.and_(pc.and_(pc.is_valid(ids), pc.is_valid(texts)), pc.greater(pc.fill_null(nbytes, 0), 0))
    messages = batch.column(MESSAGES_COLUMN) if cfg.chat is not None else None
    if messages is not None:
        keep = pc.and_(keep, pc.is_valid(messages))
    kept = pc.sum(keep).as_py() or 0
    if kept != len(batch):
        ids, texts, nbytes = pc.filter(ids, keep), pc.filter(texts, keep), pc.filter(nbytes, keep)
        messages = pc.filter(messages, keep) if messages is not None else None
    return _DocBatch(
        ids=ids.cast(pa.string()).to_pylist(),
        texts=texts.to_pylist(),
        text_bytes=int(pc.sum(nbytes).as_py() or 0),
        skipped=len(batch) - kept,
        messages=messages.cast(pa.string()).to_pylist() if messages is not None else None,
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


def iter_clean_batches(shard: DocumentShard, cfg: CacheConfig) -> Iterator[_DocBatch]:
    for batch in _prefetch(shard.open_batches()):
        yield _clean(batch, cfg)


def parquet_ids(doc_files: Sequence[str], cfg: CacheConfig) -> Iterator[str]:
    """The ids of the documents a cache of these Parquet files holds (rows `_clean` keeps)."""
    for uri in doc_files:
        for batch in parquet_shard(os.fspath(uri), cfg).open_batches():
            yield from _clean(batch, cfg).ids


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
    """Documents -> `[BOS] ids(text) [EOS]` rows."""

    row_files = ("tokens", "lengths")

    def __init__(self, tokenizer_json: str, bos: int, eos: int, cfg: CacheConfig):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_json)
        # Text that happens to spell a special token (e.g. "<|eos|>") is encoded as plain text, so
        # documents cannot inject control tokens and decode(ids) reproduces them.
        self.tok.encode_special_tokens = True
        self.bos, self.eos = bos, eos
        self.fraction = cfg.validation_fraction

    def encode_batch(self, batch: _DocBatch) -> list:
        return self.encode_texts(batch.texts)

    def encode_texts(self, texts: list[str]) -> list:
        # Releases the GIL: runs in a worker thread while the main thread frames the previous batch.
        return self.tok.encode_batch_fast(texts, add_special_tokens=False)

    def frame(self, batch: _DocBatch, encodings: list) -> tuple[dict[str, dict[str, np.ndarray]], np.ndarray, list]:
        """Encodings of a batch -> per split, its row files' values (`tokens`: concatenated [BOS] ids
        [EOS] rows, `lengths`: row lengths); the documents' id hashes, in document order (what a
        validation minimum is decided from); and the documents that are no row (none here)."""
        ids = [e.ids for e in encodings]
        n = len(ids)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=n)
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=TOKEN_DTYPE, count=int(lengths.sum()))
        hashes = id_hashes(batch.ids, n)
        in_val = in_validation(hashes, self.fraction)
        out = {}
        for split, mask in (("train", ~in_val), ("validation", in_val)):
            if mask.all():
                data, row_lengths = _frame_rows(flat, lengths, self.bos, self.eos)
            elif mask.any():
                data, row_lengths = _frame_rows(flat[np.repeat(mask, lengths)], lengths[mask], self.bos, self.eos)
            else:
                data, row_lengths = np.empty(0, TOKEN_DTYPE), np.empty(0, np.int64)
            out[split] = {"tokens": data, "lengths": row_lengths}
        return out, hashes, []


class _ChatEncoder:
    """Conversations -> rows of a chat cache: `tokens` rendered through the chat template, and beside
    them `assistant_masks`; a conversation that cannot be a row is listed with its reason, and one cut
    to seq_len is counted (`chat_template.ChatRenderer`)."""

    row_files = ("tokens", "lengths", "assistant_masks")

    def __init__(self, local_tok: str, cfg: CacheConfig):
        self.renderer = chat_template.ChatRenderer(local_tok, cfg.chat)
        self.fraction = cfg.validation_fraction

    def encode_batch(self, batch: _DocBatch) -> list[chat_template.Rendered]:
        return [self.renderer.render(messages) for messages in batch.messages]

    def frame(self, batch: _DocBatch, rendered: list[chat_template.Rendered]
              ) -> tuple[dict[str, dict[str, np.ndarray]], np.ndarray, list]:
        rows = [i for i, r in enumerate(rendered) if r.reason is None]
        hashes = id_hashes([batch.ids[i] for i in rows], len(rows))
        in_val = in_validation(hashes, self.fraction)
        out = {}
        for split, mask in (("train", ~in_val), ("validation", in_val)):
            chosen = [rendered[rows[i]] for i in np.flatnonzero(mask)]
            out[split] = {"tokens": np.fromiter(itertools.chain.from_iterable(r.ids for r in chosen), TOKEN_DTYPE),
                          "lengths": np.fromiter((len(r.ids) for r in chosen), np.int64, count=len(chosen)),
                          "assistant_masks": np.fromiter(itertools.chain.from_iterable(r.mask for r in chosen),
                                                         chat_template.MASK_DTYPE)}
        refused = [(batch.ids[i], r) for i, r in enumerate(rendered) if r.reason is not None or r.truncated]
        return out, hashes, refused


def _encoder(local_tok: str, bos: int, eos: int, cfg: CacheConfig) -> _Encoder | _ChatEncoder:
    """The encoder of ``cfg``'s rows (a chat cache's ``cfg`` has its template resolved)."""
    if cfg.chat is not None:
        return _ChatEncoder(local_tok, cfg)
    return _Encoder(os.path.join(local_tok, "tokenizer.json"), bos, eos, cfg)


def _encode_ahead(encoder: _Encoder | _ChatEncoder, batches: Iterator[_DocBatch]) -> Iterator[tuple[_DocBatch, list]]:
    """Yield (batch, encodings) while the next batch is already being encoded."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
        ahead: tuple[_DocBatch, Future | None] | None = None
        for batch in batches:
            job = pool.submit(encoder.encode_batch, batch) if batch.texts else None
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
ROWS_AT = "encoded_as"  # the attempt folder an encoded shard's entry vouches for; not in the ledger
# In an encoded shard's entry, beside its ledger fields: where its row files are, and the identity
# it was encoded with (its split at that identity's fraction).
ROWS, ENCODING = "rows", "encoding"
ROW_FILES = {"tokens": np.dtype("<i4"), "lengths": np.dtype("<i8"), "assistant_masks": chat_template.MASK_DTYPE}
# The row file each field of the cache is written from (a chat cache's fields; a text cache's first).
FIELD_ROWS = {"input_ids": "tokens", "assistant_masks": "assistant_masks"}


def cache_fields(cfg: CacheConfig) -> tuple[str, ...]:
    """The fields of ``cfg``'s cache, as Levanter's processor for it writes them."""
    return tuple(FIELD_ROWS) if cfg.chat is not None else (INPUT_IDS,)
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
        return _encode_shard(parquet_shard(spec.uri, job.cfg, spec.fingerprint, spec.key), job)
    except Exception as exc:  # noqa: BLE001 - reported per shard by the build
        return {"key": spec.key, "error": f"{type(exc).__name__}: {exc}"}


def encode_shard_rows(spec: ShardSpec, tokenizer_dir: str, rows_uri: str, cfg: CacheConfig, *,
                      split_rows: Callable[[np.ndarray], Sequence[tuple[int, int]]] | None = None,
                      parts_uri: str | None = None, parallel_map: ParallelMap = in_process_map) -> dict:
    """Encode one Parquet shard into row files under ``rows_uri`` (a shard's own artifact), for
    `assemble_levanter_cache` to move into a cache later; returns its entry (ledger fields, `rows`,
    `encoding`). Split by ``cfg.validation_fraction`` alone: a `validation_min_documents` needs the
    whole corpus, so assembly applies it (from the id hashes written here), and no shard is encoded
    again when the corpus grows.

    ``split_rows`` cuts the file's rows, given each row's weight in text bytes (from the Parquet
    footer: the uncompressed bytes over the rows), into consecutive ranges covering them (a
    `DataParallel`'s `ranges`; the file's footer is read once, here). With more than one range, each
    is its own unit of work through ``parallel_map`` (`encode_row_range`, written under
    ``parts_uri``, which is removed after); this process then only concatenates their files, which
    gives the one-piece bytes: a huge shard spreads over workers and its artifact does not change."""
    split_by_fraction = replace(cfg, validation_min_documents=None)
    with local_tokenizer_dir(tokenizer_dir) as local_tok:
        bos_eos = _bos_eos(tokenizer_dir, local_tok)
        split_by_fraction = chat_template.resolved(split_by_fraction, local_tok)
        encoding = manifest_identity(tokenizer_json_sha256(local_tok), *bos_eos, split_by_fraction)
        row_ranges = None
        if split_rows is not None:
            rows, text_bytes = parquet_rows(spec.uri)
            row_ranges = list(split_rows(np.full(rows, text_bytes // max(rows, 1), dtype=np.int64)))
        if row_ranges is None or len(row_ranges) <= 1:
            encoder = _encoder(local_tok, *bos_eos, split_by_fraction)
            shard = parquet_shard(spec.uri, split_by_fraction, spec.fingerprint, spec.key)
            entry = _encode_rows(shard, encoder, split_by_fraction, rows_uri)
            return {**entry, ROWS: rows_uri.rstrip("/"), ENCODING: encoding}
    if parts_uri is None:
        raise ValueError("encoding a shard in row ranges needs parts_uri, a folder for the ranges' files")
    bounds = [start for start, _ in row_ranges] + [row_ranges[-1][1]]
    if bounds[0] != 0 or bounds[-1] != rows or any(a[1] != b[0] for a, b in zip(row_ranges, row_ranges[1:])):
        raise ValueError(f"row ranges must be consecutive and cover the file's {rows} rows, got {list(row_ranges)}")
    parts = parallel_map(encode_row_range, row_ranges, RowRangeJob(spec, tokenizer_dir, split_by_fraction,
                                                                         parts_uri.rstrip("/")))
    _concatenate_parts([part[ROWS] for part in parts], rows_uri, split_by_fraction)
    fs, path = fsspec.core.url_to_fs(parts_uri)
    fs.rm(path, recursive=True)
    entry = {name: value for name, value in parts[0].items() if name != ROWS}
    for part in parts[1:]:
        for name, value in part.items():
            if isinstance(value, int) and name in entry:
                entry[name] += value
    return {**entry, ROWS: rows_uri.rstrip("/"), ENCODING: encoding}


def _bos_eos(tokenizer_dir: str, local_tok: str) -> tuple[int, int]:
    """The BOS and EOS ids a shard's rows are framed with."""
    return special_token_ids(local_tok) or levanter_preprocessor_metadata(tokenizer_dir, local_tok)[1:3]


def parquet_rows(uri: str) -> tuple[int, int]:
    """A Parquet file's rows and their uncompressed bytes, from its footer alone."""
    with fsspec.open(uri, "rb") as fh:
        metadata = pq.ParquetFile(fh).metadata
    return metadata.num_rows, sum(metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups))


@dataclass(frozen=True)
class RowRangeJob:
    """What every row range of one shard's encoding shares (`encode_shard_rows` with ranges)."""

    spec: ShardSpec
    tokenizer_dir: str
    cfg: CacheConfig  # split by the fraction alone
    parts_uri: str


def encode_row_range(rows: tuple[int, int], job: RowRangeJob) -> dict:
    """Encode the rows ``[start, end)`` of a shard into row files of their own under
    ``job.parts_uri``: a unit of work of its own (a Ray task). Each attempt writes a fresh folder,
    named in the entry it returns (`ROWS`), so a retried task never writes into a lost attempt's files."""
    with local_tokenizer_dir(job.tokenizer_dir) as local_tok:
        encoder = _encoder(local_tok, *_bos_eos(job.tokenizer_dir, local_tok), job.cfg)
    shard = parquet_shard(job.spec.uri, job.cfg, job.spec.fingerprint, job.spec.key, rows=rows)
    out = f"{job.parts_uri}/{rows[0]:012d}-{uuid.uuid4().hex[:16]}"
    return {**_encode_rows(shard, encoder, job.cfg, out), ROWS: out}


def _row_file_names(cfg: CacheConfig) -> list[str]:
    kinds = _ChatEncoder.row_files if cfg.chat is not None else _Encoder.row_files
    return [f"{split}.{kind}" for split in SPLITS for kind in kinds] + [ID_HASHES] \
        + ([chat_template.QUARANTINE_FILE] if cfg.chat is not None else [])


def _concatenate_parts(parts: Sequence[str], rows_uri: str, cfg: CacheConfig, block: int = 8 << 20) -> None:
    """Each row file of ``rows_uri``: its parts' files, one after another, in row order. Every row
    is framed on its own, so this is the one-piece file byte for byte."""
    fs, path = fsspec.core.url_to_fs(rows_uri)
    fs.makedirs(path, exist_ok=True)
    for name in _row_file_names(cfg):
        with fs.open(f"{path}/{name}", "wb") as out:
            for part in parts:
                with fsspec.open(f"{part}/{name}", "rb") as fh:
                    while data := fh.read(block):
                        out.write(data)


def _encode_shard(shard: DocumentShard, job: EncodeJob) -> dict:
    out = job.shard_dir(shard.key, shard.fingerprint)
    if shard.fingerprint is not None and (done := read_json(f"{out}/{_ENCODED_ENTRY}")) is not None:
        return {**done, ROWS: f"{out}/{done[ROWS_AT]}", ENCODING: job.identity}  # an earlier, interrupted build's
    # Each attempt writes its own folder and `entry.json` names the one it vouches for: a retried
    # task never writes into files that a presumed-dead earlier attempt may still be writing.
    attempt = uuid.uuid4().hex[:16]
    with local_tokenizer_dir(job.tokenizer_dir) as local_tok:
        encoder = _encoder(local_tok, job.bos, job.eos, job.cfg)
    entry = _encode_rows(shard, encoder, job.cfg, f"{out}/{attempt}")
    write_json(f"{out}/{_ENCODED_ENTRY}", {**entry, ROWS_AT: attempt})
    return {**entry, ROWS: f"{out}/{attempt}", ENCODING: job.identity}


def _encode_rows(shard: DocumentShard, encoder: _Encoder | _ChatEncoder, cfg: CacheConfig, rows_uri: str) -> dict:
    """Write a shard's row files under ``rows_uri``; returns its ledger entry. A chat shard's
    conversations that are no row, or were cut, are listed in its quarantine file and counted."""
    fs, path = fsspec.core.url_to_fs(rows_uri)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # keep Rust threads on in forked workers
    fs.makedirs(path, exist_ok=True)
    entry = _shard_entry(shard, cfg)
    with contextlib.ExitStack() as files:
        rows = {(split, kind): files.enter_context(fs.open(f"{path}/{split}.{kind}", "wb"))
                for split in SPLITS for kind in encoder.row_files}
        id_hashes = files.enter_context(fs.open(f"{path}/{ID_HASHES}", "wb"))
        quarantine = files.enter_context(fs.open(f"{path}/{chat_template.QUARANTINE_FILE}", "w")) \
            if cfg.chat is not None else None
        for batch, encodings in _encode_ahead(encoder, iter_clean_batches(shard, cfg)):
            entry["skipped_documents"] += batch.skipped
            if not batch.texts:
                continue
            entry["text_bytes"] += batch.text_bytes
            framed, hashes, refused = encoder.frame(batch, encodings)
            id_hashes.write(hashes.astype(ID_HASH_DTYPE, copy=False).tobytes())
            for split, values in framed.items():
                for kind, array in values.items():
                    rows[split, kind].write(array.astype(ROW_FILES[kind], copy=False).tobytes())
                entry[f"{split}_documents"] += int(values["lengths"].size)
                entry[f"{split}_tokens"] += int(values["tokens"].size)
            for doc_id, rendered in refused:
                entry[f"quarantined_{rendered.reason}" if rendered.reason else chat_template.TRUNCATED] += 1
                quarantine.write(json.dumps({"id": doc_id, "reason": rendered.reason or "truncated",
                                             "detail": rendered.detail}, sort_keys=True) + "\n")
    return entry


def read_rows(rows_uri: str, name: str, dtype: np.dtype) -> np.ndarray:
    with fsspec.open(f"{rows_uri}/{name}", "rb") as fh:
        return np.frombuffer(fh.read(), dtype=dtype)


def _shard_entry(shard: DocumentShard, cfg: CacheConfig) -> dict:
    return {
        "key": shard.key,
        "fingerprint": shard.fingerprint,
        "train_documents": 0,
        "train_tokens": 0,
        "validation_documents": 0,
        "validation_tokens": 0,
        "text_bytes": 0,
        "skipped_documents": 0,
        **(chat_template.chat_counts() if cfg.chat is not None else {}),
    }


def encode_shards(todo: Sequence[DocumentShard], job: EncodeJob, parallel_map: ParallelMap,
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
