"""Vectorized MinHash signatures whose permutation stage is bit-identical to datasketch.

A signature is computed in three steps:

1. Shingling. Text is lower-cased (``str.lower``) and UTF-8 encoded; a token is a maximal run
   of bytes in ``[0-9A-Za-z_]`` or ``>= 0x80`` (so every non-ASCII character counts as a word
   character and ASCII punctuation/whitespace separates tokens). A shingle is ``shingle_size``
   consecutive tokens of one document; a document with fewer tokens (but at least one) has a
   single shingle made of all its tokens, and a document without tokens has no shingles.
2. Shingle hashing to 32 bits, one of two modes:
   * ``"fast"`` (default): each token gets a 64-bit hash (polynomial hash of its bytes, then the
     MurmurHash3 64-bit finalizer); a shingle's 64-bit hash is
     ``sum_j token_hash[j] * SHINGLE_POSITION_MULTIPLIERS[j] mod 2**64`` and its 32-bit hash is
     the upper half. Everything is numpy over a whole batch of documents.
   * ``"sha1"``: datasketch's default ``sha1_hash32`` of the shingle bytes (tokens joined by one
     space). Hashing happens per shingle in Python, so this mode is for compatibility only.
3. Permutations: exactly datasketch's ``"affine32"`` scheme (MurmurHash3 32-bit finalizer, then
   ``a_k * h + b_k mod 2**32`` with ``a, b`` drawn from ``np.random.RandomState(seed)``), min per
   document. In ``"sha1"`` mode the signature equals ``datasketch.MinHash(num_perm, seed)`` updated
   with ``shingles(text)``; in ``"fast"`` mode it equals ``datasketch.MinHash(num_perm, seed,
   hashfunc=shingle_hash32)`` updated with ``shingle_tokens(text)``. Both are tested bit for bit.

The ``fast`` mode runs in a compiled kernel (``_minhash.c``, built on install) that does steps 1-3
per document in one pass, 2-3x less CPU than numpy; ``numpy_minhash_texts`` is the definition it is
tested against, and what runs where the kernel could not be built.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import BinaryIO, Literal

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from marin_assets.curation.kernels import kernel
from marin_resources.config_identity import identity

HashMode = Literal["fast", "sha1"]

_MASK64 = (1 << 64) - 1
_UINT32_MAX = np.uint32(0xFFFFFFFF)
# Odd 64-bit multiplier of the per-token polynomial hash; any odd constant with mixed bits works.
_TOKEN_POLY_BASE = 0x9E3779B97F4A7C15
_TOKEN_POLY_BASE_INV = pow(_TOKEN_POLY_BASE, -1, 1 << 64)

# Bytes that belong to tokens (the vectorized twin is _is_word_byte). Non-ASCII bytes (>= 0x80)
# are word bytes so UTF-8 multi-byte characters never split a token.
_TOKEN_PATTERN = re.compile(rb"[0-9A-Za-z_\x80-\xff]+")

# Signature files carry their MinHashConfig so stale caches are rejected instead of mixed.
_PARQUET_CONFIG_KEY = b"marin.minhash_config"
# Keep each numpy batch's temporaries around tens of MB regardless of shard size.
_BATCH_TEXT_CHARS = 256 << 10
# Shingles per permutation block; measured fastest on AVX-512 x86 among 1k..32k.
_PERMUTATION_BLOCK = 8192
_MAX_SHINGLE_SIZE = 64


@dataclass(frozen=True)
class MinHashConfig:
    """Parameters that determine a signature; signatures from different configs never mix."""

    shingle_size: int = identity(5)
    num_perm: int = identity(128)
    seed: int = identity(1)
    hash_mode: HashMode = identity("fast")

    def __post_init__(self) -> None:
        if not 1 <= self.shingle_size <= _MAX_SHINGLE_SIZE:
            raise ValueError(f"shingle_size must be in [1, {_MAX_SHINGLE_SIZE}], got {self.shingle_size}")
        if not 2 <= self.num_perm <= 4096:
            raise ValueError(f"num_perm must be in [2, 4096], got {self.num_perm}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.hash_mode not in ("fast", "sha1"):
            raise ValueError(f"hash_mode must be 'fast' or 'sha1', got {self.hash_mode!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> MinHashConfig:
        return cls(**json.loads(text))


def _fmix64_int(value: int) -> int:
    value ^= value >> 33
    value = (value * 0xFF51AFD7ED558CCD) & _MASK64
    value ^= value >> 33
    value = (value * 0xC4CEB9FE1A85EC53) & _MASK64
    return value ^ (value >> 33)


def _fmix64(values: np.ndarray) -> np.ndarray:
    values = values ^ (values >> np.uint64(33))
    values *= np.uint64(0xFF51AFD7ED558CCD)
    values ^= values >> np.uint64(33)
    values *= np.uint64(0xC4CEB9FE1A85EC53)
    values ^= values >> np.uint64(33)
    return values


def _fmix32(values: np.ndarray) -> np.ndarray:
    # Same finalizer datasketch applies to every input hash in the affine32 scheme.
    values = values ^ (values >> np.uint32(16))
    values *= np.uint32(0x85EBCA6B)
    values ^= values >> np.uint32(13)
    values *= np.uint32(0xC2B2AE35)
    values ^= values >> np.uint32(16)
    return values


def _position_multiplier(position: int) -> int:
    return _fmix64_int(position + 1) | 1


# Shingle hash = sum of token hashes times a per-position odd constant, so order matters.
SHINGLE_POSITION_MULTIPLIERS = np.array(
    [_position_multiplier(j) for j in range(_MAX_SHINGLE_SIZE)], dtype=np.uint64
)


# ---------------------------------------------------------------------------------------------
# Scalar reference implementation (definitions; used by tests, the datasketch baseline, sha1 mode)
# ---------------------------------------------------------------------------------------------


def tokenize(text: str) -> list[bytes]:
    """Tokens of ``text`` as UTF-8 bytes, per the module docstring."""
    return _TOKEN_PATTERN.findall(text.lower().encode("utf-8", errors="replace"))


def shingle_tokens(text: str, shingle_size: int) -> list[tuple[bytes, ...]]:
    """The shingles of ``text`` as token tuples (feed these to datasketch with ``shingle_hash32``)."""
    tokens = tokenize(text)
    if not tokens:
        return []
    if len(tokens) < shingle_size:
        return [tuple(tokens)]
    return [tuple(tokens[i : i + shingle_size]) for i in range(len(tokens) - shingle_size + 1)]


def shingles(text: str, shingle_size: int) -> list[bytes]:
    """The shingles of ``text`` as bytes (tokens joined by one space), as hashed in sha1 mode."""
    return [b" ".join(shingle) for shingle in shingle_tokens(text, shingle_size)]


def token_hash64(token: bytes) -> int:
    poly = 0
    power = 1
    for byte in token:
        poly = (poly + byte * power) & _MASK64
        power = (power * _TOKEN_POLY_BASE) & _MASK64
    return _fmix64_int(poly)


def shingle_hash64(shingle: Sequence[bytes]) -> int:
    """64-bit hash of a token tuple; the set element used for exact Jaccard.

    No final mixing: token hashes are already uniform, so the position-weighted sum is too (and a
    bijective finalizer would not change which shingles collide)."""
    if not 1 <= len(shingle) <= _MAX_SHINGLE_SIZE:
        raise ValueError(f"a shingle has 1..{_MAX_SHINGLE_SIZE} tokens, got {len(shingle)}")
    total = 0
    for position, token in enumerate(shingle):
        total = (total + token_hash64(token) * int(SHINGLE_POSITION_MULTIPLIERS[position])) & _MASK64
    return total


def shingle_hash32(shingle: Sequence[bytes]) -> int:
    """The ``fast`` mode's 32-bit shingle hash; usable as a datasketch ``hashfunc``."""
    return shingle_hash64(shingle) >> 32


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)`` uint32 arrays of datasketch's affine32 scheme for ``(num_perm, seed)``."""
    generator = np.random.RandomState(seed)
    a = generator.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = generator.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return a, b


