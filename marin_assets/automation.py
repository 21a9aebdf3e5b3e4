"""New data flows to the token cache by itself, and only new data does.

A source's `<source>_new_shards` sensor (curation/sensors.py, running by default) adds a
partition and requests `raw/<source>` for each new or changed shard. From there every asset up
to the training mixture carries `FOLLOWS_NEW_DATA`, which the `automation` sensor evaluates:

    raw[shard] -> documents[shard] -> filtered[shard] -> dedup_index/<group> -> deduplicated
               -> eval_ngrams/<source>, decontaminated[shard] -> token_shards[shard] -> tokenized -> mixture

An asset is requested once an input has a new *data version* (or will be built in the same
tick), while no input is missing or in progress; the cross-shard ones are append-only (the dedup
index, the token cache), so a new shard costs its own work, not a rebuild. Every step between a
changed input and its reader is requested: a shard's decontaminated partition once the file it
reads changes (`ItsFileChanged`, a file joined its shard), and a reader never in the same tick as
a step between (`AN_INPUT_RUNS_FIRST`, `ReadsItThroughAnotherRun`): the token cache follows once
its shards' steps have run, instead of refusing them as outdated. What does not count as new
data, so that nothing churns:

* a materialization that reused its artifact: it reports the data version it already had;
* an update made by a `marin materialize` plan that builds this asset itself (its runs carry the
  plan's targets, `PLAN_TARGETS_TAG`): the plan is on its way, a second run would only reuse.

And nothing upstream of a running training is rebuilt under it: while a run of an asset tagged
`PINS_INPUTS_TAG` (a checkpoint or its eval) is queued or in flight, its upstream assets wait
(`a_training_reads_it` in the UI's automation evaluation, with the runs in its metadata) and
follow once it ends. The tokenizer is pinned and training is not automated: a new checkpoint is
a decision (`marin materialize`, the UI).

A failed automated run is requested again after a backoff (`RetryIsDue`: 60 s, 120 s, 240 s), then
left failed; each failure is in `marin failures`, marked as automation's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import dagster as dg

from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.dagster_private import (
    PARTITION_NAME_TAG,
    automation_instance,
    subset_of_partitions,
    subset_partition_keys,
)
from marin_resources.keys import AUTOMATION_TRIGGER, TRIGGER_TAG, asset_key
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore

AUTOMATION_INTERVAL_S = 30
# Every run of the automation sensors carries these tags.
AUTOMATION_RUN_TAGS = {TRIGGER_TAG: AUTOMATION_TRIGGER}
# A failed automated run is requested again this many times, after RETRY_BACKOFF_S doubling.
AUTOMATED_RETRIES = 3
RETRY_BACKOFF_S = 60
MANIFEST_READS_IN_FLIGHT = 32
# Asset tag: while a run of this asset is queued or in flight, nothing upstream of it is rebuilt.
PINS_INPUTS_TAG = "marin/pins_inputs"
# Run tag of every run of a `marin materialize` plan: the plan's targets, as comma-separated Dagster
# asset key strings (`mixture/letters_mixture`).
PLAN_TARGETS_TAG = "marin/plan_targets"
PENDING_RUN_STATUSES = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
                        dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def upstream_closure(graph, keys: Iterable[dg.AssetKey]) -> set[dg.AssetKey]:
    """Every asset upstream of ``keys`` in ``graph`` (a Dagster asset graph), ``keys`` excluded."""
    out: set[dg.AssetKey] = set()
    for key in keys:
        if graph.has(key):
            out.update(graph.upstream_key_iterator(key))
    return out


def pinned_by_runs(instance: dg.DagsterInstance, graph) -> dict[dg.AssetKey, list[str]]:
    """Asset -> the pending runs that read it: runs of a `PINS_INPUTS_TAG` asset, queued or in
    flight, and everything upstream of that asset (labelled `key[partition] (run id)`)."""
    pinned: dict[dg.AssetKey, list[str]] = {}
    for run in instance.get_runs(dg.RunsFilter(statuses=PENDING_RUN_STATUSES)):
        readers = [k for k in run.asset_selection or () if graph.has(k) and graph.get(k).tags.get(PINS_INPUTS_TAG)]
        if not readers:
            continue
        partition = run.tags.get(PARTITION_NAME_TAG)
        label = f"{','.join(k.to_user_string() for k in readers)}{f'[{partition}]' if partition else ''} " \
                f"(run {run.run_id[:8]})"
        for key in upstream_closure(graph, readers):
            pinned.setdefault(key, []).append(label)
    return pinned


class ATrainingReadsIt(dg.AutomationCondition):
    """True for every partition of an asset upstream of a queued or running training (or eval).

    Evaluated once per tick for the whole graph (one query of pending runs), then a set lookup per
    asset: its cost does not grow with the number of partitions."""

    def __init__(self) -> None:
        self._tick = None  # ((evaluation id, time) of a tick, pinned_by_runs at that tick)

    @property
    def name(self) -> str:
        return "a_training_reads_it"

    @property
    def description(self) -> str:
        return "A queued or running training or eval reads this asset: it waits until that run ends."

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        tick = (context.evaluation_id, context.evaluation_time)
        if self._tick is None or self._tick[0] != tick:
            self._tick = (tick, pinned_by_runs(automation_instance(context), context.asset_graph))
        runs = self._tick[1].get(context.key)
        if not runs:
            return dg.AutomationResult(context=context, true_subset=context.get_empty_subset())
        return dg.AutomationResult(context=context, true_subset=context.candidate_subset,
                                   metadata={"training_runs": dg.MetadataValue.text("; ".join(sorted(runs)))})


class MadeByAPlanBuildingIt(dg.AutomationCondition):
    """For an input's partitions: true where the latest materialization since the previous tick was
    made by a run of a `marin materialize` plan that also builds the asset being evaluated (it is one
    of the plan's targets or upstream of one). Evaluated after `data_version_changed` narrowed the
    partitions to those updated since the previous tick, so few are looked up: one query for their
    materializations, one for their runs."""

    @property
    def name(self) -> str:
        return "made_by_a_plan_building_it"

    @property
    def description(self) -> str:
        return "The input was built by a `marin materialize` plan that builds this asset too."

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        partitions = subset_partition_keys(context.candidate_subset)
        if not partitions or context.previous_max_storage_id is None:
            return dg.AutomationResult(context=context, true_subset=context.get_empty_subset())
        instance, graph, root = automation_instance(context), context.asset_graph, context.root_context.key
        run_of = latest_runs_since(instance, context.key, partitions, context.previous_max_storage_id)
        if not run_of:  # observed, not materialized (a source's listing): no plan made it
            return dg.AutomationResult(context=context, true_subset=context.get_empty_subset())
        targets_of = {run.run_id: run.tags.get(PLAN_TARGETS_TAG)
                      for run in instance.get_runs(dg.RunsFilter(run_ids=sorted(set(run_of.values()))))}

        @functools.cache
        def builds_root(targets: str | None) -> bool:
            keys = {dg.AssetKey.from_user_string(t) for t in (targets or "").split(",") if t}
            return root in keys or root in upstream_closure(graph, keys)

        matching = {p for p, run_id in run_of.items() if builds_root(targets_of.get(run_id))}
        return dg.AutomationResult(context=context, true_subset=subset_of_partitions(context.candidate_subset,
                                                                                     matching))


def latest_runs_since(instance: dg.DagsterInstance, key: dg.AssetKey, partitions: set[str | None],
                      after_storage_id: int) -> dict[str | None, str]:
    """Partition -> the run of its latest materialization after ``after_storage_id``."""
    records_filter = dg.AssetRecordsFilter(asset_key=key, after_storage_id=after_storage_id,
                                           asset_partitions=None if None in partitions else sorted(partitions))
    latest: dict[str | None, str] = {}
    cursor = None
    while True:
        page = instance.fetch_materializations(records_filter, limit=1000, cursor=cursor)  # newest first
        for record in page.records:
            latest.setdefault(record.partition_key, record.run_id)
        if not page.has_more:
            return latest
        cursor = page.cursor


class RequestedThisTick(dg.AutomationCondition):
    """For an input's partitions: true where this tick requests them, in whichever run (Dagster's
    `will_be_requested` is true only where they can run in the evaluated asset's own run)."""

    @property
    def name(self) -> str:
        return "requested_this_tick"

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        requested = context.request_subsets_by_key.get(context.key)
        if requested is None:
            return dg.AutomationResult(context=context, true_subset=context.get_empty_subset())
        return dg.AutomationResult(context=context,
                                   true_subset=context.candidate_subset.compute_intersection(requested))


class ReadsItThroughAnotherRun(dg.AutomationCondition):
    """For an input: true where the asset being evaluated also reads something built from that input in
    runs of its own (another of its inputs, downstream of this one, partitioned otherwise): the token
    cache reads the corpus and each shard's decontaminated and token_shards partitions. Built in the
    same run as the corpus, it would read those before they are requested; it follows them instead."""

    @property
    def name(self) -> str:
        return "reads_it_through_another_run"

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        graph, root, key = context.asset_graph, context.root_context.key, context.key
        pdef = graph.get(root).partitions_def
        between = [parent for parent in graph.get(root).parent_keys if parent != key and graph.has(parent)
                   and graph.get(parent).partitions_def != pdef and key in upstream_closure(graph, [parent])]
        return dg.AutomationResult(context=context, true_subset=context.candidate_subset if between
                                   else context.get_empty_subset())


class ItsFileChanged(dg.AutomationCondition):
    """For the partitions of an asset that reads one file of an unpartitioned input (`FileRead`, a
    shard's `decontaminated` partition): true where its committed artifact was built from another
    version of that file than the input's current artifact holds (a file joined the shard, so the
    shard's documents changed). A partition never built is `missing`'s, not this. Evaluated after the
    input has a new data version: one manifest read per built partition, `MANIFEST_READS_IN_FLIGHT` at
    a time."""

    def __init__(self, spec: ArtifactSpec, parent_version: str, store: Callable[[], ArtifactStore]) -> None:
        if spec.file_read is None:
            raise ValueError(f"{spec.key}: ItsFileChanged needs a spec that reads one file of its input")
        self._spec, self._parent_version, self._store = spec, parent_version, store

    @property
    def name(self) -> str:
        return "its_file_changed"

    @property
    def description(self) -> str:
        return f"The file of {self._spec.file_read.parent_key} this partition reads changed since it was built."

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        partitions = sorted(p for p in subset_partition_keys(context.candidate_subset) if p is not None)
        store, spec, file_read = self._store(), self._spec, self._spec.file_read
        parent = store.find(file_read.parent_key, self._parent_version, None) if partitions else None
        if parent is None:
            return dg.AutomationResult(context=context, true_subset=context.get_empty_subset())

        def changed(partition: str) -> bool:
            built = store.find(spec.key, spec.version, partition, fingerprint=fingerprint(spec.identity(partition)))
            now = parent.file_version(file_read.file_of(partition))
            return built is not None and now is not None \
                and built.upstream_versions().get((file_read.parent_key, partition)) != now

        with ThreadPoolExecutor(max_workers=MANIFEST_READS_IN_FLIGHT) as pool:
            stale = {p for p, yes in zip(partitions, pool.map(changed, partitions), strict=True) if yes}
        return dg.AutomationResult(context=context, true_subset=subset_of_partitions(context.candidate_subset, stale))


def automated_failures(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str | None) -> list[float]:
    """When the automated runs of ``key[partition]`` that failed in a row since its latest materialization
    ended, newest first (up to one past `AUTOMATED_RETRIES`); none where its latest run did not fail or
    was not automation's (a person's failure is theirs)."""
    partitions = None if partition is None else [partition]
    done = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=partitions), limit=1)
    since = done.records[0].storage_id if done.records else None
    planned = instance.fetch_planned_materializations(  # newest first
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=partitions, after_storage_id=since),
        limit=AUTOMATED_RETRIES + 2).records
    runs = {r.dagster_run.run_id: r for r in instance.get_run_records(
        dg.RunsFilter(run_ids=[record.run_id for record in planned]))} if planned else {}
    failed = []
    for record in planned:
        run = runs.get(record.run_id)
        if run is None or run.dagster_run.status != dg.DagsterRunStatus.FAILURE \
                or not AUTOMATION_RUN_TAGS.items() <= run.dagster_run.tags.items():
            break
        failed.append(run.end_time or record.timestamp)
    return failed


