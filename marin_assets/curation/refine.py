"""Refinement assets: filtered/<source> (per shard) and deduplicated/<source>.

    documents/<source> --> filtered/<source> --> dedup_index/<group> --> deduplicated/<source>
    quality_classifier, language_model --^    +-> quality_threshold -------------^

Thin wiring over `filters.py`, `quality.py`, `minhash.py`, `dedup.py` (with `dedup_index.py`) and
`paragraphs.py`; the model assets are in `model_assets.py`.
"""

import hashlib
import io
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import dagster as dg
import numpy as np
import polars as pl

from marin_assets.automation import FOLLOWS_NEW_DATA
from marin_assets.catalog import Catalog
from marin_assets.curation.chat import MESSAGES_COLUMN
from marin_assets.curation.config import CurationConfig, SourceConfig, pii_of
from marin_assets.curation.dedup import (
    DOCUMENT_ROW_GROUP,
    apply_decisions,
    decision_path,
    decisions_digest,
    duplicates_table,
    read_parquet_rows,
    update_index,
)
from marin_assets.curation.dedup_index import DedupConfig, IndexDir, ShardInput, parquet_bytes, read_registry
from marin_assets.curation.fasttext_models import LID176, ModelFileError
from marin_assets.curation.filter_report import (
    MOST,
    filter_report,
    largest_rule_problem,
    report_lines,
    report_table,
    shard_line,
)
from marin_assets.curation.filter_shard import FilterTask, filter_chunk, merge_chunks
from marin_assets.curation.formats import skipped_steps
from marin_assets.curation.minhash import MinHashConfig, load_signatures, save_signatures
from marin_assets.curation.model_assets import (
    CLASSIFIER_KEY,
    LANGUAGE_MODEL_KEY,
    SKETCH_FILE,
    THRESHOLD_KEY,
    load_model_bytes,
    read_threshold,
    score_sketch,
)
from marin_assets.curation.paragraphs import remove_duplicate_paragraphs
from marin_assets.curation.sketch import QuantileSketch
from marin_assets.curation.url_filter import blocklist_bytes, read_url_blocklist
from marin_resources.allocator import keep_freed_memory
from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import (
    CHECKED_SHARDS_AT_MOST,
    ArtifactHandle,
    Built,
    MarinStore,
    all_partitions_in,
    checked_manifest,
    checked_shards,
    input_refused,
    marin_check,
    materialize_artifact,
)
from marin_resources.config_identity import config_identity
from marin_resources.data_parallel import DataParallel
from marin_resources.keys import asset_key
from marin_resources.parallel_map import in_process_map
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore, FileEntry

FILTERED_VERSION = "v1"
DEDUP_VERSION = "v1"
DEDUP_INDEX_VERSION = "v1"
MAX_FILTER_DROP_FRACTION = 0.5
MAX_DEDUP_DROP_FRACTION = 0.5
DOCUMENT_COLUMNS = ("id", "text", "source", "source_id", "metadata")


def document_columns(frame: pl.DataFrame) -> list[str]:
    """The columns a step passes on: the document columns, and a chat document's turns (`messages`)."""
    return [*DOCUMENT_COLUMNS, *([MESSAGES_COLUMN] if MESSAGES_COLUMN in frame.columns else [])]


def dedup_group_of(source: SourceConfig) -> str:
    """The dedup group a source belongs to: `dedup: {group: <name>}` in the YAML, else its own name."""
    group = source.dedup.get("group", source.name)
    if not isinstance(group, str) or not group:
        raise ValueError(f"source {source.name!r}: dedup.group must be a non-empty string, got {group!r}")
    return group


# `dedup:` keys read by deduplicated/<source> itself rather than by the dedup index.
_OUTPUT_DEDUP_KEYS = ("group", "exact_paragraphs")


def exact_paragraphs_of(source: SourceConfig) -> bool:
    """`dedup: {exact_paragraphs: true}`: duplicate paragraphs (lines) are removed as spans."""
    value = source.dedup.get("exact_paragraphs", False)
    if not isinstance(value, bool):
        raise ValueError(f"source {source.name!r}: dedup.exact_paragraphs must be true or false, got {value!r}")
    return value