# ---------------------------------------------------------------------------------------------
# Vectorized implementation
# ---------------------------------------------------------------------------------------------


class _PowerTables:
    """``base**k`` and ``base**-k`` mod 2**64 for k < capacity, grown on demand.

    Memory is 16 bytes per byte of the largest batch (a batch is ~256k characters, or one larger
    document). Both tables are swapped in as one tuple so concurrent threads never see a mix."""

    def __init__(self) -> None:
        self.tables = (np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64))

    def at_least(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        tables = self.tables
        if size <= len(tables[0]):
            return tables
        capacity = max(size, 2 * len(tables[0]))
        base = np.full(capacity, _TOKEN_POLY_BASE, dtype=np.uint64)
        base[0] = 1
        inverse = np.full(capacity, _TOKEN_POLY_BASE_INV, dtype=np.uint64)
        inverse[0] = 1
        # Array products wrap mod 2**64, which is the intended arithmetic.
        self.tables = (np.cumprod(base, dtype=np.uint64), np.cumprod(inverse, dtype=np.uint64))
        return self.tables


_POWER_TABLES = _PowerTables()


@dataclass(frozen=True)
class ShingleHashes:
    """Shingle hashes of a batch of documents, grouped by document (``doc_index`` ascending)."""

    hashes: np.ndarray  # uint64, one per shingle occurrence
    doc_index: np.ndarray  # int64, document of each shingle


def _is_word_byte(data: np.ndarray) -> np.ndarray:
    # Arithmetic on uint8 (wrapping subtraction turns range checks into one compare) is several
    # times faster than a 256-entry lookup table gather.
    is_word = data >= np.uint8(0x80)
    is_word |= (data - np.uint8(ord("0"))) < np.uint8(10)
    is_word |= ((data | np.uint8(0x20)) - np.uint8(ord("a"))) < np.uint8(26)
    is_word |= data == np.uint8(ord("_"))
    return is_word


def _token_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 hash of every token in order, int64 number of tokens of each text)."""
    encoded = [text.lower().encode("utf-8", errors="replace") for text in texts]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    # One separator byte (not a word byte) between documents keeps tokens from spanning them.
    doc_starts = np.zeros(len(encoded), dtype=np.int64)
    np.cumsum(lengths[:-1] + 1, out=doc_starts[1:])
    data = np.frombuffer(b"\n".join(encoded), dtype=np.uint8)
    is_word = np.zeros(data.size + 2, dtype=bool)
    is_word[1:-1] = _is_word_byte(data)
    # Boundaries alternate token start, token end, so one pass over a bool array yields both
    # (numpy's nonzero is several times faster on bool than on int8).
    boundaries = np.flatnonzero(is_word[1:] != is_word[:-1])
    token_starts = boundaries[0::2]
    token_ends = boundaries[1::2]
    powers, inverse_powers = _POWER_TABLES.at_least(data.size + 1)
    # prefix[i] = sum_{k < i} byte_k * base**k, so a token's hash is a difference rescaled by base**-start.
    prefix = np.zeros(data.size + 1, dtype=np.uint64)
    weighted = data.astype(np.uint64)
    weighted *= powers[: data.size]
    np.cumsum(weighted, out=prefix[1:])
    poly = prefix[token_ends]
    poly -= prefix[token_starts]
    poly *= inverse_powers[token_starts]
    tokens_per_doc = np.diff(np.searchsorted(token_starts, doc_starts), append=np.int64(token_starts.size))
    return _fmix64(poly), tokens_per_doc


def _shingle_hashes_batch(texts: Sequence[str], shingle_size: int) -> ShingleHashes:
    token_hashes, tokens_per_doc = _token_hashes(texts)
    num_tokens = token_hashes.size
    doc_token_end = np.cumsum(tokens_per_doc)
    doc_token_start = doc_token_end - tokens_per_doc
    # Every position whose window of shingle_size tokens stays inside its document starts a shingle.
    remaining = np.repeat(doc_token_end, tokens_per_doc) - np.arange(num_tokens, dtype=np.int64)
    is_start = remaining >= shingle_size
    is_short = (tokens_per_doc > 0) & (tokens_per_doc < shingle_size)
    short_starts = doc_token_start[is_short]
    is_start[short_starts] = True
    starts = np.flatnonzero(is_start)
    # Windows at all positions, unmasked: only full windows are read from it.
    padded = np.concatenate([token_hashes, np.zeros(shingle_size, dtype=np.uint64)])
    combined = padded[:num_tokens] * SHINGLE_POSITION_MULTIPLIERS[0]
    for offset in range(1, shingle_size):
        combined += padded[offset : offset + num_tokens] * SHINGLE_POSITION_MULTIPLIERS[offset]
    hashes = combined[starts]
    if short_starts.size:
        # A document shorter than shingle_size is one shingle of all its tokens.
        short_lengths = tokens_per_doc[is_short]
        short_hashes = np.zeros(short_starts.size, dtype=np.uint64)
        for offset in range(shingle_size - 1):
            present = offset < short_lengths
            tokens = token_hashes[short_starts + np.minimum(offset, short_lengths - 1)]
            short_hashes += np.where(present, tokens, np.uint64(0)) * SHINGLE_POSITION_MULTIPLIERS[offset]
        hashes[np.searchsorted(starts, short_starts)] = short_hashes
    shingles_per_doc = np.where(tokens_per_doc >= shingle_size, tokens_per_doc - shingle_size + 1, is_short)
    return ShingleHashes(
        hashes=hashes,
        doc_index=np.repeat(np.arange(len(texts), dtype=np.int64), shingles_per_doc),
    )


def _text_batches(texts: Sequence[str], batch_chars: int = _BATCH_TEXT_CHARS) -> list[tuple[int, int]]:
    """[start, end) document ranges holding about ``batch_chars`` characters each."""
    batches = []
    start = 0
    size = 0
    for index, text in enumerate(texts):
        size += len(text)
        if size >= batch_chars:
            batches.append((start, index + 1))
            start = index + 1
            size = 0
    if start < len(texts):
        batches.append((start, len(texts)))
    return batches


def _batched_shingle_hashes(texts: Sequence[str], shingle_size: int) -> Iterator[tuple[int, int, ShingleHashes]]:
    """(start, end, shingle hashes of texts[start:end], documents counted from start) per batch of whole texts."""
    if not 1 <= shingle_size <= _MAX_SHINGLE_SIZE:
        raise ValueError(f"shingle_size must be in [1, {_MAX_SHINGLE_SIZE}], got {shingle_size}")
    for start, end in _text_batches(texts):
        yield start, end, _shingle_hashes_batch(texts[start:end], shingle_size)


def shingle_hashes(texts: Sequence[str], shingle_size: int) -> ShingleHashes:
    """64-bit hashes of every shingle occurrence of every text (``fast`` mode definition)."""
    parts = [(batch.hashes, batch.doc_index + start)
             for start, _, batch in _batched_shingle_hashes(texts, shingle_size)]
    if not parts:
        return ShingleHashes(np.zeros(0, np.uint64), np.zeros(0, np.int64))
    return ShingleHashes(
        hashes=np.concatenate([hashes for hashes, _ in parts]),
        doc_index=np.concatenate([docs for _, docs in parts]),
    )


def shingle_sets(texts: Sequence[str], shingle_size: int) -> list[np.ndarray]:
    """Per text, the sorted unique uint64 shingle hashes: the sets exact Jaccard is computed on."""
    hashed = shingle_hashes(texts, shingle_size)
    # Sorting by (document, hash) at once is one lexsort instead of one np.unique per document.
    order = np.lexsort((hashed.hashes, hashed.doc_index))
    hashes = hashed.hashes[order]
    docs = hashed.doc_index[order]
    keep = np.ones(hashes.size, dtype=bool)
    keep[1:] = (hashes[1:] != hashes[:-1]) | (docs[1:] != docs[:-1])
    hashes = hashes[keep]
    bounds = np.searchsorted(docs[keep], np.arange(len(texts) + 1))
    return [hashes[bounds[i] : bounds[i + 1]] for i in range(len(texts))]


def exact_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted unique hash arrays (two empty sets: 0.0)."""
    if a.size == 0 or b.size == 0:
        return 0.0
    intersection = np.intersect1d(a, b, assume_unique=True).size
    return intersection / (a.size + b.size - intersection)


