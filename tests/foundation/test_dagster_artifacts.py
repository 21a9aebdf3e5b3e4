"""materialize_artifact through real Dagster runs: skip, configs side by side, data versions, handles downstream."""

import dagster as dg
import pytest

from marin_assets.catalog import Catalog
from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import (
    ArtifactHandle,
    ArtifactHandleIOManager,
    Built,
    MarinStore,
    all_partitions_in,
    materialize_artifact,
)
from marin_resources.keys import asset_key, marin_key
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore

SHARDS = dg.DynamicPartitionsDefinition(name="test_shards")

WORDS, JOINED = asset_key("test/words"), asset_key("test/joined")


def make_defs(prefix, *, greeting="hello", version="v1", source=None, catalog: Catalog | None = None):
    """`source`: {partition: listing hash} of an outside input that test/words records, as raw assets do.
    `catalog`: where the specs are recorded, for a planner."""
    config = {"greeting": greeting}
    catalog = Catalog() if catalog is None else catalog
    external = None if source is None else (lambda p: {"external/src": source[p]})
    words_spec = ArtifactSpec("test/words", version, lambda _p: config, external=external)
    joined_spec = ArtifactSpec.fixed("test/joined", "v1", {})

    @catalog.asset(words_spec, partitions_def=SHARDS)
    def words(context: dg.AssetExecutionContext, store: MarinStore):
        def build(w):
            with w.open("words.txt") as fh:
                fh.write(f"{config['greeting']} {context.partition_key}".encode())
            return Built(metrics={"words": 2})
        outside = [] if source is None else [ArtifactHandle("external/src", context.partition_key, "x", "file:///src",
                                                            source[context.partition_key])]
        return materialize_artifact(context, store, words_spec, upstream=outside, build=build)

    @catalog.asset(joined_spec, ins={"shards": all_partitions_in("test/words")})
    def joined(context: dg.AssetExecutionContext, store: MarinStore, shards: dict[str, ArtifactHandle]):
        def build(w):
            text = " ".join(store.get().open(f"{h.uri}/words.txt").read().decode() for h in shards.values())
            with w.open("joined.txt") as fh:
                fh.write(text.encode())
            return Built(metrics={"shards": len(shards)})
        return materialize_artifact(context, store, joined_spec, upstream=list(shards.values()), build=build)

    store = MarinStore(prefix=str(prefix))
    return [words, joined], {"store": store, "artifact_io_manager": ArtifactHandleIOManager(store=store)}


def materialization(result, key):
    return [m for m in result.asset_materializations_for_node(asset_key(key).to_python_identifier())][0]


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        inst.add_dynamic_partitions("test_shards", ["a", "b"])
        yield inst


@pytest.mark.slow  # several Dagster runs
def test_build_then_skip_then_rebuild_downstream_on_new_data(tmp_path, instance):
    assets, resources = make_defs(tmp_path)
    first = dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)
    m1 = materialization(first, "test/words")
    assert m1.metadata["marin/reused"].value is False
    dg.materialize(assets, selection=[WORDS], partition_key="b", resources=resources, instance=instance)

    again = dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)
    m2 = materialization(again, "test/words")
    assert m2.metadata["marin/reused"].value is True
    assert m2.tags["dagster/data_version"] == m1.tags["dagster/data_version"]

    joined = dg.materialize(assets, selection=[JOINED], resources=resources, instance=instance)
    j = materialization(joined, "test/joined")
    assert j.metadata["shards"].value == 2
    text = open(f"{ArtifactStore(str(tmp_path)).find('test/joined', 'v1', None).uri}/joined.txt").read()
    assert text == "hello a hello b"
    # Unchanged upstream: the join is a no-op.
    rejoined = dg.materialize(assets, selection=[JOINED], resources=resources, instance=instance)
    assert materialization(rejoined, "test/joined").metadata["marin/reused"].value is True


