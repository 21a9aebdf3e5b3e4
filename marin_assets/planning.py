"""Partition discovery, per-partition freshness, and execution of a selection with its stale
upstream. Shared by the `marin` CLI and the sensors, so both see the same partitions."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from marin_assets.catalog import Catalog
from marin_resources.artifacts import VERIFY_TAG, VERSION_METADATA_KEY
from marin_resources.artifacts import asset_key_str as key_str
from marin_resources.failures import describe_check
from marin_resources.freshness import damage_summary
from marin_resources.identity import InvalidPartitionKeyError, changed_fields, fingerprint, validate_partition_key
from marin_resources.store import ArtifactStore

Log = Callable[[str], None]
CLI_TAG, HOST_TAG, PID_TAG = "marin/cli", "marin/host", "marin/pid"


@dataclass(frozen=True)
class PartitionState:
    asset_key: str
    partition: str | None
    state: str  # fresh | stale | missing | damaged
    cause: str
    uri: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"asset_key": self.asset_key, "partition": self.partition, "state": self.state, "cause": self.cause,
                "uri": self.uri}


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


def parse_key(key: str) -> dg.AssetKey:
    return dg.AssetKey([p for p in key.split("/") if p])


class Planner:
    def __init__(self, defs: dg.Definitions, catalog: Catalog, store: ArtifactStore, instance: dg.DagsterInstance):
        self.defs, self.catalog, self.store, self.instance = defs, catalog, store, instance
        self.graph = defs.resolve_asset_graph()
        self.refused: dict[str, dict[str, str]] = {}

    # ---- partitions ------------------------------------------------------------------------
    def discover(self, names: Iterable[str] | None = None) -> dict[str, list[str]]:
        """Run each registered discoverer and add new keys to the instance. Returns the added keys.

        A key the store would refuse is left out and kept in ``self.refused`` (partitions name ->
        key -> reason), so one bad key costs its own partition only, never its siblings or status."""
        added = {}
        for name, discover in sorted(self.catalog.discoverers.items()):
            if names is not None and name not in names:
                continue
            keys = []
            for key in discover():
                try:
                    keys.append(validate_partition_key(key))
                except InvalidPartitionKeyError as exc:
                    self.refused.setdefault(name, {})[key] = str(exc)
            known = set(self.instance.get_dynamic_partitions(name))
            new = [k for k in keys if k not in known]
            if new:
                self.instance.add_dynamic_partitions(name, new)
            # A shard whose files were regrouped or removed is retired; its artifacts stay in the store.
            for retired in sorted(known - set(keys)):
                self.instance.delete_dynamic_partition(name, retired)
            added[name] = new
        return added

    def partitions_of(self, key: dg.AssetKey) -> list[str | None]:
        pdef = self.graph.get(key).partitions_def
        if pdef is None:
            return [None]
        if isinstance(pdef, dg.DynamicPartitionsDefinition):
            return sorted(self.instance.get_dynamic_partitions(pdef.name))
        return list(pdef.get_partition_keys(dynamic_partitions_store=self.instance))

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
        mapping = self.graph.get_partition_mapping(key, parent)
        existing = set(self.partitions_of(parent))
        if isinstance(mapping, dg.SpecificPartitionsPartitionMapping):
            return set(mapping.partition_keys) & existing
        if node.partitions_def == pnode.partitions_def and partition is not None:
            return {partition}
        return existing

    def state(self, key: dg.AssetKey, partition: str | None, *, verify: bool = False) -> PartitionState:
        """Freshness of one partition. Its files get the cheap check (listed files present with their
        recorded sizes), or with `verify` a full re-hash; a damaged artifact is never fresh."""
        name, version = key_str(key), self.version_of(key)
        manifest = self.store.find(name, version, partition)
        if manifest is None:
            older = [v for v in self.store.code_versions(name)
                     if v != version and self.store.find(name, v, partition) is not None]
            cause = f"code version changed: {older[-1]} -> {version}" if older else "never materialized"
            return PartitionState(name, partition, "missing", cause)
        damage = self.store.verify(manifest) if verify else self.store.check_files(manifest)
        if damage:
            return PartitionState(name, partition, "damaged", damage_summary(damage), manifest.uri)
        recorded = manifest.upstream_versions()
        for parent in sorted(self.graph.get(key).parent_keys):
            if self.version_of(parent) is None:
                continue
            pname = key_str(parent)
            wanted = self.parent_partitions(key, partition, parent)
            have = {p for (k, p) in recorded if k == pname}
            if not have and self.graph.get(parent).partitions_def is None:
                continue  # a declared dependency this partition does not use (e.g. another run's mixture)
            if wanted != have:
                added = sorted(str(p) for p in wanted - have)
                removed = sorted(str(p) for p in have - wanted)
                detail = "; ".join(filter(None, [added and f"new {', '.join(added)}",
                                                 removed and f"gone {', '.join(removed)}"]))
                return PartitionState(name, partition, "stale", f"upstream partitions changed in {pname}: {detail}",
                                      manifest.uri)
            for p in sorted(wanted, key=str):
                current = self.store.find(pname, self.version_of(parent), p)
                where = f"{pname}[{p}]" if p else pname
                if current is None:
                    return PartitionState(name, partition, "stale", f"upstream {where} missing at its code version",
                                          manifest.uri)
                if current.data_version != recorded[(pname, p)]:
                    return PartitionState(name, partition, "stale", f"upstream data changed: {where}", manifest.uri)
        external = self.catalog.externals.get(name)
        if external is not None:
            for ext_key, version in external(partition).items():
                if recorded.get((ext_key, partition)) != version:
                    return PartitionState(name, partition, "stale", f"source data changed: {ext_key}[{partition}]",
                                          manifest.uri)
        identity = self.catalog.identities.get(name)
        if identity is not None:
            config = identity(partition)
            if fingerprint(config) != manifest.fingerprint:
                fields = changed_fields(manifest.config, config)
                return PartitionState(name, partition, "stale", f"config drift: {', '.join(fields) or 'config'}",
                                      manifest.uri)
        note = self.catalog.notes.get(name)
        return PartitionState(name, partition, "fresh", (note and note(manifest, self.store)) or "up to date",
                              manifest.uri)

    def status(self, keys: Iterable[dg.AssetKey] | None = None, *, verify: bool = False) -> list[PartitionState]:
        return [self.state(k, p, verify=verify) for k in (keys or self.artifact_keys()) for p in self.partitions_of(k)]

    # ---- execution -------------------------------------------------------------------------
    def plan(self, target: dg.AssetKey, partition: str | None) -> list[tuple[list[dg.AssetKey], list[str | None]]]:
        """Target plus its upstream as runs: assets sharing a partitions definition run together.

        An asset's stage is one past its latest parent with a different partitions definition, so
        a run never needs an asset from a later run; groups execute in stage order.
        """
        self.require_asset(target)
        wanted = dg.AssetSelection.assets(target).upstream().resolve(self.graph)
        ordered = [k for k in self.graph.toposorted_asset_keys if k in wanted and self.graph.get(k).is_materializable]
        target_pdef = self.graph.get(target).partitions_def
        if partition is not None and target_pdef is None:
            raise ValueError(f"{key_str(target)} is not partitioned; drop --partition")
        stage: dict[dg.AssetKey, int] = {}
        for key in ordered:
            pdef = self.graph.get(key).partitions_def
            stage[key] = max((stage[p] + (self.graph.get(p).partitions_def != pdef)
                              for p in self.graph.get(key).parent_keys if p in stage), default=0)
        # Partitions each asset must provide: the target's, then what each child reads, through
        # the partition mappings (a sweep fit reads only its own runs' evals).
        needed: dict[dg.AssetKey, set] = {
            target: {partition} if partition is not None else set(self.partitions_of(target))}
        for key in reversed(ordered):
            for parent in self.graph.get(key).parent_keys:
                if parent in stage:
                    needed.setdefault(parent, set()).update(
                        p for child_part in needed.get(key, ()) for p in self.parent_partitions(key, child_part, parent))
        groups: dict[tuple[int, str], list[dg.AssetKey]] = {}
        for key in ordered:
            pdef = self.graph.get(key).partitions_def
            groups.setdefault((stage[key], repr(pdef)), []).append(key)
        planned = []
        for (_, _), keys in sorted(groups.items(), key=lambda kv: kv[0]):
            parts = sorted(set().union(*(needed.get(k, set()) for k in keys)), key=lambda p: (p is not None, str(p)))
            if parts:
                planned.append((keys, parts))
        return planned

    def reap_orphaned_runs(self, log: Log = print) -> list[str]:
        """Mark runs of this CLI whose process died (kill -9, OOM, power) as failed, and free their
        pool slots; without a daemon nothing else would, and the next training would wait forever."""
        import os
        import socket

        reaped = []
        active = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.NOT_STARTED]
        for record in self.instance.get_run_records(dg.RunsFilter(statuses=active, tags={CLI_TAG: "materialize"})):
            run = record.dagster_run
            host, pid = run.tags.get(HOST_TAG), run.tags.get(PID_TAG)
            if host != socket.gethostname() or not pid or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
                continue  # still running
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            self.instance.report_run_failed(run, f"the process running it (pid {pid}) is gone")
            self.instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
            log(f"  marked run {run.run_id[:8]} failed: its process {pid} died; freed its pool slots")
            reaped.append(run.run_id)
        return reaped

    def failed_checks_of_producers(self, keys: list[dg.AssetKey], partition: str | None) -> list[str]:
        """Failed ERROR checks of the runs that built the committed artifacts of ``keys[partition]``."""
        runs = set()
        for key in keys:
            if self.version_of(key) is not None:
                manifest = self.store.find(key_str(key), self.version_of(key), partition)
                if manifest is not None and manifest.producer.get("run_id"):
                    runs.add(manifest.producer["run_id"])
        wanted = {key_str(k) for k in keys}
        evaluations = [entry.dagster_event.event_specific_data
                       for run_id in sorted(runs)
                       for entry in self.instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
                       if entry.dagster_event is not None]
        return failed_error_checks([e for e in evaluations if e.asset_key.to_user_string() in wanted])

    def require_asset(self, target: dg.AssetKey) -> None:
        if target not in self.graph.get_all_asset_keys():
            known = ", ".join(sorted(key_str(k) for k in self.artifact_keys()))
            raise KeyError(f"unknown asset {key_str(target)!r}; known: {known}")

    def require_partition(self, target: dg.AssetKey, partition: str | None) -> None:
        """Refuse a partition the asset does not have (ValueError naming the known ones), before any
        path is built from it."""
        if partition is None:
            return
        pdef = self.graph.get(target).partitions_def
        if pdef is None:
            raise ValueError(f"{key_str(target)} is not partitioned; drop --partition")
        if partition not in self.partitions_of(target):
            known = ", ".join(str(p) for p in self.partitions_of(target)) or "none"
            raise ValueError(f"{key_str(target)} has no partition {partition!r}; known: {known}")

    def retract(self, target: dg.AssetKey, partition: str | None, log: Log = print) -> str | None:
        """Withdraw the committed artifact of one asset partition (``marin materialize --rebuild``), e.g.
        one committed with incomplete metrics; returns where its manifest is kept, or None if none.
        A training run resumes from the checkpoints in its directory and nothing is deleted, unless
        the artifact fails verification: then its files are cleared. A partition another writer
        holds raises ArtifactLockedError and stays as it is."""
        self.require_asset(target)
        name, version = key_str(target), self.version_of(target)
        if version is None:
            raise ValueError(f"{name} is not a stored artifact; nothing to rebuild")
        if self.graph.get(target).partitions_def is not None and partition is None:
            raise ValueError(f"{name} is partitioned: --rebuild needs --partition (it withdraws one partition)")
        self.require_partition(target, partition)
        manifest = self.store.find(name, version, partition)
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

    def materialize(self, target: dg.AssetKey, partition: str | None, *, log: Log = print,
                    run_config: dict | None = None, force: bool = False, verify: bool = False) -> list[StepResult]:
        """Run the stale, missing or damaged steps of the target's plan. With `verify`, every
        committed artifact in the plan is re-hashed before it counts as fresh, and every build
        re-hashes the inputs it reads."""
        import os
        import socket
        import time

        self.reap_orphaned_runs(log)

        self.require_partition(target, partition)
        results = []
        for keys, parts in self.plan(target, partition):
            if not parts:
                log(f"  {', '.join(key_str(k) for k in keys)}: no partitions discovered, nothing to do")
            for part in parts:
                label = f"{', '.join(key_str(k) for k in keys)}" + (f" [{part}]" if part else "")
                states = [self.state(k, part, verify=verify) for k in keys if self.version_of(k) is not None]
                if not force and states and all(s.state == "fresh" for s in states):
                    step = StepResult([key_str(k) for k in keys], part, False, True,
                                      manifests=[f"{s.uri}/.artifact.json" for s in states])
                    # A reused artifact keeps the verdict of the checks that ran when it was built.
                    failed = self.failed_checks_of_producers(keys, part)
                    if failed:
                        step.success, step.error = False, f"ERROR check(s) failed when built: {'; '.join(failed)}"
                        log(f"  fresh   {label}, but {step.error}")
                        results.append(step)
                        return results
                    log(f"  fresh   {label}")
                    results.append(step)
                    continue
                causes = "; ".join(f"{s.asset_key}: {s.cause}" for s in states if s.state != "fresh")
                log(f"  build   {label}  ({causes or 'forced'})")
                started = time.monotonic()
                result = dg.materialize(
                    assets=list(self.defs.assets or []) + list(self.defs.asset_checks or []),
                    selection=dg.AssetSelection.assets(*keys),
                    partition_key=part, instance=self.instance, resources=self.defs.resources,
                    run_config=run_config or quiet_run_config(), raise_on_error=False,
                    tags={CLI_TAG: "materialize", HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()),
                          **({VERIFY_TAG: "true"} if verify else {})})
                failed = failed_error_checks(result.get_asset_check_evaluations())
                step = StepResult([key_str(k) for k in keys], part, True, result.success and not failed,
                                  result.run_id, round(time.monotonic() - started, 2))
                if step.success:
                    step.manifests = [f"{self.store.find(key_str(k), self.version_of(k), part).uri}/.artifact.json"
                                      for k in keys if self.version_of(k) is not None]
                    log(f"          done in {step.seconds:.1f}s (run {result.run_id[:8]})")
                else:
                    step.error = failure_message(result) if not result.success else \
                        f"ERROR check(s) failed: {'; '.join(failed)}"
                    log(f"          FAILED (run {result.run_id}): {step.error}")
                    results.append(step)
                    return results
                results.append(step)
        return results


def failed_error_checks(evaluations) -> list[str]:
    """`asset:check (metadata)` for each failed ERROR-severity check evaluation: they fail the command."""
    return [describe_check(e) for e in evaluations if not e.passed and e.severity == dg.AssetCheckSeverity.ERROR]


def quiet_run_config() -> dict:
    """Dagster's console logger at WARNING: the CLI prints its own progress."""
    return {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def failure_message(result: dg.ExecuteInProcessResult) -> str:
    for event in result.all_events:
        if event.is_step_failure and event.step_failure_data and event.step_failure_data.error:
            err = event.step_failure_data.error
            while err.cause is not None and "DagsterExecutionStepExecutionError" in err.cls_name:
                err = err.cause
            return f"{event.step_key}: {err.message.strip()}"
    return "run failed"