def dedup_config_from(source: SourceConfig) -> DedupConfig:
    """`dedup:` overrides from the sources YAML; MinHash fields may be given flat."""
    overrides = {k: v for k, v in source.dedup.items() if k not in _OUTPUT_DEDUP_KEYS}
    minhash_fields = {f.name for f in fields(MinHashConfig)}
    dedup_fields = {f.name for f in fields(DedupConfig)} - {"minhash"}
    unknown = set(overrides) - minhash_fields - dedup_fields
    if unknown:
        raise ValueError(f"source {source.name!r}: unknown dedup field(s) {sorted(unknown)}; "
                         f"known: {sorted(minhash_fields | dedup_fields | set(_OUTPUT_DEDUP_KEYS))}")
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
    spec = ArtifactSpec.fixed(f"dedup_index/{group}", DEDUP_INDEX_VERSION,
                              {"dedup": config_identity(dedup_cfg), "sources": [member.name for member in members]})
    ins = {f"shards_{member.name}": all_partitions_in(f"filtered/{member.name}") for member in members}

    @catalog.asset(spec, ins=ins, group_name="curation", kinds={"parquet"}, tags={"marin/dedup_group": group},
                   automation_condition=FOLLOWS_NEW_DATA,
                   description=f"Dedup index of group `{group}` ({', '.join(m.name for m in members)}): shard order, "
                               "each shard's keep/drop decisions, and the LSH and exact keys of kept documents as "
                               f"sorted runs in {dedup_cfg.index_partitions} bucket-hash ranges. Append-only: a new "
                               "shard is checked against the kept documents and earlier decisions stay fixed.")
    def dedup_index(context: dg.AssetExecutionContext, store: MarinStore, data_parallel: DataParallel,
                    **inputs: dict[str, ArtifactHandle]):
        artifacts = store.get()
        handles = [(name[len("shards_"):], key, handle) for name, shards in sorted(inputs.items())
                   for key, handle in sorted(shards.items())]

        def signatures_of(handle: ArtifactHandle):
            with artifacts.open(f"{handle.uri}/signatures.parquet") as fh:
                return load_signatures(fh.read(), expected=dedup_cfg.minhash)

        def shard_input(source: str, shard_key: str, handle: ArtifactHandle) -> ShardInput:
            def load_rows(rows):
                with artifacts.open(f"{handle.uri}/documents.parquet") as fh:
                    return read_parquet_rows(fh, rows)

            return ShardInput(
                source, shard_key, handle.data_version,
                load_docs=lambda: read_parquet(artifacts, f"{handle.uri}/documents.parquet").select(DOCUMENT_COLUMNS),
                load_signatures=lambda: signatures_of(handle), load_rows=load_rows,
                documents=handle.metrics.get("documents"))

        def build(writer) -> Built:
            index = IndexDir(artifacts.fs, artifacts.fs_path(writer.uri))
            # Each new shard's keys, each bucket range's pass and run write, and each shard's colliding
            # rows are units of work: in turn here, or one Ray task each (the loaders above travel to
            # the workers by value).
            update = update_index(index, [shard_input(*h) for h in handles], dedup_cfg,
                                  batch_shards=data_parallel.dedup_batch_shards,
                                  parallel_map=data_parallel.parallel_map(context),
                                  worth_spreading=data_parallel.worth_spreading)
            if update.reset_reason:
                context.log.warning(f"dedup_index/{group} started over: {update.reset_reason}")
            writer.vouch(FileEntry(rel, *entry) for rel, entry in update.files_written.items())
            registry = read_registry(index)
            totals = {"shards": len(registry), "input_docs": sum(s.docs for s in registry),
                      "kept_docs": sum(s.kept for s in registry)}
            return Built(metrics={**totals, **{f"update/{k}": v for k, v in update.stats.items()},
                                  "update/new_shards": len(update.new_shards),
                                  "update/reset": update.reset_reason or ""},
                         metadata={"new_shards": len(update.new_shards)})

        return materialize_artifact(context, store, spec, upstream=[h for *_, h in handles], build=build,
                                    resume=True)

    return dedup_index


def read_parquet(store: ArtifactStore, uri: str) -> pl.DataFrame:
    with store.open(uri) as fh:
        return pl.read_parquet(fh)


