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
from marin_assets.curation.dedup import (DedupConfig, IndexDir, ShardInput, apply_decisions, decision_path,
                                         decisions_digest, duplicates_table, read_registry, update_index)
from marin_assets.curation.filters import apply_filters
from marin_assets.curation.minhash import MinHashConfig, compute_signatures, load_signatures, save_signatures
from marin_assets.curation.quality import (load_quality_model, quality_threshold, save_quality_model, score,
                                           train_quality_classifier)
from marin_assets.curation.sources import CurationConfig, SourceConfig
from marin_resources.artifacts import (ArtifactHandle, Built, MarinStore, all_partitions_in, checked_manifest,
                                       marin_asset, marin_check, materialize_artifact)
from marin_resources.identity import fingerprint
from marin_resources.keys import asset_key
from marin_resources.store import ArtifactStore

CLASSIFIER_KEY = "quality_classifier"
CLASSIFIER_VERSION = "v1"
FILTERED_VERSION = "v1"
DEDUP_VERSION = "v1"
DEDUP_INDEX_VERSION = "v1"
# New shards decided together in one pass over the index; bounds memory, never changes decisions.
DEDUP_BATCH_SHARDS = 8
MAX_FILTER_DROP_FRACTION = 0.5
MAX_DEDUP_DROP_FRACTION = 0.5
DOCUMENT_COLUMNS = ("id", "text", "source", "source_id", "metadata")


def dedup_group_of(source: SourceConfig) -> str:
    """The dedup group a source belongs to: `dedup: {group: <name>}` in the YAML, else its own name."""
    group = source.dedup.get("group", source.name)
    if not isinstance(group, str) or not group:
        raise ValueError(f"source {source.name!r}: dedup.group must be a non-empty string, got {group!r}")
    return group


def dedup_config_from(source: SourceConfig) -> DedupConfig:
    """`dedup:` overrides from the sources YAML; MinHash fields may be given flat."""
    overrides = {k: v for k, v in source.dedup.items() if k != "group"}
    minhash_fields = {f.name for f in fields(MinHashConfig)}
    dedup_fields = {f.name for f in fields(DedupConfig)} - {"minhash"}
    unknown = set(overrides) - minhash_fields - dedup_fields
    if unknown:
        raise ValueError(f"source {source.name!r}: unknown dedup field(s) {sorted(unknown)}; "
                         f"known: {sorted(minhash_fields | dedup_fields | {'group'})}")
    minhash = MinHashConfig(**{k: v for k, v in overrides.items() if k in minhash_fields})
    return DedupConfig(minhash=minhash, **{k: v for k, v in overrides.items() if k in dedup_fields})


def dedup_group_members(source: SourceConfig, config: CurationConfig) -> list[SourceConfig]:
    """The sources deduplicated together with `source`, in YAML order; they must agree on the dedup config."""
    group = dedup_group_of(source)
    members = [other for other in config.sources if dedup_group_of(other) == group]
    for other in members:
        if dedup_config_from(other) != dedup_config_from(source):
            raise ValueError(f"sources {source.name!r} and {other.name!r} share dedup group {group!r} but differ "
                             "in their dedup settings; a group has one config")
    clash = [other.name for other in config.sources if other.name == group and other not in members]
    if clash:
        raise ValueError(f"dedup group {group!r} has the name of source {clash[0]!r}, which is not in it")
    return members


def dedup_index_key(group: str) -> dg.AssetKey:
    return asset_key(f"dedup_index/{group}")


