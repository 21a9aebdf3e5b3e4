"""Word n-gram hashes of normalized text, and the lookup that finds a document's n-grams in an index
of eval n-grams. Pure: numpy and the standard library (and `marin_assets.arrays`).

Normalization (version ``NORMALIZATION_VERSION``, part of every identity that depends on it):
lowercase, punctuation removed (Unicode categories P* and S*, as ``[^\\w\\s]``, plus ``_``), split on
whitespace. So "Hello, World!" and "hello world" give the same words, and a copy of an eval text
with other casing, punctuation or line breaks is still found.

Each word is hashed to 64 bits (blake2b, stable across processes and machines), and an n-gram is the
polynomial ``sum(w[i+k] * P**(n-1-k)) mod 2**64`` of its words' hashes: computed for every
position of a batch of documents at once with numpy (n multiply-adds over the batch's word array),
and n-grams that would cross a document boundary are left out.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from marin_assets.arrays import sorted_unique

NORMALIZATION_VERSION = 1
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplication by it is a bijection mod 2**64
_NOT_WORD = re.compile(r"[^\w\s]|_")
_WORD_CACHE_LIMIT = 2_000_000


def normalized_words(text: str) -> list[str]:
    """The words n-grams are made of: lowercase, punctuation removed, split on whitespace."""
    return _NOT_WORD.sub("", text.lower()).split()


def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")


class NgramHasher:
    """Hashes the n-grams of batches of texts; keeps its words' hashes (most words recur) up to a bound."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"n-gram size must be at least 1, got {n}")
        self.n = n
        self._words: dict[str, int] = {}

    def _hashes(self, words: list[str]) -> np.ndarray:
        cache = self._words
        if len(cache) > _WORD_CACHE_LIMIT:
            cache.clear()
        # Set and map operations run in C: Python code runs once per new word, not once per word.
        for word in set(words).difference(cache):
            cache[word] = _word_hash(word)
        return np.fromiter(map(cache.__getitem__, words), dtype=np.uint64, count=len(words))

    def batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(n-gram hashes of every text, concatenated; the index of the text each belongs to)."""
        words: list[str] = []
        counts = np.empty(len(texts), dtype=np.int64)
        for i, text in enumerate(texts):
            doc = normalized_words(text)
            counts[i] = len(doc)
            words.extend(doc)
        hashes = self._hashes(words)
        n = self.n
        positions = hashes.size - n + 1
        if positions <= 0:
            return np.empty(0, np.uint64), np.empty(0, np.int64)
        grams = hashes[:positions].copy()
        with np.errstate(over="ignore"):
            for k in range(1, n):
                grams *= _MULTIPLIER
                grams += hashes[k:k + positions]
        # Position p starts an n-gram of text d iff p + n <= end of d.
        ends = np.cumsum(counts)
        doc_of = np.repeat(np.arange(len(texts), dtype=np.int64), counts)[:positions]
        keep = np.arange(positions) + n <= ends[doc_of]
        return grams[keep], doc_of[keep]

    def of(self, text: str) -> np.ndarray:
        """The n-gram hashes of one text, in order."""
        return self.batch([text])[0]


def build_index(hasher: NgramHasher, texts: Iterable[str], batch_texts: int = 256) -> np.ndarray:
    """The sorted, distinct n-gram hashes of ``texts``: what `eval_ngrams/<source>` stores."""
    parts = [np.empty(0, np.uint64)]
    pending: list[str] = []
    for text in texts:
        pending.append(text)
        if len(pending) >= batch_texts:
            parts.append(sorted_unique(hasher.batch(pending)[0]))
            pending = []
    if pending:
        parts.append(sorted_unique(hasher.batch(pending)[0]))
    return sorted_unique(np.concatenate(parts))


def in_index(index: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """Which ``hashes`` the sorted ``index`` holds (a binary search each)."""
    if index.size == 0:
        return np.zeros(hashes.size, dtype=bool)
    at = np.searchsorted(index, hashes)
    return index[np.minimum(at, index.size - 1)] == hashes


@dataclass(frozen=True)
class Overlap:
    """Per text of a batch: its n-grams, and how many distinct ones the index holds."""

    ngrams: np.ndarray
    matching: np.ndarray


def overlap(hasher: NgramHasher, index: np.ndarray, texts: Sequence[str]) -> Overlap:
    """How many of each text's distinct n-grams are eval n-grams."""
    grams, doc_of = hasher.batch(texts)
    total = np.bincount(doc_of, minlength=len(texts))
    hit = in_index(index, grams)
    # Distinct matching n-grams per text: a repeated eval line counts once. The hits are in text order
    # already; sorting each text's hits by value puts repeats side by side.
    docs, hits = doc_of[hit], grams[hit]
    order = np.lexsort((hits, docs))
    docs, hits = docs[order], hits[order]
    first = np.ones(docs.size, dtype=bool)
    first[1:] = (docs[1:] != docs[:-1]) | (hits[1:] != hits[:-1])
    matching = np.bincount(docs[first], minlength=len(texts))
    return Overlap(total, matching)
