"""The filter rules, declared once: every rule of every family as one row of :data:`RULES`, and the
statistics of the families a source opts in to.

A rule is a name, the family it belongs to, the statistic it reads (a column of the statistics
frame), a comparison and a default threshold. ``min``: a document (or line) whose statistic is
below the threshold fails; ``max``: one above it fails. A threshold of ``None`` switches the rule
off.

The ``gopher`` family is on for every source: its thresholds are the flat fields of
``FilterConfig`` (``min_words: 50``...), its drop reasons the bare rule names. The other families
are off unless a source's ``filters.families`` picks them, optionally with thresholds of its own::

    filters:
      families:
        c4: {}                                   # every rule at its default
        fineweb: {max_short_line_ratio: 0.5}
        gopher_repetition: {max_top_2gram_fraction: null}   # this rule off

Their drop reasons are ``<family>.<rule>`` (``c4.min_sentences``). The statistics are computed
here for a whole frame of documents at once (polars over the exploded lines or words, numpy over
the n-gram hashes), from the text as read; they are our own implementations of the published
rules (C4: Raffel et al. 2020, FineWeb: Penedo et al. 2024, Gopher: Rae et al. 2021, Table A1),
with words split at whitespace. ``c4`` also rewrites what it keeps: its ``line`` rules remove
lines rather than documents, as C4 did, and a kept document's text is its remaining lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import polars as pl

GOPHER, C4, FINEWEB, GOPHER_REPETITION = "gopher", "c4", "fineweb", "gopher_repetition"
Comparison = Literal["min", "max"]


@dataclass(frozen=True)
class Rule:
    key: str  # its threshold's name in YAML (a FilterConfig field for the gopher family)
    family: str
    statistic: str  # the statistics column it compares
    comparison: Comparison
    default: float | None
    # ``line``: the statistic is per line and a failing line is removed from the document (c4).
    unit: Literal["document", "line"] = "document"

    @property
    def name(self) -> str:
        """The drop reason and the name in ``failed_rules``."""
        return self.key if self.family == GOPHER else f"{self.family}.{self.key}"

    def fails(self, statistic: pl.Expr, threshold: float) -> pl.Expr:
        return statistic < threshold if self.comparison == "min" else statistic > threshold


TOP_NGRAMS = (2, 3, 4)
DUPLICATE_NGRAMS = (5, 6, 7, 8, 9, 10)

RULES: tuple[Rule, ...] = (
    # Gopher quality (Rae et al. 2021), plus character-weighted duplicate lines and paragraphs.
    Rule("min_words", GOPHER, "n_words", "min", 50),
    Rule("max_words", GOPHER, "n_words", "max", 100_000),
    Rule("min_mean_word_length", GOPHER, "mean_word_length", "min", 3.0),
    Rule("max_mean_word_length", GOPHER, "mean_word_length", "max", 10.0),
    Rule("max_symbol_word_ratio", GOPHER, "symbol_word_ratio", "max", 0.1),
    Rule("max_non_alpha_word_fraction", GOPHER, "non_alpha_word_fraction", "max", 0.2),
    Rule("max_bullet_line_fraction", GOPHER, "bullet_line_fraction", "max", 0.9),
    Rule("max_ellipsis_line_fraction", GOPHER, "ellipsis_line_fraction", "max", 0.3),
    Rule("max_duplicate_line_fraction", GOPHER, "duplicate_line_fraction", "max", 0.2),
    Rule("max_duplicate_paragraph_fraction", GOPHER, "duplicate_paragraph_fraction", "max", 0.2),
    Rule("min_stop_words", GOPHER, "n_stop_words", "min", 2),
    # C4 (Raffel et al. 2020, and the TFDS clean-up it was built with). Lines first, in this order:
    # a line is removed by the first line rule it fails.
    Rule("max_line_word_length", C4, "line_longest_word", "max", 1000, "line"),
    Rule("min_line_terminal_punctuation", C4, "line_terminal_punctuation", "min", 1, "line"),
    Rule("min_line_words", C4, "line_words", "min", 3, "line"),
    Rule("max_line_javascript", C4, "line_javascript", "max", 0, "line"),
    Rule("max_line_policy_phrases", C4, "line_policy_phrases", "max", 0, "line"),
    Rule("max_lorem_ipsum_lines", C4, "c4_lorem_ipsum_lines", "max", 0),
    Rule("max_curly_bracket_lines", C4, "c4_curly_bracket_lines", "max", 0),
    Rule("min_sentences", C4, "c4_sentences", "min", 5),
    # FineWeb (Penedo et al. 2024), over the non-empty lines.
    Rule("min_line_punct_ratio", FINEWEB, "fineweb_line_punct_ratio", "min", 0.12),
    Rule("max_short_line_ratio", FINEWEB, "fineweb_short_line_ratio", "max", 0.67),
    Rule("max_char_duplicate_ratio", FINEWEB, "fineweb_char_duplicate_ratio", "max", 0.01),
    Rule("max_newline_ratio", FINEWEB, "fineweb_newline_ratio", "max", 0.3),
    # Gopher repetition (Rae et al. 2021, Table A1): characters in the most frequent n-gram, and in
    # the repeated occurrences of every n-gram.
    *(Rule(f"max_top_{n}gram_fraction", GOPHER_REPETITION, f"top_{n}gram_fraction", "max", d)
      for n, d in zip(TOP_NGRAMS, (0.2, 0.18, 0.16))),
    *(Rule(f"max_duplicate_{n}gram_fraction", GOPHER_REPETITION, f"duplicate_{n}gram_fraction", "max", d)
      for n, d in zip(DUPLICATE_NGRAMS, (0.15, 0.14, 0.13, 0.12, 0.11, 0.10))),
)
FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(r.family for r in RULES))
OPTIONAL_FAMILIES: tuple[str, ...] = tuple(f for f in FAMILIES if f != GOPHER)
GOPHER_DEFAULTS: dict[str, float | None] = {r.key: r.default for r in RULES if r.family == GOPHER}

# C4's terminal punctuation (a line ending in "..." has none), its citation marks, its policy phrases.
C4_LINE_END_PATTERN = r"[.?!\"']$"
# c4 splits lines where Python's str.splitlines does (as C4's code did): a form feed ends a line too.
C4_LINE_BREAK_PATTERN = "\r\n|[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]"
C4_CITATION_PATTERN = r"\[\d*]|\[edit]|\[citation needed]"
C4_POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
                     "use cookies")
# A sentence ends at a run of sentence terminals (and closing quotes or brackets) before a space or
# the line's end; a line's text after its last such end is one more sentence.
SENTENCE_END_PATTERN = r"\p{Sentence_Terminal}+[\"'”’)\]]*(?:\s|$)"
FINEWEB_LINE_END_PATTERN = r"\p{Sentence_Terminal}$"
FINEWEB_SHORT_LINE_CHARS = 30


class FamilyConfigError(ValueError):
    """A ``families`` mapping names a family or rule that does not exist."""


def family_rules(family: str) -> tuple[Rule, ...]:
    return tuple(r for r in RULES if r.family == family)


def normalize_families(families: Mapping[str, Mapping[str, float | None] | None]) -> dict[str, dict[str, float | None]]:
    """``families`` checked (FamilyConfigError naming the unknown family or rule) and in the table's
    order, ``None`` (no thresholds given) as ``{}``."""
    unknown = [f for f in families if f not in OPTIONAL_FAMILIES]
    if unknown:
        raise FamilyConfigError(f"families: unknown family {unknown[0]!r} (known: {', '.join(OPTIONAL_FAMILIES)})")
    normalized = {}
    for family in OPTIONAL_FAMILIES:
        if family not in families:
            continue
        given = families[family] or {}
        keys = [r.key for r in family_rules(family)]
        wrong = [k for k in given if k not in keys]
        if wrong:
            raise FamilyConfigError(f"families.{family}: unknown rule {wrong[0]!r} (known: {', '.join(keys)})")
        normalized[family] = {k: given[k] for k in keys if k in given}
    return normalized


def thresholds(families: Mapping[str, Mapping[str, float | None]]) -> list[tuple[Rule, float]]:
    """(rule, threshold) of every rule that is on in the selected ``families``, in table order."""
    on = []
    for rule in RULES:
        if rule.family in families:
            threshold = families[rule.family].get(rule.key, rule.default)
            if threshold is not None:
                on.append((rule, threshold))
    return on


# ------------------------------------------------------------------ statistics


def _lines(texts: pl.Series, breaks: str | None = None) -> pl.LazyFrame:
    """One row per line (split at "\\n", and at the matches of ``breaks``) of each text: ``_doc``,
    ``_line`` (position in the text), ``line``."""
    text = pl.col("line") if breaks is None else pl.col("line").str.replace_all(breaks, "\n")
    return (pl.DataFrame({"line": texts}).lazy()
            .with_row_index("_doc")
            .with_columns(text.str.split("\n"))
            .explode("line")
            .with_columns(pl.int_range(pl.len()).over("_doc").alias("_line")))


def c4_statistics(texts: pl.Series, on: Mapping[str, float]) -> tuple[pl.DataFrame, pl.Series, dict[str, int]]:
    """The c4 document statistics (with ``lines_removed/<rule>``: the lines each line rule removed
    from the document), the text each document keeps, and the lines each line rule removed in all.

    Each line is stripped and its citation marks removed; it is removed by the first line rule
    (of those ``on``: key -> threshold) it fails. Lorem ipsum and curly brackets are looked for
    in the lines that pass the word-length, punctuation and word-count rules (the bracket after
    the javascript rule), as C4 did; sentences are counted in the lines that remain."""
    line_rules = [r for r in family_rules(C4) if r.unit == "line" and r.key in on]
    stripped = pl.col("line").str.strip_chars()
    cleaned = stripped.str.replace_all(C4_CITATION_PATTERN, "")
    lower = pl.col("cleaned").str.to_lowercase()
    longest_limit = on.get("max_line_word_length")
    lines = _lines(texts, C4_LINE_BREAK_PATTERN).with_columns(stripped.alias("stripped"), cleaned.alias("cleaned"))
    lines = lines.with_columns(
        (pl.col("cleaned").str.contains(C4_LINE_END_PATTERN) & ~pl.col("cleaned").str.ends_with("..."))
        .cast(pl.Int64).alias("line_terminal_punctuation"),
        pl.col("stripped").str.count_matches(r"\S+").alias("line_words"),
        lower.str.count_matches("javascript", literal=True).alias("line_javascript"),
        pl.sum_horizontal(lower.str.count_matches(p, literal=True) for p in C4_POLICY_PHRASES)
        .alias("line_policy_phrases"),
        lower.str.contains("lorem ipsum", literal=True).alias("_lorem"),
        pl.col("cleaned").str.contains("{", literal=True).alias("_curly"),
        (pl.col("stripped").str.len_chars() > (longest_limit if longest_limit is not None else np.inf))
        .alias("_long"),
    ).collect()
    # Only a line longer than the limit can hold a longer word: those few are split in Python.
    longest = np.zeros(lines.height, dtype=np.int64)
    for i in np.flatnonzero(lines["_long"].to_numpy()).tolist():
        longest[i] = max(map(len, lines["stripped"][i].split()))
    lines = lines.with_columns(pl.Series("line_longest_word", longest))
    removed_by = pl.lit(None, pl.String)
    passed = pl.lit(True)  # the line passed every rule before this one
    seen: dict[str, pl.Expr] = {}
    for rule in line_rules:
        failing = rule.fails(pl.col(rule.statistic), on[rule.key])
        removed_by = pl.when(passed & failing).then(pl.lit(rule.name)).otherwise(removed_by)
        passed = passed & ~failing
        seen[rule.key] = passed
    # Lorem ipsum is looked for in the lines that pass the first three rules (those of them that are on).
    after = [seen[k] for k in ("max_line_word_length", "min_line_terminal_punctuation", "min_line_words") if k in seen]
    before_lorem = after[-1] if after else pl.lit(True)
    before_curly = seen.get("max_line_javascript", before_lorem)
    lines = lines.with_columns(removed_by.alias("_removed_by"), (before_lorem & pl.col("_lorem")).alias("_lorem"),
                               (before_curly & pl.col("_curly")).alias("_curly"))
    kept = pl.col("_removed_by").is_null()
    sentences = (pl.col("cleaned").str.count_matches(SENTENCE_END_PATTERN)
                 + (~pl.col("cleaned").str.contains(SENTENCE_END_PATTERN + "$")
                    & pl.col("cleaned").str.contains(r"\S")).cast(pl.UInt32))
    per_doc = (lines.lazy().group_by("_doc").agg(
        pl.col("_lorem").sum().alias("c4_lorem_ipsum_lines"),
        pl.col("_curly").sum().alias("c4_curly_bracket_lines"),
        sentences.filter(kept).sum().alias("c4_sentences"),
        pl.col("cleaned").filter(kept).str.join("\n").str.strip_chars().alias("_text"),
        *((pl.col("_removed_by") == r.name).sum().alias(f"lines_removed/{r.name}") for r in line_rules),
    ).sort("_doc").collect())
    stats = per_doc.select(pl.col("c4_lorem_ipsum_lines", "c4_curly_bracket_lines", "c4_sentences").cast(pl.Float64),
                           pl.col("^lines_removed/.*$"))
    removed = {r.name: int(per_doc[f"lines_removed/{r.name}"].sum()) for r in line_rules}
    return stats, per_doc["_text"], removed


def fineweb_statistics(texts: pl.Series) -> pl.DataFrame:
    """FineWeb's ratios over each document's non-empty lines (a document without any has line
    punctuation ratio 0, so the first rule drops it)."""
    lines = (_lines(texts).filter(pl.col("line").str.strip_chars().str.len_bytes() > 0)
             .with_columns(pl.struct("_doc", "line").is_first_distinct().alias("_first")))
    per_doc = (lines.group_by("_doc").agg(
        pl.len().alias("_lines"),
        pl.col("line").str.contains(FINEWEB_LINE_END_PATTERN).sum().alias("_punct"),
        (pl.col("line").str.len_chars() <= FINEWEB_SHORT_LINE_CHARS).sum().alias("_short"),
        pl.col("line").str.len_chars().filter(~pl.col("_first")).sum().alias("_repeated"),
    ).collect())
    docs = pl.DataFrame({"text": texts}).with_row_index("_doc").join(per_doc, on="_doc", how="left")
    lines_n = pl.col("_lines").fill_null(0)
    chars = pl.col("text").str.len_chars() - pl.col("text").str.count_matches("\n", literal=True)
    words = pl.col("text").str.count_matches(r"\S+")
    return docs.select(
        pl.when(lines_n > 0).then(pl.col("_punct") / lines_n).otherwise(0.0).alias("fineweb_line_punct_ratio"),
        pl.when(lines_n > 0).then(pl.col("_short") / lines_n).otherwise(0.0).alias("fineweb_short_line_ratio"),
        pl.when(chars > 0).then(pl.col("_repeated").fill_null(0) / chars).otherwise(0.0)
        .alias("fineweb_char_duplicate_ratio"),
        (pl.col("text").str.count_matches("\n", literal=True) / pl.max_horizontal(words, 1))
        .alias("fineweb_newline_ratio"),
    ).cast(pl.Float64)


# Odd multipliers of the n-gram hashes: word hash i of an n-gram is multiplied by the i-th.
_NGRAM_MULTIPLIERS = np.random.default_rng(0x6E6772616D).integers(1, 2**63, size=max(DUPLICATE_NGRAMS),
                                                                  dtype=np.uint64) | np.uint64(1)


@dataclass
class _Groups:
    """Positions grouped by the n-gram starting there."""

    first: np.ndarray  # each group of two or more: its first position, ascending
    count: np.ndarray  # and its size
    repeats: np.ndarray  # every position but the first of its group
    shared: np.ndarray  # the positions of the groups of two or more, ascending


def _group(keys: np.ndarray, positions: np.ndarray) -> _Groups:
    order = np.argsort(keys)  # not stable: each group's first position is its minimum
    keys, positions = keys[order], positions[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if keys.size else np.zeros(0, dtype=np.int64)
    count = np.diff(starts, append=keys.size)
    first = np.minimum.reduceat(positions, starts) if keys.size else positions
    several = count > 1
    in_several = np.repeat(several, count)
    repeats = positions[positions != np.repeat(first, count)]
    by_first = np.argsort(first[several])
    return _Groups(first[several][by_first], count[several][by_first], repeats, np.sort(positions[in_several]))


def _top_ngram_chars(groups: _Groups, n: int, doc: np.ndarray, cum: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per document: characters of its most frequent n-gram (words and spaces) times its count,
    the earliest of equals; a document whose n-grams are all different counts its first one."""
    n_docs = ends.size - 1
    top = np.zeros(n_docs)
    starts = ends[:-1]
    fits = ends[1:] - starts >= n
    top[fits] = cum[starts[fits] + n] - cum[starts[fits]] + n - 1
    at, count = groups.first, groups.count
    if at.size:
        group_doc = doc[at]  # ascending with ``at``, so each document's groups are contiguous
        bounds = np.flatnonzero(np.r_[True, group_doc[1:] != group_doc[:-1]])
        is_most = count == np.repeat(np.maximum.reduceat(count, bounds), np.diff(bounds, append=at.size))
        best_docs, best = np.unique(group_doc[is_most], return_index=True)
        best_at = at[is_most][best]
        top[best_docs] = (cum[best_at + n] - cum[best_at] + n - 1) * count[is_most][best]
    return top