def write_parquet(writer, rel: str, frame: pl.DataFrame, row_group_size: int | None = None) -> int:
    data = parquet_bytes(frame, row_group_size)
    with writer.open(rel) as fh:
        fh.write(data)
    return len(data)


class ShardToDeduplicate(NamedTuple):
    """One filtered shard to write into `deduplicated/<source>`: its key, its artifact's URI and its
    sequence number in the dedup index (which names its decisions file)."""

    shard_key: str
    uri: str
    seq: int


@dataclass(frozen=True)
class DeduplicateJob:
    """What every shard's unit of one `deduplicated/<source>` build shares: the store, the URI being
    written, the dedup index, the quality threshold (None: no quality filter) and, with exact paragraph
    dedup, the paragraphs of every shard before (which makes the shards depend on their order)."""

    artifacts: ArtifactStore
    uri: str
    index: IndexDir
    threshold: float | None
    exact_paragraphs: bool
    seen_paragraphs: set[int] = field(default_factory=set)


def deduplicate_shards(shards: list[ShardToDeduplicate], job: DeduplicateJob) -> list[tuple[dict[str, int], int,
                                                                                            list[FileEntry]]]:
    """`deduplicate_shard` of each shard of a group, in order: one task's work."""
    return [deduplicate_shard(shard, job) for shard in shards]


def deduplicate_shard(shard: ShardToDeduplicate, job: DeduplicateJob) -> tuple[dict[str, int], int, list[FileEntry]]:
    """One shard's files of `deduplicated/<source>`: its kept documents (`data/`), what the index
    dropped and why (`duplicates/`), and where set, what the quality threshold dropped and the
    paragraph spans removed. Returns the shard's counts, its dropped documents, and the entries of
    the files it wrote, hashed from the bytes written (the commit takes them instead of reading the
    files back). Without exact paragraph dedup each shard is independent of the others: a unit of work."""
    output = IndexDir(job.artifacts.fs, job.artifacts.fs_path(job.uri))
    written: list[FileEntry] = []

    def write(rel: str, frame: pl.DataFrame) -> None:
        data = parquet_bytes(frame)
        output.write_bytes(rel, data)
        written.append(FileEntry(rel, len(data), hashlib.sha256(data).hexdigest()))

    docs = read_parquet(job.artifacts, f"{shard.uri}/documents.parquet")
    decisions = job.index.read_parquet(decision_path(shard.seq))
    kept = apply_decisions(docs, decisions)
    counts = {"after_dedup": kept.height}
    if job.threshold is not None:
        low = kept["quality_score"] <= job.threshold
        write(f"quality_dropped/{shard.shard_key}.parquet", kept.filter(low).select("id", "source_id", "quality_score"))
        kept = kept.filter(~low)
        counts["quality_dropped"] = int(low.sum())
    if job.exact_paragraphs:
        result = remove_duplicate_paragraphs(kept, job.seen_paragraphs)
        kept = result.documents
        write(f"paragraph_spans/{shard.shard_key}.parquet", result.spans)
        write(f"paragraph_hashes/{shard.shard_key}.parquet",
              pl.DataFrame({"paragraph_hash": pl.Series(result.new_hashes, dtype=pl.UInt64)}))
        counts |= {"paragraph_spans": result.spans.height,
                   "paragraph_chars": int((result.spans["end"] - result.spans["start"]).sum() or 0),
                   "paragraph_emptied": result.emptied.height}
    kept = kept.select(document_columns(kept))
    counts["documents"] = kept.height
    write(f"data/{shard.shard_key}.parquet", kept)
    write(f"duplicates/{shard.shard_key}.parquet", duplicates_table(decisions))
    return counts, decisions.height, written


def language_model_of(source: SourceConfig, config: CurationConfig) -> str | None:
    """The sha256 of the fastText model that identifies ``source``'s languages: the adopted
    ``language_id:`` model, else the pinned lid.176; None where langid does, or nothing does."""
    if not source.filters.languages or source.filters.language_identifier != "fasttext":
        return None
    return config.language_id.model_sha256 if config.language_id is not None else LID176.sha256


