"""The train/validation split of a corpus: a function of each document's id, shared by every stage
that needs it (tokenization puts validation documents in their own split; decontamination keeps them
as the reference and never drops them). One module, so the two can never disagree.

A document is in validation iff ``id_hash(id) / 2**32 < threshold``: stable across rebuilds, corpus
growth and machines, and monotone in the threshold. ``raised_threshold`` is the threshold where a
minimum number of held-out documents is asked for (``validation_min_documents``). Pure: numpy only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import numpy as np

ID_HASH_DTYPE = np.dtype("<u4")


def id_hash(doc_id: str) -> int:
    """The first 32 bits of the id's sha256."""
    return int(hashlib.sha256(doc_id.encode("utf-8")).hexdigest()[:8], 16)


def id_hashes(doc_ids: Iterable[str], count: int = -1) -> np.ndarray:
    """``id_hash`` of each id, as uint32, in order."""
    return np.fromiter(map(id_hash, doc_ids), dtype=np.uint32, count=count)


def in_validation(hashes: np.ndarray, threshold: float) -> np.ndarray:
    """Which of these id hashes are validation documents at ``threshold``."""
    return hashes / 2**32 < threshold


def is_validation_document(doc_id: str, threshold: float) -> bool:
    """Deterministic held-out membership from the document id alone."""
    return id_hash(doc_id) / 2**32 < threshold


def validation_wanted(min_documents: int | None, documents: int) -> int:
    """How many of ``documents`` a minimum asks to hold out: at most half the corpus."""
    return min(min_documents or 0, documents // 2)


def fraction_holds_enough(min_documents: int | None, documents: int, held_out: int) -> bool:
    """Whether ``held_out`` of ``documents`` (those below the fraction) meet the minimum."""
    wanted = validation_wanted(min_documents, documents)
    return wanted == 0 or held_out >= wanted


def raised_threshold(fraction: float, min_documents: int | None, documents: int, held_out: int,
                     hashes: Callable[[], np.ndarray]) -> float:
    """The split threshold of a corpus of ``documents``, ``held_out`` of them below ``fraction``, that
    holds out at least ``min_documents`` (at most half the corpus): the fraction itself where that is
    enough, else just above the id hash of the ``min_documents``-th lowest (``hashes`` is read only
    then), so those documents, whatever order they come in, are validation."""
    if fraction_holds_enough(min_documents, documents, held_out):
        return fraction
    wanted = validation_wanted(min_documents, documents)
    return (int(np.partition(hashes(), wanted - 1)[wanted - 1]) + 1) / 2**32


def corpus_threshold(fraction: float, min_documents: int | None, doc_ids: Iterable[str]) -> float:
    """``raised_threshold`` over every id of a corpus."""
    hashes = id_hashes(doc_ids)
    held_out = int(np.count_nonzero(in_validation(hashes, fraction)))
    return raised_threshold(fraction, min_documents, hashes.size, held_out, lambda: hashes)