def _sha1_shingle_hashes(texts: Sequence[str], shingle_size: int) -> tuple[np.ndarray, np.ndarray]:
    digests = []
    counts = np.zeros(len(texts), dtype=np.int64)
    sha1 = hashlib.sha1
    for index, text in enumerate(texts):
        doc_shingles = shingles(text, shingle_size)
        counts[index] = len(doc_shingles)
        digests.extend(sha1(shingle).digest() for shingle in doc_shingles)
    # datasketch's sha1_hash32 is the little-endian uint32 of the first 4 of the 20 digest bytes.
    hashes = np.frombuffer(b"".join(digests), dtype="<u4").reshape(-1, 5)[:, 0].astype(np.uint32)
    return hashes, np.repeat(np.arange(len(texts), dtype=np.int64), counts)


def _min_permuted(hashes32: np.ndarray, doc_index: np.ndarray, num_docs: int, config: MinHashConfig) -> np.ndarray:
    a, b = permutations(config.num_perm, config.seed)
    signatures = np.full((num_docs, config.num_perm), _UINT32_MAX, dtype=np.uint32)
    mixed = _fmix32(hashes32)
    a_column = a[:, None]
    b_column = b[:, None]
    block = np.empty((config.num_perm, _PERMUTATION_BLOCK), dtype=np.uint32)
    # doc_index is sorted: first shingle of each document that has any.
    counts = np.bincount(doc_index, minlength=num_docs)
    docs_with_shingles = np.flatnonzero(counts)
    doc_first_shingle = (np.cumsum(counts) - counts)[docs_with_shingles]
    for start in range(0, mixed.size, _PERMUTATION_BLOCK):
        end = min(start + _PERMUTATION_BLOCK, mixed.size)
        view = block[:, : end - start]
        np.multiply(a_column, mixed[None, start:end], out=view)
        np.add(view, b_column, out=view)
        first, last = np.searchsorted(doc_first_shingle, [start, end])
        segment_starts = doc_first_shingle[first:last] - start
        segment_docs = docs_with_shingles[first:last]
        if segment_starts.size == 0 or segment_starts[0] != 0:
            # The block begins inside a document that started in an earlier block.
            segment_starts = np.concatenate([np.zeros(1, np.int64), segment_starts])
            segment_docs = np.concatenate([docs_with_shingles[first - 1 : first], segment_docs])
        segment_minima = np.minimum.reduceat(view, segment_starts, axis=1).T
        # Documents are unique within one block, so gather-min-scatter is safe.
        signatures[segment_docs] = np.minimum(signatures[segment_docs], segment_minima)
    return signatures


