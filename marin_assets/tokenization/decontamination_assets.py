"""Decontamination assets: `eval_ngrams/<source>` (the n-gram index of the eval text a source must not
contain: its own validation split, its mixture partners', the declared eval sets) and
`decontaminated/<source>` (one partition per deduplicated shard: its training documents that share
eval n-grams dropped, or marked), between `deduplicated/<source>` and `token_shards/<source>`.
Thin wiring over `decontamination.py`; see docs/decontamination.md."""

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marin_assets.automation import FOLLOWS_NEW_DATA, checks_new_shards_and_new_evals
from marin_assets.catalog import Catalog
from marin_assets.tokenization.cache_config import CacheConfig
from marin_assets.tokenization.decontamination import (
    EvalSet,
    EvalSetError,
    SplitNgrams,
    SplitNgramsJob,
    decontaminate,
    eval_set,
    eval_set_texts,
    index_bytes,
    merged_index,
    parquet_bytes,
    read_index,
    split_ngrams,
    validation_threshold_of,
)
from marin_assets.tokenization.ngrams import NORMALIZATION_VERSION, NgramHasher, build_index
from marin_assets.tokenization.registry import (
    DECONTAMINATED_VERSION,
    EVAL_NGRAMS_VERSION,
    TokenizationRegistry,
    TokenizedEntry,
)
from marin_resources.artifact_spec import ArtifactSpec, FileRead
from marin_resources.artifacts import (
    ArtifactHandle,
    Built,
    MarinStore,
    checked_manifest,
    input_of,
    input_refused,
    marin_check,
    materialize_artifact,
)
from marin_resources.config_identity import config_identity
from marin_resources.data_parallel import DataParallel
from marin_resources.keys import asset_key, shard_partitions
from marin_resources.splits import fraction_holds_enough
from marin_resources.storage.store import ArtifactStore


def eval_ngrams_key(source: str) -> str:
    """The eval index a source's shards are checked against."""
    return f"eval_ngrams/{source}"
INDEX_FILE = "ngrams.npy"


def shard_file(shard: str) -> str:
    """The file that holds one shard's documents: in `deduplicated/<source>` (every shard's), and in its
    `decontaminated/<source>` partition, what token_shards encodes (named alike, so the token cache's
    ledger keeps naming its shards by their keys)."""
    return f"data/{shard}.parquet"


def contaminated_file(shard: str, mode: str) -> str:
    """A `decontaminated/<source>` partition's contaminated documents (`id`, `reason`, `contaminated_ngrams`):
    its dropped table (`dropped/<shard>.parquet`), or under `mode: mark` the documents it kept and marked
    (`marked/<shard>.parquet`)."""
    return f"{'marked' if mode == 'mark' else 'dropped'}/{shard}.parquet"


def corpus_file_sizes(store: ArtifactStore, uri: str) -> list[tuple[str, int]]:
    """The corpus's document files, in path order, with their sizes in bytes."""
    manifest = store.read_manifest(uri)
    if manifest is None:
        raise dg.Failure(f"{uri} lost its manifest")
    return [(f"{uri}/{f.path}", f.bytes) for f in sorted(manifest.files, key=lambda f: f.path)
            if f.path.startswith("data/") and f.path.endswith(".parquet")]


def corpus_files(store: ArtifactStore, uri: str) -> list[str]:
    return [path for path, _ in corpus_file_sizes(store, uri)]


def split_identity(entry: TokenizedEntry) -> dict[str, Any]:
    """What decides a source's validation split, as the token cache decides it."""
    cache = entry.cache
    return {"validation_fraction": cache.validation_fraction,
            "validation_min_documents": cache.validation_min_documents, "id_column": cache.id_column,
            "text_column": cache.text_column}


def declared_eval_sets(registry: TokenizationRegistry) -> list[EvalSet]:
    """The registry's eval set files, each checked and hashed (the hash is in every index's identity)."""
    return [eval_set(name, path) for name, path in sorted(registry.decontamination.eval_texts.items())]


