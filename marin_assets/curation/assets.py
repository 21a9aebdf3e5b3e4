"""Curation assets, one family per declared source (an asset factory):

    raw/<source>  ->  documents/<source>  (per shard, dynamic partitions added by discovery)

Assets are thin wiring: reading, normalization and quarantine live in `readers.py`,
discovery in `discovery.py`, copying in `copying.py`; this module only moves bytes through the store.
"""

import json
import time

import dagster as dg

from marin_assets.automation import FOLLOWS_NEW_DATA
from marin_assets.catalog import Catalog
from marin_assets.curation.config import SourceConfig, reading_identity
from marin_assets.curation.copying import copy_listed_file
from marin_assets.curation.discovery import Shard, discover_shards
from marin_assets.curation.listed_files import FileRef
from marin_assets.curation.model_assets import build_model_assets
from marin_assets.curation.readers import read_shard, with_original_source_ids
from marin_assets.curation.refine import build_refinement_assets, write_parquet
from marin_assets.curation.sensors import build_new_shard_sensor
from marin_assets.deployment import Deployment
from marin_resources.allocator import keep_freed_memory
from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import (
    ArtifactHandle,
    Built,
    MarinStore,
    checked_manifest,
    marin_check,
    materialize_artifact,
)
from marin_resources.dagster_private import observable_source_assets_def
from marin_resources.environments import MarinSettings
from marin_resources.keys import asset_key, shard_partitions, stage_owners
from marin_resources.progress import ProgressMeter
from marin_resources.storage.store import FileEntry, UpstreamRef

RAW_VERSION = "v1"
DOCUMENTS_VERSION = "v1"
MAX_QUARANTINE_FRACTION = 0.2


def shards_partitions(source: SourceConfig) -> dg.DynamicPartitionsDefinition:
    return shard_partitions(source.name)


_LISTING_TTL_S = 30.0
_listings: dict[tuple[str, str, tuple[str, ...]], tuple[float, dict[str, Shard]]] = {}


def _listing(source: SourceConfig, excluded: tuple[str, ...]) -> dict[str, Shard]:
    """Discovery, memoized briefly: one CLI or sensor pass lists a source once, not once per shard.
    ``excluded``: the store's prefix, whose files are never the source's (a store inside the data).

    A listing is kept for _LISTING_TTL_S after it ended, or ten times as long as it took: timed
    from its start, a listing slower than the TTL (75,000 files) expired as it was made and every
    shard's lookup listed the source again."""
    cached = _listings.get((source.name, source.uri, excluded))
    if cached is None or time.monotonic() > cached[0]:
        started = time.monotonic()
        shards = {shard.key: shard for shard in discover_shards(source, excluded)}
        ended = time.monotonic()
        cached = (ended + max(_LISTING_TTL_S, 10 * (ended - started)), shards)
        _listings[(source.name, source.uri, excluded)] = cached
    return cached[1]


def current_shards(source: SourceConfig, excluded: tuple[str, ...]) -> list[Shard]:
    return list(_listing(source, excluded).values())


def shard_by_key(source: SourceConfig, key: str, excluded: tuple[str, ...]) -> Shard:
    shard = _listing(source, excluded).get(key)
    if shard is None:
        raise dg.Failure(f"source {source.name!r} has no shard {key!r} any more (files moved or removed?)")
    return shard


def external_key(source: SourceConfig) -> str:
    """The marin key under which manifests record a source's listing: `external/<source>`."""
    return f"external/{source.name}"


def build_source_observation(source: SourceConfig, partitions: dg.DynamicPartitionsDefinition,
                             excluded: tuple[str, ...]):
    """`external/<source>`: the source itself, an observable source asset. Its data version per shard
    is the listing's fingerprint (paths, sizes, checksums), the version `raw/<source>` records as
    its input; a changed file makes that raw shard "Unsynced" in the UI, as `marin status` calls
    it stale. The planner records an observation whenever a shard's fingerprint changes."""

    @dg.observable_source_asset(
        key=asset_key(external_key(source)), partitions_def=partitions, group_name="curation",
        tags={"marin/source": source.name, "dagster/kind/source": ""},
        description=f"Source `{source.name}` as listed at {source.uri}: one data version per shard, the "
                    "fingerprint of its files' paths, sizes and checksums.")
    def external(context) -> dg.DataVersionsByPartition:
        known = set(context.instance.get_dynamic_partitions(partitions.name))
        return dg.DataVersionsByPartition({shard.key: dg.DataVersion(shard.fingerprint)
                                           for shard in discover_shards(source, excluded) if shard.key in known})

    # The decorator takes no owners; as the AssetsDefinition Dagster makes of it anyway, it does.
    return observable_source_assets_def(external).map_asset_specs(
        lambda spec: spec.replace_attributes(owners=stage_owners("curation")))


