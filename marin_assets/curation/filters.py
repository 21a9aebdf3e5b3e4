"""Heuristic quality rules, and the filter that applies them with language identification
(`language_id`: fastText's lid.176 by default, or langid.py's model).

The rules are the rows of ``rules.RULES``: the Gopher family, always on, and the families a
source opts in to (C4, FineWeb, Gopher repetition). Every rule compares a column of a statistics
frame computed for the whole documents frame at once, so one polars query evaluates all rules for
all documents of a shard without a Python loop per document. Each threshold can be set to
``None`` to switch that rule off.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Literal

import numpy as np
import polars as pl

from marin_assets.curation.fasttext_models import LID176
from marin_assets.curation.kernels import kernel
from marin_assets.curation.language_id import (
    LanguageIdentifier,
    add_language_columns,
    fasttext_identifier,
    identify_language,
)
from marin_assets.curation.rules import (
    C4,
    FINEWEB,
    GOPHER,
    GOPHER_DEFAULTS,
    GOPHER_REPETITION,
    RULES,
    FamilyConfigError,
    Rule,
    c4_statistics,
    fineweb_statistics,
    gopher_repetition_statistics,
    normalize_families,
    thresholds,
)
from marin_assets.curation.url_filter import URL_BLOCKED
from marin_resources.config_identity import identity, runtime
from marin_resources.typed_config import typed_config

# Gopher's stop-word rule: a real English document uses a few of these.
STOP_WORDS: tuple[str, ...] = ("the", "be", "to", "of", "and", "that", "have", "with")

WORD_PATTERN = r"\S+"
ALPHA_WORD_PATTERN = r"\S*\p{L}\S*"
# The core of a word: from its first to its last character that is not punctuation or a symbol.
# Gopher's mean word length is over these, so "end." counts 3 and "-", "|" or "***" are not words
# (as in DataTrove's GopherQualityFilter, whose tokenizer splits such punctuation off).
WORD_CORE_PATTERN = r"[^\s\p{P}\p{S}](?:\S*[^\s\p{P}\p{S}])?"
SYMBOL_PATTERN = r"#|\.\.\.|…"
BULLET_LINE_PATTERN = r"(?m)^[ \t]*(?:[•‣◦▪▫●○■□–—*\-+])(?:[ \t]|$)"
ELLIPSIS_LINE_PATTERN = r"(?m)(?:\.\.\.|…)[ \t]*$"
NONEMPTY_LINE_PATTERN = r"(?m)^[ \t]*\S"
STOP_WORD_PATTERN = r"(?i)\b(?:" + "|".join(STOP_WORDS) + r")\b"
PARAGRAPH_BREAK_PATTERN = r"\n[ \t]*\n\s*"


@typed_config
@dataclass(frozen=True)
class FilterConfig:
    """Thresholds of the heuristic rules; ``None`` switches a rule off.

    The flat fields are the Gopher family's thresholds, their defaults the table's (``rules.RULES``):
    Gopher (Rae et al. 2021) except where noted.
    """

    min_words: int | None = identity(GOPHER_DEFAULTS["min_words"])
    max_words: int | None = identity(GOPHER_DEFAULTS["max_words"])
    min_mean_word_length: float | None = identity(GOPHER_DEFAULTS["min_mean_word_length"])
    max_mean_word_length: float | None = identity(GOPHER_DEFAULTS["max_mean_word_length"])
    # ('#' + ellipses) per word.
    max_symbol_word_ratio: float | None = identity(GOPHER_DEFAULTS["max_symbol_word_ratio"])
    # Fraction of words that contain no letter at all.
    max_non_alpha_word_fraction: float | None = identity(GOPHER_DEFAULTS["max_non_alpha_word_fraction"])
    max_bullet_line_fraction: float | None = identity(GOPHER_DEFAULTS["max_bullet_line_fraction"])
    max_ellipsis_line_fraction: float | None = identity(GOPHER_DEFAULTS["max_ellipsis_line_fraction"])
    # Repeated occurrences (beyond the first) of a line / paragraph, as a
    # fraction of the characters in all lines / paragraphs. Character-weighted
    # rather than count-based so verse drama, whose speaker tags ("Ham.") repeat
    # hundreds of times, is not mistaken for boilerplate.
    max_duplicate_line_fraction: float | None = identity(GOPHER_DEFAULTS["max_duplicate_line_fraction"])
    max_duplicate_paragraph_fraction: float | None = identity(GOPHER_DEFAULTS["max_duplicate_paragraph_fraction"])
    min_stop_words: int | None = identity(GOPHER_DEFAULTS["min_stop_words"])
    # Language identification; an empty tuple switches it off.
    languages: tuple[str, ...] = identity(("en",))
    # fasttext: fastText's lid.176, pinned by sha256 (or the model of the top-level `language_id:` block);
    # langid: langid.py's naive-Bayes model, its features counted by the _langid kernel.
    language_identifier: Literal["fasttext", "langid"] = identity("fasttext")
    min_language_score: float = identity(0.5)
    # Either identifier reads only the first characters: long documents rarely
    # switch language and the cost is linear in length.
    language_sample_chars: int = identity(5000)
    # The optional families this source opts in to, each with the thresholds it sets (the others
    # keep the table's defaults; None switches a rule off): {"c4": {}, "fineweb": {"max_short_line_ratio": 0.5}}.
    # Absent from the identity while none is selected: sources keep the artifacts they had before families.
    families: Mapping[str, Mapping[str, float | None] | None] = identity(default_factory=dict, omit="empty")

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "families", normalize_families(self.families))
        except FamilyConfigError as exc:
            raise ValueError(str(exc)) from None


@typed_config
@dataclass(frozen=True)
class LanguageIdConfig:
    """The ``language_id:`` block: a fastText language-ID model (e.g. ``lid.176.bin``) adopted by URI and
    identified by the sha256 of its bytes; its labels are ``__label__<code>``. Without the block, the
    sources whose ``language_identifier`` is ``fasttext`` use the pinned lid.176.ftz (``LID176``)."""

    model_uri: str = runtime()
    model_sha256: str = identity()

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{64}", self.model_sha256):
            raise ValueError(f"language_id.model_sha256: expected 64 lowercase hex digits, got {self.model_sha256!r}")


# Texts (and how many leading characters to read) -> (language code, probability) per text.

# Evaluation order of the rules every source has; a dropped document's ``reason`` is the first
# rule it fails. The selected families' document rules follow, in the table's order.
RULE_ORDER: tuple[str, ...] = ("language", *(r.key for r in RULES if r.family == GOPHER))
_GOPHER_RULES = {r.key: r for r in RULES if r.family == GOPHER}


@dataclass
class FilterResult:
    kept: pl.DataFrame
    # Same columns as ``kept`` plus ``reason`` (first failed rule) and
    # ``failed_rules`` (every enabled rule the document failed).
    dropped: pl.DataFrame
    # Rule name -> number of documents whose first failed rule it is; the
    # values add up to ``dropped.height``. Every enabled rule has an entry.
    per_rule_drop_counts: dict[str, int]
    # ``kept["text"]`` as Python strings, row-aligned, for the next pass over them (MinHash):
    # converting 25 MB of text costs about 0.07 s each time.
    kept_texts: list[str] | None = None
    # Line rule (c4) -> lines it removed from the kept and dropped documents.
    line_removals: dict[str, int] = field(default_factory=dict)


def error_reason(family: str) -> str:
    """The reason of a document on which a family's statistics raised (it is dropped alone)."""
    return f"{family}.error"


