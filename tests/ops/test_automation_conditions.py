"""`FOLLOWS_NEW_DATA`, tick by tick, with Dagster's own evaluator (`dg.evaluate_automation_conditions`)
on a small graph shaped like the pipeline: `raw[shard] -> documents[shard] -> mixture -> checkpoint[run]`.

Each asset reports the data version the test gives it, as `materialize_artifact` does: a reused
artifact reports the version it already had. The real daemon is in test_automation_daemon.py.
"""

import time
import uuid
from datetime import UTC, datetime

import dagster as dg
import pytest

from marin_assets.automation import (
    AUTOMATED_RETRIES,
    AUTOMATION_RUN_TAGS,
    FOLLOWS_NEW_DATA,
    MAX_KEYS_PER_SENSOR,
    PINS_INPUTS_TAG,
    PLAN_TARGETS_TAG,
    RETRY_BACKOFF_S,
    build_automation_sensors,
)
from marin_resources.failures import failed_materializations
from marin_resources.keys import asset_key, marin_key

SHARDS = dg.DynamicPartitionsDefinition(name="shards")
RUNS = dg.DynamicPartitionsDefinition(name="runs")
RAW, DOCUMENTS, MIXTURE, CHECKPOINT = (dg.AssetKey(k) for k in ("raw", "documents", "mixture", "checkpoint"))


FAILS = "fails"  # a version that makes the build fail


def versioned(key: dg.AssetKey, versions: dict, **kwargs):
    @dg.asset(key=key, **kwargs)
    def build(context: dg.AssetExecutionContext):
        partition = context.partition_key if context.has_partition_key else None
        if versions[(key, partition)] == FAILS:
            raise RuntimeError(f"{key.to_user_string()}[{partition}] failed")
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
                                tags=tags or {}, raise_on_error=False)
        assert result.success == (version != FAILS)

    def tick(self, at: float | None = None) -> dg.EvaluateAutomationConditionsResult:
        result = dg.evaluate_automation_conditions(
            self.assets, self.instance, cursor=self.cursor,
            evaluation_time=None if at is None else datetime.fromtimestamp(at, tz=UTC))
        self.cursor = result.cursor
        return result

    def requested(self, at: float | None = None) -> dict[str, set]:
        result = self.tick(at)
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


def test_a_failed_automated_run_is_retried_after_a_backoff_then_left_failed(graph):
    """Issue 50: a failed automated run used to stay failed until new data came. It is requested again
    60 s, 120 s and 240 s after each failure, then left failed; `marin failures` lists every failure as
    automation's and says what comes next. A failure of a person's run is theirs: never retried."""
    from marin_assets.cli import failure_lines

    graph.build(RAW, "a", "raw-a-2")
    assert graph.requested() == {"documents": {"a"}}
    graph.build(DOCUMENTS, "a", FAILS, tags=AUTOMATION_RUN_TAGS)  # the requested run fails
    failed_at = time.time()
    for retry in range(1, AUTOMATED_RETRIES + 1):
        delay = RETRY_BACKOFF_S * 2 ** (retry - 1)
        assert graph.requested(at=failed_at + delay - 5) == {}
        assert graph.requested(at=failed_at + delay + 1) == {"documents": {"a"}}
        graph.build(DOCUMENTS, "a", FAILS, tags=AUTOMATION_RUN_TAGS)
        failed_at = time.time()
        if retry == 1:
            lines = failure_lines(graph.instance, failed_materializations(graph.instance))
            assert "documents[a]  (automation)" in lines[0]
            assert lines[1] == "    RuntimeError: documents[a] failed"
            assert lines[2].startswith("    documents: automation retries it at ") and "(retry 2 of 3)" in lines[2]
    assert graph.requested(at=failed_at + 3600) == {}  # it gave up
    lines = failure_lines(graph.instance, failed_materializations(graph.instance))
    assert lines[2] == "    documents: automation gave up after 3 retries; rebuild it: marin materialize documents " \
                       "--partition a"
    assert lines[-1] == f"{AUTOMATED_RETRIES + 1} failed materialization(s)"

    graph.build(RAW, "b", "raw-b-2")
    assert graph.requested(at=failed_at + 3601) == {"documents": {"b"}}
    graph.build(DOCUMENTS, "b", FAILS)  # a person's run (no automation tag) failed instead
    assert graph.requested(at=time.time() + 3600) == {}


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


