"""Partition discovery, per-partition freshness, and execution of a selection with its stale
upstream. Shared by the `marin` CLI and the sensors, so both see the same partitions. The runs
themselves are submitted and read back through `run_submission.py`."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import dagster as dg

from marin_assets.automation import PLAN_TARGETS_TAG
from marin_assets.catalog import Catalog
from marin_assets.run_submission import (
    OUTSIDE_FAILURE,
    InProcessRuns,
    Log,
    RunProgress,
    RunSubmitter,
    default_parallelism,
    failed_error_checks,
    failure_message,
    process_gone,
    quiet_run_config,
    refused_input,
    step_failures,
    worker_died,
)
from marin_resources.artifacts import VERIFY_TAG, VERSION_METADATA_KEY
from marin_resources.artifacts import asset_key_str as key_str
from marin_resources.dagster_private import DATA_VERSION_TAG
from marin_resources.keys import parse_selection
from marin_resources.new_shard_launcher import launcher_for
from marin_resources.storage.freshness import Decision, damage_summary, decide, label_of
from marin_resources.storage.identity import InvalidPartitionKeyError, fingerprint, validate_partition_key
from marin_resources.storage.stage_index import StageListing, list_stage
from marin_resources.storage.store import ArtifactStore, Manifest, UpstreamRef

CLI_TAG, HOST_TAG, PID_TAG = "marin/cli", "marin/host", "marin/pid"
WORKER_CHECK_S = 2.0  # how often in-flight runs' worker processes are checked for a silent death


@dataclass(frozen=True)
class PartitionState:
    asset_key: str
    partition: str | None
    state: str  # fresh | stale | missing | damaged
    cause: str
    uri: str | None = None
    decision: Decision | None = None
    unrequested: bool = False
    """Missing, never built, and nothing built reads it: what the project declares but has not asked
    for (another sweep, an evaluation never run), not a gap in what it built (`Planner.status`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"asset_key": self.asset_key, "partition": self.partition, "state": self.state, "cause": self.cause,
                "unrequested": self.unrequested,
                "kind": self.decision.kind if self.decision else None, "uri": self.uri,
                "why": self.decision.chain() if self.decision else []}


@dataclass
class StepResult:
    asset_keys: list[str]
    partition: str | None
    ran: bool
    success: bool
    run_id: str | None = None
    seconds: float = 0.0
    manifests: list[str] = field(default_factory=list)
    error: str | None = None
    skipped: bool = False  # not run because a step it reads from did not succeed
    refused: bool = False  # failed by refusing its input (`input_refused`): the CLI exits 2, as for a bad config


@dataclass(frozen=True)
class PlannedStep:
    """One run of a plan: a group of assets sharing a partitions definition, for one partition, run
    after the steps (indices into the plan) whose artifacts it reads."""

    keys: list[dg.AssetKey]
    partition: str | None
    after: frozenset[int]
    serves: int = 0
    """The first of the plan's targets this step is needed for: steps start in that order (the
    targets' order is the caller's priority), then in plan order."""


class RequestError(ValueError):
    """What a command asked for does not exist or cannot be done (an unknown asset or partition, a
    malformed key, --rebuild of what is not stored); the message says which. The CLI refuses it in
    one line (exit 2)."""


def parse_key(key: str) -> dg.AssetKey:
    """The asset a user named: a marin key (`filtered/shakespeare`) or the asset key the UI shows."""
    try:
        return parse_selection(key)
    except ValueError as exc:
        raise RequestError(str(exc)) from None


