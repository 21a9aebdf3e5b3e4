"""The rule table and the optional filter families (c4, fineweb, gopher_repetition): each rule on
hand-made documents that just pass and just fail its default threshold, the YAML that picks them,
and the identity of sources that pick none."""

from __future__ import annotations

import dataclasses
import itertools
from fractions import Fraction

import polars as pl
import pytest

from marin_assets.curation import filters
from marin_assets.curation.config import SourceConfigError, load_curation_config, parse_curation_config
from marin_assets.curation.filters import RULE_ORDER, FilterConfig, apply_filters, enabled_rules
from marin_assets.curation.rules import RULES, Rule, c4_statistics

from .conftest import NORMAL_TEXT, build_filtered_shard
from .test_pii import _filtered_identity

RULE = {r.name: r for r in RULES}


def _only(family: str, **thresholds: float | None) -> FilterConfig:
    """Only ``family``'s rules (no language id, no Gopher rule)."""
    return FilterConfig(languages=(), **{rule: None for rule in RULE_ORDER if rule != "language"},
                        families={family: thresholds})


def _failed(texts: list[str], cfg: FilterConfig) -> list[list[str]]:
    """Per text, the rules it failed."""
    result = apply_filters(pl.DataFrame({"id": [str(i) for i in range(len(texts))], "text": texts}), cfg)
    failed = dict(zip(result.dropped["id"].to_list(), result.dropped["failed_rules"].to_list()))
    return [failed.get(str(i), []) for i in range(len(texts))]


def _passes_then_fails(rule: str, passing: str, failing: str) -> None:
    ok, bad = _failed([passing, failing], _only(RULE[rule].family))
    assert rule not in ok and rule in bad, (ok, bad)


def test_the_table_is_the_gopher_config_and_names_are_unique():
    assert len({r.name for r in RULES}) == len(RULES)
    gopher = [r for r in RULES if r.family == "gopher"]
    assert RULE_ORDER == ("language", *(r.key for r in gopher))
    defaults = FilterConfig()
    assert all(getattr(defaults, r.key) == r.default for r in gopher)
    assert {r.family for r in RULES} == {"gopher", "c4", "fineweb", "gopher_repetition"}


# ------------------------------------------------------------------ c4


def _c4_removed(text: str) -> dict[str, int]:
    on = {r.key: r.default for r in RULES if r.family == "c4"}
    stats, _, _ = c4_statistics(pl.Series([text]), on)
    return {name.removeprefix("lines_removed/"): stats[name][0] for name in stats.columns
            if name.startswith("lines_removed/")}


@pytest.mark.parametrize(("rule", "kept_line", "removed_line"), [
    ("c4.max_line_word_length", "A word of " + "x" * 1000 + " ends.", "A word of " + "x" * 1001 + " ends."),
    ("c4.min_line_terminal_punctuation", "The line ends here.", "The line ends here"),
    ("c4.min_line_terminal_punctuation", 'She said "it ends."', "The line trails off..."),
    ("c4.min_line_words", "Three words here.", "Two words."),
    ("c4.max_line_javascript", "Please enable Java to continue.", "Please enable JavaScript to continue."),
    ("c4.max_line_policy_phrases", "Read our privacy notes first.", "Read our Privacy Policy first."),
])
def test_each_c4_line_rule_removes_the_line_that_just_fails_it(rule, kept_line, removed_line):
    assert all(n == 0 for n in _c4_removed(kept_line).values())
    assert _c4_removed(removed_line) == {name: int(name == rule) for name in _c4_removed(kept_line)}


def test_c4_keeps_the_lines_that_pass_and_drops_citations():
    text = "Menu\nThe first sentence is here. The second one[1] too.\nThird line is fine!\nCookies: we use cookies ok."
    result = apply_filters(pl.DataFrame({"id": ["0"], "text": [text]}), _only("c4", min_sentences=3))
    assert result.kept["text"].to_list() == ["The first sentence is here. The second one too.\nThird line is fine!"]
    assert result.kept_texts == result.kept["text"].to_list()
    assert result.line_removals == {"c4.max_line_word_length": 0, "c4.min_line_terminal_punctuation": 1,
                                    "c4.min_line_words": 0, "c4.max_line_javascript": 0,
                                    "c4.max_line_policy_phrases": 1}