@pytest.mark.slow  # several Dagster runs
def test_two_configs_coexist_and_going_back_is_a_no_op(tmp_path, instance):
    store = ArtifactStore(str(tmp_path))
    assets, resources = make_defs(tmp_path)
    first = dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)
    hello = store.find("test/words", "v1", "a")
    assets, resources = make_defs(tmp_path, greeting="bonjour")
    changed = dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources,
                             instance=instance)
    m = materialization(changed, "test/words")
    assert m.metadata["marin/reused"].value is False
    assert "config changed: greeting" in m.metadata["marin/decision"].value
    bonjour = store.find("test/words", "v1", "a")  # the ref follows the latest materialization
    assert bonjour.uri != hello.uri
    assert bonjour.uri.endswith(f"/test/words/v1-{fingerprint({'greeting': 'bonjour'})[:8]}/a")
    assert (tmp_path / f"test/words/v1-{fingerprint({'greeting': 'hello'})[:8]}/a/words.txt").read_text() == "hello a"
    assert open(f"{bonjour.uri}/words.txt").read() == "bonjour a"

    # Back to the first config: nothing is built, the old artifact becomes current again.
    assets, resources = make_defs(tmp_path)
    back = dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)
    m = materialization(back, "test/words")
    assert m.metadata["marin/reused"].value is True and m.metadata["marin/repointed"].value is True
    assert m.tags["dagster/data_version"] == materialization(first, "test/words").tags["dagster/data_version"]
    assert store.find("test/words", "v1", "a").uri == hello.uri
    # Downstream reads the current one.
    dg.materialize(assets, selection=[WORDS], partition_key="b", resources=resources, instance=instance)
    dg.materialize(assets, selection=[JOINED], resources=resources, instance=instance)
    assert open(f"{store.find('test/joined', 'v1', None).uri}/joined.txt").read().startswith("hello a")


def test_new_code_version_writes_beside_the_old(tmp_path, instance):
    assets, resources = make_defs(tmp_path)
    dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)
    assets, resources = make_defs(tmp_path, greeting="hi", version="v2")
    dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)
    assert (tmp_path / f"test/words/v1-{fingerprint({'greeting': 'hello'})[:8]}/a/words.txt").read_text() == "hello a"
    assert (tmp_path / f"test/words/v2-{fingerprint({'greeting': 'hi'})[:8]}/a/words.txt").read_text() == "hi a"


def test_missing_upstream_is_a_clear_failure(tmp_path, instance):
    assets, resources = make_defs(tmp_path)
    with pytest.raises(dg.Failure, match="no committed artifact"):
        dg.materialize(assets, selection=[JOINED], resources=resources, instance=instance)


def test_value_io_manager_round_trips_tables_and_json_with_a_manifest(tmp_path, instance):
    import polars as pl

    from marin_resources.io_managers import ValueIOManagerFactory

    @dg.asset(key=["test", "table"], metadata={"marin/version": "v3"})
    def table() -> pl.DataFrame:
        return pl.DataFrame({"a": [1, 2, 3]})

    @dg.asset(key=["test", "summary"])
    def summary(table: pl.DataFrame) -> dict:
        return {"total": int(table["a"].sum())}

    store = MarinStore(prefix=str(tmp_path))
    result = dg.materialize([table, summary], resources={"io_manager": ValueIOManagerFactory(store=store)},
                            instance=instance)
    assert result.success
    manifest = ArtifactStore(str(tmp_path)).find("test/table", "v3", None)
    assert [f.path for f in manifest.files] == ["value.parquet"] and manifest.metrics == {"rows": 3, "columns": 1}
    assert (tmp_path / f"test/summary/v1-{fingerprint({})[:8]}/value.json").read_text().strip().startswith("{")
    assert result.output_for_node("test__summary") == {"total": 6}


def test_planner_follows_partition_mappings(tmp_path, instance):
    from marin_assets.planning import Planner, parse_key

    @dg.asset(key=asset_key("test/fit"), ins={"words": dg.AssetIn(
        key=asset_key("test/words"), partition_mapping=dg.SpecificPartitionsPartitionMapping(["a"]))})
    def fit(words):
        return 1

    assets, resources = make_defs(tmp_path)
    defs = dg.Definitions(assets=[*assets, fit], resources=resources)
    planner = Planner(defs, Catalog(), ArtifactStore(str(tmp_path)), instance)
    plan = {tuple(marin_key(k) for k in keys): parts for keys, parts in planner.plan(parse_key("test/fit"), None)}
    assert plan[("test/words",)] == ["a"]  # only the mapped partition, not "b"
    assert planner.parent_partitions(parse_key("test/joined"), None, parse_key("test/words")) == {"a", "b"}


