"""Language identification: which language a document is in, and how sure.

Two identifiers, both of the `LanguageIdentifier` type (texts and a sample length in, a language code
and a probability per text out), chosen per source by `filters.FilterConfig.language_identifier`:

- fastText's lid.176 (`fasttext_identifier`, the default; pinned by sha256 in `fasttext_models`), or
  a fastText model the ``language_id:`` block adopts;
- langid.py's naive-Bayes model (`identify_language`), with the same features and scores as
  ``langid.classify`` but vectorised: its byte n-gram features are counted by the compiled
  ``_langid`` kernel (or a numpy twin) and a batch is scored with one sparse matrix product.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import polars as pl
from scipy import sparse

from marin_assets.curation.fasttext_models import FastTextClassifier
from marin_assets.curation.kernels import kernel

LanguageIdentifier = Callable[[list[str], int], tuple[list[str], list[float]]]
"""Texts and the characters to sample of each -> (language codes, probabilities)."""


@lru_cache(maxsize=1)
def _language_identifier():
    # The model ships inside the langid wheel; nothing is downloaded.
    from langid.langid import LanguageIdentifier as LangidModel
    from langid.langid import model

    return LangidModel.from_modelstring(model, norm_probs=True)


@dataclass(frozen=True)
class _FeatureTables:
    """langid's byte n-gram features as lookup tables, for counting them.

    The numpy twin's (built on first use, 64 MB): ``short[n - 1]`` maps the big-endian code of
    an n-byte sequence (n = 1..3) to its feature index + 1, or 0. A four-byte feature is found in
    two steps: ``four_prefix`` maps its first three bytes to a row of ``four`` + 1 (or 0), and
    that row's entry for the fourth byte is the feature index + 1, or 0.

    The compiled kernel's (``kernel``, about 2 MB: see _langid.c), one load per n-gram order:
    ``two[code of 2 bytes]`` is ``row << 16 | 2-byte feature + 1``, where ``row`` picks a row of
    ``three`` (0: a row of zeros, no longer feature starts with these bytes); ``three[row, third
    byte]`` is ``(3-byte feature + 1) << 16 | row of padded_four``; ``padded_four`` is ``four``
    after a row of zeros. Small and dense, these are built from the n-grams in milliseconds,
    where 16M-entry tables cost every filtering process about 0.25 s of page faults.
    """

    ngrams: dict[int, bytes]
    n_features: int
    one: np.ndarray  # uint16, 256: 1-byte feature index + 1, or 0
    four: np.ndarray  # uint16 rows of 256, one per distinct first three bytes of a 4-byte feature
    four_prefixes: list[bytes]  # the three bytes of each row of ``four``, ascending
    kernel: tuple[np.ndarray, np.ndarray, np.ndarray]  # two, three, padded_four
    # A byte that is in no feature and never in UTF-8 text (or None): put between texts, it ends
    # every n-gram that would cross into the next text, so no per-byte "bytes left" array is needed.
    separator: int | None = None

    @cached_property
    def short(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tables = (self.one, np.zeros(256**2, dtype=np.uint16), np.zeros(256**3, dtype=np.uint16))
        for index, gram in self.ngrams.items():
            if len(gram) in (2, 3):
                tables[len(gram) - 1][int.from_bytes(gram, "big")] = index + 1
        return tables

    @cached_property
    def four_prefix(self) -> np.ndarray:
        table = np.zeros(256**3, dtype=np.uint16)
        for row, prefix in enumerate(self.four_prefixes):
            table[int.from_bytes(prefix, "big")] = row + 1
        return table


def feature_ngrams(identifier) -> dict[int, bytes]:
    """Feature index -> the byte n-gram it counts, recovered from langid's tokenizer automaton.

    langid counts features with an Aho-Corasick automaton (``tk_nextmove``, ``tk_output``):
    entering a state emits every feature that is a suffix of the bytes read so far. A
    breadth-first walk gives each state its trie label (the shortest byte path to it); a
    feature is the shortest label among the states that emit it.
    """
    moves = np.asarray(identifier.tk_nextmove).reshape(-1, 256)
    labels: dict[int, bytes] = {0: b""}
    seen = np.zeros(moves.shape[0], dtype=bool)
    seen[0] = True
    frontier = [0]
    while frontier:
        following = []
        for state in frontier:
            targets = moves[state]
            for byte in np.flatnonzero(~seen[targets]).tolist():
                target = int(targets[byte])
                if not seen[target]:  # two bytes may lead to the same new state
                    seen[target] = True
                    labels[target] = labels[state] + bytes([byte])
                    following.append(target)
        frontier = following
    ngrams: dict[int, bytes] = {}
    for state, emitted in identifier.tk_output.items():
        for index in emitted:
            if index not in ngrams or len(labels[state]) < len(ngrams[index]):
                ngrams[index] = labels[state]
    return ngrams


def _feature_tables(ngrams: dict[int, bytes], n_features: int) -> _FeatureTables:
    if max(len(g) for g in ngrams.values()) > 4 or len(ngrams) != n_features or n_features >= 2**16 - 1:
        raise ValueError("langid model has features this counter does not handle (longer than 4 bytes, "
                         "or more than 65534)")
    by_order: list[dict[bytes, int]] = [{}, {}, {}, {}]  # n-gram -> feature index + 1, per length
    for index, gram in ngrams.items():
        by_order[len(gram) - 1][gram] = index + 1
    one = np.zeros(256, dtype=np.uint16)
    for gram, feature in by_order[0].items():
        one[gram[0]] = feature
    four_prefixes = sorted({gram[:3] for gram in by_order[3]})
    four_row = {prefix: row + 1 for row, prefix in enumerate(four_prefixes)}  # rows of padded_four
    padded_four = np.zeros((len(four_prefixes) + 1, 256), dtype=np.uint16)
    for gram, feature in by_order[3].items():
        padded_four[four_row[gram[:3]], gram[3]] = feature
    # The kernel's 3-byte codes: a 3-byte feature, or the first three bytes of a 4-byte one.
    codes3 = sorted(set(by_order[2]) | set(four_row))
    three_row = {pair: row + 1 for row, pair in enumerate(sorted({code[:2] for code in codes3}))}
    if len(three_row) >= 2**16:
        raise ValueError("langid model has more 2-byte prefixes than the kernel's tables hold")
    two = np.zeros(256**2, dtype=np.uint32)
    for gram, feature in by_order[1].items():
        two[int.from_bytes(gram, "big")] = feature
    for pair, row in three_row.items():
        two[int.from_bytes(pair, "big")] |= row << 16
    three = np.zeros((len(three_row) + 1, 256), dtype=np.uint32)
    for code in codes3:
        three[three_row[code[:2]], code[2]] = by_order[2].get(code, 0) << 16 | four_row.get(code, 0)
    used = {byte for gram in ngrams.values() for byte in gram}
    # 0xC0, 0xC1 and 0xF5..0xFF never occur in UTF-8.
    separator = next((b for b in (0xFF, 0xFE, 0xFD, 0xFC, 0xFB, 0xFA, 0xF9, 0xF8, 0xF7, 0xF6, 0xF5, 0xC1, 0xC0)
                      if b not in used), None)
    return _FeatureTables(ngrams, n_features, one, padded_four[1:], four_prefixes, (two, three, padded_four),
                          separator)


@dataclass(frozen=True)
class _LanguageModel:
    weights: np.ndarray  # features x languages, log P(feature | language)
    priors: np.ndarray  # log P(language)
    classes: np.ndarray  # language codes
    tables: _FeatureTables


@lru_cache(maxsize=1)
def _language_model() -> _LanguageModel:
    """langid's naive-Bayes model and feature tables, from a local cache file when there is one.

    Unpacking langid's model string (bz2 + pickle) costs about 1.5 s of CPU in every process
    that filters, which a pod building one shard pays for each shard; the arrays it yields
    load from an ``.npz`` in a few milliseconds. The file is named by the model string's
    digest, so another langid model never reads it; a file that cannot be read or written
    is ignored and the model is unpacked as before.
    """
    import hashlib

    from langid.langid import model as model_string

    from marin_assets.curation.local_cache import cache_dir

    digest = hashlib.sha256(model_string.encode() if isinstance(model_string, str) else model_string).hexdigest()
    path = cache_dir() / "langid" / f"{digest[:16]}.npz"
    try:
        with np.load(path) as cached:
            ngrams = {int(i): bytes(g[:n]) for i, g, n in zip(cached["feature"], cached["gram"], cached["gram_len"])}
            return _LanguageModel(cached["weights"], cached["priors"], cached["classes"],
                                  _feature_tables(ngrams, int(cached["weights"].shape[0])))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):  # absent, truncated or foreign
        pass
    identifier = _language_identifier()
    ngrams = feature_ngrams(identifier)
    built = _LanguageModel(np.ascontiguousarray(identifier.nb_ptc, dtype=np.float64),
                           np.asarray(identifier.nb_pc, dtype=np.float64), np.asarray(identifier.nb_classes),
                           _feature_tables(ngrams, identifier.nb_numfeats))
    features = sorted(ngrams)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(staged, weights=built.weights, priors=built.priors, classes=built.classes,
                 feature=np.array(features), gram=np.array([ngrams[i].ljust(4, b"\0") for i in features], dtype="S4"),
                 gram_len=np.array([len(ngrams[i]) for i in features]))
        os.replace(staged, path)  # readers see a whole file or none
    except OSError:
        pass
    return built


def language_features(texts: list[str], sample_chars: int = 5000) -> np.ndarray:
    """langid's feature counts (``instance2fv`` of ``text[:sample_chars]``), one row per text.

    The same counts langid's automaton produces, computed per n-gram order over all texts'
    bytes at once instead of a Python step per byte: each position's 1- to 4-byte code is
    looked up in the feature tables, n-grams crossing into the next text are skipped, and
    hits are summed per (text, feature) with one ``bincount`` (one per order would zero
    and add a texts x features array four times).
    """
    return _language_feature_counts(texts, sample_chars).toarray().astype(np.int64)


def _feature_hits(texts: list[str], sample_chars: int, tables: _FeatureTables) -> np.ndarray:
    """``row * n_features + feature`` for every feature occurrence (in no particular order), as
    int32 when every such cell fits."""
    n_feats = tables.n_features
    encoded = [t[:sample_chars].encode("utf-8") for t in texts]
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    if tables.separator is None:
        data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        # Bytes left in its own text from each position on: an n-gram fits when this is >= n.
        left = np.repeat(np.cumsum(lengths), lengths) - np.arange(data.size)
        starts = np.cumsum(lengths) - lengths
    else:
        # One separator byte between texts: no feature contains it, so no n-gram found crosses.
        data = np.frombuffer(bytes([tables.separator]).join(encoded), dtype=np.uint8)
        left = None
        starts = np.cumsum(lengths + 1) - (lengths + 1)
    hits = []  # (positions, features), one pair per order
    # The narrowest integer each n-gram's code fits in: the lookups read less memory. `np.take`
    # rather than `table[code]`: fancy indexing with an unsigned index costs about twice as much.
    code = data
    for n, dtype in ((1, np.uint8), (2, np.uint16), (3, np.uint32)):
        if n > 1:
            code = (code[:-1].astype(dtype) << dtype(8)) | data[n - 1 :]
        feature = np.take(tables.short[n - 1], code)
        found = feature != 0
        if left is not None:
            found &= left[: code.size] >= n
        at = np.flatnonzero(found)
        hits.append((at, np.take(feature, at)))
    # Four-byte n-grams: the first three bytes (``code`` now) pick a row, the fourth the entry.
    row = np.take(tables.four_prefix, code[:-1])
    found = row != 0
    if left is not None:
        found &= left[: row.size] >= 4
    at = np.flatnonzero(found)
    entry = np.take(row, at).astype(np.intp)
    entry -= 1
    entry <<= 8
    entry += np.take(data, at + 3)
    feature = np.take(tables.four.reshape(-1), entry)
    found = np.flatnonzero(feature != 0)  # indices: two gathers by a bool mask cost more
    hits.append((np.take(at, found), np.take(feature, found)))
    positions = np.concatenate([h[0] for h in hits])
    # int32 cells whenever they fit (a batch of identify_language always does): they sort faster.
    cell = np.int32 if len(texts) * n_feats < 2**31 else np.int64
    features = np.concatenate([h[1] for h in hits]).astype(cell)
    features -= 1  # the tables hold index + 1
    rows = (np.searchsorted(starts, positions, side="right") - 1).astype(cell)
    rows *= cell(n_feats)
    rows += features
    return rows


def _language_feature_counts(texts: list[str], sample_chars: int) -> sparse.csr_matrix:
    """:func:`language_features` as a float64 CSR matrix with sorted column indices (the matrix
    ``csr_matrix(language_features(...), dtype=float64)`` is, built without a dense pass)."""
    langid = kernel("_langid")  # the compiled twin of _numpy_feature_counts (_langid.c)
    if langid is None:
        return _numpy_feature_counts(texts, sample_chars)
    tables = _language_model().tables
    encoded = [t[:sample_chars].encode("utf-8") for t in texts]
    starts = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=starts[1:])
    indptr = np.empty(len(texts) + 1, dtype=np.int64)
    indices, counts = langid.feature_counts(b"".join(encoded), starts, tables.one, *tables.kernel,
                                             tables.n_features, indptr)
    return sparse.csr_matrix(
        (np.frombuffer(counts, dtype=np.int32).astype(np.float64), np.frombuffer(indices, dtype=np.int32), indptr),
        shape=(len(texts), tables.n_features),
    )


def _numpy_feature_counts(texts: list[str], sample_chars: int) -> sparse.csr_matrix:
    """The feature counts in numpy: the definition the compiled kernel is tested against, and what
    runs where it was not built."""
    tables = _language_model().tables
    n_feats = tables.n_features
    # Sorting the hits (a few per byte) and counting equal neighbours is cheaper than a bincount
    # over every (text, feature) cell and a scan of it for the non-zero ones.
    hits = np.sort(_feature_hits(texts, sample_chars, tables))
    first = np.ones(hits.size, dtype=bool)
    first[1:] = hits[1:] != hits[:-1]
    starts = np.flatnonzero(first)
    nonzero = hits[starts]
    counts = np.diff(starts, append=hits.size)
    index = nonzero.dtype.type
    indptr = np.searchsorted(nonzero, np.arange(len(texts) + 1, dtype=index) * index(n_feats))
    return sparse.csr_matrix(
        (counts.astype(np.float64), nonzero % index(n_feats), indptr.astype(index)),
        shape=(len(texts), n_feats),
    )


def identify_language(
    texts: list[str], sample_chars: int = 5000, batch_size: int = 256
) -> tuple[list[str], list[float]]:
    """langid.py language code and normalised probability for each text.

    Same model, features and scores as ``langid.classify``, but vectorised: the feature
    counts come from :func:`language_features` rather than langid's per-byte Python loop,
    and the naive-Bayes scoring of a batch is one float64 matrix product (langid multiplies
    a uint32 vector by the float matrix per document, which numpy cannot hand to BLAS).
    """
    model = _language_model()
    weights, priors, classes = model.weights, model.priors, model.classes
    langs: list[str] = []
    scores: list[float] = []
    for start in range(0, len(texts), batch_size):
        batch = texts[start : start + batch_size]
        # Most features are absent from a document: a sparse product skips their zero rows.
        log_probs = np.asarray(_language_feature_counts(batch, sample_chars) @ weights)
        log_probs += priors
        best = log_probs.argmax(axis=1)
        # Probability of the best class: 1 / sum_j exp(lp_j - lp_best), stable since lp_j <= lp_best.
        confidence = 1.0 / np.exp(log_probs - log_probs[np.arange(len(batch)), best][:, None]).sum(axis=1)
        langs.extend(classes[best].tolist())
        scores.extend(confidence.tolist())
    return langs, scores


@lru_cache(maxsize=2)
def fasttext_identifier(model: bytes) -> LanguageIdentifier:
    """Identification by a fastText model with ``__label__<code>`` labels, loaded once per process:
    the top label and its probability (:meth:`FastTextClassifier.top_labels`)."""
    classifier = FastTextClassifier(model, "language model")

    def identify(texts: list[str], sample_chars: int) -> tuple[list[str], list[float]]:
        langs, probs = classifier.top_labels(texts, sample_chars)
        return langs, probs.tolist()

    return identify


def add_language_columns(df: pl.DataFrame, sample_chars: int, identify: LanguageIdentifier,
                         texts: list[str] | None = None) -> pl.DataFrame:
    """Add ``lang`` (str) and ``lang_score`` (float, 0..1) columns (``texts``: the ``text`` column as a
    list, when the caller has it)."""
    langs, scores = identify(df["text"].to_list() if texts is None else texts, sample_chars)
    return df.with_columns(
        pl.Series("lang", langs, dtype=pl.String), pl.Series("lang_score", scores, dtype=pl.Float64)
    )