def retry_delay_s(failures: int) -> float | None:
    """How long after its ``failures``-th automated failure in a row automation requests a partition
    again; None once it has been retried `AUTOMATED_RETRIES` times."""
    return None if failures > AUTOMATED_RETRIES else RETRY_BACKOFF_S * 2 ** (failures - 1)


def retry_note(instance: dg.DagsterInstance, key: str, partition: str | None) -> str | None:
    """What automation does next about ``key[partition]`` (a marin key) after its automated failures, for
    `marin failures`; None where its latest run succeeded or was a person's."""
    failed = automated_failures(instance, asset_key(key), partition)
    if not failed:
        return None
    delay = retry_delay_s(len(failed))
    if delay is None:
        return (f"automation gave up after {AUTOMATED_RETRIES} retries; rebuild it: marin materialize {key}"
                + (f" --partition {partition}" if partition is not None else ""))
    at = datetime.fromtimestamp(failed[0] + delay, tz=UTC).isoformat(timespec="seconds")
    return f"automation retries it at {at} (retry {len(failed)} of {AUTOMATED_RETRIES})"


class RetryIsDue(dg.AutomationCondition):
    """For partitions whose latest run failed (`execution_failed` narrowed them to those): true where
    that run was automation's and its backoff has passed (`retry_delay_s`)."""

    @property
    def name(self) -> str:
        return "retry_is_due"

    @property
    def description(self) -> str:
        return (f"Its latest run, an automated one, failed: requested again after {RETRY_BACKOFF_S} s, doubling, "
                f"{AUTOMATED_RETRIES} times.")

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        instance, now = automation_instance(context), context.evaluation_time.timestamp()
        due = set()
        for partition in subset_partition_keys(context.candidate_subset):
            failed = automated_failures(instance, context.key, partition)
            delay = retry_delay_s(len(failed)) if failed else None
            if delay is not None and now >= failed[0] + delay:
                due.add(partition)
        return dg.AutomationResult(context=context, true_subset=subset_of_partitions(context.candidate_subset, due))