def reference_sources(registry: TokenizationRegistry, source: str) -> list[str]:
    """The sources whose validation split ``source``'s training documents must not contain: its own, and
    that of every source it shares a mixture with (a model trained on the mixture is evaluated on them);
    none where the registry checks against its eval sets alone (`validation_splits: false`)."""
    if not registry.decontamination.validation_splits:
        return []
    partners = {c for mixture in registry.mixtures.values() if source in mixture.weights for c in mixture.weights}
    return sorted(({source} | partners) & set(registry.tokenized))


def eval_ngrams_identity(registry: TokenizationRegistry, source: str, sets: list[EvalSet]) -> dict[str, Any]:
    return {"ngram": registry.decontamination.ngram, "normalization": NORMALIZATION_VERSION,
            "validation_splits": {s: split_identity(registry.tokenized[s])
                                  for s in reference_sources(registry, source)},
            "eval_texts": {s.name: s.sha256 for s in sets}}


def build_eval_ngrams_asset(registry: TokenizationRegistry, source: str, sets: list[EvalSet], catalog: Catalog,
                            corpora: Mapping[str, ArtifactSpec]):
    sources = reference_sources(registry, source)
    spec = ArtifactSpec.fixed(eval_ngrams_key(source), EVAL_NGRAMS_VERSION,
                              eval_ngrams_identity(registry, source, sets))
    n = registry.decontamination.ngram
    ins = {f"corpus_{s}": input_of(corpora[s]) for s in sources}
    held = ([f"the validation split of {', '.join(sources)}"] if sources else []) \
        + ([f"the eval sets {', '.join(s.name for s in sets)}"] if sets else [])

    @catalog.asset(spec, ins=ins, group_name="tokenization", kinds={"numpy"}, automation_condition=FOLLOWS_NEW_DATA,
                   tags={"marin/source": source},
                   description=f"The eval text `{source}`'s training documents are checked against, as {n}-gram hashes "
                               f"(lowercased words, punctuation removed; uint64, sorted, distinct: `{INDEX_FILE}`): "
                               + (" and ".join(held) or "none (no eval set, and validation splits not indexed)")
                               + f". decontaminated/{source} drops training documents that share them. A new eval set"
                               + (" or a grown split" if sources else "")
                               + " makes it, and every decontaminated shard, stale.")
    def eval_ngrams(context: dg.AssetExecutionContext, store: MarinStore, data_parallel: DataParallel,
                    **corpora: ArtifactHandle):
        artifacts = store.get()
        current = {name.removeprefix("corpus_"): h for name, h in sorted(corpora.items())}

        def hashed(files: list[tuple[str, int]], cfg: CacheConfig, threshold: float) -> list[SplitNgrams]:
            # Units of about a chunk's bytes of validation text, here or on the resource's workers: hashing
            # it is the work (a file's other documents are only read past), so a corpus whose split is
            # under one chunk stays in this process (at 160 MB, Ray's worker starts cost more than it).
            paths = [path for path, _ in files]
            weights = [int(size * threshold) for _, size in files]
            return data_parallel.parallel_map(context)(
                split_ngrams, [paths[a:b] for a, b in data_parallel.ranges(weights)],
                SplitNgramsJob(cfg, threshold, n))

        def build(writer) -> Built:
            started = time.monotonic()
            parts: list[np.ndarray] = []
            thresholds, held_out, text_bytes = {}, {}, 0
            for source, handle in current.items():
                cfg = registry.tokenized[source].cache
                files = corpus_file_sizes(artifacts, handle.uri)
                # The split's fraction, unless it holds out fewer than the cache's minimum: the units count
                # the corpus as they read it, so only a corpus that small has every id read again, here.
                thresholds[source] = cfg.validation_fraction
                units = hashed(files, cfg, thresholds[source])
                if not fraction_holds_enough(cfg.validation_min_documents, sum(u.corpus_documents for u in units),
                                             sum(u.documents for u in units)):
                    thresholds[source] = validation_threshold_of([path for path, _ in files], cfg)
                    units = hashed(files, cfg, thresholds[source])
                held_out[source] = sum(unit.documents for unit in units)
                text_bytes += sum(unit.text_bytes for unit in units)
                parts.extend(unit.hashes for unit in units)
            for declared in sets:
                try:
                    found = eval_set_texts(declared)
                except EvalSetError as exc:
                    raise input_refused(str(exc)) from None
                held_out[f"eval_set/{declared.name}"] = len(found)
                text_bytes += sum(len(t.encode("utf-8")) for t in found)
                parts.append(build_index(NgramHasher(n), found))
            index = merged_index(parts)
            with writer.open(INDEX_FILE) as fh:
                fh.write(index_bytes(index))
            seconds = time.monotonic() - started
            return Built(metrics={"ngram": n, "ngrams": int(index.size), "eval_documents": held_out,
                                  "thresholds": thresholds, "text_bytes": text_bytes,
                                  "build_seconds": round(seconds, 3)},
                         metadata={"dagster/row_count": int(index.size)})

        return materialize_artifact(context, store, spec, upstream=list(current.values()), build=build)

    return eval_ngrams