def enabled_rules(cfg: FilterConfig) -> list[str]:
    """Every document rule that is on, in evaluation order (with each selected family's error reason)."""
    gopher = [r for r in RULE_ORDER if (bool(cfg.languages) if r == "language" else getattr(cfg, r) is not None)]
    on = {rule.name for rule, _ in thresholds(cfg.families) if rule.unit == "document"}
    families = [name for family in cfg.families
                for name in (error_reason(family), *(r.name for r in RULES if r.family == family and r.name in on))]
    return gopher + families


# The duplicate statistics sort by (document, hash >> this) in one uint64: 40 hash bits for up
# to 2**24 documents.
_DUPLICATE_SORT_SHIFT = 24


def _duplicate_fractions(df: pl.DataFrame, unit: str) -> np.ndarray:
    """Per document: characters in repeated lines/paragraphs over all characters (0.0 without any).

    Pieces are stripped, empty ones left out, and grouped per document by a 64-bit hash of
    their text rather than the text itself (same groups up to negligible collisions); a group
    weighs its first piece's characters times its size, and everything past the first piece
    is repeated. The grouping is a sort: by document and the hash's top 40 bits in one stable
    uint64 argsort, or by document and the whole hash where two hashes of one document share
    their top 40 bits.
    """
    pieces = pl.col("text")
    if unit == "paragraph":
        # polars splits on literals only, so mark paragraph breaks first.
        pieces = pieces.str.replace_all(PARAGRAPH_BREAK_PATTERN, "\x00")
        pieces = pieces.str.split("\x00")
    else:
        pieces = pieces.str.split("\n")
    per_piece = (
        df.lazy()
        .select(pl.int_range(pl.len(), dtype=pl.UInt32).alias("_doc"), pieces.alias("_piece"))
        .explode("_piece")
        .with_columns(pl.col("_piece").str.strip_chars())
        .filter(pl.col("_piece").str.len_bytes() > 0)
        .select("_doc", pl.col("_piece").hash(seed=0).alias("_hash"), pl.col("_piece").str.len_chars().alias("_chars"))
        .collect()
    )
    docs = per_piece["_doc"].to_numpy().astype(np.uint64)
    hashes = per_piece["_hash"].to_numpy()
    chars = per_piece["_chars"].to_numpy().astype(np.int64)
    shift = np.uint64(_DUPLICATE_SORT_SHIFT)
    if docs.size and int(docs[-1]) < 1 << _DUPLICATE_SORT_SHIFT:
        order = np.argsort((docs << (np.uint64(64) - shift)) | (hashes >> shift), kind="stable")
        docs, hashes, chars = docs[order], hashes[order], chars[order]
        same_prefix = (docs[1:] == docs[:-1]) & ((hashes[1:] >> shift) == (hashes[:-1] >> shift))
        if np.any(same_prefix & (hashes[1:] != hashes[:-1])):
            order = np.lexsort((hashes, docs))  # stable too: each group starts at its first piece
            docs, hashes, chars = docs[order], hashes[order], chars[order]
    elif docs.size:
        order = np.lexsort((hashes, docs))
        docs, hashes, chars = docs[order], hashes[order], chars[order]
    group_start = np.ones(docs.size, dtype=bool)
    group_start[1:] = (docs[1:] != docs[:-1]) | (hashes[1:] != hashes[:-1])
    starts = np.flatnonzero(group_start)
    count = np.diff(starts, append=docs.size)
    first_chars = chars[starts]
    group_doc = docs[starts].astype(np.int64)
    total = np.bincount(group_doc, weights=first_chars * count, minlength=df.height)
    duplicated = np.bincount(group_doc, weights=first_chars * (count - 1), minlength=df.height)
    fractions = np.zeros(df.height, dtype=np.float64)
    np.divide(duplicated, total, out=fractions, where=total > 0)
    return fractions