def build_source_assets(source: SourceConfig, catalog: Catalog, excluded: tuple[str, ...]) -> list:
    """``excluded``: the store's prefix, never listed as the source's files."""
    partitions = shards_partitions(source)
    name = source.name
    source_identity = reading_identity(source)
    catalog.add_discoverer(partitions.name, lambda: [s.key for s in current_shards(source, excluded)])
    raw_spec = ArtifactSpec(
        f"raw/{name}", RAW_VERSION, lambda partition: {"source": source_identity, "shard": partition},
        code_identity={"source": source_identity},
        external=lambda partition: {external_key(source): shard_by_key(source, partition, excluded).fingerprint})
    documents_spec = ArtifactSpec.fixed(f"documents/{name}", DOCUMENTS_VERSION, {"source": source_identity})
    external = build_source_observation(source, partitions, excluded)

    @catalog.asset(raw_spec, partitions_def=partitions, group_name="curation", tags={"marin/source": name},
                   deps=[external.key], kinds={"files"},
                   description=f"Raw bytes of source `{name}` ({source.uri}), one shard per partition.")
    def raw(context: dg.AssetExecutionContext, store: MarinStore) -> dg.Output[ArtifactHandle]:
        shard = shard_by_key(source, context.partition_key, excluded)
        # The listing (paths, sizes, content checksums) stands in for the outside world's data version.
        source_ref = UpstreamRef(asset_key=external_key(source), partition=shard.key, data_version=shard.fingerprint,
                                 uri=source.uri)

        def build(writer) -> Built:
            total = 0
            listing = []
            for ref in shard.files:
                refused = ref.refused
                if refused is None:
                    copied = copy_listed_file(ref, source, lambda: writer.open(f"files/{ref.relpath}"))  # noqa: B023 - called within this iteration
                    if isinstance(copied, str):
                        writer.remove(f"files/{ref.relpath}")
                        refused = copied
                if refused is not None:  # listed with its reason; not one byte of it is kept
                    listing.append({"relpath": ref.relpath, "uri": ref.uri, "bytes": 0, "etag": ref.etag,
                                    "refused": refused})
                    continue
                # Hashed as it was written: the commit takes this entry instead of reading the copy back.
                writer.vouch([FileEntry(path=f"files/{ref.relpath}", bytes=copied.bytes, sha256=copied.sha256)])
                total += copied.bytes
                # A range of a split file: documents' source ids say which range their line numbers count in.
                uri = ref.uri if ref.byte_range is None else f"{ref.uri}#bytes={ref.byte_range[0]}-{ref.byte_range[1]}"
                listing.append({"relpath": ref.relpath, "uri": uri, "bytes": copied.bytes, "etag": copied.etag})
            writer.write_json("listing.json", listing)
            return Built(metrics={"files": len(shard.files), "raw_bytes": total},
                         metadata={"source_uri": source.uri})

        return materialize_artifact(context, store, raw_spec, upstream=[_as_handle(source_ref)], build=build)

    @catalog.asset(documents_spec, partitions_def=partitions, tags={"marin/source": name},
                   group_name="curation", kinds={"parquet"}, ins={"raw": dg.AssetIn(key=raw.key)},
                   automation_condition=FOLLOWS_NEW_DATA,
                   description=(f"Conversations of chat source `{name}` (id, text: a plain rendering of the "
                                "turns, source, source_id, metadata, messages: the turns as JSON) plus a quarantine "
                                "table of every record that is not a conversation, with its reason."
                                if source.format == "chat" else
                                f"Normalized documents of `{name}` (id, text, source, source_id, metadata) "
                                "plus a quarantine table of every record that could not be used."))
    def documents(context: dg.AssetExecutionContext, store: MarinStore, raw: ArtifactHandle):
        artifacts = store.get()

        def build(writer) -> Built:
            keep_freed_memory()
            with artifacts.open(f"{raw.uri}/listing.json") as fh:
                listing = json.load(fh)
            stored = Shard(source=name, key=context.partition_key, files=tuple(
                FileRef(uri=f"{raw.uri}/files/{item['relpath']}", relpath=item["relpath"], size=item["bytes"],
                        refused=item.get("refused"))
                for item in listing))
            meter = ProgressMeter(context.log.info, "read", total_bytes=sum(item["bytes"] for item in listing))
            result = read_shard(source, stored, meter)
            # Readers saw the stored copies; report the original locations as source ids.
            originals = {f"{raw.uri}/files/{item['relpath']}": item["uri"] for item in listing}
            docs = with_original_source_ids(result.documents, originals)
            quarantine = with_original_source_ids(result.quarantine, originals)
            doc_bytes = write_parquet(writer, "documents.parquet", docs)
            write_parquet(writer, "quarantine.parquet", quarantine)
            # Files never opened (a FIFO, a dangling link) say nothing about how well records parse: the
            # bound is over the records read. They are counted, in `refused_files` and their reasons.
            read = result.n_records - result.n_refused_files
            fraction = (quarantine.height - result.n_refused_files) / max(1, read)
            metrics = {"documents": docs.height, "quarantined": quarantine.height, "records": result.n_records,
                       "refused_files": result.n_refused_files,
                       "quarantine_fraction": round(fraction, 6), "repaired_encoding": result.n_repaired_encoding,
                       "text_bytes": int(docs["text"].str.len_bytes().sum() or 0),
                       **{f"quarantine/{k}": v for k, v in result.quarantine_counts.items()}}
            return Built(metrics=metrics, metadata={"dagster/row_count": docs.height, "parquet_bytes": doc_bytes})

        return materialize_artifact(context, store, documents_spec, upstream=[raw], build=build)

    @marin_check(documents, description="Quarantined records stay under "
                                                 f"{MAX_QUARANTINE_FRACTION:.0%} of the records read from the shard. "
                                                 "A shard with no document (every record quarantined, or every "
                                                 "file refused) is a valid empty shard: a warning, not a failure.")
    def documents_quarantine_bound(context: dg.AssetCheckExecutionContext, store: MarinStore):
        m = _manifest_for_check(store, documents_spec, context)
        return quarantine_bound_result(m.metrics, MAX_QUARANTINE_FRACTION)

    @marin_check(documents, description="Every input record is either a document or quarantined.")
    def documents_accounted(context: dg.AssetCheckExecutionContext, store: MarinStore):
        return accounted_result(_manifest_for_check(store, documents_spec, context).metrics)

    return [external, raw, documents, documents_quarantine_bound, documents_accounted,
            build_new_shard_sensor(source, partitions, raw.key, external.key, excluded)]


