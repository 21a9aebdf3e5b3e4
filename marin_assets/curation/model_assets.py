"""Model assets of the curation stage: the quality classifier, an adopted language-ID model, and the
corpus-wide keep threshold.

    pinned training sources --> quality_classifier --> filtered/<source> (scores, per shard) --> quality_threshold
    language_id.model_uri   --> language_model     --^

Thin wiring over ``quality.py``, ``fasttext_models.py`` and ``sketch.py``.
"""


import json
from typing import Any

import dagster as dg
import numpy as np

from marin_assets.catalog import Catalog
from marin_assets.curation.config import CurationConfig, SourceConfig
from marin_assets.curation.discovery import discover_shards
from marin_assets.curation.fasttext_models import FastTextClassifier, ModelFileError, fetch_model, sha256_hex
from marin_assets.curation.filter_report import shifts_table, threshold_shifts
from marin_assets.curation.quality import ADOPTED, CLASSIFIER, THRESHOLD, QualityConfig, train_quality_model
from marin_assets.curation.readers import read_shard
from marin_assets.curation.schemes.registry import scheme_of
from marin_assets.curation.sketch import QuantileSketch, keep_threshold
from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import (
    ArtifactHandle,
    Built,
    MarinStore,
    all_partitions_in,
    input_refused,
    materialize_artifact,
)
from marin_resources.config_identity import config_identity
from marin_resources.storage.store import ArtifactStore

CLASSIFIER_KEY = "quality_classifier"
CLASSIFIER_VERSION = "v2"
LANGUAGE_MODEL_KEY = "language_model"
LANGUAGE_MODEL_VERSION = "v1"
THRESHOLD_KEY = "quality_threshold"
THRESHOLD_VERSION = "v1"
MODEL_FILE = "model.bin"
SKETCH_FILE = "quality_sketch.json"


def classifier_identity(config: CurationConfig) -> dict[str, Any]:
    quality = config.quality
    assert quality is not None
    if quality.model_uri is not None:  # adopted: the bytes are the identity, wherever they are read from
        return renamed(config_identity(quality, ADOPTED), {"model_sha256": "adopted_sha256"})
    # A training source's PII removal and URL block list are not in it: the classifier reads its texts
    # straight from the pin, through neither.
    return {"training": config_identity(quality, CLASSIFIER),
            "positives": [config_identity(s, CLASSIFIER) for s in config.quality_positive_sources],
            "negatives": [config_identity(s, CLASSIFIER) for s in config.quality_negative_sources]}


def threshold_identity(config: CurationConfig) -> dict[str, Any]:
    """The keep threshold's identity: the quality config's fields of its scope, and the scored sources."""
    assert config.quality is not None
    return {**renamed(config_identity(config.quality, THRESHOLD), {"sketch_relative_accuracy": "relative_accuracy"}),
            "sources": list(config.quality_sources)}