class ShardedCorpus:
    """The token cache's shape, with real artifacts (`materialize_artifact` on a store): `raw -> corpus`,
    one file per shard; `index` (the eval index); `checked[shard]`, which reads its shard's file of the
    corpus and the index, with decontaminated's condition; `encoded[shard]` from it; `cache`, which reads
    the corpus, the index and every `checked` and `encoded` partition, as tokenized does."""

    def __init__(self, root):
        from marin_assets.automation import checks_new_shards_and_new_evals
        from marin_assets.catalog import Catalog
        from marin_resources.artifact_spec import ArtifactSpec, FileRead
        from marin_resources.artifacts import ArtifactHandleIOManager, MarinStore, input_of, materialize_artifact
        from marin_resources.storage.store import ArtifactStore

        self.texts = {"a": "text a", "b": "text b"}
        self.index_text = "evals 1"
        self.instance = dg.DagsterInstance.ephemeral()
        self.instance.add_dynamic_partitions(SHARDS.name, ["a", "b"])
        store = MarinStore(prefix=str(root))
        self.resources = {"store": store, "artifact_io_manager": ArtifactHandleIOManager(store=store)}
        catalog = Catalog()
        # The outside inputs (the source files, the eval texts) are their identity: a change is a new artifact.
        raw_spec = ArtifactSpec("t/raw", "v1", lambda _p: dict(self.texts))
        index_spec = ArtifactSpec("t/index", "v1", lambda _p: self.index_text)
        corpus_spec, cache_spec = (ArtifactSpec.fixed(f"t/{k}", "v1", {}) for k in ("corpus", "cache"))
        checked_spec = ArtifactSpec.fixed("t/checked", "v1", {}, file_read=FileRead("t/corpus", self.file_of))
        encoded_spec = ArtifactSpec.fixed("t/encoded", "v1", {})
        texts = self.texts

        def writes(files):
            def build(writer):
                for rel, text in files().items():
                    with writer.open(rel) as fh:
                        fh.write(text.encode())
            return build

        @catalog.asset(raw_spec)
        def raw(context: dg.AssetExecutionContext, store: MarinStore):
            return materialize_artifact(context, store, raw_spec, upstream=[], build=writes(
                lambda: {self.file_of(k): v for k, v in texts.items()}))

        @catalog.asset(corpus_spec, ins={"raw": input_of(raw_spec)}, automation_condition=FOLLOWS_NEW_DATA)
        def corpus(context: dg.AssetExecutionContext, store: MarinStore, raw):
            return materialize_artifact(context, store, corpus_spec, upstream=[raw], build=writes(
                lambda: {self.file_of(k): v for k, v in texts.items()}))

        @catalog.asset(index_spec)
        def index(context: dg.AssetExecutionContext, store: MarinStore):
            return materialize_artifact(context, store, index_spec, upstream=[],
                                        build=writes(lambda: {"index": self.index_text}))

        @catalog.asset(checked_spec, partitions_def=SHARDS, ins={"corpus": input_of(corpus_spec),
                                                                 "index": input_of(index_spec)},
                       automation_condition=checks_new_shards_and_new_evals(
                           checked_spec, "v1", asset_key("t/index"), store.get))
        def checked(context: dg.AssetExecutionContext, store: MarinStore, corpus, index):
            from dataclasses import replace

            rel = self.file_of(context.partition_key)
            version = store.get().read_manifest(corpus.uri).file_version(rel)
            text = store.get().open(f"{corpus.uri}/{rel}").read().decode()
            return materialize_artifact(context, store, checked_spec,
                                        upstream=[replace(corpus, partition=context.partition_key,
                                                          data_version=version), index],
                                        build=writes(lambda: {rel: text}))

        @catalog.asset(encoded_spec, partitions_def=SHARDS, ins={"checked": input_of(checked_spec)},
                       automation_condition=FOLLOWS_NEW_DATA)
        def encoded(context: dg.AssetExecutionContext, store: MarinStore, checked):
            return materialize_artifact(context, store, encoded_spec, upstream=[checked], build=writes(
                lambda: {"rows": store.get().open(f"{checked.uri}/{self.file_of(context.partition_key)}").read()
                         .decode()}))

        @catalog.asset(cache_spec, ins={"corpus": input_of(corpus_spec), "index": input_of(index_spec)},
                       deps=[checked, encoded], automation_condition=FOLLOWS_NEW_DATA)
        def cache(context: dg.AssetExecutionContext, store: MarinStore, corpus, index):
            return materialize_artifact(context, store, cache_spec, upstream=[corpus, index],
                                        build=writes(lambda: {"cache": corpus.data_version + index.data_version}))

        self.assets = [raw, corpus, index, checked, encoded, cache]
        self.store = ArtifactStore(str(root))
        self.cursor = None

    @staticmethod
    def file_of(shard: str) -> str:
        return f"data/{shard}.txt"

    def build(self, name: str, *partitions: str | None) -> None:
        for partition in partitions or (None,):
            assert dg.materialize(self.assets, selection=[asset_key(f"t/{name}")], partition_key=partition,
                                  resources=self.resources, instance=self.instance).success

    def requested(self) -> dict[str, set]:
        result = dg.evaluate_automation_conditions(dg.Definitions(assets=self.assets, resources=self.resources),
                                                   self.instance, cursor=self.cursor)
        self.cursor = result.cursor
        return {marin_key(k).removeprefix("t/"): set(result.get_requested_partitions(k))
                for k in (a.key for a in self.assets) if result.get_num_requested(k)}