def decontaminated_identity(entry: TokenizedEntry) -> dict[str, Any]:
    return {"policy": config_identity(entry.decontamination), "id_column": entry.cache.id_column,
            "text_column": entry.cache.text_column}


def build_decontaminated_asset(entry: TokenizedEntry, catalog: Catalog, corpus: ArtifactSpec, *,
                               indexes_splits: bool, store: Callable[[], ArtifactStore]):
    """``corpus``: the source's `deduplicated/<source>`; ``indexes_splits``: whether the source's index
    holds its validation split (else eval sets alone); ``store``: the store, for automation to see
    which shards' files changed."""
    source, policy = entry.source, entry.decontamination
    key, corpus_key = f"decontaminated/{source}", corpus.key
    spec = ArtifactSpec.fixed(key, DECONTAMINATED_VERSION, decontaminated_identity(entry),
                              file_read=FileRead(corpus_key, shard_file))

    @catalog.asset(spec, partitions_def=shard_partitions(source), group_name="tokenization", kinds={"parquet"},
                   automation_condition=checks_new_shards_and_new_evals(spec, corpus.version,
                                                                        asset_key(eval_ngrams_key(source)), store),
                   ins={"corpus": input_of(corpus),
                        "eval_ngrams": dg.AssetIn(key=asset_key(eval_ngrams_key(source)))},
                   tags={"marin/source": source},
                   description=f"One shard of `{source}` per partition, checked against eval_ngrams/{source}: training "
                               f"documents with at least {policy.min_matching_ngrams} eval n-gram(s) are "
                               + ("dropped (`dropped/<shard>.parquet`, reason `contaminated`)" if policy.mode == "drop"
                                  else "kept as they are and listed in `marked/<shard>.parquet`")
                               + "; its validation documents (the split tokenized/<source> holds out) are kept and are "
                               f"themselves eval text. `data/<shard>.parquet` is what token_shards/{source} encodes.")
    def decontaminated(context: dg.AssetExecutionContext, store: MarinStore, corpus: ArtifactHandle,
                       eval_ngrams: ArtifactHandle):
        artifacts = store.get()
        shard, rel = context.partition_key, shard_file(context.partition_key)
        corpus_manifest = artifacts.read_manifest(corpus.uri)
        version = corpus_manifest.file_version(rel) if corpus_manifest is not None else None
        if version is None:
            raise input_refused(f"{corpus_key} holds no shard {shard!r} ({rel}) yet; materialize {corpus_key} first "
                                f"(marin materialize {key} --partition {shard} plans it)")
        thresholds = eval_ngrams.metrics.get("thresholds") or {}
        # A split the index does not hold (eval sets alone) is taken at the cache's fraction, and its
        # documents are kept whatever eval n-grams they share. Where a validation minimum raises the
        # cache's threshold (a corpus of a few documents), the documents it adds are checked as training.
        threshold = thresholds.get(source) if indexes_splits else entry.cache.validation_fraction
        if threshold is None:
            raise input_refused(f"{eval_ngrams.asset_key} holds no validation split of {source}; materialize it again")
        shard_input = replace(corpus, partition=shard, data_version=version)

        def build(writer) -> Built:
            started = time.monotonic()
            with artifacts.open(f"{eval_ngrams.uri}/{INDEX_FILE}") as fh:
                try:
                    index = read_index(fh.read())
                except ValueError as exc:
                    raise input_refused(f"{eval_ngrams.asset_key} ({eval_ngrams.uri}/{INDEX_FILE}): {exc}") from None
            with artifacts.open(f"{corpus.uri}/{rel}") as fh:
                raw = fh.read()
            table = pq.read_table(pa.BufferReader(raw))
            columns = (entry.cache.id_column, entry.cache.text_column)
            missing = [c for c in columns if c not in table.column_names]
            if missing:
                raise dg.Failure(f"{corpus_key}/{rel}: missing column(s) {missing}")
            result = decontaminate(table, index, NgramHasher(int(eval_ngrams.metrics["ngram"])), threshold, policy,
                                   entry.cache)
            with writer.open(rel) as fh:
                # Marked: the shard's file as it is, so its token_shards partition stays fresh.
                fh.write(parquet_bytes(result.kept) if policy.mode == "drop" else raw)
            with writer.open(contaminated_file(shard, policy.mode)) as fh:
                fh.write(parquet_bytes(result.contaminated_rows))
            seconds = time.monotonic() - started
            text_bytes = sum(len(t.encode("utf-8")) for t in table.column(entry.cache.text_column).to_pylist() if t)
            return Built(metrics={"documents": result.documents, "validation_documents": result.validation_documents,
                                  "contaminated": result.contaminated,
                                  "dropped": result.contaminated if policy.mode == "drop" else 0,
                                  "kept": result.kept.num_rows, "matching_ngrams": result.matching_ngrams,
                                  "mode": policy.mode, "threshold": threshold, "text_bytes": text_bytes,
                                  "decontaminate_seconds": round(seconds, 3)},
                         metadata={"dagster/row_count": result.kept.num_rows})

        return materialize_artifact(context, store, spec, upstream=[shard_input, eval_ngrams], build=build)

    @marin_check(decontaminated, name="contamination",
                 description="No training document of the shard shares eval n-grams (a WARN names how many do: "
                             "dropped, or marked under `mode: mark`).")
    def contamination(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        manifest = checked_manifest(context, store, spec)
        if manifest is None:
            return dg.AssetCheckResult(passed=False, metadata={"error": "no committed shard"})
        found = int(manifest.metrics.get("contaminated", 0))
        verb = "dropped" if policy.mode == "drop" else "marked"
        return dg.AssetCheckResult(
            passed=found == 0, severity=dg.AssetCheckSeverity.WARN,
            description=f"{found} training document(s) share eval n-grams ({verb})" if found else None,
            metadata={"contaminated": found, "documents": int(manifest.metrics.get("documents", 0))})

    return decontaminated, contamination


def build_decontamination_assets(registry: TokenizationRegistry, catalog: Catalog,
                                 corpora: Mapping[str, ArtifactSpec],
                                 store: Callable[[], ArtifactStore]) -> tuple[list, list]:
    """`eval_ngrams/<source>` and `decontaminated/<source>` for every tokenized source, with their checks;
    ``corpora``: each source's `deduplicated/<source>` spec."""
    sets = declared_eval_sets(registry)  # a missing or damaged one: EvalSetError, one line, before anything runs
    assets, checks = [], []
    for entry in registry.tokenized.values():
        assets.append(build_eval_ngrams_asset(registry, entry.source, sets, catalog, corpora))
        decontaminated, check = build_decontaminated_asset(
            entry, catalog, corpora[entry.source], indexes_splits=registry.decontamination.validation_splits,
            store=store)
        assets.append(decontaminated)
        checks.append(check)
    return assets, checks
