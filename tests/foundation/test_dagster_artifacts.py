"""materialize_artifact through real Dagster runs: skip, drift, data versions, handles downstream."""

import dagster as dg
import pytest

from marin_resources.artifacts import (ArtifactHandle, ArtifactHandleIOManager, Built, MarinStore, all_partitions_in,
                                       marin_asset, materialize_artifact)
from marin_resources.freshness import FingerprintDriftError
from marin_resources.keys import asset_key, marin_key

SHARDS = dg.DynamicPartitionsDefinition(name="test_shards")

WORDS, JOINED = asset_key("test/words"), asset_key("test/joined")


def make_defs(prefix, *, greeting="hello", strict=False, version="v1"):
    config = {"greeting": greeting}

    @marin_asset(key="test/words", version=version, partitions_def=SHARDS)
    def words(context: dg.AssetExecutionContext, store: MarinStore):
        def build(w):
            with w.open("words.txt") as fh:
                fh.write(f"{config['greeting']} {context.partition_key}".encode())
            return Built(metrics={"words": 2})
        return materialize_artifact(context, store, config=config, upstream=[], build=build)

    @marin_asset(key="test/joined", version="v1", ins={"shards": all_partitions_in("test/words")})
    def joined(context: dg.AssetExecutionContext, store: MarinStore, shards: dict[str, ArtifactHandle]):
        def build(w):
            text = " ".join(store.get().open(f"{h.uri}/words.txt").read().decode() for h in shards.values())
            with w.open("joined.txt") as fh:
                fh.write(text.encode())
            return Built(metrics={"shards": len(shards)})
        return materialize_artifact(context, store, config={}, upstream=list(shards.values()), build=build)

    store = MarinStore(prefix=str(prefix), strict_fingerprints=strict)
    return [words, joined], {"store": store, "artifact_io_manager": ArtifactHandleIOManager(store=store)}


def materialization(result, key):
    return [m for m in result.asset_materializations_for_node(asset_key(key).to_python_identifier())][0]


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        inst.add_dynamic_partitions("test_shards", ["a", "b"])
        yield inst


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
    text = (tmp_path / "test/joined/v1/joined.txt").read_text()
    assert text == "hello a hello b"
    # Unchanged upstream: the join is a no-op.
    rejoined = dg.materialize(assets, selection=[JOINED], resources=resources, instance=instance)
    assert materialization(rejoined, "test/joined").metadata["marin/reused"].value is True


def test_drift_warns_and_reuses_by_default_and_strict_refuses(tmp_path, instance):
    assets, resources = make_defs(tmp_path)
    dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)
    assets, resources = make_defs(tmp_path, greeting="bonjour")
    drifted = dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources,
                             instance=instance)
    m = materialization(drifted, "test/words")
    assert m.metadata["marin/reused"].value is True
    assert m.metadata["marin/fingerprint_drift"].value == {"changed_fields": ["greeting"]}
    assert (tmp_path / "test/words/v1/a/words.txt").read_text() == "hello a"
    logs = instance.all_logs(drifted.run_id)
    assert any("config drift" in (r.user_message or "") and r.level >= 30 for r in logs)

    assets, resources = make_defs(tmp_path, greeting="bonjour", strict=True)
    with pytest.raises(FingerprintDriftError, match="greeting"):
        dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)


def test_new_code_version_writes_beside_the_old(tmp_path, instance):
    assets, resources = make_defs(tmp_path)
    dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)
    assets, resources = make_defs(tmp_path, greeting="hi", version="v2")
    dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)
    assert (tmp_path / "test/words/v1/a/words.txt").read_text() == "hello a"
    assert (tmp_path / "test/words/v2/a/words.txt").read_text() == "hi a"


def test_missing_upstream_is_a_clear_failure(tmp_path, instance):
    assets, resources = make_defs(tmp_path)
    with pytest.raises(dg.Failure, match="no committed artifact"):
        dg.materialize(assets, selection=[JOINED], resources=resources, instance=instance)


def test_value_io_manager_round_trips_tables_and_json_with_a_manifest(tmp_path, instance):
    import polars as pl

    from marin_resources.io_managers import ValueIOManagerFactory
    from marin_resources.store import ArtifactStore

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
    assert (tmp_path / "test/summary/v1/value.json").read_text().strip().startswith("{")
    assert result.output_for_node("test__summary") == {"total": 6}


def test_planner_follows_partition_mappings(tmp_path, instance):
    from marin_assets.catalog import Catalog
    from marin_assets.planning import Planner, parse_key
    from marin_resources.store import ArtifactStore

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