@pytest.fixture
def corpus(tmp_path) -> ShardedCorpus:
    corpus = ShardedCorpus(tmp_path)
    corpus.build("raw")
    corpus.build("corpus")
    corpus.build("index")
    corpus.build("checked", "a", "b")
    corpus.build("encoded", "a", "b")
    corpus.build("cache")
    assert corpus.requested() == {}  # the first tick only records where it starts
    return corpus


@pytest.mark.slow  # a dozen Dagster runs
def test_a_file_that_joins_a_shard_is_carried_to_the_cache_step_by_step(corpus):
    """Issue 50: a file joined shard b. Its checked and encoded partitions are requested once the corpus
    holds the new file, and the cache only after them: never with the corpus (it would refuse shard b as
    built from another file), never beside them."""
    corpus.texts["b"] = "text b, and the file that joined it"
    corpus.build("raw")
    assert corpus.requested() == {"corpus": {None}}  # not the cache with it: it also reads shard b's steps
    corpus.build("corpus")
    assert corpus.requested() == {"checked": {"b"}, "encoded": {"b"}}  # a's file is as it was
    corpus.build("checked", "b")  # the requested run (here no run is in flight: the next tick would request the cache)
    corpus.build("encoded", "b")
    assert corpus.requested() == {"cache": {None}}
    corpus.build("cache")
    assert corpus.requested() == {}


@pytest.mark.slow  # a dozen Dagster runs
def test_a_new_shard_and_a_new_eval_index_reach_the_cache_after_their_steps(corpus):
    """A new shard requests only its own partitions; a new eval index every one, since a new eval text may
    be in any shard; the cache follows them, not the corpus or the index directly."""
    corpus.instance.add_dynamic_partitions(SHARDS.name, ["c"])
    corpus.texts["c"] = "text c"
    corpus.build("raw")
    assert corpus.requested() == {"corpus": {None}}
    corpus.build("corpus")
    assert corpus.requested() == {"checked": {"c"}, "encoded": {"c"}}
    corpus.build("checked", "c")
    corpus.build("encoded", "c")
    assert corpus.requested() == {"cache": {None}}
    corpus.build("cache")
    assert corpus.requested() == {}
    corpus.index_text = "evals 2"
    corpus.build("index")
    assert corpus.requested() == {"checked": {"a", "b", "c"}, "encoded": {"a", "b", "c"}}
    corpus.build("checked", "a", "b", "c")
    corpus.build("encoded", "a", "b", "c")
    assert corpus.requested() == {"cache": {None}}