def minhash_texts(texts: Sequence[str], config: MinHashConfig) -> np.ndarray:
    """(len(texts), num_perm) uint32 MinHash signatures; a text without tokens gets all 2**32-1."""
    if config.hash_mode == "sha1":
        hashes32, doc_index = _sha1_shingle_hashes(texts, config.shingle_size)
        return _min_permuted(hashes32, doc_index, len(texts), config)
    compiled = kernel("_minhash")  # the compiled twin of numpy_minhash_texts (_minhash.c)
    if compiled is not None:
        return _kernel_minhash_texts(texts, config, compiled)
    return numpy_minhash_texts(texts, config)


def numpy_minhash_texts(texts: Sequence[str], config: MinHashConfig) -> np.ndarray:
    """The ``fast`` mode's signatures in numpy: the definition the compiled kernel is tested against,
    and what runs where the kernel was not built."""
    # A batch of whole documents at a time: each signature depends on its own document only, and
    # the shard's shingles (8 bytes each, plus their document index) are never held at once.
    signatures = np.empty((len(texts), config.num_perm), dtype=np.uint32)
    for start, end, batch in _batched_shingle_hashes(texts, config.shingle_size):
        hashes32 = (batch.hashes >> np.uint64(32)).astype(np.uint32)
        signatures[start:end] = _min_permuted(hashes32, batch.doc_index, end - start, config)
    return signatures