# Character classes as the regex engine of polars sees them, per code point, filled in on first
# sight of a code point (by asking polars) so they agree with the patterns above exactly.
_SPACE, _LETTER, _PUNCT_OR_SYMBOL, _KNOWN, _WORD = 1, 2, 4, 8, 16
_CHAR_CLASSES = np.zeros(0x110000, dtype=np.uint8)
# Characters per numpy batch of the word statistics (4 bytes each as UTF-32, plus temporaries).
_WORD_STATS_BATCH_CHARS = 1 << 20


def _learn_char_classes(codepoints: np.ndarray) -> None:
    chars = pl.Series([chr(c) for c in codepoints.tolist()], dtype=pl.String)
    classes = np.full(len(chars), _KNOWN, dtype=np.uint8)
    for flag, pattern in ((_SPACE, r"^\s$"), (_LETTER, r"^\p{L}$"), (_PUNCT_OR_SYMBOL, r"^[\p{P}\p{S}]$"),
                          (_WORD, r"^\w$")):
        classes |= np.where(chars.str.contains(pattern).to_numpy(), flag, 0).astype(np.uint8)
    _CHAR_CLASSES[codepoints] = classes


def _char_classes(codepoints: np.ndarray) -> np.ndarray:
    classes = np.take(_CHAR_CLASSES, codepoints)  # np.take: fancy indexing by uint8/uint32 costs twice as much
    unknown = (classes & _KNOWN) == 0
    if unknown.any():
        _learn_char_classes(np.unique(codepoints[unknown]))
        classes = np.take(_CHAR_CLASSES, codepoints)
    return classes


_learn_char_classes(np.arange(0x3000))  # ASCII, Latin and the common scripts up front