def describe_language_id(source: SourceConfig, config: CurationConfig) -> str:
    """What identifies ``source``'s languages, for its description."""
    sha256 = language_model_of(source, config)
    if sha256 is None:
        return "langid.py's model" if source.filters.languages else "switched off"
    model = f"adopted from `{config.language_id.model_uri}`" if config.language_id is not None else LID176.name
    return f"fastText {model}, sha256 {sha256[:12]}..."


def build_refinement_assets(source: SourceConfig, config: CurationConfig, partitions: dg.PartitionsDefinition,
                            documents_key: dg.AssetKey, catalog: Catalog) -> list:
    name = source.name
    dedup_cfg = dedup_config_from(source)
    group = dedup_group_of(source)
    members = dedup_group_members(source, config)
    quality = config.quality if name in config.quality_sources else None
    uses_model = quality is not None and quality.classifier == "fasttext"
    # The steps this source's format skips by declaration (chat data: docs/post-training.md); config.py
    # refuses what only they read (its own filters, a block list, quality scoring, paragraph dedup).
    skipped = skipped_steps(source.format)
    language = None if skipped else language_model_of(source, config)
    language_model = language is not None and config.language_id is not None  # adopted: the language_model asset
    pii = pii_of(source)
    blocklist = read_url_blocklist(source.url_blocklist) if source.url_blocklist is not None else None
    # A format that skips the rules is not defined by their thresholds (the global `filters:` defaults).
    judged = {"skipped_steps": list(skipped)} if skipped else {"filters": config_identity(source.filters)}
    declared_skips = {"skipped_steps": list(skipped)} if skipped else {}
    filtered_identity = {**judged, "minhash": config_identity(dedup_cfg.minhash),
                         "quality_classifier": quality.classifier if quality else None,
                         "score_max_chars": quality.score_max_chars if uses_model else None,
                         "sketch_relative_accuracy": quality.sketch_relative_accuracy if quality else None,
                         "language_model": language,
                         # Present only when used, so a source without them keeps its artifacts.
                         **({"pii": config_identity(pii)} if pii is not None else {}),
                         **({"url_blocklist_sha256": blocklist.sha256} if blocklist is not None else {})}
    exact_paragraphs = exact_paragraphs_of(source)
    dedup_identity = {"dedup": config_identity(dedup_cfg), "group": group, "exact_paragraphs": exact_paragraphs,
                      "quality_threshold": quality is not None, **declared_skips}
    filtered_spec = ArtifactSpec.fixed(f"filtered/{name}", FILTERED_VERSION, filtered_identity,
                                       results=lambda manifest: [shard_line(manifest.metrics)])
    dedup_spec = ArtifactSpec.fixed(f"deduplicated/{name}", DEDUP_VERSION, dedup_identity,
                                    results=lambda manifest: report_lines(manifest.metrics.get("filter_report") or {},
                                                                          int(manifest.metrics["documents"])))

    ins: dict[str, dg.AssetIn] = {"documents": dg.AssetIn(key=documents_key)}
    if uses_model:
        ins["classifier"] = dg.AssetIn(key=asset_key(CLASSIFIER_KEY))
    if language_model:
        ins["language_model"] = dg.AssetIn(key=asset_key(LANGUAGE_MODEL_KEY))

    @catalog.asset(filtered_spec, partitions_def=partitions, ins=ins, tags={"marin/source": name},
                   group_name="curation", kinds={"parquet", "polars"},
                   automation_condition=FOLLOWS_NEW_DATA,
                   description=(f"Conversations of chat source `{name}`, every one kept"
                                + (", with e-mail and public IP addresses replaced by placeholders in their turns "
                                   "and their text rendered again (counts in `pii/*`)" if pii is not None else "")
                                + f". Skipped by declaration for chat data: {', '.join(skipped)} "
                                "(docs/post-training.md). MinHash signatures of their text are cached per shard for "
                                "dedup.") if skipped else
                               f"Documents of `{name}` that pass "
                               + ("the URL block list, " if blocklist is not None else "")
                               + f"language id ({describe_language_id(source, config)}) and the Gopher/C4 heuristics"
                               + (", with e-mail and public IP addresses replaced by placeholders (counts in "
                                  "`pii/*`)" if pii is not None else "")
                               + ", with their attributes (`lang`, `lang_score`"
                               + (f", `quality_score` from the {quality.classifier} classifier, sketched in "
                                  f"`{SKETCH_FILE}` for the corpus-wide threshold" if quality else "")
                               + "). Dropped documents are kept in `dropped.parquet` with their reason; MinHash "
                               "signatures of the kept documents are cached per shard for dedup.")
    def filtered(context: dg.AssetExecutionContext, store: MarinStore, data_parallel: DataParallel,
                 documents: ArtifactHandle, **optional: ArtifactHandle) -> dg.Output[ArtifactHandle]:
        artifacts = store.get()

        def build(writer) -> Built:
            keep_freed_memory()
            docs = read_parquet(artifacts, f"{documents.uri}/documents.parquet")
            if language_model:
                language_bytes = load_model_bytes(artifacts, optional["language_model"])
            elif language is not None:  # the pinned lid.176, read where its package is installed
                try:
                    language_bytes = LID176.read()
                except ModelFileError as exc:
                    raise input_refused(str(exc)) from None
            else:
                language_bytes = None
            task = FilterTask(source.filters, dedup_cfg.minhash, quality,
                              load_model_bytes(artifacts, optional["classifier"]) if uses_model else None,
                              language_bytes, pii,
                              None if blocklist is None else blocklist_bytes(source.url_blocklist, blocklist),
                              chat=source.format == "chat")
            # One piece by default; row ranges of about MARIN_RAY_CHUNK_MB on Ray when chosen. Same bytes either way.
            ranges = data_parallel.ranges(docs["text"].str.len_bytes().to_numpy())
            chunks = [docs.slice(start, end - start) for start, end in ranges]
            result = merge_chunks(data_parallel.map(context, filter_chunk, chunks, task), task)
            kept, dropped = result.kept, result.dropped
            metrics: dict[str, Any] = {}
            if quality is not None:
                scores = kept["quality_score"].to_numpy()
                with writer.open(SKETCH_FILE) as fh:
                    fh.write(score_sketch(scores, quality).encode())
                metrics["quality_score_mean"] = round(float(np.mean(scores)), 6) if len(scores) else None
            if "lang" in kept.columns:
                metrics |= {f"language/{lang}": n for lang, n in sorted(kept.group_by("lang").len().iter_rows())}
            buf = io.BytesIO()
            save_signatures(result.signatures, buf)
            with writer.open("signatures.parquet") as fh:
                fh.write(buf.getvalue())
            write_parquet(writer, "documents.parquet", kept, row_group_size=DOCUMENT_ROW_GROUP)
            write_parquet(writer, "dropped.parquet", dropped)
            total = docs.height
            metrics |= {"input_documents": total, "documents": kept.height, "dropped": dropped.height,
                        "drop_fraction": round(dropped.height / total, 6) if total else 0.0,
                        "kernel": result.kernel,  # compiled or numpy: same bytes, so not in the data version
                        **{f"dropped/{rule}": n for rule, n in sorted(result.counts.items())},
                        **{f"pii/{kind}": n for kind, n in sorted(result.pii.items())},
                        **{f"lines_removed/{rule}": n for rule, n in sorted(result.line_removals.items())},
                        **declared_skips}
            return Built(metrics=metrics, metadata={"dagster/row_count": kept.height, "chunks": len(ranges)})

        upstream = [documents] + [optional[k] for k in ("classifier", "language_model") if k in optional]
        return materialize_artifact(context, store, filtered_spec, upstream=upstream, build=build)

    dedup_ins = {"index": dg.AssetIn(key=dedup_index_key(group))}
    if quality is not None:
        dedup_ins["threshold"] = dg.AssetIn(key=asset_key(THRESHOLD_KEY))

    @catalog.asset(dedup_spec, ins=dedup_ins, tags={"marin/source": name, "marin/dedup_group": group},
                   automation_condition=FOLLOWS_NEW_DATA, group_name="curation", kinds={"parquet"},
                   description=f"`{name}` after exact and fuzzy (MinHash LSH, Jaccard-verified) deduplication against "
                               f"dedup group `{group}`"
                               + (", then the corpus-wide quality threshold (`quality_dropped/<shard>.parquet`)"
                                  if quality else "")
                               + (", then exact paragraph dedup (removed spans in `paragraph_spans/<shard>.parquet`)"
                                  if exact_paragraphs else "")
                               + ". `data/<shard>.parquet` holds each shard's kept documents and "
                               "`duplicates/<shard>.parquet` its dropped ids, with the kept id that replaced each and "
                               "their exact Jaccard. Files of earlier shards are rewritten only when the threshold "
                               "moves."
                               + (" Chat data: the dedup compares each conversation's text rendering and keeps its "
                                  f"turns (`messages`) beside it; skipped by declaration: {', '.join(skipped)}."
                                  if skipped else ""))
    def deduplicated(context: dg.AssetExecutionContext, store: MarinStore, data_parallel: DataParallel,
                     index: ArtifactHandle, **optional: ArtifactHandle) -> dg.Output[ArtifactHandle]:
        artifacts = store.get()
        index_dir = IndexDir(artifacts.fs, artifacts.fs_path(index.uri))
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
        threshold_handle = optional.get("threshold")
        threshold = read_threshold(artifacts, threshold_handle) if threshold_handle is not None else None

        def digest_entry(shard_key: str) -> tuple[str, str, str]:
            return shard_key, shards[shard_key].data_version, decision_sha[decision_path(registered[shard_key].seq)]

        # Shards already written stay byte-identical; the previous commit vouches for them only if
        # their inputs, decisions and the quality threshold are unchanged (an index that started over
        # changes the decisions; a moved threshold changes every shard's kept set).
        previous = artifacts.find(f"deduplicated/{name}", DEDUP_VERSION, None, fingerprint=fingerprint(dedup_identity))
        written = sorted(entry.path[len("data/"):-len(".parquet")] for entry in previous.files
                         if entry.path.startswith("data/")) if previous else []
        reusable = (previous is not None and set(written) <= set(shards)
                    and previous.metrics.get("quality_threshold") == _json_threshold(threshold)
                    and previous.metrics.get("decisions_digest") == decisions_digest(map(digest_entry, written)))

        def build(writer) -> Built:
            # A damaged artifact is built from scratch (`writer.resumed` false): its files are gone, so
            # none is kept, whatever its last commit vouched for (issue 50: it committed an empty one).
            kept = reusable and writer.resumed
            kept_shards = set(written) if kept else set()
            shard_counts: dict[str, dict[str, int]] = dict(previous.metrics.get("shard_counts", {})) if kept else {}
            if not kept:
                for rel in artifacts.list_files(writer.uri):
                    artifacts.fs.rm_file(artifacts.fs_path(f"{writer.uri}/{rel}"))
            new_shards = sorted(set(shards) - kept_shards)
            # Registration order: every reused shard was registered before every new one.
            in_order = sorted(shards, key=lambda key: registered[key].seq)
            job = DeduplicateJob(artifacts, writer.uri, index_dir, threshold, exact_paragraphs)
            units = [ShardToDeduplicate(key, shards[key].uri, registered[key].seq) for key in in_order
                     if key not in kept_shards]
            if exact_paragraphs:
                # A paragraph is removed where an earlier shard holds it: shards in order, here.
                for key in kept_shards:
                    hashes = read_parquet(artifacts, f"{writer.uri}/paragraph_hashes/{key}.parquet")
                    job.seen_paragraphs.update(hashes["paragraph_hash"].to_list())
                written_counts = in_process_map(deduplicate_shard, units, job)
            else:
                # Shards are independent units, grouped into tasks big enough to pay for a worker.
                groups = [units[start:end] for start, end in
                          data_parallel.document_ranges([registered[u.shard_key].docs for u in units])]
                written_counts = [counts for group in data_parallel.map(context, deduplicate_shards, groups, job)
                                  for counts in group]
            stats = {"shards_written": len(units), "documents_written": 0, "dropped_written": 0}
            for unit, (counts, dropped, entries) in zip(units, written_counts):
                writer.vouch(entries)
                shard_counts[unit.shard_key] = counts
                stats["documents_written"] += counts["documents"]
                stats["dropped_written"] += dropped
            present = artifacts.file_stats(writer.uri)
            untouched = set(writer.previous.untouched(present)) if writer.previous is not None else set()
            unaccounted = shards_without_files(shards, kept_shards, set(present), untouched)
            if unaccounted:
                raise dg.Failure(f"deduplicated/{name}: this build holds no data file for {len(unaccounted)} of the "
                                 f"{len(shards)} shards its index accounts for ({', '.join(unaccounted[:5])}); "
                                 "nothing committed")
            entries = [registered[key] for key in shards]
            total = sum(e.docs for e in entries)
            shard_counts = {key: shard_counts[key] for key in sorted(shards)}
            summed = {k: sum(c.get(k, 0) for c in shard_counts.values())
                      for k in ("after_dedup", "quality_dropped", "paragraph_spans", "paragraph_chars",
                                "paragraph_emptied", "documents")}
            documents = summed["documents"]
            report = source_filter_report(artifacts, [shards[key] for key in sorted(shards)], quality is not None,
                                          duplicates=total - summed["after_dedup"],
                                          quality_dropped=summed["quality_dropped"] if quality else None)
            optional_metrics = ({"quality_dropped": summed["quality_dropped"]} if quality else {}) | (
                {k: summed[k] for k in ("paragraph_spans", "paragraph_chars", "paragraph_emptied")}
                if exact_paragraphs else {})
            return Built(metrics={**stats, "input_docs": total, "kept_docs": summed["after_dedup"],
                                  "documents": documents, **optional_metrics,
                                  "drop_fraction": round(1 - documents / total, 6) if total else 0.0,
                                  "quality_threshold": _json_threshold(threshold), "shard_counts": shard_counts,
                                  "decisions_digest": decisions_digest(map(digest_entry, shards)),
                                  # What this build wrote: the schema check reads these, not every shard again.
                                  "written_shards": new_shards, "filter_report": report, **declared_skips},
                         metadata={"dagster/row_count": documents, "shards": len(shards),
                                   "filter_report_table": dg.MetadataValue.md(report_table(report))})

        upstream = [index] + ([threshold_handle] if threshold_handle is not None else [])
        return materialize_artifact(context, store, dedup_spec, upstream=upstream, build=build, resume=True)

    checks = [
        _bound_check(filtered, filtered_spec, "drop_fraction", MAX_FILTER_DROP_FRACTION,
                     input_metric="input_documents"),
        _bound_check(deduplicated, dedup_spec, "drop_fraction", MAX_DEDUP_DROP_FRACTION),
        _schema_check(deduplicated, dedup_spec,
                      (*DOCUMENT_COLUMNS, MESSAGES_COLUMN) if source.format == "chat" else DOCUMENT_COLUMNS),
        _largest_rule_check(deduplicated, dedup_spec),
    ]
    # The group's first source (in YAML order) carries the group's index asset.
    index_assets = [build_dedup_index(group, members, dedup_cfg, catalog)] if members[0] is source else []
    return [filtered, *index_assets, deduplicated, *checks]