# Characters per call of the kernel: bounds the encoded copy of the texts it reads.
_KERNEL_BATCH_CHARS = 4 << 20


def _kernel_minhash_texts(texts: Sequence[str], config: MinHashConfig, compiled: ModuleType) -> np.ndarray:
    """``numpy_minhash_texts`` through the compiled kernel: tokens, shingles and the permutations of
    each shingle in one pass per document, 2-3x less CPU. (MinHashConfig bounds shingle_size; the
    kernel refuses fewer multipliers than that.)"""
    a, b = permutations(config.num_perm, config.seed)
    multipliers = np.ascontiguousarray(SHINGLE_POSITION_MULTIPLIERS[: config.shingle_size])
    signatures = np.full((len(texts), config.num_perm), _UINT32_MAX, dtype=np.uint32)
    for start, end in _text_batches(texts, _KERNEL_BATCH_CHARS):
        encoded = [text.lower().encode("utf-8", errors="replace") for text in texts[start:end]]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        # Each text is followed by one separator byte (not a word byte); ends exclude it.
        ends = np.cumsum(lengths + 1) - 1
        compiled.signatures(b"\n".join(encoded), ends, config.shingle_size, a, b, multipliers, _TOKEN_POLY_BASE,
                           signatures[start:end])
    return signatures