def renamed(identity: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``identity`` with fields under the names their artifacts were first fingerprinted with."""
    return {names.get(k, k): v for k, v in identity.items()}


def pinned_source_texts(source: SourceConfig) -> list[str]:
    """Every document of a pinned training source, read straight from it (sdist checked by sha256 when
    fetched; a single file checked here)."""
    digest = scheme_of(source.uri).pinned_sha256(source)
    if digest is not None and digest != source.sha256:
        raise ValueError(f"training source {source.name!r} ({source.uri}): sha256 is {digest}, "
                         f"expected {source.sha256}")
    texts: list[str] = []
    for shard in discover_shards(source):
        texts.extend(read_shard(source, shard).documents["text"].to_list())
    return texts


def load_model_bytes(store: ArtifactStore, handle: ArtifactHandle) -> bytes:
    with store.open(f"{handle.uri}/{MODEL_FILE}") as fh:
        return fh.read()


def _adopted(uri: str, sha256: str, what: str, required_labels: list[str]) -> bytes:
    try:
        data = fetch_model(uri, sha256, what)
        FastTextClassifier(data, f"{what} {uri}", required_labels)  # loads: labels and fastText agree
    except ModelFileError as exc:
        raise input_refused(str(exc)) from None  # one line, exit 2 from the CLI, nothing committed
    return data


def build_model_assets(config: CurationConfig, catalog: Catalog) -> list:
    assets = []
    quality = config.quality
    if quality is not None and quality.classifier == "fasttext":
        classifier_spec = ArtifactSpec.fixed(CLASSIFIER_KEY, CLASSIFIER_VERSION, classifier_identity(config))
        adopted = quality.model_uri is not None
        description = (f"fastText quality classifier adopted from `{quality.model_uri}` (sha256 "
                       f"{quality.model_sha256[:12]}...); scores are P({quality.positive_label})." if adopted else
                       "fastText quality classifier trained on pinned sources ("
                       + ", ".join(s.name for s in config.quality_positive_sources) + " against "
                       + ", ".join(s.name for s in config.quality_negative_sources)
                       + "): one thread, a fixed seed, the same sources give the same model bytes.")

        @catalog.asset(classifier_spec, group_name="curation", kinds={"fasttext"}, description=description)
        def quality_classifier(context: dg.AssetExecutionContext, store: MarinStore):
            def build(writer) -> Built:
                if adopted:
                    model = _adopted(quality.model_uri, quality.model_sha256, "quality model",
                                     [quality.positive_label])
                    summary: dict[str, Any] = {"adopted_from": quality.model_uri}
                else:
                    positives = [t for s in config.quality_positive_sources for t in pinned_source_texts(s)]
                    negatives = [t for s in config.quality_negative_sources for t in pinned_source_texts(s)]
                    model, summary = train_quality_model(positives, negatives, quality)
                with writer.open(MODEL_FILE) as fh:
                    fh.write(model)
                info = FastTextClassifier(model, CLASSIFIER_KEY).info
                writer.write_json("model.json", {"sha256": sha256_hex(model), "labels": list(info.labels),
                                                 "positive_label": quality.positive_label, "dim": info.dim,
                                                 "words": info.n_words, "quantized": info.quantized})
                return Built(metrics={**summary, "model_sha256": sha256_hex(model), "model_bytes": len(model)})

            return materialize_artifact(context, store, classifier_spec, upstream=[], build=build)

        assets.append(quality_classifier)

    language = config.language_id
    if language is not None:
        language_spec = ArtifactSpec.fixed(LANGUAGE_MODEL_KEY, LANGUAGE_MODEL_VERSION,
                                           {"adopted_sha256": language.model_sha256})

        @catalog.asset(language_spec, group_name="curation", kinds={"fasttext"},
                       description=f"fastText language-ID model adopted from `{language.model_uri}` (sha256 "
                                   f"{language.model_sha256[:12]}...); identifies the languages of every source whose "
                                   "`language_identifier` is `fasttext`, in place of the pinned lid.176.")
        def language_model(context: dg.AssetExecutionContext, store: MarinStore):
            def build(writer) -> Built:
                model = _adopted(language.model_uri, language.model_sha256, "language model", [])
                with writer.open(MODEL_FILE) as fh:
                    fh.write(model)
                info = FastTextClassifier(model, LANGUAGE_MODEL_KEY).info
                return Built(metrics={"languages": len(info.labels), "model_bytes": len(model),
                                      "adopted_from": language.model_uri})

            return materialize_artifact(context, store, language_spec, upstream=[], build=build)

        assets.append(language_model)
    if quality is not None and config.quality_sources:
        assets.append(build_quality_threshold(config, catalog))
    return assets


def build_quality_threshold(config: CurationConfig, catalog: Catalog):
    quality = config.quality
    assert quality is not None
    threshold_spec = ArtifactSpec.fixed(THRESHOLD_KEY, THRESHOLD_VERSION, threshold_identity(config))
    ins = {f"shards_{name}": all_partitions_in(f"filtered/{name}") for name in config.quality_sources}

    @catalog.asset(threshold_spec, ins=ins, group_name="curation", kinds={"json"},
                   description=f"The keep threshold of the `{quality.classifier}` quality score over the corpus being "
                               f"filtered ({', '.join(config.quality_sources)}): the {1 - quality.keep_fraction:g} "
                               "quantile of every scored document, from the shards' mergeable sketches (relative "
                               f"accuracy {quality.sketch_relative_accuracy:g}); independent of shard order. "
                               "`threshold_shifts` says "
                               "how far each source moves it: the threshold the other sources alone would give.")
    def quality_threshold(context: dg.AssetExecutionContext, store: MarinStore, **inputs: dict[str, ArtifactHandle]):
        artifacts = store.get()
        handles = [h for _, shards in sorted(inputs.items()) for _, h in sorted(shards.items())]

        def build(writer) -> Built:
            merged = QuantileSketch(quality.sketch_relative_accuracy)
            per_source = {}
            for name, shards in sorted(inputs.items()):
                source = per_source[name.removeprefix("shards_")] = QuantileSketch(quality.sketch_relative_accuracy)
                for _, handle in sorted(shards.items()):
                    with artifacts.open(f"{handle.uri}/{SKETCH_FILE}") as fh:
                        source.merge(QuantileSketch.from_json(fh.read()))
                merged.merge(source)
            # Which source moved the shared threshold, and by how much: adding a source changes what is kept
            # from every other one, which the per-source reports alone do not show.
            threshold = keep_threshold(merged, quality.keep_fraction)
            shifts = threshold_shifts(per_source, quality.keep_fraction, threshold)
            threshold = None if threshold == float("-inf") else threshold  # keep_fraction 1 (or no scores): keep all
            # Only the threshold is data: the counts move with every shard, the threshold rarely leaves its bucket.
            writer.write_json("threshold.json", {"threshold": threshold, "keep_fraction": quality.keep_fraction,
                                                 "relative_accuracy": quality.sketch_relative_accuracy,
                                                 "rule": "keep scores above the lower edge of the sketch bucket "
                                                         "holding the (1 - keep_fraction) quantile of the corpus"})
            quantile = merged.quantile(1 - quality.keep_fraction) if merged.count else None
            return Built(metrics={"threshold": "keep all" if threshold is None else threshold,
                                  "scored_documents": merged.count, "shards": len(handles),
                                  "quantile_estimate": quantile,
                                  **{f"shift/{name}": row["shift"] for name, row in shifts.items()}},
                         metadata={"threshold_shifts": dg.MetadataValue.md(shifts_table(shifts))})

        return materialize_artifact(context, store, threshold_spec, upstream=handles, build=build)

    return quality_threshold


def read_threshold(store: ArtifactStore, handle: ArtifactHandle) -> float:
    with store.open(f"{handle.uri}/threshold.json") as fh:
        threshold = json.load(fh)["threshold"]
    return float("-inf") if threshold is None else float(threshold)


def score_sketch(scores: np.ndarray, quality: QualityConfig) -> str:
    return QuantileSketch(quality.sketch_relative_accuracy).add(scores).to_json()