@pytest.mark.slow  # several Dagster runs
def test_status_follows_one_rule_and_causes_propagate_downstream(tmp_path, instance):
    """The planner's states come from the rule the assets apply: a stale input makes its consumers
    stale with the cause chain; a config change is 'missing' beside the old artifact and, once
    materialized, fresh again."""
    from marin_assets.planning import Planner, parse_key

    source, greeting = {"a": "listing-a1", "b": "listing-b1"}, {"value": "hello"}

    def run(selection, partition=None):
        assets, resources = make_defs(tmp_path, greeting=greeting["value"], source=source)
        dg.materialize(assets, selection=[asset_key(selection)], partition_key=partition, resources=resources,
                       instance=instance)

    def states():
        catalog = Catalog()
        assets, resources = make_defs(tmp_path, greeting=greeting["value"], source=source, catalog=catalog)
        planner = Planner(dg.Definitions(assets=assets, resources=resources), catalog, ArtifactStore(str(tmp_path)),
                          instance)
        return {(s.asset_key, s.partition): s for s in planner.status([parse_key("test/words"),
                                                                        parse_key("test/joined")])}

    for partition in ("a", "b"):
        run("test/words", partition)
    run("test/joined")
    assert {s.state for s in states().values()} == {"fresh"}

    source["a"] = "listing-a2"  # the outside file of shard a changed
    now = states()
    assert now[("test/words", "a")].state == "stale"
    assert now[("test/words", "a")].cause == "upstream external/src[a] changed (data)"
    assert now[("test/words", "b")].state == "fresh"
    joined = now[("test/joined", None)]
    assert joined.state == "stale" and joined.cause == "upstream test/words[a] is stale"
    assert joined.decision.chain() == ["test/joined: stale: upstream test/words[a] is stale",
                                       "  test/words[a]: stale: upstream external/src[a] changed (data)"]
    run("test/words", "a")
    # Rebuilt from the new listing, with the same bytes: the same data version, so the join stays fresh.
    assert {s.state for s in states().values()} == {"fresh"}

    greeting["value"] = "bonjour"  # a config change: built beside, missing until then
    now = states()
    assert now[("test/words", "a")].state == "missing" and "config changed: greeting" in now[("test/words", "a")].cause
    assert now[("test/joined", None)].cause == "upstream test/words[a] is missing, test/words[b] is missing"
    for partition in ("a", "b"):
        run("test/words", partition)
    assert states()[("test/joined", None)].cause == "upstream test/words[a], test/words[b] changed (data)"
    run("test/joined")
    assert {s.state for s in states().values()} == {"fresh"}


def test_build_cpu_seconds_count_the_process_a_build_waits_for():
    """A build that launches a process (training, eval) is charged that process's CPU once it is
    waited for, as `marin/build_cpu_seconds` reports it."""
    import subprocess
    import sys

    from marin_resources.artifacts import cpu_seconds

    before = cpu_seconds()
    # The child spins until it has used 0.3 s of its own CPU, however busy the machine is.
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.3: pass"], check=True)
    assert cpu_seconds() - before >= 0.3


def test_a_check_reads_every_shard_of_an_append_and_a_seeded_sample_of_a_large_build():
    from marin_resources.artifacts import checked_shards

    assert checked_shards(["c", "a", "b"], "v1", at_most=4) == ["c", "a", "b"]  # in the order given
    many = [f"shard-{i:05d}" for i in range(1000)]
    sample = checked_shards(many, "v1", at_most=4)
    assert len(sample) == 4 and set(sample) <= set(many) and sample == sorted(sample)
    # The same artifact, the same shards, whatever order its shards are listed in.
    assert checked_shards(list(reversed(many)), "v1", at_most=4) == list(reversed(sample))
    assert checked_shards(many, "v2", at_most=4) != sample  # a new version is checked on others