class Planner:
    def __init__(self, defs: dg.Definitions, catalog: Catalog, store: ArtifactStore, instance: dg.DagsterInstance):
        self.defs, self.catalog, self.store, self.instance = defs, catalog, store, instance
        self.graph = defs.resolve_asset_graph()
        self.refused: dict[str, dict[str, str]] = {}
        # Dynamic partitions name -> its keys, read from the instance once per plan or status: every
        # step and every input of a per-shard asset asked again, O(shards^2) rows at 75,000 shards.
        self._partitions: dict[str, tuple[list[str], frozenset[str]]] = {}
        # Dynamic partitions name -> the keys its discovery listed: partitions a sensor adds after that
        # listing are left to the sensor (this command knows nothing of their files).
        self._listed: dict[str, frozenset[str]] = {}
        self._mappings: dict[tuple[dg.AssetKey, dg.AssetKey], dg.PartitionMapping] = {}
        # (asset key, partition) -> the fingerprint of the identity it wants, during a `status` only.
        self._fingerprints: dict[tuple[dg.AssetKey, str | None], str | None] = {}
        # (asset key, code version) -> its stage's listing, during a `status` only (`_listing`).
        self._listings: dict[tuple[str, str], StageListing] | None = None

    # ---- partitions ------------------------------------------------------------------------
    def discover(self, names: Iterable[str] | None = None) -> dict[str, list[str]]:
        """Run each registered discoverer and add new keys to the instance. Returns the added keys.

        A key the store would refuse is left out and kept in ``self.refused`` (partitions name ->
        key -> reason), so one bad key costs its own partition only, never its siblings or status."""
        added = {}
        for name, discover in sorted(self.catalog.discoverers.items()):
            if names is not None and name not in names:
                continue
            # Read before the listing: a partition a sensor adds meanwhile is not among them, so it is
            # never retired for being missing from a listing older than it.
            known = set(self.instance.get_dynamic_partitions(name))
            keys = []
            for key in discover():
                try:
                    keys.append(validate_partition_key(key))
                except InvalidPartitionKeyError as exc:
                    self.refused.setdefault(name, {})[key] = str(exc)
            new = [k for k in keys if k not in known]
            if new:
                self.instance.add_dynamic_partitions(name, new)
            # A shard whose files were regrouped or removed is retired; its artifacts stay in the store.
            for retired in sorted(known - set(keys)):
                self.instance.delete_dynamic_partition(name, retired)
            added[name] = new
            self._listed[name] = frozenset(keys)
            self._partitions.pop(name, None)
        self.observe_sources(names)
        return added

    def observe_sources(self, names: Iterable[str] | None = None) -> int:
        """Record each source shard's listing fingerprint as the data version of its observable source
        asset (`external/<source>`), where it differs from the last one recorded, so Dagster's own
        staleness (the UI's "Unsynced") sees a changed source as `marin status` does. Returns how
        many observations were recorded."""
        current: dict[dg.AssetKey, dict[str, str]] = {}
        externals = {spec.key: spec.external for spec in self.catalog.specs.values() if spec.external is not None}
        for consumer, external in sorted(externals.items()):
            key = parse_key(consumer)
            pdef = self.graph.get(key).partitions_def if self.graph.has(key) else None
            if pdef is None or (names is not None and getattr(pdef, "name", None) not in names):
                continue
            for partition in self.partitions_of(key):
                for ext_key, version in external(partition).items():
                    if self.graph.has(parse_key(ext_key)):
                        current.setdefault(parse_key(ext_key), {})[partition] = version
        recorded = 0
        for key, versions in current.items():
            last = self.instance.event_log_storage.get_latest_tags_by_partition(
                key, dg.DagsterEventType.ASSET_OBSERVATION, [DATA_VERSION_TAG], asset_partitions=list(versions))
            for partition, version in sorted(versions.items()):
                if last.get(partition, {}).get(DATA_VERSION_TAG) != version:
                    self.instance.report_runless_asset_event(dg.AssetObservation(
                        asset_key=key, partition=partition, tags={DATA_VERSION_TAG: version}))
                    recorded += 1
        return recorded

    def partitions_of(self, key: dg.AssetKey) -> list[str | None]:
        pdef = self.graph.get(key).partitions_def
        if pdef is None:
            return [None]
        if isinstance(pdef, dg.DynamicPartitionsDefinition):
            return list(self._dynamic_partitions(pdef.name)[0])
        return list(pdef.get_partition_keys(dynamic_partitions_store=self.instance))

    def _dynamic_partitions(self, name: str) -> tuple[list[str], frozenset[str]]:
        """The sorted keys of a dynamic partitions definition, and their set, as last read."""
        if name not in self._partitions:
            keys = sorted(self.instance.get_dynamic_partitions(name))
            if name in self._listed:
                keys = [k for k in keys if k in self._listed[name]]
            self._partitions[name] = keys, frozenset(keys)
        return self._partitions[name]

    def has_partition(self, key: dg.AssetKey, partition: str) -> bool:
        pdef = self.graph.get(key).partitions_def
        if isinstance(pdef, dg.DynamicPartitionsDefinition):
            return partition in self._dynamic_partitions(pdef.name)[1]
        return partition in self.partitions_of(key)

    def forget_partitions(self) -> None:
        """Read the dynamic partitions from the instance again when next asked (runs may have added some)."""
        self._partitions.clear()

    def version_of(self, key: dg.AssetKey) -> str | None:
        version = self.graph.get(key).metadata.get(VERSION_METADATA_KEY)
        return None if version is None else str(version)

    def artifact_keys(self) -> list[dg.AssetKey]:
        return [k for k in self.graph.toposorted_asset_keys
                if self.graph.get(k).is_materializable and self.version_of(k) is not None]

    # ---- freshness -------------------------------------------------------------------------
    def parent_partitions(self, key: dg.AssetKey, partition: str | None, parent: dg.AssetKey) -> set:
        """The parent partitions that `key[partition]` reads, following the declared partition mapping."""
        node, pnode = self.graph.get(key), self.graph.get(parent)
        if pnode.partitions_def is None:
            return {None}
        if (key, parent) not in self._mappings:  # Dagster's lookup, asked once per partition otherwise
            self._mappings[(key, parent)] = self.graph.get_partition_mapping(key, parent)
        mapping = self._mappings[(key, parent)]
        if isinstance(mapping, dg.SpecificPartitionsPartitionMapping):
            return {p for p in mapping.partition_keys if self.has_partition(parent, p)}
        if node.partitions_def == pnode.partitions_def and partition is not None:
            return {partition}
        return set(self.partitions_of(parent))

    def starts_from(self, key: dg.AssetKey, partition: str | None) -> list[str]:
        """The partitions of ``key`` itself that ``key[partition]`` starts from and reads (a cooldown's
        base run), from its spec: no Dagster dependency can say so (`ArtifactSpec.starts_from`)."""
        spec = self.catalog.specs.get(key_str(key))
        if spec is None or spec.starts_from is None or partition is None:
            return []
        return spec.starts_from(partition)

    def with_starts(self, key: dg.AssetKey, partitions: Iterable[str | None]) -> list[str | None]:
        """``partitions`` and every partition of ``key`` they start from, transitively, each after the
        ones it starts from (else in the order given): the order their steps must run in."""
        ordered: list[str | None] = []

        def visit(partition: str | None) -> None:
            if partition in ordered:
                return
            for start in self.starts_from(key, partition):
                visit(start)  # run loops are refused when the runs load
            ordered.append(partition)

        for partition in partitions:
            visit(partition)
        return ordered

    def reads(self, key: dg.AssetKey, partition: str | None, parent: dg.AssetKey) -> bool:
        """Whether `key[partition]` reads ``parent``: every declared input, unless the catalog says fewer."""
        spec = self.catalog.specs.get(key_str(key))
        reads = spec.reads if spec is not None else None
        return reads is None or partition is None or key_str(parent) in reads(partition)

    def wanted_identity(self, key: dg.AssetKey, partition: str | None) -> Any | None:
        """The identity config the code wants for ``key[partition]`` now, from its spec (None: not an
        artifact the catalog declares)."""
        spec = self.catalog.specs.get(key_str(key))
        return None if spec is None else spec.identity(partition)

    def wanted_fingerprint(self, key: dg.AssetKey, partition: str | None) -> str | None:
        """The fingerprint of `wanted_identity`; within a `status` computed once per partition (it asks
        for each of 75,000 partitions more than once). A plan computes it afresh each time: an
        identity may read an artifact the plan builds (the token cache's tokenizer)."""
        if (key, partition) in self._fingerprints:
            return self._fingerprints[(key, partition)]
        config = self.wanted_identity(key, partition)
        wanted = None if config is None else fingerprint(config)
        if self._listings is not None:
            self._fingerprints[(key, partition)] = wanted
        return wanted

    def current(self, key: dg.AssetKey, partition: str | None) -> Manifest | None:
        """The committed artifact of the identity the code wants now: found by its config where the
        catalog knows it, else the one the asset last committed or reused (its ref)."""
        wanted = self.wanted_fingerprint(key, partition)
        listing = self._listing(key, partition) if wanted is not None else None
        if listing is not None:
            return listing.find(partition, wanted)
        return self.store.find(key_str(key), self.version_of(key), partition, fingerprint=wanted)

    def _listing(self, key: dg.AssetKey, partition: str | None) -> StageListing | None:
        """The stage's listing of this `status` (`stage_index`), for a partition of a partitioned
        asset; None outside a status, where each lookup reads the store (a plan's runs commit while it
        waits)."""
        if self._listings is None or partition is None:
            return None
        name, version = key_str(key), self.version_of(key)
        if (name, version) not in self._listings:
            self._listings[(name, version)] = list_stage(self.store, name, version)
        return self._listings[(name, version)]

    def state(self, key: dg.AssetKey, partition: str | None, *, verify: bool = False,
              memo: dict | None = None) -> PartitionState:
        """Freshness of one partition, by `freshness.decide` (the rule the asset code applies). Its
        files get the cheap check (listed files present with their recorded sizes), or with `verify`
        a full re-hash; a damaged artifact is never fresh. An input that is not fresh makes this
        partition stale, and the decision keeps the input's own cause (`marin status --why`)."""
        decision, manifest = self._assess(key, partition, verify, {} if memo is None else memo)
        cause = decision.reason
        spec = self.catalog.specs.get(key_str(key))
        note = spec.note if spec is not None else None
        if decision.state == "fresh" and note is not None and manifest is not None:
            cause = note(manifest, self.store) or cause
        return PartitionState(key_str(key), partition, decision.state, cause,
                              manifest.uri if manifest is not None else None, decision)

    def _assess(self, key: dg.AssetKey, partition: str | None, verify: bool,
                memo: dict) -> tuple[Decision, Manifest | None]:
        if (key, partition) in memo:
            return memo[(key, partition)]
        name, version = key_str(key), self.version_of(key)
        label = label_of(name, partition)
        config = self.wanted_identity(key, partition)
        manifest = self.current(key, partition)
        wanted = self.wanted_fingerprint(key, partition)
        listing = self._listing(key, partition) if wanted is not None and not verify else None
        if manifest is None:
            kept = listing.find_previous(partition, wanted) if listing is not None else \
                self.store.find_previous(name, version, partition, fingerprint=wanted)
            previous = None if kept is not None else self._previous(name, version, partition, listing)
            # An unfinished rebuild's inputs are judged by the artifact it keeps, which stays readable.
            memo[(key, partition)] = decide(None, config=config, upstream=[], code_version=version, label=label,
                                            previous=previous, kept=kept), kept
            return memo[(key, partition)]
        damage = self.store.verify(manifest) if verify else \
            listing.check_files(manifest) if listing is not None else self.store.check_files(manifest)
        recorded = manifest.upstream_versions()
        wanted = dict(recorded)  # inputs the planner cannot evaluate are taken as recorded
        decisions: dict[tuple[str, str | None], Decision] = {}
        spec = self.catalog.specs.get(name)
        file_read = spec.file_read if spec is not None else None
        file_parent, file_of = (file_read.parent_key, file_read.file_of) if file_read is not None else (None, None)
        for parent in sorted(self.graph.get(key).parent_keys):
            if self.version_of(parent) is None:
                continue
            pname = key_str(parent)
            parts = self.parent_partitions(key, partition, parent)
            if not any(k == pname for k, _ in recorded) and self.graph.get(parent).partitions_def is None:
                continue  # a declared dependency this partition does not use (e.g. another run's mixture)
            wanted = {k: v for k, v in wanted.items() if k[0] != pname}
            for p in sorted(parts, key=str):
                parent_decision, current = self._assess(parent, p, verify, memo)
                decisions[(pname, p)] = parent_decision
                if pname == file_parent and partition is not None:  # reads its own file of the parent
                    version = current.file_version(file_of(partition)) if current is not None \
                        else recorded.get((pname, partition))
                    wanted[(pname, partition)] = version or "absent"
                elif current is not None:
                    wanted[(pname, p)] = current.data_version
                elif (pname, p) in recorded:
                    wanted[(pname, p)] = recorded[(pname, p)]  # missing: said by its decision, not as new data
        for start in self.starts_from(key, partition):  # a cooldown reads its base's checkpoint
            start_decision, current = self._assess(key, start, verify, memo)
            decisions[(name, start)] = start_decision
            if current is not None:
                wanted[(name, start)] = current.data_version
        external = spec.external if spec is not None else None
        if external is not None:
            wanted.update({(ext_key, partition): v for ext_key, v in external(partition).items()})
        upstream = [UpstreamRef(k, p, v, "") for (k, p), v in wanted.items()]
        memo[(key, partition)] = decide(manifest, config=config if config is not None else manifest.config,
                                        upstream=upstream, damage=damage, upstream_decisions=decisions,
                                        code_version=version, label=label), manifest
        return memo[(key, partition)]

    def _previous(self, name: str, version: str, partition: str | None,
                  listing: StageListing | None = None) -> Manifest | None:
        """What was current before the wanted identity: this code version's ref, else the newest older
        code version's. A stage's ``listing`` says which refs exist: only those are read."""
        versions = listing.code_versions if listing is not None else self.store.code_versions(name)
        for v in [version, *reversed([v for v in versions if v != version])]:
            if listing is not None and not listing.has_ref(v, partition):
                continue
            manifest = self.store.find(name, v, partition)
            if manifest is not None:
                return manifest
        return None

    def status(self, keys: Iterable[dg.AssetKey] | None = None, *, verify: bool = False) -> list[PartitionState]:
        for key in keys or ():
            self.require_asset(key)
        self.forget_partitions()
        memo: dict = {}
        # One listing a stage, with its index of manifests, instead of reads per partition; not for
        # --verify, which reads and re-hashes every artifact.
        self._listings = None if verify else {}
        try:
            states = [self.state(k, p, verify=verify, memo=memo) for k in (keys or self.artifact_keys())
                      for p in self.partitions_of(k)]
            unrequested = self.unrequested(keys or self.artifact_keys(), verify=verify, memo=memo)
        finally:
            for listing in (self._listings or {}).values():
                listing.finish()
            self._listings = None
            self._fingerprints.clear()
        return [replace(s, unrequested=True) if (s.asset_key, s.partition) in unrequested else s for s in states]

    def unrequested(self, keys: Iterable[dg.AssetKey], *, verify: bool = False,
                    memo: dict | None = None) -> set[tuple[str, str | None]]:
        """The partitions of ``keys`` never built that nothing built reads: neither they nor any
        partition downstream that reads them (through the partition mappings, as a plan does) was
        ever committed. A new shard of a source whose corpus was built is not among them (the corpus
        reads it); the partitions of a sweep nobody ran, or an evaluation never asked for, are."""
        memo = {} if memo is None else memo
        keys = set(keys)
        scope = dg.AssetSelection.assets(*keys).downstream().resolve(self.graph)
        ordered = [k for k in self.artifact_keys() if k in scope]
        wanted: set[tuple[dg.AssetKey, str | None]] = set()
        unread: set[tuple[str, str | None]] = set()
        for key in reversed(ordered):  # every reader before what it reads
            for partition in self.partitions_of(key):
                decision = self.state(key, partition, verify=verify, memo=memo).decision
                if (key, partition) not in wanted and decision is not None and decision.never_built:
                    if key in keys:
                        unread.add((key_str(key), partition))
                    continue
                for parent in self.graph.get(key).parent_keys:
                    if self.version_of(parent) is not None and self.reads(key, partition, parent):
                        wanted.update((parent, p) for p in self.parent_partitions(key, partition, parent))
        return unread

    # ---- execution -------------------------------------------------------------------------
    def plan(self, target: dg.AssetKey, partition: str | None) -> list[tuple[list[dg.AssetKey], list[str | None]]]:
        """`plan_all` of one target."""
        return self.plan_all([(target, partition)])

    def plan_all(self, targets: list[tuple[dg.AssetKey, str | None]]
                 ) -> list[tuple[list[dg.AssetKey], list[str | None]]]:
        """The targets plus their upstream as groups: assets sharing a partitions definition run together.

        An asset's stage is one past its latest parent with a different partitions definition, so
        a group never needs an asset from a later group; groups are listed in stage order.
        """
        for target, partition in targets:
            self.require_asset(target)
            if partition is not None and self.graph.get(target).partitions_def is None:
                raise RequestError(f"{key_str(target)} is not partitioned; drop --partition")
        wanted = dg.AssetSelection.assets(*[t for t, _ in targets]).upstream().resolve(self.graph)
        ordered = [k for k in self.graph.toposorted_asset_keys if k in wanted and self.graph.get(k).is_materializable]
        stage: dict[dg.AssetKey, int] = {}
        for key in ordered:
            pdef = self.graph.get(key).partitions_def
            stage[key] = max((stage[p] + (self.graph.get(p).partitions_def != pdef)
                              for p in self.graph.get(key).parent_keys if p in stage), default=0)
        # Partitions each asset must provide: the targets', then what each child reads, through
        # the partition mappings (a sweep fit reads only its own runs' evals).
        needed: dict[dg.AssetKey, set] = {}
        for target, partition in targets:
            needed.setdefault(target, set()).update(
                {partition} if partition is not None else self.partitions_of(target))
        for key in reversed(ordered):
            if key in needed:
                needed[key] = set(self.with_starts(key, needed[key]))
            for parent in self.graph.get(key).parent_keys:
                if parent in stage:
                    needed.setdefault(parent, set()).update(
                        p for child_part in needed.get(key, ()) if self.reads(key, child_part, parent)
                        for p in self.parent_partitions(key, child_part, parent))
        for key in ordered:  # a whole-corpus step over a source that discovery found empty builds nothing
            if self.graph.get(key).partitions_def is None and needed.get(key):
                for parent in self.graph.get(key).parent_keys:
                    pdef = self.graph.get(parent).partitions_def if parent in stage else None
                    if isinstance(pdef, dg.DynamicPartitionsDefinition) and not needed.get(parent):
                        raise RequestError(f"{key_str(key)} would be built from nothing: {key_str(parent)} has "
                                           f"no partitions (discovery found none for {pdef.name}; does the "
                                           "source's uri match any file?)")
        groups: dict[tuple[int, str], list[dg.AssetKey]] = {}
        for key in (k for k in ordered if needed.get(k)):  # upstream of the targets, but read by none of them
            pdef = self.graph.get(key).partitions_def
            groups.setdefault((stage[key], repr(pdef)), []).append(key)
        planned = []
        for (_, _), keys in sorted(groups.items(), key=lambda kv: kv[0]):
            parts = sorted(set().union(*(needed.get(k, set()) for k in keys)), key=lambda p: (p is not None, str(p)))
            for key in keys:  # a partition's step after the steps of those it starts from
                parts = self.with_starts(key, parts)
            if parts:
                planned.append((keys, parts))
        return planned

    def steps_of(self, targets: list[tuple[dg.AssetKey, str | None]]) -> list[PlannedStep]:
        """The plan as steps, one per group and partition (one Dagster run each), in plan order, each
        naming the earlier steps whose artifacts it reads."""
        planned = self.plan_all(targets)
        group_of = {key: g for g, (keys, _) in enumerate(planned) for key in keys}
        index: dict[tuple[int, str | None], int] = {}
        steps: list[PlannedStep] = []
        for g, (keys, parts) in enumerate(planned):
            for part in parts:
                after = {index[(group_of[parent], p)]
                         for key in keys for parent in self.graph.get(key).parent_keys
                         if group_of.get(parent, g) != g
                         for p in self.parent_partitions(key, part, parent) if (group_of[parent], p) in index}
                after |= {index[(g, start)] for key in keys for start in self.starts_from(key, part)
                          if (g, start) in index}
                index[(g, part)] = len(steps)
                steps.append(PlannedStep(keys, part, frozenset(after)))
        serves = [len(targets)] * len(steps)
        for t, (target, partition) in enumerate(targets):
            reached = [i for i, step in enumerate(steps)
                       if target in step.keys and (partition is None or step.partition == partition)]
            while reached:
                i = reached.pop()
                if serves[i] > t:
                    serves[i] = t
                    reached.extend(steps[i].after)
        return [replace(step, serves=serves[i]) for i, step in enumerate(steps)]

    def reap_orphaned_runs(self, log: Log = print) -> list[str]:
        """Mark runs of this CLI whose process died (kill -9, OOM, power) as failed, and free their
        pool slots; without a daemon nothing else would, and the next training would wait forever."""
        reaped = []
        active = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.NOT_STARTED]
        for record in self.instance.get_run_records(dg.RunsFilter(statuses=active, tags={CLI_TAG: "materialize"})):
            run = record.dagster_run
            host = run.tags.get(HOST_TAG)
            # A launched run lives in its own worker process, which outlives a killed CLI.
            pid = self.run_worker_pid(run.run_id) or run.tags.get(PID_TAG)
            if host != socket.gethostname() or not pid or int(pid) == os.getpid() or not process_gone(pid):
                continue
            self.fail_orphaned_run(run, f"the process running it (pid {pid}) is gone")
            log(f"  marked run {run.run_id[:8]} failed: its process {pid} died; freed its pool slots")
            reaped.append(run.run_id)
        return reaped

    def fail_orphaned_run(self, run: dg.DagsterRun, why: str) -> None:
        self.instance.report_run_failed(run, why)
        self.instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)

    def lost_worker(self, run_id: str) -> str | None:
        """Why a launched, unfinished run will never finish: its worker process on this host is gone
        (killed, out of memory) without reporting an end. None while it may still be working.

        Only runs of the DefaultRunLauncher have a local worker; on a cluster Dagster's run
        monitoring (the daemon) fails the run of a lost pod."""
        pid = self.gone_worker_pid(run_id)
        if pid is None:
            return None
        # The worker writes the run's end before it exits: read the record after seeing it gone.
        run = self.instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            return None
        why = worker_died(pid)
        self.fail_orphaned_run(run, why)
        return why

    def gone_worker_pid(self, run_id: str) -> str | None:
        """The pid of a run's local worker process when that process is gone; None otherwise."""
        # The instance's launcher may wrap the local one (NewShardRunLauncher): ask who launched this run.
        run = self.instance.get_run_by_id(run_id)
        if run is None or not isinstance(launcher_for(self.instance.run_launcher, run), dg.DefaultRunLauncher):
            return None
        pid = self.run_worker_pid(run_id)
        return pid if pid is not None and process_gone(pid) else None

    def run_worker_pid(self, run_id: str) -> str | None:
        """The pid a run worker reported when it started (its engine event), if it was launched."""
        for entry in self.instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
            data = entry.dagster_event.event_specific_data if entry.dagster_event else None
            pid = getattr(data, "metadata", {}).get("pid") if data is not None else None
            if pid is not None and entry.dagster_event.message.startswith("Started process for run"):
                return str(pid.value)
        return None

    def failed_checks_of_producers(self, keys: list[dg.AssetKey], partition: str | None) -> list[str]:
        """Failed ERROR checks of the runs that built the committed artifacts of ``keys[partition]``."""
        runs = set()
        for key in keys:
            if self.version_of(key) is not None:
                manifest = self.current(key, partition)
                if manifest is not None and manifest.producer.get("run_id"):
                    runs.add(manifest.producer["run_id"])
        wanted = {key_str(k) for k in keys}
        evaluations = [entry.dagster_event.event_specific_data
                       for run_id in sorted(runs)
                       for entry in self.instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
                       if entry.dagster_event is not None]
        return failed_error_checks([e for e in evaluations if key_str(e.asset_key) in wanted])

    def require_asset(self, target: dg.AssetKey) -> None:
        if target not in self.graph.get_all_asset_keys():
            known = ", ".join(sorted(key_str(k) for k in self.artifact_keys()))
            raise RequestError(f"unknown asset {key_str(target)!r}; known: {known}")

    def require_partition(self, target: dg.AssetKey, partition: str | None) -> None:
        """Refuse a partition the asset does not have (RequestError naming the known ones), before any
        path is built from it."""
        if partition is None:
            return
        pdef = self.graph.get(target).partitions_def
        if pdef is None:
            raise RequestError(f"{key_str(target)} is not partitioned; drop --partition")
        if not self.has_partition(target, partition):
            known = ", ".join(str(p) for p in self.partitions_of(target)) or "none"
            raise RequestError(f"{key_str(target)} has no partition {partition!r}; known: {known}")

    def retract(self, target: dg.AssetKey, partition: str | None, log: Log = print) -> str | None:
        """Withdraw the committed artifact of one asset partition (``marin materialize --rebuild``), e.g.
        one committed with incomplete metrics; returns where its manifest is kept, or None if none.
        A training run resumes from the checkpoints in its directory and nothing is deleted, unless
        the artifact fails verification: then its files are cleared. A partition another writer
        holds raises ArtifactLockedError and stays as it is."""
        self.require_asset(target)
        name, version = key_str(target), self.version_of(target)
        if version is None:
            raise RequestError(f"{name} is not a stored artifact; nothing to rebuild")
        if self.graph.get(target).partitions_def is not None and partition is None:
            raise RequestError(f"{name} is partitioned: --rebuild needs --partition (it withdraws one partition)")
        self.require_partition(target, partition)
        manifest = self.current(target, partition)
        label = name + (f" [{partition}]" if partition else "")
        if manifest is None:
            log(f"  retract {label}: nothing committed at {version}")
            return None
        # A damaged artifact's files cannot be resumed from: clear them so it is built from scratch.
        damage = self.store.verify(manifest)
        kept = self.store.retract(manifest, run_id=f"rebuild-{uuid.uuid4().hex[:8]}", clear=bool(damage))
        log(f"  retract {label}  (manifest kept as {kept})")
        if damage:
            log(f"  retract {label}: {damage_summary(damage)}; its files are cleared, it is built from scratch")
        return kept

    def materialize(self, target: dg.AssetKey, partition: str | None, **options) -> list[StepResult]:
        """`materialize_all` of one target."""
        return self.materialize_all([(target, partition)], **options)

    def materialize_all(self, targets: list[tuple[dg.AssetKey, str | None]], *, log: Log = print,
                        run_config: dict | None = None, force: bool = False, verify: bool = False,
                        runs: RunSubmitter | None = None, max_parallel: int | None = None,
                        last_plan: bool = True) -> list[StepResult]:
        """Run the stale, missing or damaged steps of the targets' plan. With `verify`, every
        committed artifact in the plan is re-hashed before it counts as fresh, and every build
        re-hashes the inputs it reads.

        Every step (a group of assets for one partition) is its own Dagster run, submitted through
        ``runs`` as soon as the steps it reads from have succeeded, with at most ``max_parallel`` in
        flight (default: `default_parallelism`), in the order of the targets they serve, then in plan
        order; pools still bound each asset. So independent partitions and branches overlap.
        A step is judged fresh or not only when it is ready, after its inputs were built. A failed
        step does not stop its siblings; the steps that read it are not run, and say why. With
        `last_plan` (no plan follows on ``runs``), ``runs`` is told before its last run starts
        (`RunSubmitter.no_more_runs`)."""
        self.reap_orphaned_runs(log)
        self.forget_partitions()  # an earlier plan's runs may have added partitions
        for target, partition in targets:
            self.require_partition(target, partition)
        runs = runs or InProcessRuns(self.defs, self.instance)
        limit = max(1, min(max_parallel or default_parallelism(self.instance), runs.max_parallel))
        tags = {CLI_TAG: "materialize", HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()),
                # Automation leaves to this plan what it builds itself (marin_assets/automation.py).
                PLAN_TARGETS_TAG: ",".join(sorted({t.to_user_string() for t, _ in targets})),
                **({VERIFY_TAG: "true"} if verify else {})}
        run_config = run_config or quiet_run_config()
        steps = self.steps_of(targets)
        # Assessments of finished steps and their inputs: only a step whose inputs are all finished is
        # assessed, and a step that is then built drops its own entries when it ends.
        memo: dict = {}
        results: dict[int, StepResult] = {}
        # A step's inputs serve at least the targets it serves, so they still come before it.
        pending, in_flight = sorted(range(len(steps)), key=lambda i: (steps[i].serves, i)), {}
        next_health_check = time.monotonic() + WORKER_CHECK_S
        # Ready steps judged stale and waiting for a slot: a verdict stays, since their inputs are done.
        stale: set[int] = set()
        progress = RunProgress(self.instance, log)
        while pending or in_flight:
            # Every ready step is judged first, then the stale ones start: so a step whose siblings
            # all turn out fresh can take along the global step that reads them (`_follower`).
            for i in list(pending):
                if i in stale:
                    continue
                step = steps[i]
                unfinished = [d for d in step.after if d not in results]
                failed = [d for d in step.after if d in results and not results[d].success]
                if failed:
                    pending.remove(i)
                    # A failure propagates as a skip, so each failure is reported once, where it happened.
                    log(f"  skip    {self._label(step)}  (input {self._label(steps[failed[0]])} did not succeed)")
                    results[i] = StepResult([key_str(k) for k in step.keys], step.partition, False, False,
                                            error="skipped: an input did not succeed", skipped=True)
                    continue
                if unfinished:
                    continue
                fresh = None if force else self._fresh_result(step, verify, memo, log)
                if fresh is not None:
                    pending.remove(i)
                    results[i] = fresh
                    continue
                stale.add(i)
            for i in [j for j in pending if j in stale]:  # in pending's (start) order
                if len(in_flight) >= limit:
                    break
                step = steps[i]
                pending.remove(i)
                stale.discard(i)
                log(f"  build   {self._label(step)}  ({self._causes(step, verify, memo) or 'forced'})")
                follower = self._follower(i, steps, pending, results)
                group = [i] if follower is None else [i, follower]
                if follower is not None:
                    pending.remove(follower)
                    log(f"          with {self._label(steps[follower])} in the same run (it reads it, and "
                        "nothing else it reads is left to build)")
                keys = [k for g in group for k in steps[g].keys]
                if last_plan and not pending:
                    runs.no_more_runs()
                run_id = runs.submit(keys, self._checks_of(keys), step.partition, run_config, tags)
                in_flight[run_id] = (group, time.monotonic())
            finished = [(run_id, run) for run_id in in_flight
                        if (run := self.instance.get_run_by_id(run_id)) is not None and run.is_finished]
            for run_id, (group, _) in in_flight.items():
                progress.show(run_id, self._label(steps[group[0]]))
            if not finished:
                if time.monotonic() >= next_health_check:
                    next_health_check = time.monotonic() + WORKER_CHECK_S
                    for run_id, (group, _) in list(in_flight.items()):
                        why = self.lost_worker(run_id)
                        if why:
                            log(f"          {self._label(steps[group[0]])}: {why}")
                time.sleep(0.2)
                continue
            for run_id, run in finished:
                group, started = in_flight.pop(run_id)
                seconds = round(time.monotonic() - started, 2)
                for position, i in enumerate(group):
                    step = steps[i]
                    for key in step.keys:
                        memo.pop((key, step.partition), None)
                    if position and not results[group[0]].success:
                        # Built on an input that failed (e.g. an ERROR check after its materialization):
                        # what this run committed for it is withdrawn, as if it had not run.
                        withdrawn = self._withdraw(step.keys, run_id)
                        log(f"  skip    {self._label(step)}  (input {self._label(steps[group[0]])} did not succeed"
                            + (f"; withdrew what this run committed for {', '.join(withdrawn)})" if withdrawn else ")"))
                        results[i] = StepResult([key_str(k) for k in step.keys], step.partition, False, False,
                                                error="skipped: an input did not succeed", skipped=True)
                        continue
                    result = self._run_result(step.keys, step.partition, run, seconds, alone=len(group) == 1)
                    if result.success:
                        log(f"          {self._label(step)}: done in {result.seconds:.1f}s (run {run_id[:8]})")
                    else:
                        log(f"          {self._label(step)}: FAILED (run {run_id}): {result.error}")
                    # Also after a failed ERROR check: what was committed says why (a rule that dropped most).
                    for line in self.results_of(step, run_id):
                        log(f"          {line}")
                    results[i] = result
        return [results[i] for i in sorted(results)]

    def results_of(self, step: PlannedStep, run_id: str) -> list[str]:
        """What run ``run_id`` of the step committed, as its assets' specs word it
        (`ArtifactSpec.results`), each asset's lines under its name: the eval loss, the export's path,
        curation's drops by rule. An artifact the run reused, or none it committed, says nothing."""
        lines = []
        for key in step.keys:
            spec = self.catalog.specs.get(key_str(key))
            manifest = self.current(key, step.partition) if spec is not None and spec.results is not None else None
            built = manifest is not None and manifest.producer.get("run_id") == run_id
            results = spec.results(manifest) if built else []
            if results:
                label = key_str(key) + (f" [{step.partition}]" if step.partition else "")
                lines += [f"{label}: {results[0]}", *results[1:]]
        return lines

    @staticmethod
    def _label(step: PlannedStep) -> str:
        return ", ".join(key_str(k) for k in step.keys) + (f" [{step.partition}]" if step.partition else "")

    def _states(self, step: PlannedStep, verify: bool, memo: dict) -> list[PartitionState]:
        return [self.state(k, step.partition, verify=verify, memo=memo) for k in step.keys
                if self.version_of(k) is not None]

    def _causes(self, step: PlannedStep, verify: bool, memo: dict) -> str:
        return "; ".join(f"{s.asset_key}: {s.cause}" for s in self._states(step, verify, memo) if s.state != "fresh")

    def _fresh_result(self, step: PlannedStep, verify: bool, memo: dict, log: Log) -> StepResult | None:
        """The result of a step whose artifacts are all fresh (nothing to run), else None."""
        states = self._states(step, verify, memo)
        if not states or any(s.state != "fresh" for s in states):
            return None
        result = StepResult([key_str(k) for k in step.keys], step.partition, False, True,
                            manifests=[f"{s.uri}/.artifact.json" for s in states])
        # A reused artifact keeps the verdict of the checks that ran when it was built.
        failed = self.failed_checks_of_producers(step.keys, step.partition)
        if failed:
            result.success, result.error = False, f"ERROR check(s) failed when built: {'; '.join(failed)}"
            log(f"  fresh   {self._label(step)}, but {result.error}")
        else:
            log(f"  fresh   {self._label(step)}")
        return result

    def _checks_of(self, keys: list[dg.AssetKey]) -> list[dg.AssetCheckKey]:
        return [c for c in self.graph.asset_check_keys if c.asset_key in keys]

    def _follower(self, i: int, steps: list[PlannedStep], pending: list[int], results: dict[int, StepResult]
                  ) -> int | None:
        """An unpartitioned step that reads step ``i`` and nothing else still to build: it joins
        ``i``'s run. So one new shard is one run through the global steps after it (its partition,
        then dedup and the token cache), not two; a first build, where sibling shards are still
        running when the last one starts, is unchanged. A follower that turns out fresh is a reuse
        inside the run (`materialize_artifact`)."""
        if steps[i].partition is None:
            return None
        for j in pending:
            step = steps[j]
            if step.partition is None and i in step.after and all(
                    d == i or (d in results and results[d].success) for d in step.after):
                return j
        return None

    def _withdraw(self, keys: list[dg.AssetKey], run_id: str) -> list[str]:
        """Retract the unpartitioned artifacts of ``keys`` that run ``run_id`` committed; their names."""
        withdrawn = []
        for key in keys:
            manifest = self.current(key, None) if self.version_of(key) is not None else None
            if manifest is not None and manifest.producer.get("run_id") == run_id:
                self.store.retract(manifest, run_id=f"withdraw-{run_id[:8]}")
                withdrawn.append(key_str(key))
        return withdrawn

    def _run_result(self, keys: list[dg.AssetKey], part: str | None, run: dg.DagsterRun, seconds: float, *,
                    alone: bool = True) -> StepResult:
        """What a finished run did for ``keys``, from its record and event log in the instance. In a
        failed run that also held other steps (not ``alone``), the keys succeeded if each was
        materialized and each of their checks was evaluated (a check that raised has no evaluation)."""
        evaluations = [d for e in self.instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
                       if e.dagster_event is not None
                       and (d := e.dagster_event.event_specific_data).asset_key in keys]
        failed = failed_error_checks(evaluations)
        ok = run.status == dg.DagsterRunStatus.SUCCESS
        if not ok and not alone:
            materialized = {e.dagster_event.asset_key for e in
                            self.instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
                            if e.dagster_event is not None}
            evaluated = {(d.asset_key, d.check_name) for d in evaluations}
            ok = all(k in materialized for k in keys) and all(
                (c.asset_key, c.name) in evaluated for c in self._checks_of(keys))
        step = StepResult([key_str(k) for k in keys], part, True, ok and not failed, run.run_id, seconds)
        if step.success:
            step.manifests = [f"{self.current(k, part).uri}/.artifact.json"
                              for k in keys if self.version_of(k) is not None]
        elif ok:
            step.error = f"ERROR check(s) failed: {'; '.join(failed)}"
        else:
            failures = step_failures(self.instance, run.run_id)
            step.error = failure_message(self.instance, run.run_id, failures)
            # The code server that started a killed worker may mark its run failed before the
            # planner's health check does, with Dagster's generic message: name the cause instead.
            if OUTSIDE_FAILURE in step.error and (pid := self.gone_worker_pid(run.run_id)):
                step.error = step.error.replace(OUTSIDE_FAILURE, worker_died(pid))
            step.refused = refused_input(failures)
        return step