def test_c4_splits_lines_where_python_does():
    text = "Page one ends here.\x0cPage two ends here\r\nLine three ends here.\rLine four ends here."
    result = apply_filters(pl.DataFrame({"id": ["0"], "text": [text]}), _only("c4", min_sentences=None))
    assert result.kept["text"][0] == "Page one ends here.\nLine three ends here.\nLine four ends here."
    assert result.line_removals["c4.min_line_terminal_punctuation"] == 1


def test_c4_sentences_just_pass_and_just_fail():
    five = "One sentence is here. Two sentences are here.\nThree are here! Four? Five is the end."
    assert _failed([five], _only("c4")) == [[]]
    four = five.replace(" Four?", "")
    assert _failed([four], _only("c4")) == [["c4.min_sentences"]]


def test_c4_lorem_ipsum_and_curly_brackets_only_in_lines_that_survive_the_earlier_rules():
    body = "One sentence is here. Two sentences are here.\nThree are here! Four? Five is the end.\n"
    assert _failed([body + "Lorem ipsum dolor sit amet."], _only("c4")) == [["c4.max_lorem_ipsum_lines"]]
    assert _failed([body + "Lorem ipsum dolor sit amet"], _only("c4")) == [[]]  # no terminal punctuation
    assert _failed([body + "Use the {name} field here."], _only("c4")) == [["c4.max_curly_bracket_lines"]]
    assert _failed([body + "Turn on javascript {now} please."], _only("c4")) == [[]]  # removed as javascript


# ------------------------------------------------------------------ fineweb


def _lines(n_punct: int, n_plain: int, width: int = 40) -> list[str]:
    """Distinct lines of ``width`` characters, the first ``n_punct`` ending in a full stop."""
    return [f"line {i:04d} ".ljust(width - 1, "w") + ("." if i < n_punct else "w") for i in range(n_punct + n_plain)]


def test_fineweb_line_punctuation_ratio():
    # 3 of 25 lines is 0.12: kept (not below); 2 of 25 is 0.08.
    _passes_then_fails("fineweb.min_line_punct_ratio", "\n".join(_lines(3, 22)), "\n".join(_lines(2, 23)))


def test_fineweb_short_line_ratio():
    long = _lines(0, 100)
    short = [f"s{i:03d}" for i in range(100)]
    _passes_then_fails("fineweb.max_short_line_ratio", "\n".join(short[:67] + long[67:]),
                       "\n".join(short[:68] + long[68:]))


def test_fineweb_char_duplicate_ratio():
    repeated = "abcdefghij"  # 10 characters, twice: 10 repeated of 1000 is 0.01, kept; of 990, dropped
    unique = "".join(f"{i:04d}" for i in range(245))  # 980 characters, as one line
    assert len(unique) == 980
    _passes_then_fails("fineweb.max_char_duplicate_ratio", "\n".join([unique, repeated, repeated]),
                       "\n".join([unique[:970], repeated, repeated]))


def test_fineweb_newline_ratio():
    # 3 newlines over 10 words is 0.3 (kept); over 9 words it is above.
    _passes_then_fails("fineweb.max_newline_ratio", "a b c d\ne f g\nh i\nj.", "a b c d\ne f g\nh\ni.")


# ------------------------------------------------------------------ gopher repetition

_FILLER = ["".join(t) for t in itertools.product("pqrstuvxyz", repeat=3)]  # distinct 3-letter words


def _repetition_doc(unit: list[str], copies: int, n_words: int) -> str:
    """``copies`` of ``unit`` separated by distinct words, padded with distinct words to
    ``n_words`` words of 3 letters."""
    filler = iter(_FILLER)
    words = []
    for _ in range(copies):
        words += [*unit, next(filler)]
    words += [next(filler) for _ in range(n_words - len(words))]
    return " ".join(words)