# An input with a new data version, not built by a plan that builds this asset too, nor in a run
# that builds this asset (Dagster's own rule), or an input that will be requested in this tick, in
# this asset's run, unless the asset also reads what other runs build from it.
NEW_DATA = ((dg.AutomationCondition.data_version_changed()
             & ~dg.AutomationCondition.executed_with_root_target()
             & ~MadeByAPlanBuildingIt()).with_label("new_data_version")
            | (dg.AutomationCondition.will_be_requested() & ~ReadsItThroughAnotherRun()).with_label(
                "built_in_the_same_run"))
ANY_INPUT_HAS_NEW_DATA = dg.AutomationCondition.any_deps_match(NEW_DATA).with_label("any_input_has_new_data")
# An input this tick requests in a run of its own: that run goes first, the asset follows it.
AN_INPUT_RUNS_FIRST = dg.AutomationCondition.any_deps_match(
    RequestedThisTick() & ~dg.AutomationCondition.will_be_requested()).with_label("an_input_runs_first")
RETRY = (dg.AutomationCondition.execution_failed() & RetryIsDue()).with_label("failed_and_retry_is_due")


def follows(trigger: dg.AutomationCondition, label: str) -> dg.AutomationCondition:
    """Requested once ``trigger`` has been true (and not yet acted on), or to retry a failed automated
    run, when no input is missing, in progress or requested in a run of its own, and no training reads it."""
    return (
        (trigger.since_last_handled() | RETRY)
        & ~dg.AutomationCondition.any_deps_missing()
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~AN_INPUT_RUNS_FIRST
        & ~dg.AutomationCondition.in_progress()
        & ~ATrainingReadsIt()
    ).with_label(label)


