"""Dagster side of the artifact store: the store resource, artifact handles, the handle IO
manager, and `materialize_artifact`, which every artifact-producing asset calls.

Large artifacts (shards, caches, checkpoints) are written by the asset itself through the
store. What travels between assets is an `ArtifactHandle`: a small, JSON-able pointer with
the data version. Nothing large is pickled or loaded into memory by the IO layer.
"""

from __future__ import annotations

import functools
import json
import random
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.display import display_metadata
from marin_resources.keys import asset_key, marin_key, stage_owners
from marin_resources.storage.freshness import damage_summary, decide, label_of
from marin_resources.storage.identity import fingerprint as compute_fingerprint
from marin_resources.storage.object_stores import check_store_reachable
from marin_resources.storage.secrets import scrub
from marin_resources.storage.store import ArtifactStore, ArtifactWriter, Manifest, UpstreamRef, producer_info, writing

VERSION_METADATA_KEY = "marin/version"
ALL_PARTITIONS_METADATA_KEY = "marin/all_partitions"
# Run tag: re-hash every file of the artifact and of its inputs instead of the cheap size check.
VERIFY_TAG = "marin/verify"
REFUSED_METADATA_KEY = "marin/refused"
INPUT_CHECKS_IN_FLIGHT = 32


def input_refused(message: str) -> dg.Failure:
    """A step's refusal of its input (a missing piece, a mismatch the user must fix): one line, and
    marked so that the CLI exits 2 for it as for any other refusal, not 1 as for a failed build. An
    asset's retry policy never retries it: another attempt would refuse the same input again."""
    return dg.Failure(description=message, metadata={REFUSED_METADATA_KEY: True}, allow_retries=False)


@dataclass(frozen=True)
class ArtifactHandle:
    """A committed artifact, as passed downstream."""

    asset_key: str
    partition: str | None
    code_version: str
    uri: str
    data_version: str
    metrics: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> ArtifactHandle:
        return cls(manifest.asset_key, manifest.partition, manifest.code_version, manifest.uri,
                   manifest.data_version, dict(manifest.metrics))

    def ref(self) -> UpstreamRef:
        return UpstreamRef(self.asset_key, self.partition, self.data_version, self.uri)


@dataclass
class Built:
    """What a build function returns: metrics for the manifest, extra Dagster metadata for the UI."""

    metrics: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


