"""New data flows to the token cache by itself, and only new data does.

A source's `<source>_new_shards` sensor (curation/sensors.py, running by default) adds a
partition and requests `raw/<source>` for each new or changed shard. From there every asset up
to the training mixture carries `FOLLOWS_NEW_DATA`, which the `automation` sensor evaluates:

    raw[shard] -> documents[shard] -> filtered[shard] -> dedup_index/<group> -> deduplicated
               -> eval_ngrams/<source>, decontaminated[shard] -> token_shards[shard] -> tokenized -> mixture

An asset is requested once an input has a new *data version* (or will be built in the same
tick), while no input is missing or in progress; the cross-shard ones are append-only (the dedup
index, the token cache), so a new shard costs its own work, not a rebuild. What does not count
as new data, so that nothing churns:

* a materialization that reused its artifact: it reports the data version it already had;
* an update made by a `marin materialize` plan that builds this asset itself (its runs carry the
  plan's targets, `PLAN_TARGETS_TAG`): the plan is on its way, a second run would only reuse.

And nothing upstream of a running training is rebuilt under it: while a run of an asset tagged
`PINS_INPUTS_TAG` (a checkpoint or its eval) is queued or in flight, its upstream assets wait
(`a_training_reads_it` in the UI's automation evaluation, with the runs in its metadata) and
follow once it ends. The tokenizer is pinned and training is not automated: a new checkpoint is
a decision (`marin materialize`, the UI).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import dagster as dg

from marin_resources.dagster_private import (
    PARTITION_NAME_TAG,
    automation_instance,
    subset_of_partitions,
    subset_partition_keys,
)

AUTOMATION_INTERVAL_S = 30
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


# An input with a new data version, not built by a plan that builds this asset too, nor in a run
# that builds this asset (Dagster's own rule), or an input that will be requested in this tick.
NEW_DATA = ((dg.AutomationCondition.data_version_changed()
             & ~dg.AutomationCondition.executed_with_root_target()
             & ~MadeByAPlanBuildingIt()).with_label("new_data_version")
            | dg.AutomationCondition.will_be_requested())
ANY_INPUT_HAS_NEW_DATA = dg.AutomationCondition.any_deps_match(NEW_DATA).with_label("any_input_has_new_data")

FOLLOWS_NEW_DATA = (
    (dg.AutomationCondition.newly_missing() | ANY_INPUT_HAS_NEW_DATA).since_last_handled()
    & ~dg.AutomationCondition.any_deps_missing()
    & ~dg.AutomationCondition.any_deps_in_progress()
    & ~dg.AutomationCondition.in_progress()
    & ~ATrainingReadsIt()
).with_label("follows_new_data")


def checks_new_shards_and_new_evals(eval_index: dg.AssetKey) -> dg.AutomationCondition:
    """`decontaminated/<source>`, a shard's step that reads its own file of the whole corpus: a partition
    not yet built is requested once its corpus has new data (the new shard's file is then there), and a
    built one never for another shard's arrival (`Catalog.add_file_read`); but every built one again
    when the eval index (``eval_index``) has new data, since a new eval text may be in any shard."""
    new_evals = dg.AutomationCondition.any_deps_match(NEW_DATA).allow(
        dg.AssetSelection.assets(eval_index)).with_label("eval_index_has_new_data")
    return (
        ((dg.AutomationCondition.missing() & ANY_INPUT_HAS_NEW_DATA) | new_evals).since_last_handled()
        & ~dg.AutomationCondition.any_deps_missing()
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~dg.AutomationCondition.in_progress()
        & ~ATrainingReadsIt()
    ).with_label("checks_new_shards_and_new_evals")


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
        use_user_code_server=True,
        description="Carries new data from raw/ to the token cache and the mixtures: evaluates the automation "
                    "condition of curation, dedup and tokenization assets (training has none). A reused artifact "
                    "is not new data, and nothing upstream of a running training is rebuilt.")
        for i, chunk in enumerate(chunks)]