def _smallest_passing(repeated_chars: int, threshold: float) -> int:
    """The fewest 3-letter words (text of 4 * words - 1 characters) at which the fraction is not above."""
    words = 1
    while Fraction(repeated_chars, 4 * words - 1) > Fraction(threshold).limit_denominator(1000):
        words += 1
    return words


@pytest.mark.parametrize("n", [2, 3, 4])
def test_top_ngram_fraction(n):
    rule = f"gopher_repetition.max_top_{n}gram_fraction"
    unit = ["aaa", "bbb", "ccc", "ddd"][:n]
    copies = 10
    words = _smallest_passing(copies * (4 * n - 1), RULE[rule].default)  # the n-gram with its spaces
    _passes_then_fails(rule, _repetition_doc(unit, copies, words), _repetition_doc(unit, copies, words - 1))


@pytest.mark.parametrize("n", [5, 6, 7, 8, 9, 10])
def test_duplicate_ngram_fraction(n):
    rule = f"gopher_repetition.max_duplicate_{n}gram_fraction"
    unit = [f"{c}{c}{c}" for c in "abcdefghij"[:n]]
    copies = 3  # two repeats of n words, their letters only
    words = _smallest_passing((copies - 1) * 3 * n, RULE[rule].default)
    _passes_then_fails(rule, _repetition_doc(unit, copies, words), _repetition_doc(unit, copies, words - 1))


def test_overlapping_repeats_count_each_character_once():
    text = " ".join(["abc"] * 12)  # 47 characters; every 5-gram after the first repeats: words 1..11
    stats = filters.gopher_repetition_statistics(pl.Series([text]))
    assert stats["duplicate_5gram_fraction"][0] == pytest.approx(11 * 3 / 47)
    assert stats["top_2gram_fraction"][0] == pytest.approx(11 * 7 / 47)


# ------------------------------------------------------------------ faults, YAML, identity


def test_a_document_on_which_a_family_raises_is_dropped_alone(monkeypatch):
    real = filters.fineweb_statistics

    def fragile(texts: pl.Series) -> pl.DataFrame:
        if texts.str.contains("BOOM").any():
            raise ValueError("cannot read this one")
        return real(texts)

    monkeypatch.setattr(filters, "fineweb_statistics", fragile)
    texts = [NORMAL_TEXT, "BOOM " + NORMAL_TEXT, "short\nlines\nonly"]
    result = apply_filters(pl.DataFrame({"id": ["0", "1", "2"], "text": texts}), _only("fineweb"))
    assert result.kept["id"].to_list() == ["0"]
    rows = {row["id"]: row for row in result.dropped.iter_rows(named=True)}
    assert rows["1"]["reason"] == "fineweb.error" and rows["1"]["failed_rules"] == ["fineweb.error"]
    assert rows["1"]["error"] == "ValueError: cannot read this one"
    assert rows["2"]["reason"] == "fineweb.min_line_punct_ratio" and rows["2"]["error"] is None
    assert result.per_rule_drop_counts["fineweb.error"] == 1


def test_yaml_picks_families_and_overrides_thresholds(tmp_path):
    config = parse_curation_config({
        "filters": {"families": {"c4": None}},
        "sources": [{"name": "a", "uri": "a/*"},
                    {"name": "b", "uri": "b/*", "filters": {"families": {
                        "fineweb": {"max_short_line_ratio": 0.5},
                        "gopher_repetition": {"max_top_2gram_fraction": None}}}}],
    }, tmp_path)
    a, b = (config.source(name).filters for name in ("a", "b"))
    assert a.families == {"c4": {}} and "c4.min_sentences" in enabled_rules(a)
    assert b.families == {"fineweb": {"max_short_line_ratio": 0.5}, "gopher_repetition": {"max_top_2gram_fraction":
                                                                                              None}}
    assert "gopher_repetition.max_top_2gram_fraction" not in enabled_rules(b)
    assert "gopher_repetition.max_top_3gram_fraction" in enabled_rules(b) and "c4.min_sentences" not in enabled_rules(b)
    short = "\n".join(["short line."] * 6 + ["a much longer line that is not short at all."] * 4)
    assert "fineweb.max_short_line_ratio" in _failed([short], b)[0]  # 0.6 > 0.5, though not > 0.67
    assert "fineweb.max_short_line_ratio" not in _failed([short], _only("fineweb"))[0]