def test_status_sets_apart_what_was_never_built_and_nothing_built_reads(tmp_path, instance):
    """After a corpus is built, a new shard it reads is missing (a gap in what was built); an asset
    downstream that no build asked for is `unrequested`, and `marin status` lists it apart."""
    from marin_assets.cli import status_lines
    from marin_assets.planning import Planner, parse_key
    from marin_resources.storage.store import UpstreamRef, producer_info, writing

    catalog = Catalog()
    assets, resources = make_defs(tmp_path, catalog=catalog)
    report_spec = ArtifactSpec.fixed("test/report", "v1", {})

    @catalog.asset(report_spec, ins={"joined": dg.AssetIn(key=JOINED)})
    def report(context: dg.AssetExecutionContext, store: MarinStore, joined: ArtifactHandle):
        return materialize_artifact(context, store, report_spec, upstream=[joined], build=lambda w: None)

    store = ArtifactStore(str(tmp_path))
    refs = []
    for part in ("a", "b"):
        with writing(store, "test/words", "v1", part, fingerprint=fingerprint({"greeting": "hello"}), run_id="t") as w:
            with w.open("words.txt") as fh:
                fh.write(f"hello {part}".encode())
            m = w.commit(config={"greeting": "hello"}, upstream=[], producer=producer_info("t"))
        refs.append(UpstreamRef(m.asset_key, part, m.data_version, m.uri))
    with writing(store, "test/joined", "v1", None, fingerprint=fingerprint({}), run_id="t") as w:
        with w.open("joined.txt") as fh:
            fh.write(b"hello a hello b")
        w.commit(config={}, upstream=refs, producer=producer_info("t"))
    instance.add_dynamic_partitions("test_shards", ["c"])  # a new shard, never built

    planner = Planner(dg.Definitions(assets=[*assets, report], resources=resources), catalog, store, instance)
    states = planner.status()
    by_key = {(s.asset_key, s.partition): s for s in states}
    assert [(k, s.state, s.unrequested) for k, s in sorted(by_key.items(), key=str)] == [
        (("test/joined", None), "stale", False), (("test/report", None), "missing", True),
        (("test/words", "a"), "fresh", False), (("test/words", "b"), "fresh", False),
        (("test/words", "c"), "missing", False)]
    assert by_key[("test/report", None)].to_dict()["unrequested"] is True
    # Asked about the report alone, it is still judged by what reads it (nothing).
    assert [s.unrequested for s in planner.status([parse_key("test/report")])] == [True]

    lines = status_lines(states, "/store")
    assert not any(line.startswith("missing  test/report") for line in lines)
    assert lines[-3:] == ["not built: never materialized, and nothing built reads them (marin materialize KEY "
                          "builds one)", "  test/report", "2 fresh, 1 stale, 1 missing, 0 damaged, 1 not built  "
                                                         "(prefix /store)"]


def test_what_describe_reads_from_the_artifact_is_on_every_event_a_reuse_too(tmp_path, instance):
    """The UI shows an asset's latest materialization; a reuse (a checkpoint reused by the run that
    exports it) must carry the plot its build committed, not only the build's own event."""
    spec = ArtifactSpec.fixed("test/plotted", "v1", {})

    def shown(manifest):
        return {"plot": ArtifactStore(str(tmp_path)).open(f"{manifest.uri}/plot.txt").read().decode()}

    @dg.asset(key=asset_key("test/plotted"), metadata={"marin/version": "v1"})
    def plotted(context: dg.AssetExecutionContext, store: MarinStore):
        def build(writer):
            with writer.open("plot.txt") as fh:
                fh.write(b"a curve")
            return Built(metrics={"points": 3})
        return materialize_artifact(context, store, spec, upstream=[], build=build, describe=shown)

    resources = {"store": MarinStore(prefix=str(tmp_path))}
    events = []
    for _ in range(2):
        result = dg.materialize([plotted], resources=resources, instance=instance)
        events.append({k: v.value for k, v in materialization(result, "test/plotted").metadata.items()})
    assert [(e["marin/reused"], e["plot"]) for e in events] == [(False, "a curve"), (True, "a curve")]