def _stretches(inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First and last position of each maximal run of True in ``inside`` (whose ends are False)."""
    edges = np.flatnonzero(inside[1:] != inside[:-1])
    return edges[0::2] + 1, edges[1::2]


def _word_counts_batch(texts: list[str]) -> tuple[np.ndarray, ...]:
    """Per text: \\S+ runs, non-space characters, runs with a core character, characters outside
    the cores, runs with a letter.

    The counts ``count_matches`` gives for WORD_PATTERN, ``\\S``, WORD_CORE_PATTERN, ``\\S``
    after removing those matches, and ALPHA_WORD_PATTERN, from one classification of each
    character instead of a regex pass per pattern. A run of non-space characters (a word) has
    one core match, from its first to its last core character, when it has a core character, and
    one alpha match when it has a letter. So, with stretches the maximal runs of punctuation or
    symbols (or of non-letters) inside words: a word without a core character (a letter) is a
    stretch with whitespace on both sides, and the characters outside the cores are the stretches
    of punctuation or symbols that do not lie between two core characters.
    """
    n_docs = len(texts)
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=n_docs)
    # A newline (whitespace) before every text and after the last: nothing crosses from one
    # text into the next, and every stretch has a neighbour on both sides.
    joined = "\n" + "\n".join(texts) + "\n"
    if joined.isascii():
        codepoints = np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
    else:
        codepoints = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
    classes = _char_classes(codepoints)
    # Segment of each text: its separator and its characters (never empty, so reduceat is exact).
    segments = np.cumsum(lengths + 1) - lengths - 1
    space = (classes & _SPACE) != 0
    nonspace = ~space
    run_start = nonspace.copy()
    run_start[1:] &= space[:-1]
    n_words = np.add.reduceat(run_start, segments, dtype=np.int64)
    n_nonspace = np.add.reduceat(nonspace, segments, dtype=np.int64)

    def per_doc(positions: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        docs = np.searchsorted(segments, positions, side="right") - 1
        return np.bincount(docs, weights=weights, minlength=n_docs)

    first, last = _stretches(nonspace & ((classes & _PUNCT_OR_SYMBOL) != 0))
    space_before, space_after = space[first - 1], space[last + 1]
    word_cores = n_words - per_doc(first[space_before & space_after])
    outside = space_before | space_after
    non_core_chars = per_doc(first[outside], (last - first + 1)[outside]).astype(np.int64)
    first, last = _stretches(nonspace & ((classes & _LETTER) == 0))
    alpha_words = n_words - per_doc(first[space[first - 1] & space[last + 1]])
    return n_words, n_nonspace, word_cores, non_core_chars, alpha_words


def _word_counts(texts: list[str]) -> tuple[np.ndarray, ...]:
    """:func:`_word_counts_batch` over all texts in batches of about _WORD_STATS_BATCH_CHARS
    characters; ASCII texts are batched apart from the others, so most batches are one byte
    per character rather than four (each text's counts are its own, whatever its batch)."""
    ascii_texts = np.fromiter(map(str.isascii, texts), dtype=bool, count=len(texts))
    counts = tuple(np.zeros(len(texts), dtype=np.int64) for _ in range(5))
    for group in (np.flatnonzero(ascii_texts), np.flatnonzero(~ascii_texts)):
        start, size = 0, 0
        for position, index in enumerate(group.tolist()):
            size += len(texts[index]) + 1
            if size >= _WORD_STATS_BATCH_CHARS or position == group.size - 1:
                members = group[start : position + 1]
                for column, values in zip(counts, _word_counts_batch([texts[i] for i in members.tolist()])):
                    column[members] = values
                start, size = position + 1, 0
    return counts


# The kernel's output columns, in its order: text_stats' names for them.
_TEXT_COUNT_COLUMNS = ("n_words", "_nonspace", "_word_cores", "_non_core_chars", "_alpha_words", "_lines",
                       "_symbols", "_bullet_lines", "_ellipsis_lines", "n_stop_words")


def _learn_classes_of(texts: list[str]) -> None:
    """Learn the character classes of every character in ``texts`` (in batches of about
    _WORD_STATS_BATCH_CHARS characters as UTF-32)."""
    batch: list[str] = []
    size = 0
    for text in (t for t in texts if not t.isascii()):
        batch.append(text)
        size += len(text)
        if size >= _WORD_STATS_BATCH_CHARS:
            _char_classes(np.frombuffer("".join(batch).encode("utf-32-le"), dtype=np.uint32))
            batch, size = [], 0
    _char_classes(np.frombuffer("".join(batch).encode("utf-32-le"), dtype=np.uint32))


def _run_kernel(function: Callable, texts: list[str], columns: int) -> np.ndarray:
    """A _textstats function's int64 rows for ``texts``, learning unknown character classes first."""
    out = np.empty((len(texts), columns), dtype=np.int64)
    if not function(texts, _CHAR_CLASSES, out):
        _learn_classes_of(texts)  # characters no text has shown yet
        if not function(texts, _CHAR_CLASSES, out):
            raise RuntimeError(f"{function.__name__}: a character class is still unknown after learning them")
    return out


def _compiled_text_counts(texts: list[str], textstats: ModuleType) -> pl.DataFrame:
    """text_stats' pattern counts from the compiled kernel, one column per _TEXT_COUNT_COLUMNS."""
    counts = _run_kernel(textstats.text_counts, texts, len(_TEXT_COUNT_COLUMNS))
    return pl.DataFrame({name: counts[:, i] for i, name in enumerate(_TEXT_COUNT_COLUMNS)})


def _compiled_duplicate_fractions(texts: list[str], textstats: ModuleType) -> dict[str, np.ndarray]:
    """:func:`_duplicate_fractions` of both units from the compiled kernel (pieces grouped by their
    text rather than its hash), by unit."""
    chars = _run_kernel(textstats.duplicate_chars, texts, 4).astype(np.float64)
    fractions = {}
    for unit, (duplicated, total) in (("line", chars[:, 0:2].T), ("paragraph", chars[:, 2:4].T)):
        fractions[unit] = np.zeros(len(texts), dtype=np.float64)
        np.divide(duplicated, total, out=fractions[unit], where=total > 0)
    return fractions


def _pattern_counts(df: pl.DataFrame, texts: list[str] | None) -> pl.DataFrame:
    """The counts text_stats derives its ratios from, one column per _TEXT_COUNT_COLUMNS: from the
    compiled kernel, else numpy's word counts and polars' regex counts (all regex where ``texts``
    is None: a text is null)."""
    text = pl.col("text")
    if texts is not None:
        if (textstats := kernel("_textstats")) is not None:
            return _compiled_text_counts(texts, textstats)
        # The word counts from one classification of every character (see _word_counts_batch):
        # the same numbers as the regex counts below, in a quarter of the time.
        word_columns = [pl.Series(name, values) for name, values in zip(_TEXT_COUNT_COLUMNS, _word_counts(texts))]
    else:
        word_columns = [
            text.str.count_matches(WORD_PATTERN).alias("n_words"),
            (text.str.len_chars() - text.str.count_matches(r"\s")).alias("_nonspace"),
            text.str.count_matches(WORD_CORE_PATTERN).alias("_word_cores"),
            # Characters outside the word cores: what is left once the cores are removed.
            text.str.replace_all(WORD_CORE_PATTERN, "").str.count_matches(r"\S").alias("_non_core_chars"),
            text.str.count_matches(ALPHA_WORD_PATTERN).alias("_alpha_words"),
        ]
    # Each pattern is matched once; the ratios are derived from the counts afterwards
    # (an eager select does not share a count used by several expressions).
    return df.select(
        *word_columns,
        text.str.count_matches(NONEMPTY_LINE_PATTERN).alias("_lines"),
        text.str.count_matches(SYMBOL_PATTERN).alias("_symbols"),
        text.str.count_matches(BULLET_LINE_PATTERN).alias("_bullet_lines"),
        text.str.count_matches(ELLIPSIS_LINE_PATTERN).alias("_ellipsis_lines"),
        text.str.count_matches(STOP_WORD_PATTERN).alias("n_stop_words"),
    ).cast(pl.Int64)


def text_stats(df: pl.DataFrame, texts: list[str] | None = None) -> pl.DataFrame:
    """Per-document statistics the rules read, one row per row of ``df`` (``texts``: its ``text``
    column as a list, when the caller has it)."""
    if df["text"].null_count():
        texts = None
    elif texts is None:
        texts = df["text"].to_list()
    else:
        texts = list(texts)
    counts = _pattern_counts(df, texts)
    n_words, n_lines = pl.col("n_words").cast(pl.Float64), pl.col("_lines")
    stats = counts.select(
        n_words,
        pl.when(pl.col("_word_cores") > 0)
        .then((pl.col("_nonspace") - pl.col("_non_core_chars")) / pl.col("_word_cores"))
        .otherwise(0.0)
        .alias("mean_word_length"),
        pl.when(n_words > 0).then(pl.col("_symbols") / n_words).otherwise(0.0).alias("symbol_word_ratio"),
        pl.when(n_words > 0)
        .then(1.0 - pl.col("_alpha_words") / n_words)
        .otherwise(1.0)
        .alias("non_alpha_word_fraction"),
        pl.when(n_lines > 0).then(pl.col("_bullet_lines") / n_lines).otherwise(0.0).alias("bullet_line_fraction"),
        pl.when(n_lines > 0)
        .then(pl.col("_ellipsis_lines") / n_lines)
        .otherwise(0.0)
        .alias("ellipsis_line_fraction"),
        pl.col("n_stop_words").cast(pl.Float64),
    )
    if texts is not None and (textstats := kernel("_textstats")) is not None:
        fractions = _compiled_duplicate_fractions(texts, textstats)
    else:
        fractions = {unit: _duplicate_fractions(df, unit) for unit in ("line", "paragraph")}
    return stats.with_columns(
        pl.Series(f"duplicate_{unit}_fraction", values, dtype=pl.Float64) for unit, values in fractions.items())


def default_identifier(cfg: FilterConfig) -> LanguageIdentifier:
    """The identifier ``cfg`` names where no model is handed in: langid, or the pinned lid.176."""
    return identify_language if cfg.language_identifier == "langid" else fasttext_identifier(LID176.read())


def _rule_failures(stats: pl.DataFrame, cfg: FilterConfig) -> pl.DataFrame:
    """Boolean column per enabled Gopher rule: True where the document fails."""
    return stats.select(rule.fails(pl.col(rule.statistic), threshold).alias(rule.name)
                        for rule in _GOPHER_RULES.values() if (threshold := getattr(cfg, rule.key)) is not None)


@dataclass
class _FamilyResult:
    failures: pl.DataFrame  # a boolean column per rule name (with the family's error reason), per document
    errors: list[str | None]  # per document: why its statistics raised, or None
    c4_texts: pl.Series | None = None  # what c4 keeps of each document
    line_removals: dict[str, int] = field(default_factory=dict)


def _family_statistics(family: str, texts: pl.Series, on: Mapping[str, float]):
    if family == C4:
        return c4_statistics(texts, on)
    if family == FINEWEB:
        return fineweb_statistics(texts), None, {}
    assert family == GOPHER_REPETITION, family
    return gopher_repetition_statistics(texts), None, {}


def _family_failures(family: str, rules: list[tuple[Rule, float]], texts: pl.Series) -> _FamilyResult:
    """The family's failures for every document. Its statistics are computed for all documents at
    once; if that raises, for each document alone, and a document that raises then fails the
    family's error reason alone (its other rules do not fail)."""
    on = {rule.key: threshold for rule, threshold in rules}
    errors: list[str | None] = [None] * len(texts)
    try:
        stats, c4_texts, removals = _family_statistics(family, texts, on)
    except Exception:  # noqa: BLE001 - narrowed to the documents that raise just below
        parts, c4_parts, removals = [], [], {}
        for i in range(len(texts)):
            try:
                part, c4_text, removed = _family_statistics(family, texts.slice(i, 1), on)
            except Exception as exc:  # noqa: BLE001 - this document alone is dropped with the reason
                errors[i] = f"{type(exc).__name__}: {exc}"
                part, c4_text, removed = None, None, {}
            parts.append(part)
            c4_parts.append(None if c4_text is None else c4_text[0])
            for name, n in removed.items():
                removals[name] = removals.get(name, 0) + n
        schema = next((p.schema for p in parts if p is not None), None)
        stats = pl.concat([p if p is not None else pl.DataFrame([pl.Series(c, [None], t) for c, t in schema.items()])
                           for p in parts]) if schema is not None else None
        c4_texts = pl.Series("text", c4_parts, pl.String) if family == C4 else None
    failed = pl.Series(error_reason(family), [e is not None for e in errors], pl.Boolean)
    documents = [(rule, threshold) for rule, threshold in rules if rule.unit == "document"]
    if stats is None:  # every document raised
        columns = [failed, *(pl.Series(rule.name, [False] * len(texts)) for rule, _ in documents)]
    else:
        columns = [failed, *stats.select(rule.fails(pl.col(rule.statistic), threshold).fill_null(False).alias(rule.name)
                                         for rule, threshold in documents).get_columns()]
    return _FamilyResult(pl.DataFrame(columns), errors, c4_texts, removals)


def apply_filters(df: pl.DataFrame, cfg: FilterConfig, identify: LanguageIdentifier | None = None,
                  blocked: pl.Series | None = None) -> FilterResult:
    """Split ``df`` (needs a ``text`` column) into kept and dropped documents.

    When language filtering is on, every document gets ``lang``/``lang_score``
    and the language rule comes first: the stop-word rule is English-specific,
    so a French page should be reported as "wrong language", not "too few
    stop words". Sources that keep several languages should switch
    ``min_stop_words`` off. ``identify`` replaces the identifier ``cfg`` names (e.g. by an adopted
    fastText model). ``blocked`` (per row: the document's URL is on the source's block list) adds
    the rule ``url_blocked``, before all others: a blocked site is dropped whatever its text.

    The selected families' rules come last. With any family selected the dropped documents have an
    ``error`` column: why a family's statistics raised on the document (its reason is then
    ``<family>.error``), else null. With ``c4`` selected a kept document's text is what c4 keeps
    of it (its lines that pass c4's line rules); the dropped ones keep their text as read.
    """
    rules = enabled_rules(cfg)
    if blocked is not None:
        rules = [URL_BLOCKED, *rules]
    counts = {rule: 0 for rule in rules}
    texts = df["text"].to_list() if df["text"].null_count() == 0 else None
    if cfg.languages:
        df = add_language_columns(df, cfg.language_sample_chars, identify or default_identifier(cfg), texts)
    extra = ["error"] if cfg.families else []
    if df.height == 0 or not rules:
        dropped = df.clear().with_columns(
            pl.lit(None, pl.String).alias("reason"), pl.lit(None, pl.List(pl.String)).alias("failed_rules"),
            *(pl.lit(None, pl.String).alias(name) for name in extra))
        return FilterResult(df, dropped, counts, texts)

    columns: list[pl.Series] = []
    if blocked is not None:
        columns.append(blocked.alias(URL_BLOCKED))
    if cfg.languages:
        wrong_language = ~df["lang"].is_in(list(cfg.languages)) | (df["lang_score"] < cfg.min_language_score)
        columns.append(wrong_language.alias("language"))
    if any(r in _GOPHER_RULES for r in rules):
        columns.extend(_rule_failures(text_stats(df, texts), cfg).get_columns())
    errors: list[str | None] = [None] * df.height
    c4_texts, line_removals = None, {}
    family_texts = df["text"].fill_null("")
    for family in cfg.families:
        result = _family_failures(family, [(r, t) for r, t in thresholds(cfg.families) if r.family == family],
                                  family_texts)
        columns.extend(result.failures.get_columns())
        errors = [e if e is not None else f for e, f in zip(errors, result.errors)]
        c4_texts = result.c4_texts if family == C4 else c4_texts
        line_removals |= result.line_removals
    failures = pl.DataFrame(columns)
    if extra:
        df = df.with_columns(pl.Series("error", errors, pl.String))
    marked = df.with_columns(
        failures.select(
            pl.concat_list(
                [pl.when(pl.col(r)).then(pl.lit(r)).otherwise(pl.lit(None, pl.String)) for r in rules]
            )
            .list.drop_nulls()
            .alias("failed_rules")
        )["failed_rules"]
    ).with_columns(pl.col("failed_rules").list.first().alias("reason"))

    keep = marked["reason"].is_null()
    dropped = marked.filter(~keep)
    kept = marked.filter(keep).drop("failed_rules", "reason", *extra)
    for reason, n in dropped.group_by("reason").len().iter_rows():
        counts[reason] = n
    if c4_texts is not None:
        kept = kept.with_columns(c4_texts.filter(keep).alias("text"))
        kept_texts = kept["text"].to_list()
    else:
        kept_texts = None if texts is None else list(itertools.compress(texts, keep.to_list()))
    return FilterResult(kept, dropped.select([*kept.columns, "reason", "failed_rules", *extra]), counts, kept_texts,
                        line_removals)