FOLLOWS_NEW_DATA = follows(dg.AutomationCondition.newly_missing() | ANY_INPUT_HAS_NEW_DATA, "follows_new_data")


def checks_new_shards_and_new_evals(spec: ArtifactSpec, corpus_version: str, eval_index: dg.AssetKey,
                                    store: Callable[[], ArtifactStore]) -> dg.AutomationCondition:
    """`decontaminated/<source>` (``spec``), a shard's step that reads its own file of the whole corpus
    (at ``corpus_version``): a partition not yet built is requested once its corpus has new data (the
    new shard's file is then there), and a built one when its own file changed (a file joined its
    shard), never for another shard's arrival; but every built one again when the eval index
    (``eval_index``) has new data, since a new eval text may be in any shard."""
    def input_has_new_data(key: dg.AssetKey, label: str) -> dg.AutomationCondition:
        return dg.AutomationCondition.any_deps_match(NEW_DATA).allow(dg.AssetSelection.assets(key)).with_label(label)

    changed = ItsFileChanged(spec, corpus_version, store)
    new_evals = input_has_new_data(eval_index, "eval_index_has_new_data")
    # The corpus's new data narrows the partitions first: their manifests are read only then.
    its_file = input_has_new_data(asset_key(spec.file_read.parent_key), "corpus_has_new_data") & changed
    return follows((dg.AutomationCondition.missing() & ANY_INPUT_HAS_NEW_DATA) | new_evals | its_file,
                   "checks_new_shards_and_new_evals")


