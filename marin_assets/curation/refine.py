"""Refinement assets: quality classifier, filtered/<source> (per shard) and deduplicated/<source>.

    documents/<source> --> filtered/<source> --> deduplicated/<source>
    documents/<positives + negatives> --> quality_classifier --^

Thin wiring over `filters.py`, `quality.py`, `minhash.py` and `dedup.py`.
"""

import io
import json
import tempfile
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import polars as pl

from marin_assets.catalog import Catalog
from marin_assets.curation.dedup import DedupConfig, dedup_source
from marin_assets.curation.filters import apply_filters
from marin_assets.curation.minhash import MinHashConfig, compute_signatures, load_signatures, save_signatures
from marin_assets.curation.quality import (load_quality_model, quality_threshold, save_quality_model, score,
                                           train_quality_classifier)
from marin_assets.curation.sources import CurationConfig, SourceConfig
from marin_resources.artifacts import (ArtifactHandle, Built, MarinStore, all_partitions_in, checked_manifest,
                                       marin_asset, materialize_artifact)
from marin_resources.store import ArtifactStore

CLASSIFIER_KEY = "quality_classifier"
CLASSIFIER_VERSION = "v1"
FILTERED_VERSION = "v1"
DEDUP_VERSION = "v1"
MAX_FILTER_DROP_FRACTION = 0.5
MAX_DEDUP_DROP_FRACTION = 0.5
DOCUMENT_COLUMNS = ("id", "text", "source", "source_id", "metadata")


def dedup_config_from(source: SourceConfig) -> DedupConfig:
    """`dedup:` overrides from the sources YAML; MinHash fields may be given flat."""
    overrides = dict(source.dedup)
    minhash_fields = {f.name for f in fields(MinHashConfig)}
    dedup_fields = {f.name for f in fields(DedupConfig)} - {"minhash"}
    unknown = set(overrides) - minhash_fields - dedup_fields
    if unknown:
        raise ValueError(f"source {source.name!r}: unknown dedup field(s) {sorted(unknown)}; "
                         f"known: {sorted(minhash_fields | dedup_fields)}")
    minhash = MinHashConfig(**{k: v for k, v in overrides.items() if k in minhash_fields})
    return DedupConfig(minhash=minhash, **{k: v for k, v in overrides.items() if k in dedup_fields})


def read_parquet(store: ArtifactStore, uri: str) -> pl.DataFrame:
    with store.open(uri) as fh:
        return pl.read_parquet(fh)


def write_parquet(writer, rel: str, frame: pl.DataFrame) -> int:
    buf = io.BytesIO()
    frame.write_parquet(buf, compression="zstd")
    with writer.open(rel) as fh:
        fh.write(buf.getvalue())
    return len(buf.getvalue())


def load_model_from(store: ArtifactStore, handle: ArtifactHandle):
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("weights.npz", "config.json"):
            with store.open(f"{handle.uri}/model/{name}") as src:
                Path(tmp, name).write_bytes(src.read())
        return load_quality_model(tmp)


def build_quality_classifier(config: CurationConfig, catalog: Catalog) -> list:
    if config.quality is None or not (config.quality_positive_sources and config.quality_negative_sources):
        return []
    identity = {"quality": asdict(config.quality), "positives": list(config.quality_positive_sources),
                "negatives": list(config.quality_negative_sources)}
    catalog.add_identity(CLASSIFIER_KEY, lambda partition: identity)
    ins = {f"pos_{n}": all_partitions_in(f"documents/{n}") for n in config.quality_positive_sources}
    ins |= {f"neg_{n}": all_partitions_in(f"documents/{n}") for n in config.quality_negative_sources}

    @marin_asset(key=CLASSIFIER_KEY, version=CLASSIFIER_VERSION, identity=identity, ins=ins,
                 group_name="curation", kinds={"numpy"},
                 description="Hashed n-gram logistic-regression quality classifier, trained on documents of the "
                             "configured positive sources against the negative ones. The keep threshold is the "
                             "`1 - keep_fraction` quantile of the positives' scores, fixed here so that filtering "
                             "a shard never depends on its neighbours.")
    def quality_classifier(context: dg.AssetExecutionContext, store: MarinStore, **inputs: dict):
        artifacts = store.get()
        def texts(prefix: str) -> list[str]:
            out: list[str] = []
            for name, shards in sorted(inputs.items()):
                if name.startswith(prefix):
                    for h in shards.values():
                        out.extend(read_parquet(artifacts, f"{h.uri}/documents.parquet")["text"].to_list())
            return out

        def build(writer) -> Built:
            positives, negatives = texts("pos_"), texts("neg_")
            model = train_quality_classifier(positives, negatives, config.quality)
            pos_scores = score(model, positives)
            threshold = quality_threshold(pos_scores, config.quality.keep_fraction)
            save_quality_model(model, writer.staging_dir() / "model")
            writer.write_json("threshold.json", {"threshold": threshold,
                                                 "keep_fraction": config.quality.keep_fraction,
                                                 "rule": "quantile of positive-class training scores"})
            neg_scores = score(model, negatives)
            return Built(metrics={**model.training_summary, "threshold": threshold,
                                  "positive_score_mean": float(np.mean(pos_scores)),
                                  "negative_score_mean": float(np.mean(neg_scores)),
                                  "negatives_above_threshold": float(np.mean(neg_scores >= threshold))})

        upstream = [h for _, shards in sorted(inputs.items()) for _, h in sorted(shards.items())]
        return materialize_artifact(context, store, config=identity, upstream=upstream, build=build)

    return [quality_classifier]