def empty_signature_mask(hashvalues: np.ndarray) -> np.ndarray:
    """Rows that are the signature of the empty set (a document without tokens)."""
    return np.all(hashvalues == _UINT32_MAX, axis=1)


def band_hashes(hashvalues: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(num_docs, bands) uint64: one hash per LSH band of ``rows`` consecutive signature values.

    Two documents share a bucket in band ``b`` exactly when their band values are equal (up to a
    2**-64 hash collision, which only adds a candidate that verification rejects). The band index
    seeds the hash, so equal values in different bands land in different buckets.
    """
    if bands * rows > hashvalues.shape[1]:
        raise ValueError(f"bands * rows = {bands * rows} exceeds the signature length {hashvalues.shape[1]}")
    values = hashvalues[:, : bands * rows].astype(np.uint64).reshape(len(hashvalues), bands, rows)
    hashes = np.broadcast_to(
        _fmix64(np.arange(1, bands + 1, dtype=np.uint64) * np.uint64(_TOKEN_POLY_BASE)), (len(hashvalues), bands)
    ).copy()
    for row in range(rows):
        hashes ^= values[:, :, row]
        hashes = _fmix64(hashes * np.uint64(_TOKEN_POLY_BASE))
    return hashes


def estimate_jaccard(signature_a: np.ndarray, signature_b: np.ndarray) -> float:
    """MinHash estimate: the fraction of equal positions (datasketch's ``MinHash.jaccard``)."""
    return float(np.count_nonzero(signature_a == signature_b)) / signature_a.size


# ---------------------------------------------------------------------------------------------
# Signature tables: one per shard, cached as Parquet
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignatureTable:
    """MinHash signatures of one shard, row-aligned with the shard's documents."""

    ids: np.ndarray  # object array of document ids (hex sha256 of text)
    hashvalues: np.ndarray  # (num_docs, num_perm) uint32
    config: MinHashConfig

    def __post_init__(self) -> None:
        if self.hashvalues.dtype != np.uint32 or self.hashvalues.ndim != 2:
            raise ValueError(
                f"hashvalues must be a 2-D uint32 array, got {self.hashvalues.dtype} {self.hashvalues.shape}"
            )
        if self.hashvalues.shape != (len(self.ids), self.config.num_perm):
            raise ValueError(
                f"hashvalues shape {self.hashvalues.shape} does not match "
                f"{len(self.ids)} ids x num_perm {self.config.num_perm}"
            )

    def __len__(self) -> int:
        return len(self.ids)

    def to_frame(self) -> pl.DataFrame:
        """Columns ``id`` (Utf8) and ``signature`` (Array(UInt32, num_perm))."""
        return pl.DataFrame(
            {
                "id": pl.Series("id", self.ids, dtype=pl.Utf8),
                "signature": pl.Series(
                    "signature", self.hashvalues, dtype=pl.Array(pl.UInt32, self.config.num_perm)
                ),
            }
        )

    @classmethod
    def from_frame(cls, frame: pl.DataFrame, config: MinHashConfig) -> SignatureTable:
        """Inverse of ``to_frame``; the caller vouches that ``config`` produced the frame."""
        if frame.columns != ["id", "signature"]:
            raise ValueError(f"a signature frame has columns ['id', 'signature'], got {frame.columns}")
        expected = pl.Array(pl.UInt32, config.num_perm)
        if frame.schema["signature"] != expected:
            raise ValueError(f"signature column must be {expected}, got {frame.schema['signature']}")
        hashvalues = frame["signature"].to_numpy().astype(np.uint32, copy=False).reshape(len(frame), config.num_perm)
        return cls(ids=frame["id"].to_numpy().astype(object), hashvalues=hashvalues, config=config)


def compute_signatures(docs: pl.DataFrame, config: MinHashConfig, texts: list[str] | None = None) -> SignatureTable:
    """Signatures of one shard's documents (columns ``id`` and ``text`` are used; ``texts``: the
    ``text`` column as a list, when the caller has it)."""
    for column in ("id", "text"):
        if column not in docs.columns:
            raise ValueError(f"documents need an {column!r} column; got {docs.columns}")
    if docs["text"].null_count() or docs["id"].null_count():
        raise ValueError("documents have null id or text values")
    if texts is None:
        texts = docs["text"].to_list()
    elif len(texts) != docs.height:
        raise ValueError(f"{len(texts)} texts for {docs.height} documents")
    return SignatureTable(
        ids=docs["id"].to_numpy().astype(object),
        hashvalues=minhash_texts(texts, config),
        config=config,
    )


def save_signatures(table: SignatureTable, destination: str | os.PathLike | BinaryIO) -> None:
    """Write Parquet: ``id`` string, ``signature`` fixed_size_list<uint32>[num_perm], config in metadata."""
    # Built from buffers and through polars, not `pa.array`: that imports pandas on first use (0.5 s
    # of every per-shard run worker); the file's bytes are the same either way.
    values = np.ascontiguousarray(table.hashvalues, dtype=np.uint32).reshape(-1)
    flat = pa.Array.from_buffers(pa.uint32(), len(values), [None, pa.py_buffer(values)])
    ids = pl.Series("id", list(table.ids), dtype=pl.String).to_arrow().cast(pa.string())
    arrow = pa.table(
        {
            "id": ids,
            "signature": pa.FixedSizeListArray.from_arrays(flat, table.config.num_perm),
        }
    ).replace_schema_metadata({_PARQUET_CONFIG_KEY: table.config.to_json().encode()})
    # Plain pages, uncompressed: signatures and hex ids are random, so arrow's default dictionary
    # attempt and snappy only cost time (0.24 CPU-s for a 25 MB shard's first write in a process,
    # against 0.04) and the file comes out larger (5.0 MB against 4.5).
    pq.write_table(arrow, destination, use_dictionary=False, compression="none")


def load_signatures(
    source: str | os.PathLike | BinaryIO | bytes, expected: MinHashConfig | None = None
) -> SignatureTable:
    """Read a ``save_signatures`` file; raise if its config differs from ``expected``."""
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    arrow = pq.read_table(source)
    metadata = arrow.schema.metadata or {}
    if _PARQUET_CONFIG_KEY not in metadata:
        raise ValueError("not a signature file: its Parquet metadata has no MinHash config")
    config = MinHashConfig.from_json(metadata[_PARQUET_CONFIG_KEY])
    if expected is not None and config != expected:
        raise ValueError(f"signature file was computed with {config}, expected {expected}")
    signature_column = arrow.column("signature").combine_chunks()
    hashvalues = signature_column.flatten().to_numpy(zero_copy_only=False).astype(np.uint32, copy=False)
    return SignatureTable(
        ids=np.array(arrow.column("id").to_pylist(), dtype=object),
        hashvalues=hashvalues.reshape(len(arrow), config.num_perm),
        config=config,
    )
