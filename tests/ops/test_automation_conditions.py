"""`FOLLOWS_NEW_DATA`, tick by tick, with Dagster's own evaluator (`dg.evaluate_automation_conditions`)
on a small graph shaped like the pipeline: `raw[shard] -> documents[shard] -> mixture -> checkpoint[run]`.

Each asset reports the data version the test gives it, as `materialize_artifact` does: a reused
artifact reports the version it already had. The real daemon is in test_automation_daemon.py.
"""

import uuid

import dagster as dg
import pytest

from marin_assets.automation import (
    FOLLOWS_NEW_DATA,
    MAX_KEYS_PER_SENSOR,
    PINS_INPUTS_TAG,
    PLAN_TARGETS_TAG,
    build_automation_sensors,
)

SHARDS = dg.DynamicPartitionsDefinition(name="shards")
RUNS = dg.DynamicPartitionsDefinition(name="runs")
RAW, DOCUMENTS, MIXTURE, CHECKPOINT = (dg.AssetKey(k) for k in ("raw", "documents", "mixture", "checkpoint"))


def versioned(key: dg.AssetKey, versions: dict, **kwargs):
    @dg.asset(key=key, **kwargs)
    def build(context: dg.AssetExecutionContext):
        partition = context.partition_key if context.has_partition_key else None
        return dg.Output(None, data_version=dg.DataVersion(versions[(key, partition)]))
    return build


class Graph:
    def __init__(self):
        self.versions: dict = {}
        self.instance = dg.DagsterInstance.ephemeral()
        self.instance.add_dynamic_partitions(SHARDS.name, ["a", "b"])
        self.instance.add_dynamic_partitions(RUNS.name, ["nano"])
        self.assets = [
            versioned(RAW, self.versions, partitions_def=SHARDS),
            versioned(DOCUMENTS, self.versions, partitions_def=SHARDS, deps=[RAW],
                      automation_condition=FOLLOWS_NEW_DATA),
            versioned(MIXTURE, self.versions, deps=[DOCUMENTS], automation_condition=FOLLOWS_NEW_DATA),
            versioned(CHECKPOINT, self.versions, partitions_def=RUNS, deps=[MIXTURE], tags={PINS_INPUTS_TAG: "true"}),
        ]
        self.cursor = None

    def build(self, key: dg.AssetKey, partition: str | None, version: str, tags: dict | None = None) -> None:
        self.versions[(key, partition)] = version
        result = dg.materialize(self.assets, selection=[key], partition_key=partition, instance=self.instance,
                                tags=tags or {})
        assert result.success

    def tick(self) -> dg.EvaluateAutomationConditionsResult:
        result = dg.evaluate_automation_conditions(self.assets, self.instance, cursor=self.cursor)
        self.cursor = result.cursor
        return result

    def requested(self) -> dict[str, set]:
        result = self.tick()
        return {k.to_user_string(): set(result.get_requested_partitions(k))
                for k in (DOCUMENTS, MIXTURE) if result.get_num_requested(k)}


@pytest.fixture
def graph() -> Graph:
    graph = Graph()
    for shard in ("a", "b"):
        graph.build(RAW, shard, f"raw-{shard}-1")
        graph.build(DOCUMENTS, shard, f"documents-{shard}-1")
    graph.build(MIXTURE, None, "mixture-1")
    assert graph.requested() == {}  # the first tick only records where it starts
    return graph


def test_a_reused_artifact_is_not_new_data_and_a_new_version_flows(graph):
    graph.build(RAW, "a", "raw-a-1")  # reused: the same data version again
    graph.build(DOCUMENTS, "b", "documents-b-1")
    assert graph.requested() == {}
    graph.build(RAW, "a", "raw-a-2")
    assert graph.requested() == {"documents": {"a"}}
    assert graph.requested() == {}  # handled: requested once
    graph.build(DOCUMENTS, "a", "documents-a-2")  # the requested run, with new documents
    assert graph.requested() == {"mixture": {None}}


def test_a_new_raw_version_whose_documents_are_the_same_stops_there(graph):
    graph.build(RAW, "a", "raw-a-2")
    assert graph.requested() == {"documents": {"a"}}
    graph.build(DOCUMENTS, "a", "documents-a-1")  # e.g. only a byte the reader ignores changed
    assert graph.requested() == {}


def test_a_new_shard_flows(graph):
    graph.instance.add_dynamic_partitions(SHARDS.name, ["c"])
    assert graph.requested() == {}  # its raw bytes are not there yet
    graph.build(RAW, "c", "raw-c-1")
    assert graph.requested() == {"documents": {"c"}}
    graph.build(DOCUMENTS, "c", "documents-c-1")
    assert graph.requested() == {"mixture": {None}}


def test_a_plan_that_builds_the_asset_itself_is_left_to_do_so(graph):
    # `marin materialize mixture` built both raw shards anew and goes on to their documents and the mixture.
    graph.build(RAW, "a", "raw-a-2", tags={PLAN_TARGETS_TAG: "mixture"})
    graph.build(RAW, "b", "raw-b-2", tags={PLAN_TARGETS_TAG: "mixture"})
    assert graph.requested() == {}
    graph.build(DOCUMENTS, "a", "documents-a-2", tags={PLAN_TARGETS_TAG: "mixture"})
    assert graph.requested() == {}
    # A plan that stops at raw leaves the rest to automation.
    graph.build(RAW, "b", "raw-b-3", tags={PLAN_TARGETS_TAG: "raw"})
    assert graph.requested() == {"documents": {"b"}}