# Dagster's cap on the assets and checks of one sensor evaluated in the code server.
MAX_KEYS_PER_SENSOR = 500


def automated_keys(stages: Iterable[dg.Definitions]) -> list[dg.AssetKey]:
    """The assets of ``stages`` that carry an automation condition, in stage order."""
    return [key for stage in stages for assets in stage.assets or () if isinstance(assets, dg.AssetsDefinition)
            for key, condition in assets.automation_conditions_by_key.items() if condition is not None]


def build_automation_sensors(stages: Iterable[dg.Definitions]) -> list[dg.AutomationConditionSensorDefinition]:
    """`automation`, over every automated asset (not their checks: a requested asset's checks run with
    it anyway); past `MAX_KEYS_PER_SENSOR` assets, `automation_2`, ... take the rest, in stage order,
    and a chain that crosses two of them moves on at the next tick instead of within one."""
    keys = automated_keys(stages)
    chunks = [keys[i:i + MAX_KEYS_PER_SENSOR] for i in range(0, len(keys), MAX_KEYS_PER_SENSOR)]
    # Evaluated in the code server (use_user_code_server): the custom conditions above are Python,
    # not Dagster's serializable built-ins the daemon could evaluate itself.
    return [dg.AutomationConditionSensorDefinition(
        "automation" if i == 0 else f"automation_{i + 1}", target=dg.AssetSelection.assets(*chunk).without_checks(),
        default_status=dg.DefaultSensorStatus.RUNNING, minimum_interval_seconds=AUTOMATION_INTERVAL_S,
        use_user_code_server=True, run_tags=AUTOMATION_RUN_TAGS,
        description="Carries new data from raw/ to the token cache and the mixtures: evaluates the automation "
                    "condition of curation, dedup and tokenization assets (training has none). A reused artifact "
                    "is not new data, and nothing upstream of a running training is rebuilt.")
        for i, chunk in enumerate(chunks)]