def build_source_family(source: SourceConfig, config, catalog: Catalog, excluded: tuple[str, ...]) -> list:
    base = build_source_assets(source, catalog, excluded)
    documents_key = asset_key(f"documents/{source.name}")
    documents = next(a for a in base if isinstance(a, dg.AssetsDefinition) and a.key == documents_key)
    return base + build_refinement_assets(source, config, shards_partitions(source), documents.key, catalog)


def _as_handle(ref: UpstreamRef) -> ArtifactHandle:
    return ArtifactHandle(ref.asset_key, ref.partition, "external", ref.uri, ref.data_version)


def _manifest_for_check(store: MarinStore, spec: ArtifactSpec, context):
    manifest = checked_manifest(context, store, spec)
    if manifest is None:
        raise dg.Failure(f"{spec.key} has no committed artifact to check")
    return manifest


def quarantine_bound_result(metrics: dict, bound: float) -> dg.AssetCheckResult:
    """`documents_quarantine_bound` of a shard's metrics. Over the bound fails (ERROR), naming the
    counts; a shard that yields no document adds nothing downstream, so it is only a warning: counted
    and shown, never a failure that withholds the source's other shards from its global steps."""
    fraction, documents = float(metrics.get("quarantine_fraction", 0.0)), metrics["documents"]
    quarantined, records = metrics["quarantined"], metrics["records"]
    refused = metrics.get("refused_files", 0)
    data = {"quarantine_fraction": fraction, "bound": bound, "documents": documents, "quarantined": quarantined,
            "records": records, "refused_files": refused}
    if documents == 0:
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN, metadata=data,
                                   description=f"an empty shard: documents=0 of records={records} "
                                               f"(quarantined={quarantined}, of which refused_files={refused})")
    read = records - refused
    return dg.AssetCheckResult(passed=fraction <= bound, severity=dg.AssetCheckSeverity.ERROR, metadata=data,
                               description=None if fraction <= bound else
                               f"quarantine_fraction={fraction} > bound={bound}: quarantined={quarantined - refused}"
                               f" of the records={read} read")


def accounted_result(metrics: dict) -> dg.AssetCheckResult:
    """`documents_accounted`: documents + quarantined == records, whatever either count is (a shard of
    nothing but quarantined records is complete)."""
    documents, quarantined, records = metrics["documents"], metrics["quarantined"], metrics["records"]
    total = documents + quarantined
    return dg.AssetCheckResult(passed=total == records,
                               metadata={"records": records, "documents": documents, "quarantined": quarantined},
                               description=None if total == records else
                               f"documents={documents} + quarantined={quarantined} = {total} != records={records}: "
                               f"{records - total} record(s) neither a document nor quarantined")


def build_curation_stage(settings: MarinSettings, deployment: Deployment,
                         upstream: Catalog) -> tuple[dg.Definitions, Catalog]:
    config = deployment.curation
    catalog = Catalog()
    defs = []
    defs.extend(build_model_assets(config, catalog))
    for source in config.sources:  # the store is never a source's data, even inside its folder
        defs.extend(build_source_family(source, config, catalog, (settings.prefix,)))
    sensors = [d for d in defs if isinstance(d, dg.SensorDefinition)]
    checks = [d for d in defs if isinstance(d, dg.AssetChecksDefinition)]
    assets = [d for d in defs if d not in sensors and d not in checks]
    return dg.Definitions(assets=assets, asset_checks=checks, sensors=sensors), catalog