def build_refinement_assets(source: SourceConfig, config: CurationConfig, partitions: dg.PartitionsDefinition,
                            documents_key: dg.AssetKey, catalog: Catalog, has_classifier: bool) -> list:
    name = source.name
    dedup_cfg = dedup_config_from(source)
    # A source that is the classifier's negative class is its reference for "low quality": not scored.
    use_classifier = has_classifier and name not in config.quality_negative_sources
    filtered_identity = {"filters": asdict(source.filters), "minhash": asdict(dedup_cfg.minhash),
                         "quality_classifier": use_classifier}
    dedup_identity = asdict(dedup_cfg)
    catalog.add_identity(f"filtered/{name}", lambda partition: filtered_identity)
    catalog.add_identity(f"deduplicated/{name}", lambda partition: dedup_identity)

    ins: dict[str, dg.AssetIn] = {"documents": dg.AssetIn(key=documents_key)}
    if use_classifier:
        ins["classifier"] = dg.AssetIn(key=dg.AssetKey(CLASSIFIER_KEY))

    @marin_asset(key=f"filtered/{name}", version=FILTERED_VERSION, partitions_def=partitions, ins=ins,
                 identity=filtered_identity,
                 group_name="curation", kinds={"parquet", "polars"},
                 automation_condition=dg.AutomationCondition.eager(),
                 description=f"Quality-filtered documents of `{name}`: language id, Gopher/C4 heuristics"
                             + (", model quality score" if use_classifier else "")
                             + ". Dropped documents are kept in `dropped.parquet` with their reason; MinHash "
                               "signatures of the kept documents are cached per shard for dedup.")
    def filtered(context: dg.AssetExecutionContext, store: MarinStore, documents: ArtifactHandle,
                 **optional: ArtifactHandle) -> dg.Output[ArtifactHandle]:
        artifacts = store.get()
        classifier = optional.get("classifier")

        def build(writer) -> Built:
            docs = read_parquet(artifacts, f"{documents.uri}/documents.parquet")
            result = apply_filters(docs, source.filters)
            kept, dropped = result.kept, result.dropped
            counts = dict(result.per_rule_drop_counts)
            metrics: dict[str, Any] = {}
            if classifier is not None:
                model = load_model_from(artifacts, classifier)
                with artifacts.open(f"{classifier.uri}/threshold.json") as fh:
                    threshold = json.load(fh)["threshold"]
                scored = kept.with_columns(pl.Series("quality_score", score(model, kept["text"].to_list()) if
                                                     kept.height else np.zeros(0), dtype=pl.Float64))
                low = scored.filter(pl.col("quality_score") < threshold)
                kept = scored.filter(pl.col("quality_score") >= threshold)
                dropped = pl.concat([dropped.with_columns(pl.lit(None, pl.Float64).alias("quality_score")),
                                     low.with_columns(pl.lit("quality").alias("reason"),
                                                      pl.lit(["quality"]).alias("failed_rules"))
                                     .select(dropped.columns + ["quality_score"])], how="diagonal_relaxed")
                counts["quality"] = low.height
                metrics["quality_threshold"] = threshold
            signatures = compute_signatures(kept, dedup_cfg.minhash)
            buf = io.BytesIO()
            save_signatures(signatures, buf)
            with writer.open("signatures.parquet") as fh:
                fh.write(buf.getvalue())
            write_parquet(writer, "documents.parquet", kept)
            write_parquet(writer, "dropped.parquet", dropped)
            total = docs.height
            metrics |= {"input_documents": total, "documents": kept.height, "dropped": dropped.height,
                        "drop_fraction": round(dropped.height / total, 6) if total else 0.0,
                        **{f"dropped/{rule}": n for rule, n in sorted(counts.items())}}
            return Built(metrics=metrics, metadata={"dagster/row_count": kept.height})

        upstream = [documents] + ([classifier] if classifier is not None else [])
        return materialize_artifact(context, store, config=filtered_identity, upstream=upstream, build=build)

    @marin_asset(key=f"deduplicated/{name}", version=DEDUP_VERSION, ins={"shards": all_partitions_in(filtered.key)},
                 identity=dedup_identity,
                 group_name="curation", kinds={"parquet"},
                 description=f"`{name}` after exact and fuzzy (MinHash LSH, Jaccard-verified) deduplication across "
                             "all shards. `data/<shard>.parquet` holds the kept documents; `duplicates.parquet` "
                             "records every dropped id with the id that replaced it and their exact Jaccard.")
    def deduplicated(context: dg.AssetExecutionContext, store: MarinStore,
                     shards: dict[str, ArtifactHandle]) -> dg.Output[ArtifactHandle]:
        artifacts = store.get()

        def build(writer) -> Built:
            inputs = []
            for key, handle in sorted(shards.items()):
                docs = read_parquet(artifacts, f"{handle.uri}/documents.parquet")
                with artifacts.open(f"{handle.uri}/signatures.parquet") as fh:
                    sigs = load_signatures(fh.read(), expected=dedup_cfg.minhash)
                inputs.append((key, docs.select(DOCUMENT_COLUMNS), sigs))
            result = dedup_source(inputs, dedup_cfg)
            for (shard_key,), part in result.kept.group_by("shard_key", maintain_order=True):
                write_parquet(writer, f"data/{shard_key}.parquet", part.drop("shard_key"))
            write_parquet(writer, "duplicates.parquet", result.duplicates)
            stats = {k: (float(v) if isinstance(v, float) else int(v)) for k, v in result.stats.items()}
            total = stats.get("input_docs", 0)
            stats["drop_fraction"] = round(1 - stats.get("kept_docs", 0) / total, 6) if total else 0.0
            stats["documents"] = stats.get("kept_docs", 0)
            return Built(metrics=stats, metadata={"dagster/row_count": stats["documents"],
                                                  "shards": len(shards)})

        return materialize_artifact(context, store, config=dedup_identity, upstream=list(
            h for _, h in sorted(shards.items())), build=build)

    checks = [
        _bound_check(filtered, f"filtered/{name}", FILTERED_VERSION, "drop_fraction", MAX_FILTER_DROP_FRACTION),
        _bound_check(deduplicated, f"deduplicated/{name}", DEDUP_VERSION, "drop_fraction", MAX_DEDUP_DROP_FRACTION),
        _schema_check(deduplicated, f"deduplicated/{name}", DEDUP_VERSION),
    ]
    return [filtered, deduplicated, *checks]