def gopher_repetition_statistics(texts: pl.Series) -> pl.DataFrame:
    """Per document and n: the characters of its most frequent n-gram times its occurrences (ties:
    the one seen first), and the characters of the words inside any occurrence of an n-gram seen
    before in the document (each character once), both over the document's characters.

    Words are the whitespace-separated ones; an n-gram's characters are its words' and the n - 1
    spaces between them (for the top n-gram) or its words' alone (for the duplicates, as DataTrove
    counts them). N-grams are grouped by a 64-bit hash of their words' hashes and their document's."""
    words = (pl.DataFrame({"w": texts}).lazy().with_row_index("_doc")
             .with_columns(pl.col("w").str.extract_all(r"\S+")).explode("w").drop_nulls("w")
             .select("_doc", pl.col("w").hash(seed=0).alias("h"), pl.col("w").str.len_chars().alias("n"))
             .collect())
    n_docs = len(texts)
    doc = words["_doc"].to_numpy().astype(np.int64)
    word_hash = words["h"].to_numpy()
    length = words["n"].to_numpy().astype(np.int64)
    total = texts.str.len_chars().to_numpy().astype(np.float64)
    cum = np.concatenate([[0], np.cumsum(length)])
    # Words left in their document from each position on (an n-gram starting there fits when >= n).
    ends = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(np.bincount(doc, minlength=n_docs), out=ends[1:])
    left = ends[doc + 1] - np.arange(doc.size) if doc.size else np.zeros(0, dtype=np.int64)
    doc_mix = doc.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    columns = {}
    ngram = word_hash.copy()
    # An n-gram can repeat only where its first n - 1 words do: each n groups only the positions
    # whose (n - 1)-gram occurs more than once, a few percent of the words in most text.
    candidates = np.flatnonzero(left >= 1)
    with np.errstate(over="ignore"):
        ngram *= _NGRAM_MULTIPLIERS[0]
        for n in range(2, max(DUPLICATE_NGRAMS) + 1):
            ngram = ngram[:-1] + word_hash[n - 1:] * _NGRAM_MULTIPLIERS[n - 1]
            candidates = candidates[left[candidates] >= n]
            groups = _group(ngram[candidates] ^ doc_mix[candidates], candidates)
            if n in TOP_NGRAMS:
                columns[f"top_{n}gram_fraction"] = _top_ngram_chars(groups, n, doc, cum, ends)
            if n in DUPLICATE_NGRAMS:
                cover = np.bincount(groups.repeats, minlength=doc.size + 1) - np.bincount(groups.repeats + n,
                                                                                          minlength=doc.size + 1)
                covered = np.cumsum(cover[:-1]) > 0
                columns[f"duplicate_{n}gram_fraction"] = np.bincount(doc[covered], weights=length[covered],
                                                                     minlength=n_docs)
            candidates = groups.shared
    fractions = {name: np.divide(chars, total, out=np.zeros(n_docs), where=total > 0)
                 for name, chars in columns.items()}
    return pl.DataFrame({name: fractions[name] for name in
                         [f"top_{n}gram_fraction" for n in TOP_NGRAMS]
                         + [f"duplicate_{n}gram_fraction" for n in DUPLICATE_NGRAMS]})
