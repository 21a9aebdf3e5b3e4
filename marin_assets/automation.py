"""New data flows to the token cache by itself, and only new data does.

A source's `<source>_new_shards` sensor (curation/sensors.py, running by default) adds a
partition and requests `raw/<source>` for each new or changed shard. From there every asset up
to the training mixture carries `FOLLOWS_NEW_DATA`, which the one `automation` sensor evaluates:

    raw[shard] -> documents[shard] -> filtered[shard] -> dedup_index/<group> -> deduplicated
               -> tokenized -> mixture

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

from collections.abc import Iterable

import dagster as dg

AUTOMATION_INTERVAL_S = 30
# Asset tag: while a run of this asset is queued or in flight, nothing upstream of it is rebuilt.
PINS_INPUTS_TAG = "marin/pins_inputs"
# Run tag of every run of a `marin materialize` plan: the plan's targets, comma-separated marin keys.
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
        partition = run.tags.get("dagster/partition")
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
        self._tick = None  # (asset graph view of the tick, pinned_by_runs of that tick)

    @property
    def name(self) -> str:
        return "a_training_reads_it"

    @property
    def description(self) -> str:
        return "A queued or running training or eval reads this asset: it waits until that run ends."

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        view = context.asset_graph_view
        if self._tick is None or self._tick[0] is not view:
            self._tick = (view, pinned_by_runs(view.instance, context.asset_graph))
        runs = self._tick[1].get(context.key)
        if not runs:
            return dg.AutomationResult(context=context, true_subset=context.get_empty_subset())
        return dg.AutomationResult(context=context, true_subset=context.candidate_subset,
                                   metadata={"training_runs": dg.MetadataValue.text("; ".join(sorted(runs)))})


class MadeByAPlanBuildingIt(dg.AutomationCondition):
    """For an input's new partitions: true where the run that made it belongs to a `marin materialize`
    plan that also builds the asset being evaluated (the asset is one of the plan's targets or
    upstream of one). Only the few partitions updated since the last tick are looked up."""

    @property
    def name(self) -> str:
        return "made_by_a_plan_building_it"

    @property
    def description(self) -> str:
        return "The input was built by a `marin materialize` plan that builds this asset too."

    async def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        root = context.root_context.key
        graph = context.asset_graph

        def plan_builds_root(record) -> bool:
            targets = record.dagster_run.tags.get(PLAN_TARGETS_TAG)
            if not targets:
                return False
            keys = {dg.AssetKey.from_user_string(t) for t in targets.split(",")}
            return root in keys or root in upstream_closure(graph, keys)

        true_subset = await context.asset_graph_view.compute_latest_run_matches_subset(
            from_subset=context.candidate_subset, filter_fn=plan_builds_root)
        return dg.AutomationResult(context=context, true_subset=true_subset)


# An input with a new data version, not built by a plan that builds this asset too, nor in a run
# that builds this asset (Dagster's own rule), or an input that will be requested in this tick.
ANY_INPUT_HAS_NEW_DATA = dg.AutomationCondition.any_deps_match(
    (dg.AutomationCondition.data_version_changed()
     & ~dg.AutomationCondition.executed_with_root_target()
     & ~MadeByAPlanBuildingIt()).with_label("new_data_version")
    | dg.AutomationCondition.will_be_requested()
).with_label("any_input_has_new_data")

FOLLOWS_NEW_DATA = (
    (dg.AutomationCondition.newly_missing() | ANY_INPUT_HAS_NEW_DATA).since_last_handled()
    & ~dg.AutomationCondition.any_deps_missing()
    & ~dg.AutomationCondition.any_deps_in_progress()
    & ~dg.AutomationCondition.in_progress()
    & ~ATrainingReadsIt()
).with_label("follows_new_data")


def build_automation_sensor() -> dg.AutomationConditionSensorDefinition:
    # Evaluated in the code server (use_user_code_server): the custom conditions above are Python,
    # not Dagster's serializable built-ins the daemon could evaluate itself.
    return dg.AutomationConditionSensorDefinition(
        "automation", target=dg.AssetSelection.all(), default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=AUTOMATION_INTERVAL_S, use_user_code_server=True,
        description="Carries new data from raw/ to the token cache and the mixtures: evaluates every asset's "
                    "automation condition (curation, dedup, tokenization; training has none). A reused "
                    "artifact is not new data, and nothing upstream of a running training is rebuilt.")
