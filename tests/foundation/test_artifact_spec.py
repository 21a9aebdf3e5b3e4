"""An artifact is declared once, by its `ArtifactSpec`: the asset commits the identity the spec gives,
and the planner (`marin status`) looks for that same identity. The demo's whole graph is checked the
same way in tests/foundation/test_demo.py (every committed artifact is the one status wants)."""

import dagster as dg
import pytest

from marin_assets.catalog import Catalog
from marin_assets.planning import Planner, parse_key
from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import ArtifactHandleIOManager, Built, MarinStore, materialize_artifact
from marin_resources.keys import asset_key
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore

SHARDS = dg.DynamicPartitionsDefinition(name="spec_shards")


class Width(dg.Config):
    width: int = 80


def graph(prefix, catalog: Catalog, *, greeting: str = "hello"):
    """test/lines (per shard: the greeting and the shard), then test/wrapped, whose run config is part of
    its identity."""
    lines = ArtifactSpec("test/lines", "v1", lambda shard: {"greeting": greeting, "shard": shard},
                         code_identity={"greeting": greeting})
    wrapped = ArtifactSpec("test/wrapped", "v1", lambda _p, config=None: {"width": (config or Width()).width},
                           run_config=Width)

    @catalog.asset(lines, partitions_def=SHARDS)
    def lines_asset(context: dg.AssetExecutionContext, store: MarinStore):
        def build(writer) -> Built:
            with writer.open("lines.txt") as fh:
                fh.write(f"{greeting} {context.partition_key}".encode())

        return materialize_artifact(context, store, lines, upstream=[], build=build)

    @catalog.asset(wrapped)
    def wrapped_asset(context: dg.AssetExecutionContext, config: Width, store: MarinStore):
        def build(writer) -> Built:
            writer.write_json("width.json", {"width": config.width})

        return materialize_artifact(context, store, wrapped, upstream=[], build=build, run_config=config)

    store = MarinStore(prefix=str(prefix))
    return dg.Definitions(assets=[lines_asset, wrapped_asset],
                          resources={"store": store, "artifact_io_manager": ArtifactHandleIOManager(store=store)})


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        inst.add_dynamic_partitions(SHARDS.name, ["a", "b"])
        yield inst


def test_what_the_asset_commits_is_what_status_wants(tmp_path, instance):
    catalog = Catalog()
    defs = graph(tmp_path, catalog)
    for shard in ("a", "b"):
        result = dg.materialize(defs.assets, selection=[asset_key("test/lines")], partition_key=shard,
                                resources=defs.resources, instance=instance)
        assert result.success
    store = ArtifactStore(str(tmp_path))
    planner = Planner(defs, catalog, store, instance)
    for shard in ("a", "b"):
        committed = store.find("test/lines", "v1", shard)
        assert committed.config == {"greeting": "hello", "shard": shard}
        assert fingerprint(planner.wanted_identity(parse_key("test/lines"), shard)) == committed.fingerprint
    assert {s.state for s in planner.status([parse_key("test/lines")])} == {"fresh"}
    # The partition-independent identity marks Dagster's code version: a new greeting is a new version.
    version = defs.resolve_asset_graph().get(asset_key("test/lines")).code_version
    changed = graph(tmp_path, Catalog(), greeting="hi").resolve_asset_graph().get(asset_key("test/lines")).code_version
    assert version.startswith("v1+") and changed.startswith("v1+") and version != changed


def test_a_run_config_in_the_identity_is_the_builds_and_status_assumes_its_defaults(tmp_path, instance):
    catalog = Catalog()
    defs = graph(tmp_path, catalog)
    store = ArtifactStore(str(tmp_path))
    op = next(a for a in defs.assets if a.key == asset_key("test/wrapped")).op.name
    result = dg.materialize(defs.assets, selection=[asset_key("test/wrapped")], resources=defs.resources,
                            instance=instance, run_config={"ops": {op: {"config": {"width": 40}}}})
    assert result.success
    assert store.find("test/wrapped", "v1", None).config == {"width": 40}
    planner = Planner(defs, catalog, store, instance)
    assert planner.wanted_identity(parse_key("test/wrapped"), None) == {"width": 80}
    assert [s.state for s in planner.status([parse_key("test/wrapped")])] == ["missing"]
    assert dg.materialize(defs.assets, selection=[asset_key("test/wrapped")], resources=defs.resources,
                          instance=instance).success
    assert [s.state for s in planner.status([parse_key("test/wrapped")])] == ["fresh"]


def test_an_artifact_is_declared_once(tmp_path):
    catalog = Catalog()
    graph(tmp_path, catalog)
    with pytest.raises(ValueError, match="'test/lines' is declared twice"):
        graph(tmp_path, catalog)
    with pytest.raises(ValueError, match=r"declared by two stages: \['test/lines', 'test/wrapped'\]"):
        catalog.merge(Catalog(specs=dict(catalog.specs)))
    with pytest.raises(ValueError, match="needs a key and a version"):
        ArtifactSpec.fixed("test/x", "", {})
    # Another stage's artifact is found by its spec, and a key no stage declares is refused naming those that are.
    assert catalog.spec("test/lines").version == "v1"
    with pytest.raises(ValueError, match="no artifact 'test/none' is declared .*declared: test/lines, test/wrapped"):
        catalog.spec("test/none")


def test_an_asset_built_with_another_artifacts_spec_fails_before_writing(tmp_path, instance):
    other = ArtifactSpec.fixed("test/other", "v1", {})
    mine = ArtifactSpec.fixed("test/mine", "v1", {})

    @Catalog().asset(mine)
    def wrong(context: dg.AssetExecutionContext, store: MarinStore):
        return materialize_artifact(context, store, other, upstream=[], build=lambda writer: None)

    store = MarinStore(prefix=str(tmp_path))
    result = dg.materialize([wrong], resources={"store": store, "artifact_io_manager": ArtifactHandleIOManager(
        store=store)}, instance=instance, raise_on_error=False)
    assert not result.success
    assert "asset test/mine materialized with the spec of test/other" in str(result.all_events)
    assert not list(tmp_path.rglob(".artifact.json"))