def shards_without_files(shards, kept: set[str], present: set[str], untouched: set[str]) -> list[str]:
    """The shards whose data file is not in the artifact about to be committed (``present``: its files),
    or, for a shard this build ``kept`` from the last commit, not as that commit left it (``untouched``):
    a rebuild never commits fewer shards' documents than its inputs account for."""
    return sorted(key for key in shards if f"data/{key}.parquet" not in (untouched if key in kept else present))


def _json_threshold(threshold: float | None) -> float | str | None:
    """The threshold as the manifest's metrics store it (JSON has no infinity)."""
    return "keep all" if threshold == float("-inf") else threshold


def _not_committed(key: str) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, metadata={"error": "no committed artifact"},
                               description=f"no committed {key}")


def _bound_check(asset, spec: ArtifactSpec, metric: str, bound: float, input_metric: str | None = None):
    """`metric` at most `bound`, and some document kept. With `input_metric` (a per-shard step), a
    shard that got no document in (every record quarantined upstream) is empty, not over-filtered."""
    @marin_check(asset, name=f"{metric}_bound",
                    description=f"`{metric}` stays at or under {bound}; a filter or dedup that drops most of a "
                                "corpus is a misconfiguration, not a result.")
    def check(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        manifest = checked_manifest(context, store, spec)
        if manifest is None:
            return _not_committed(spec.key)
        value = float(manifest.metrics.get(metric, 0.0))
        documents = manifest.metrics.get("documents", 0)
        empty_input = input_metric is not None and manifest.metrics.get(input_metric) == 0
        broken = (f"{metric}={value} > bound={bound}" if value > bound else
                  None if documents > 0 or empty_input else "documents=0: no document kept")
        return dg.AssetCheckResult(passed=broken is None, description=broken,
                                   metadata={metric: value, "bound": bound, "documents": documents})
    return check


def source_filter_report(store: ArtifactStore, shards: list, scored: bool, *, duplicates: int,
                         quality_dropped: int | None) -> dict[str, Any]:
    """`filter_report` of a source from its filtered shards' manifests (and, where scored, their
    quality score sketches)."""
    manifests = [store.read_manifest(ref.uri) for ref in shards]
    scores = None
    if scored:
        for ref in shards:
            with store.open(f"{ref.uri}/{SKETCH_FILE}") as fh:
                sketch = QuantileSketch.from_json(fh.read())
            scores = sketch if scores is None else scores.merge(sketch)
    return filter_report([m.metrics for m in manifests if m is not None], duplicates=duplicates,
                         quality_dropped=quality_dropped, scores=scores)


def _largest_rule_check(asset, spec: ArtifactSpec):
    @marin_check(asset, name="no_rule_drops_most",
                 description=f"No single rule (a filter, the language filter, duplicates, the quality threshold) "
                             f"drops more than {MOST:.0%} of the documents read from the source; a warning, with "
                             "the source's filter report.")
    def check(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        manifest = checked_manifest(context, store, spec)
        if manifest is None:
            return _not_committed(spec.key)
        report = manifest.metrics.get("filter_report") or {}
        problem = largest_rule_problem(report)
        return dg.AssetCheckResult(passed=problem is None, severity=dg.AssetCheckSeverity.WARN, description=problem,
                                   metadata={"largest_rule": str(report.get("largest_rule")),
                                             "largest_rule_share": float(report.get("largest_rule_share") or 0.0),
                                             "dropped_share": dg.MetadataValue.json(report.get("dropped_share", {}))})
    return check


def _schema_check(asset, spec: ArtifactSpec, columns: tuple[str, ...]):
    @marin_check(asset, name="document_schema",
                 description=f"Up to {CHECKED_SHARDS_AT_MOST} of the output shards the last build wrote (a "
                             f"sample when it wrote more) have the document columns ({', '.join(columns)}) with "
                             "string types and unique "
                             "ids (earlier shards were checked when they were written and are never rewritten).")
    def check(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        import pyarrow.parquet as pq

        artifacts = store.get()
        manifest = checked_manifest(context, store, spec)
        if manifest is None:
            return _not_committed(spec.key)
        written_shards = manifest.metrics.get("written_shards", [])
        written = {f"data/{shard}.parquet" for shard in checked_shards(written_shards, manifest.data_version)}
        problems, ids, rows = [], set(), 0
        for entry in manifest.files:
            if entry.path not in written:
                continue
            # The schema and the id column only: the texts are most of the bytes and are not read.
            with artifacts.open(f"{manifest.uri}/{entry.path}") as fh:
                parquet = pq.ParquetFile(fh)
                schema = pl.from_arrow(parquet.schema_arrow.empty_table()).schema
                missing = [c for c in columns if schema.get(c) != pl.String]
                if missing:
                    problems.append(f"{entry.path}: missing or non-string {missing}")
                shard_ids = parquet.read(columns=["id"]).column("id").to_pylist() if "id" in schema else []
            rows += len(shard_ids)
            ids.update(shard_ids)
        if len(ids) != rows:
            problems.append(f"{rows - len(ids)} duplicate ids after dedup")
        documents = manifest.metrics.get("documents", 0)
        if documents == 0:
            problems.append("documents=0: no document kept")
        return dg.AssetCheckResult(passed=not problems, description="; ".join(problems) or None,
                                   metadata={"shards_checked": len(written), "shards_written": len(written_shards),
                                             "rows_checked": rows,
                                             "problems": dg.MetadataValue.json(problems)})
    return check