def _bound_check(asset, key: str, version: str, metric: str, bound: float):
    @dg.asset_check(asset=asset, name=f"{metric}_bound",
                    description=f"`{metric}` stays at or under {bound}; a filter or dedup that drops most of a "
                                "corpus is a misconfiguration, not a result.")
    def check(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        manifest = checked_manifest(context, store, key, version)
        if manifest is None:
            return dg.AssetCheckResult(passed=False, metadata={"error": "no committed artifact"})
        value = float(manifest.metrics.get(metric, 0.0))
        return dg.AssetCheckResult(passed=value <= bound and manifest.metrics.get("documents", 0) > 0,
                                   metadata={metric: value, "bound": bound,
                                             "documents": manifest.metrics.get("documents", 0)})
    return check


def _schema_check(asset, key: str, version: str):
    @dg.asset_check(asset=asset, name="document_schema",
                    description="Every output shard has the document columns with string types and unique ids.")
    def check(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        artifacts = store.get()
        manifest = checked_manifest(context, store, key, version)
        if manifest is None:
            return dg.AssetCheckResult(passed=False, metadata={"error": "no committed artifact"})
        problems, ids, rows = [], set(), 0
        for entry in manifest.files:
            if not entry.path.startswith("data/"):
                continue
            frame = read_parquet(artifacts, f"{manifest.uri}/{entry.path}")
            missing = [c for c in DOCUMENT_COLUMNS if c not in frame.columns or frame.schema[c] != pl.String]
            if missing:
                problems.append(f"{entry.path}: missing or non-string {missing}")
            rows += frame.height
            ids.update(frame["id"].to_list())
        if len(ids) != rows:
            problems.append(f"{rows - len(ids)} duplicate ids after dedup")
        return dg.AssetCheckResult(passed=not problems and rows > 0,
                                   metadata={"rows": rows, "problems": dg.MetadataValue.json(problems)})
    return check