class MarinStore(dg.ConfigurableResource):
    """Where artifacts live. `prefix` is any fsspec URL; it is a runtime choice and never part of identity."""

    prefix: str = "./local_store"
    storage_options: dict[str, Any] = {}

    def get(self) -> ArtifactStore:
        return _store_for(self.prefix, json.dumps(self.storage_options, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _store_for(prefix: str, storage_options_json: str) -> ArtifactStore:
    store = ArtifactStore(prefix, json.loads(storage_options_json))
    if not store.is_local:
        check_store_reachable(store.fs, store.prefix)  # once per process, before anything is written
    return store


def asset_key_str(key: dg.AssetKey) -> str:
    """The marin key (store path, CLI name) of an asset: see marin_resources.keys."""
    return marin_key(key)


def marin_check(asset: dg.AssetsDefinition, **kwargs: Any):
    """`dg.asset_check` on a marin asset, partitioned as the asset is: each partition's check runs in
    that partition's run, right after its materialization, and the UI shows it on that partition."""
    return dg.asset_check(asset=asset, partitions_def=asset.partitions_def, **kwargs)


def checked_manifest(context: dg.AssetCheckExecutionContext, store: MarinStore, spec: ArtifactSpec) -> Manifest | None:
    """The committed artifact an asset check inspects: the check's partition (none when unpartitioned)."""
    return store.get().find(spec.key, spec.version, asset_partition(context))


# How many of the shards a build wrote an asset check reads back: the check runs in one process, and a
# first build of a large corpus writes tens of thousands of shards (docs/scaling-out.md, "10 TB").
CHECKED_SHARDS_AT_MOST = 4


def checked_shards(written: Sequence[str], seed: str, at_most: int = CHECKED_SHARDS_AT_MOST) -> list[str]:
    """The shards of ``written`` an asset check reads, in ``written``'s order: all of them when there
    are at most ``at_most`` (an append), else a sample drawn with ``seed`` (the artifact's data
    version: the same artifact is always checked on the same shards, and each new version on others)."""
    if len(written) <= at_most:
        return list(written)
    chosen = set(random.Random(seed).sample(sorted(written), at_most))
    return [shard for shard in written if shard in chosen]


def asset_partition(context: dg.AssetExecutionContext | dg.AssetCheckExecutionContext) -> str | None:
    """The partition an asset (or check) is built for; None when it is unpartitioned, also inside a run
    that has a partition (a global step that joined the run of the one shard it was waiting for,
    see the planner's `_follower`), where Dagster's `has_partition_key` is true for every step."""
    if context.op_execution_context.assets_def.partitions_def is None:
        return None
    return context.partition_key


def cpu_seconds() -> float:
    """CPU time of this process's threads plus its finished, waited-for children (a training or
    eval process the build launched); not Ray's workers, which are not its children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def materialize_artifact(
    context: dg.AssetExecutionContext,
    store: MarinStore,
    spec: ArtifactSpec,
    *,
    upstream: Sequence[ArtifactHandle],
    build: Callable[[ArtifactWriter], Built | None],
    resume: bool = False,
    writes_by_rename: bool = False,
    carried: Sequence[ArtifactHandle] = (),
    first_identity: Any = None,
    run_config: Any = None,
    describe: Callable[[Manifest], Mapping[str, Any]] | None = None,
) -> dg.Output[ArtifactHandle]:
    """Build the artifact of ``spec`` unless an identical one is already committed; report it either way.

    The spec's identity of this partition is fingerprinted and stored. Runtime choices must not be in it.
    `carried`: inputs (also in `upstream`) taken as the committed artifact recorded them, whose files a
    resumed build does not read (a token shard its cache already holds). The input check passes them
    over when the build resumes (`writer.resumed`), and checks them as any other when it starts from
    scratch (a damaged artifact) or re-hashes everything (`marin/verify`).
    `first_identity`: the identity of a partition whose spec has none yet, an artifact pinned to the
    inputs of its first build (a trained tokenizer); once committed, the spec reads it back.
    `run_config`: the build's Dagster config, where the spec says it is part of the identity.
    `writes_by_rename`: the build replaces files only by renaming new ones over them (`ArtifactStore.begin`).
    `describe`: UI metadata read from the committed artifact (a plot among its files), added to every
    materialization, a reuse too: the UI shows an asset's latest event, and a reuse is often the
    latest (a checkpoint reused by the run that exports it).
    """
    artifacts = store.get()
    key, version = spec.key, spec.version
    if asset_key_str(context.asset_key) != key:
        raise ValueError(f"asset {asset_key_str(context.asset_key)} materialized with the spec of {key}")
    partition = asset_partition(context)
    if (run_config is None) != (spec.run_config is None):
        raise ValueError(f"{key}: its spec takes a run config {spec.run_config}, the build passed {run_config!r}")
    config = spec.identity(partition) if run_config is None else spec.identity(partition, run_config)
    if config is None:
        if first_identity is None:
            raise ValueError(f"{key}[{partition}]: its spec gives no identity and the build none for a first one")
        config = first_identity
    fp = compute_fingerprint(config)
    refs = [h.ref() for h in upstream]
    full = context.run.tags.get(VERIFY_TAG) == "true"
    check = artifacts.verify if full else artifacts.check_files
    existing = artifacts.find(key, version, partition, fingerprint=fp)
    previous = artifacts.find(key, version, partition) if existing is None else None
    kept = artifacts.find_previous(key, version, partition, fingerprint=fp) if existing is None else None
    decision = decide(existing, config=config, upstream=refs, previous=previous, code_version=version, kept=kept,
                      damage=check(existing) if existing is not None else None, label=label_of(key, partition))

    extra: dict[str, Any] = {}
    if decision.action == "reuse":
        assert existing is not None
        manifest = existing
        # Going back to a config is this: its artifact is still there and becomes the current one.
        if artifacts.point(manifest):
            context.log.info(f"{key}[{partition}]: back to the stored artifact of this config, {manifest.uri}")
            extra["marin/repointed"] = True
        else:
            context.log.info(f"{key}[{partition}] is fresh: {decision.reason}")
    else:
        log = context.log.warning if decision.state == "damaged" else context.log.info
        log(f"building {key}[{partition}]: {decision.reason}")
        # Files of a damaged artifact cannot be trusted to resume from (an incremental builder would
        # see its own ledger and skip the missing part): it is built from scratch.
        resume = resume and decision.state != "damaged"
        unread = {(h.asset_key, h.partition) for h in carried} if resume and not full else set()
        refuse_damaged_inputs(artifacts, [h for h in upstream if (h.asset_key, h.partition) not in unread], full=full)
        started, cpu_started = time.monotonic(), cpu_seconds()
        with writing(artifacts, key, version, partition, fingerprint=fp, run_id=context.run.run_id,
                     resume=resume, writes_by_rename=writes_by_rename) as writer:
            built = build(writer) or Built()
            manifest = writer.commit(config=config, upstream=refs, producer=producer_info(context.run.run_id),
                                     metrics=built.metrics)
        extra.update(built.metadata)
        if resume:
            extra["marin/files_rehash_skipped"] = writer.files_rehash_skipped
        if unread:
            extra["marin/inputs_carried"] = len(unread)  # recorded as the last commit did, not checked again
        if writer.files_vouched:
            extra["marin/files_vouched"] = writer.files_vouched  # hashed by the units that wrote them
        extra["marin/build_seconds"] = round(time.monotonic() - started, 3)
        extra["marin/build_cpu_seconds"] = round(cpu_seconds() - cpu_started, 3)  # what it cost in cores

    if describe is not None:
        extra.update(describe(manifest))
    handle = ArtifactHandle.from_manifest(manifest)
    # The code version is Dagster's own (shown with the definition); the store's path shows in the uri.
    metadata = display_metadata({
        "marin/uri": dg.MetadataValue.path(manifest.uri),
        "marin/manifest": dg.MetadataValue.path(f"{manifest.uri}/.artifact.json"),
        "marin/fingerprint": manifest.fingerprint,
        "marin/reused": decision.action == "reuse",
        "marin/decision": decision.reason,
        "marin/bytes": sum(f.bytes for f in manifest.files),
        "marin/files": len(manifest.files),
        "marin/producer_run_id": str(manifest.producer.get("run_id")),
        **manifest.metrics,
        **extra,
    })
    return dg.Output(handle, metadata=scrub(metadata), data_version=dg.DataVersion(manifest.data_version))


def refuse_damaged_inputs(artifacts: ArtifactStore, upstream: Sequence[ArtifactHandle], *, full: bool) -> None:
    """Fail before reading any input whose stored files or data version do not match its manifest
    (``full``: re-hash them). Inputs outside the store (a source's listing) are checked by their own
    asset; an input read as one of its files (`Manifest.file_version`) by that file alone. A step
    over every shard has tens of thousands of inputs: they are checked `INPUT_CHECKS_IN_FLIGHT` at
    a time, and the first damaged one, in input order, is named."""
    def damage(handle: ArtifactHandle) -> str | None:
        if not handle.uri.startswith(artifacts.prefix + "/"):
            return None
        label = handle.asset_key + (f" --partition {handle.partition}" if handle.partition else "")
        manifest = artifacts.read_manifest(handle.uri)
        if manifest is None:
            return f"input {handle.uri} was withdrawn while this run waited; materialize it again: marin materialize " \
                   f"{label}"
        one_file = manifest.file_of_version(handle.data_version) \
            if handle.data_version != manifest.data_version else None
        problems = artifacts.check_file(manifest, one_file, full=full) if one_file is not None \
            else artifacts.verify(manifest) if full else artifacts.check_files(manifest)
        if not manifest.holds_version(handle.data_version):
            problems.append(f"{handle.uri}: data_version {manifest.data_version[:12]} != "
                            f"{handle.data_version[:12]} handed to this run")
        return f"refusing damaged input {handle.asset_key}: {damage_summary(problems)}; rebuild it: " \
               f"marin materialize {label}" if problems else None

    with ThreadPoolExecutor(max_workers=INPUT_CHECKS_IN_FLIGHT) as pool:
        refused = next((message for message in pool.map(damage, upstream) if message is not None), None)
    if refused is not None:
        raise dg.Failure(refused)


class ArtifactHandleIOManager(dg.ConfigurableIOManager):
    """Stores nothing (the asset committed its manifest) and loads handles from manifests.

    Inputs marked with `marin/all_partitions` metadata receive `{partition: handle}` for every
    upstream partition in scope; other inputs receive the single matching handle.
    """

    store: MarinStore

    def handle_output(self, context: dg.OutputContext, obj: ArtifactHandle) -> None:
        if not isinstance(obj, ArtifactHandle):
            raise TypeError(f"{context.asset_key.to_user_string()} must return an ArtifactHandle, got "
                            f"{type(obj).__name__}; large data goes through the store, not the IO manager")

    def load_input(self, context: dg.InputContext) -> ArtifactHandle | dict[str, ArtifactHandle]:
        upstream = context.upstream_output
        assert upstream is not None
        version = (upstream.definition_metadata or {}).get(VERSION_METADATA_KEY)
        key = asset_key_str(context.asset_key)
        if version is None:
            raise dg.Failure(f"upstream {key} has no {VERSION_METADATA_KEY}; declare it with Catalog.asset(spec)")
        artifacts = self.store.get()
        wants_all = bool((context.definition_metadata or {}).get(ALL_PARTITIONS_METADATA_KEY))
        partitions: list[str | None] = list(context.asset_partition_keys) if context.has_asset_partitions else [None]
        handles = {}
        for partition in partitions:
            manifest = artifacts.find(key, str(version), partition)
            if manifest is None:
                where = f"[{partition}]" if partition else ""
                raise dg.Failure(f"upstream {key}{where} has no committed artifact at code version {version} "
                                 f"under {artifacts.prefix}; materialize it first (marin materialize {key})",
                                 allow_retries=False)
            handles[partition] = ArtifactHandle.from_manifest(manifest)
        if wants_all:
            return {str(p): h for p, h in sorted(handles.items(), key=lambda kv: str(kv[0]))}
        if len(handles) != 1:
            raise dg.Failure(f"input {key} spans {len(handles)} partitions; mark the AssetIn with "
                             f"metadata={{'{ALL_PARTITIONS_METADATA_KEY}': True}} to receive them all")
        return next(iter(handles.values()))


def all_partitions_in(key: str | dg.AssetKey, **kwargs: Any) -> dg.AssetIn:
    """An input that receives every upstream partition as `{partition: ArtifactHandle}`."""
    metadata = {ALL_PARTITIONS_METADATA_KEY: True, **kwargs.pop("metadata", {})}
    return dg.AssetIn(key=key if isinstance(key, dg.AssetKey) else asset_key(key), metadata=metadata, **kwargs)


def input_of(spec: ArtifactSpec, **kwargs: Any) -> dg.AssetIn:
    """An input that reads the artifact ``spec`` declares: another stage's artifact is named by the spec
    its catalog holds, not by a key spelled again here."""
    return dg.AssetIn(key=asset_key(spec.key), **kwargs)


def marin_asset(spec: ArtifactSpec, **asset_kwargs: Any):
    """`dg.asset` for the store-backed artifact of ``spec``.

    The spec's key is the marin key (`filtered/shakespeare`); the Dagster key follows
    marin_resources.keys. Its version is the code version used in storage paths (with the identity
    fingerprint beside it). Where the spec has a partition-independent identity, a short fingerprint
    of it is appended to Dagster's code version too, so that the UI marks the asset stale after a
    config change. The stage's owners are set from `group_name`.
    """
    version = spec.version
    dagster_version = version if spec.code_identity is None \
        else f"{version}+{compute_fingerprint(spec.code_identity)[:8]}"
    metadata = {VERSION_METADATA_KEY: version, **asset_kwargs.pop("metadata", {})}
    owners = asset_kwargs.pop("owners", None) or stage_owners(asset_kwargs.get("group_name", ""))
    return dg.asset(key=asset_key(spec.key), code_version=dagster_version, metadata=metadata, owners=owners,
                    io_manager_key="artifact_io_manager", **asset_kwargs)