def in_flight_training(instance: dg.DagsterInstance) -> dg.DagsterRun:
    run = dg.DagsterRun(job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED,
                        asset_selection=frozenset({CHECKPOINT}), tags={"dagster/partition": "nano"})
    return instance.add_run(run)


def test_nothing_upstream_of_a_running_training_is_rebuilt_until_it_ends(graph):
    run = in_flight_training(graph.instance)
    graph.build(RAW, "a", "raw-a-2")
    result = graph.tick()
    assert result.total_requested == 0
    # The reason, as the UI's automation evaluation shows it: the blocking condition and the run.
    blocked = [r for r in result.results if r.key == DOCUMENTS][0]
    waits = [n for n in walk(blocked.serializable_evaluation) if n.condition_snapshot.name == "a_training_reads_it"]
    # (metadata only where it is true)
    assert waits[0].metadata["training_runs"].value == f"checkpoint[nano] (run {run.run_id[:8]})"
    assert graph.requested() == {}  # still waiting

    graph.instance.report_run_failed(run)  # the training ended
    assert graph.requested() == {"documents": {"a"}}


def walk(evaluation):
    yield evaluation
    for child in evaluation.child_evaluations:
        yield from walk(child)


def test_automated_assets_are_split_across_sensors_past_dagsters_cap():
    def automated(name: str):
        return dg.asset(name=name, deps=[RAW], automation_condition=FOLLOWS_NEW_DATA)(lambda: None)

    stages = [dg.Definitions(assets=[versioned(RAW, {}), *(automated(f"a{i}") for i in range(MAX_KEYS_PER_SENSOR))]),
              dg.Definitions(assets=[automated("last")])]
    first, second = build_automation_sensors(stages)
    graph = dg.Definitions.merge(*stages).resolve_asset_graph()
    assert (first.name, second.name) == ("automation", "automation_2")
    assert len(first.asset_selection.resolve(graph)) == MAX_KEYS_PER_SENSOR
    assert second.asset_selection.resolve(graph) == {dg.AssetKey("last")}
    assert not first.asset_selection.resolve_checks(graph)


def test_the_operations_page_states_every_sensor_and_schedule_default():
    """docs/operations.md's table of sensors and schedules, against the default deployment's definitions."""
    from pathlib import Path

    from marin_assets.definitions import defs

    page = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    table = page[page.index("### Sensors and schedules"):].split("\n\n")[2]
    rows = {cells[0].strip("` "): (cells[2].strip(), cells[3].strip()) for line in table.splitlines()[2:]
            if (cells := [c.strip() for c in line.strip("|").split("|")])}
    stated = {}
    for sensor in defs.sensors:
        name = "<source>_new_shards" if sensor.name.endswith("_new_shards") else sensor.name
        stated[name] = (sensor.default_status.value.lower(), f"{sensor.minimum_interval_seconds} s")
    for schedule in defs.schedules:
        assert schedule.cron_schedule == "0 6 * * *"
        stated[schedule.name] = (schedule.default_status.value.lower(), "06:00 UTC daily")
    assert rows == stated


def test_a_shards_decontamination_follows_new_shards_and_a_new_eval_index():
    """`checks_new_shards_and_new_evals` (decontaminated[shard] over the corpus and the eval index): a
    new corpus version requests only the partition never built; a new eval index requests every one,
    since a new eval text may be in any shard. Each shard's encoding is requested with it, in the same
    tick (a run per shard), and reuses its rows where the shard's documents did not change."""
    from marin_assets.automation import checks_new_shards_and_new_evals

    corpus, index, checked, encoded = (dg.AssetKey(k) for k in ("corpus", "index", "checked", "encoded"))
    versions: dict = {}
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SHARDS.name, ["a", "b"])
    assets = [versioned(corpus, versions), versioned(index, versions, deps=[corpus]),
              versioned(checked, versions, partitions_def=SHARDS, deps=[corpus, index],
                        automation_condition=checks_new_shards_and_new_evals(index)),
              versioned(encoded, versions, partitions_def=SHARDS, deps=[checked],
                        automation_condition=FOLLOWS_NEW_DATA)]
    cursor = None

    def build(key, partition, version):
        versions[(key, partition)] = version
        assert dg.materialize(assets, selection=[key], partition_key=partition, instance=instance).success

    def requested():
        nonlocal cursor
        result = dg.evaluate_automation_conditions(assets, instance, cursor=cursor)
        cursor = result.cursor
        return {k.to_user_string(): set(result.get_requested_partitions(k)) for k in (checked, encoded)
                if result.get_num_requested(k)}

    build(corpus, None, "corpus-1")
    build(index, None, "index-1")
    for shard in ("a", "b"):
        build(checked, shard, f"checked-{shard}-1")
        build(encoded, shard, f"encoded-{shard}-1")
    assert requested() == {}
    instance.add_dynamic_partitions(SHARDS.name, ["c"])
    build(corpus, None, "corpus-2")  # the corpus gains shard c; the eval index is unchanged
    assert requested() == {"checked": {"c"}, "encoded": {"c"}}
    assert requested() == {}
    build(checked, "c", "checked-c-1")
    build(encoded, "c", "encoded-c-1")
    assert requested() == {}
    build(index, None, "index-2")  # a new eval set
    assert requested() == {"checked": {"a", "b", "c"}, "encoded": {"a", "b", "c"}}
    assert requested() == {}