@pytest.mark.parametrize(("families", "message"), [
    ({"c5": {}}, "source 'a'.filters: families: unknown family 'c5' (known: c4, fineweb, gopher_repetition)"),
    ({"c4": {"min_sentence": 3}}, "source 'a'.filters: families.c4: unknown rule 'min_sentence' (known: "),
    ({"c4": {"min_sentences": "five"}}, "source 'a'.filters.families.c4.min_sentences: expected a number"),
    (["c4"], "source 'a'.filters.families: expected a mapping"),
])
def test_a_bad_family_or_rule_is_refused_in_one_line(tmp_path, families, message):
    path = tmp_path / "sources.yaml"
    path.write_text(f"sources:\n  - name: a\n    uri: a/*\n    filters: {{families: {families!r}}}\n")
    with pytest.raises(SourceConfigError) as refused:
        load_curation_config(path)
    assert str(refused.value).startswith(f"{path.resolve()}: {message}") and "\n" not in str(refused.value)


def test_identity_is_unchanged_for_sources_without_families(tmp_path):
    plain = _filtered_identity(tmp_path, format="jsonl")
    # What filtered/'s identity held before families existed, field for field.
    assert plain["filters"] == {
        "min_words": 50, "max_words": 100_000, "min_mean_word_length": 3.0, "max_mean_word_length": 10.0,
        "max_symbol_word_ratio": 0.1, "max_non_alpha_word_fraction": 0.2, "max_bullet_line_fraction": 0.9,
        "max_ellipsis_line_fraction": 0.3, "max_duplicate_line_fraction": 0.2,
        "max_duplicate_paragraph_fraction": 0.2, "min_stop_words": 2, "languages": ["en"],
        "language_identifier": "fasttext", "min_language_score": 0.5, "language_sample_chars": 5000}
    picked = _filtered_identity(tmp_path, format="jsonl", filters={"families": {"c4": {}}})
    assert picked["filters"] == {**plain["filters"], "families": {"c4": {}}}
    assert _filtered_identity(tmp_path, format="jsonl", filters={"families": {"c4": {"min_sentences": 3}}}) != picked
    assert dataclasses.asdict(FilterConfig())["families"] == {}


def test_rule_comparisons():
    rule = Rule("x", "c4", "s", "min", 1)
    frame = pl.DataFrame({"s": [0.0, 1.0, 2.0]})
    assert frame.select(rule.fails(pl.col("s"), 1))["s"].to_list() == [True, False, False]
    assert frame.select(dataclasses.replace(rule, comparison="max").fails(pl.col("s"), 1))["s"].to_list() == [
        False, False, True]


def _reference_repetition(text: str) -> dict[str, float]:
    """The repetition statistics of one text, the slow and obvious way."""
    words = text.split()
    stats = {}
    for n in (2, 3, 4):
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        counts: dict[tuple, int] = {}
        for gram in grams:  # insertion order: the earliest of equal counts wins
            counts[gram] = counts.get(gram, 0) + 1
        top = max(counts.items(), key=lambda item: item[1], default=None)
        stats[f"top_{n}gram_fraction"] = 0.0 if top is None else len(" ".join(top[0])) * top[1] / len(text)
    for n in range(5, 11):
        seen, covered = set(), [False] * len(words)
        for i in range(len(words) - n + 1):
            gram = tuple(words[i:i + n])
            if gram in seen:
                covered[i:i + n] = [True] * n
            seen.add(gram)
        stats[f"duplicate_{n}gram_fraction"] = sum(len(w) for w, c in zip(words, covered) if c) / len(text)
    return stats


def test_repetition_statistics_equal_the_obvious_computation_on_real_text():
    from pydoc_data.topics import topics

    texts = [topics[name] for name in sorted(topics)][:150]
    texts += [" ".join(t.split()[:40]) * 3 for t in texts[:30]]  # repeated passages, some overlapping
    texts += ["one", "a b", "x " * 30, "\n"]
    stats = filters.gopher_repetition_statistics(pl.Series(texts))
    for i, text in enumerate(texts):
        assert stats.row(i, named=True) == pytest.approx(_reference_repetition(text)), i