def build_dedup_index(group: str, members: list[SourceConfig], dedup_cfg: DedupConfig, catalog: Catalog):
    """`dedup_index/<group>`: the incremental, partitioned dedup index over every filtered shard of the group."""
    identity = {"dedup": asdict(dedup_cfg), "sources": [member.name for member in members]}
    catalog.add_identity(f"dedup_index/{group}", lambda partition: identity)
    ins = {f"shards_{member.name}": all_partitions_in(f"filtered/{member.name}") for member in members}

    @marin_asset(key=f"dedup_index/{group}", version=DEDUP_INDEX_VERSION, identity=identity, ins=ins,
                 group_name="curation", kinds={"parquet"}, tags={"marin/dedup_group": group},
                 description=f"Dedup index of group `{group}` ({', '.join(m.name for m in members)}): shard order, "
                             "each shard's keep/drop decisions, and the LSH and exact keys of kept documents as "
                             f"sorted runs in {dedup_cfg.index_partitions} bucket-hash ranges. Append-only: a new "
                             "shard is checked against the kept documents and earlier decisions stay fixed.")
    def dedup_index(context: dg.AssetExecutionContext, store: MarinStore, **inputs: dict[str, ArtifactHandle]):
        artifacts = store.get()
        handles = [(name[len("shards_"):], key, handle) for name, shards in sorted(inputs.items())
                   for key, handle in sorted(shards.items())]

        def signatures_of(handle: ArtifactHandle):
            with artifacts.open(f"{handle.uri}/signatures.parquet") as fh:
                return load_signatures(fh.read(), expected=dedup_cfg.minhash)

        def shard_input(source: str, shard_key: str, handle: ArtifactHandle) -> ShardInput:
            return ShardInput(
                source, shard_key, handle.data_version,
                load_docs=lambda: read_parquet(artifacts, f"{handle.uri}/documents.parquet").select(DOCUMENT_COLUMNS),
                load_signatures=lambda: signatures_of(handle))

        def build(writer) -> Built:
            index = IndexDir(artifacts.fs, artifacts._path(writer.uri))
            update = update_index(index, [shard_input(*h) for h in handles], dedup_cfg,
                                  batch_shards=DEDUP_BATCH_SHARDS)
            if update.reset_reason:
                context.log.warning(f"dedup_index/{group} started over: {update.reset_reason}")
            registry = read_registry(index)
            totals = {"shards": len(registry), "input_docs": sum(s.docs for s in registry),
                      "kept_docs": sum(s.kept for s in registry)}
            return Built(metrics={**totals, **{f"update/{k}": v for k, v in update.stats.items()},
                                  "update/new_shards": len(update.new_shards),
                                  "update/reset": update.reset_reason or ""},
                         metadata={"new_shards": len(update.new_shards)})

        return materialize_artifact(context, store, config=identity, upstream=[h for *_, h in handles],
                                    build=build, resume=True)

    return dedup_index


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
    group = dedup_group_of(source)
    members = dedup_group_members(source, config)
    # A source that is the classifier's negative class is its reference for "low quality": not scored.
    use_classifier = has_classifier and name not in config.quality_negative_sources
    filtered_identity = {"filters": asdict(source.filters), "minhash": asdict(dedup_cfg.minhash),
                         "quality_classifier": use_classifier}
    dedup_identity = {"dedup": asdict(dedup_cfg), "group": group}
    catalog.add_identity(f"filtered/{name}", lambda partition: filtered_identity)
    catalog.add_identity(f"deduplicated/{name}", lambda partition: dedup_identity)

    ins: dict[str, dg.AssetIn] = {"documents": dg.AssetIn(key=documents_key)}
    if use_classifier:
        ins["classifier"] = dg.AssetIn(key=asset_key(CLASSIFIER_KEY))

    @marin_asset(key=f"filtered/{name}", version=FILTERED_VERSION, partitions_def=partitions, ins=ins,
                 identity=filtered_identity, tags={"marin/source": name},
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

    @marin_asset(key=f"deduplicated/{name}", version=DEDUP_VERSION,
                 ins={"index": dg.AssetIn(key=dedup_index_key(group))},
                 identity=dedup_identity, tags={"marin/source": name, "marin/dedup_group": group},
                 group_name="curation", kinds={"parquet"},
                 description=f"`{name}` after exact and fuzzy (MinHash LSH, Jaccard-verified) deduplication against "
                             f"dedup group `{group}`. `data/<shard>.parquet` holds each shard's kept documents and "
                             "`duplicates/<shard>.parquet` its dropped ids, with the kept id that replaced each and "
                             "their exact Jaccard. Files of earlier shards are never rewritten.")
    def deduplicated(context: dg.AssetExecutionContext, store: MarinStore,
                     index: ArtifactHandle) -> dg.Output[ArtifactHandle]:
        artifacts = store.get()
        index_dir = IndexDir(artifacts.fs, artifacts._path(index.uri))
        index_manifest = artifacts.read_manifest(index.uri)
        # The index pins the filtered shards it decided on; reading them through it keeps one lineage path.
        shards = {str(ref.partition): ref for ref in index_manifest.upstream if ref.asset_key == f"filtered/{name}"}
        registered = {shard.shard_key: shard for shard in read_registry(index_dir) if shard.source == name}
        stale = sorted(key for key in shards if key not in registered or registered[key].version !=
                       shards[key].data_version)
        if stale:
            raise dg.Failure(f"{dedup_index_key(group).to_user_string()} does not match its manifest for {name} "
                             f"shard(s) {stale[:5]}; materialize it again")
        decision_sha = {entry.path: entry.sha256 for entry in index_manifest.files}

        def digest_entry(shard_key: str) -> tuple[str, str, str]:
            return shard_key, shards[shard_key].data_version, decision_sha[decision_path(registered[shard_key].seq)]

        # Shards already written stay byte-identical; the previous commit vouches for them only if
        # their inputs and decisions are unchanged (an index that started over changes them).
        previous = artifacts.find(f"deduplicated/{name}", DEDUP_VERSION, None)
        written = sorted(entry.path[len("data/"):-len(".parquet")] for entry in previous.files
                         if entry.path.startswith("data/")) if previous else []
        reusable = (previous is not None and previous.fingerprint == fingerprint(dedup_identity)
                    and set(written) <= set(shards)
                    and previous.metrics.get("decisions_digest") == decisions_digest(map(digest_entry, written)))

        def build(writer) -> Built:
            kept_shards = set(written) if reusable else set()
            if not reusable:
                for rel in artifacts.list_files(writer.uri):
                    artifacts.fs.rm_file(artifacts._path(f"{writer.uri}/{rel}"))
            stats = {"shards_written": 0, "documents_written": 0, "dropped_written": 0}
            for shard_key in sorted(set(shards) - kept_shards):
                docs = read_parquet(artifacts, f"{shards[shard_key].uri}/documents.parquet")
                decisions = index_dir.read_parquet(decision_path(registered[shard_key].seq))
                kept = apply_decisions(docs.select(DOCUMENT_COLUMNS), decisions)
                write_parquet(writer, f"data/{shard_key}.parquet", kept)
                write_parquet(writer, f"duplicates/{shard_key}.parquet", duplicates_table(decisions))
                stats["shards_written"] += 1
                stats["documents_written"] += kept.height
                stats["dropped_written"] += decisions.height
            entries = [registered[key] for key in shards]
            total, documents = sum(e.docs for e in entries), sum(e.kept for e in entries)
            return Built(metrics={**stats, "input_docs": total, "documents": documents, "kept_docs": documents,
                                  "drop_fraction": round(1 - documents / total, 6) if total else 0.0,
                                  "decisions_digest": decisions_digest(map(digest_entry, shards))},
                         metadata={"dagster/row_count": documents, "shards": len(shards)})

        return materialize_artifact(context, store, config=dedup_identity, upstream=[index], build=build,
                                    resume=True)

    checks = [
        _bound_check(filtered, f"filtered/{name}", FILTERED_VERSION, "drop_fraction", MAX_FILTER_DROP_FRACTION),
        _bound_check(deduplicated, f"deduplicated/{name}", DEDUP_VERSION, "drop_fraction", MAX_DEDUP_DROP_FRACTION),
        _schema_check(deduplicated, f"deduplicated/{name}", DEDUP_VERSION),
    ]
    # The group's first source (in YAML order) carries the group's index asset.
    index_assets = [build_dedup_index(group, members, dedup_cfg, catalog)] if members[0] is source else []
    return [filtered, *index_assets, deduplicated, *checks]


def _bound_check(asset, key: str, version: str, metric: str, bound: float):
    @marin_check(asset, name=f"{metric}_bound",
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
    @marin_check(asset, name="document_schema",
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
            # The schema and the id column only: the texts are most of the bytes and not needed here.
            with artifacts.open(f"{manifest.uri}/{entry.path}") as fh:
                data = fh.read()
            schema = pl.read_parquet_schema(io.BytesIO(data))
            missing = [c for c in DOCUMENT_COLUMNS if schema.get(c) != pl.String]
            if missing:
                problems.append(f"{entry.path}: missing or non-string {missing}")
            shard_ids = pl.read_parquet(io.BytesIO(data), columns=["id"])["id"] if "id" in schema else []
            rows += len(shard_ids)
            ids.update(shard_ids)
        if len(ids) != rows:
            problems.append(f"{rows - len(ids)} duplicate ids after dedup")
        return dg.AssetCheckResult(passed=not problems and rows > 0,
                                   metadata={"rows": rows, "problems": dg.MetadataValue.json(problems)})
    return check