def test_a_shard_in_chunks_keeps_c4_text_and_sums_its_line_removals():
    from marin_assets.curation.filter_shard import FilterTask, filter_chunk, merge_chunks
    from marin_assets.curation.minhash import MinHashConfig

    body = "One sentence is here. Two sentences are here.\nThree are here! Four? Five is the end.\n"
    texts = [body + "Menu", "Home\n" + body, body + "Short one."]
    docs = pl.DataFrame({"id": ["0", "1", "2"], "text": texts})
    task = FilterTask(_only("c4"), MinHashConfig())
    whole = merge_chunks([filter_chunk(docs, task)], task)
    chunked = merge_chunks([filter_chunk(docs.slice(i, 1), task) for i in range(3)], task)
    assert whole.kept["text"].to_list() == [body.strip()] * 3 == chunked.kept["text"].to_list()
    assert whole.line_removals == chunked.line_removals
    # "Menu", "Home" and the empty line after the body of the second (an empty line has no punctuation).
    removed = whole.line_removals
    assert removed["c4.min_line_terminal_punctuation"] == 3 and removed["c4.min_line_words"] == 1
    assert (whole.signatures.hashvalues == chunked.signatures.hashvalues).all()


@pytest.mark.slow  # materializes raw, documents and filtered of a text source in this process
def test_a_source_with_families_builds_filtered_with_their_reasons_metrics_and_text(tmp_path):
    import json

    from marin_assets.curation.assets import build_curation_stage
    from marin_assets.deployment import Deployment
    from marin_assets.stages import build_stage
    from marin_resources.environments import MarinSettings

    body = "One sentence is here. Two sentences are here.\nThree are here! Four? Five is the end."
    (tmp_path / "texts").mkdir()
    for name, text in {"plain": body + "\nMenu", "lorem": body + "\nLorem ipsum dolor sit amet.",
                       "prose": NORMAL_TEXT}.items():
        (tmp_path / "texts" / f"{name}.txt").write_text(text)
    sources = tmp_path / "sources.yaml"
    sources.write_text("sources:\n  - name: notes\n    uri: texts/*.txt\n    format: text\n"
                       "    filters: {languages: [], min_words: 5, min_stop_words: null, families: {c4: {}}}\n")
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SOURCES": str(sources)})
    _, catalog = build_stage(build_curation_stage, settings, Deployment.load(settings))
    assert catalog.specs["filtered/notes"].identity(None)["filters"]["families"] == {"c4": {}}
    manifest_path = build_filtered_shard(settings, "notes")
    metrics = json.loads(manifest_path.read_text())["metrics"]
    assert metrics["dropped/c4.max_lorem_ipsum_lines"] == 1 and metrics["dropped/c4.min_sentences"] == 1  # prose
    assert metrics["lines_removed/c4.min_line_terminal_punctuation"] >= 1
    assert pl.read_parquet(manifest_path.parent / "documents.parquet")["text"].to_list() == [body]
    dropped = pl.read_parquet(manifest_path.parent / "dropped.parquet")
    assert sorted(dropped["reason"].to_list()) == ["c4.max_lorem_ipsum_lines", "c4.min_sentences"]
    assert dropped["error"].null_count() == 2


def test_the_quality_classifiers_identity_is_unchanged_for_training_sources_without_families():
    """The classifier's identity names its training sources' filters: a source without families must
    give the identity it gave before families existed, or every classifier (and everything it scores)
    rebuilds on upgrade."""
    from marin_assets.curation.config import SourceConfig
    from marin_assets.curation.quality import CLASSIFIER
    from marin_resources.config_identity import config_identity

    plain = config_identity(SourceConfig(name="a", uri="file:///tmp/a", format="jsonl"), CLASSIFIER)
    assert "families" not in plain["filters"]
    picked = config_identity(SourceConfig(name="a", uri="file:///tmp/a", format="jsonl",
                                          filters=FilterConfig(families={"c4": {}})), CLASSIFIER)
    assert picked["filters"]["families"] == {"c4": {}}
