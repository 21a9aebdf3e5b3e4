"""A partition key the store refuses costs that partition alone: discovery skips and reports it."""

from pathlib import Path

import dagster as dg

from marin_assets.curation.assets import build_curation_stage
from marin_assets.planning import Planner, parse_key
from marin_resources.environments import MarinSettings, build_resources

REPO = Path(__file__).resolve().parents[2]
TEXT = "The ferry crossed the grey water twice an hour, carrying carts, cattle and sleepy clerks. " * 10


def test_refused_key_is_reported_alone_and_status_does_not_crash(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    data = tmp_path / "in"
    data.mkdir()
    for name in ("a.txt", "z.txt"):
        (data / name).write_text(f"{name}. {TEXT}")
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - name: ferry\n    uri: {data}/*.txt\n    format: text\n")
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SOURCES": str(sources)})
    stage, catalog = build_curation_stage(settings)
    defs = dg.Definitions.merge(stage, dg.Definitions(resources=build_resources(settings)))
    # A discoverer that yields a key no store may use, next to good ones (shard_key never does this).
    real = catalog.discoverers["ferry_shards"]
    catalog.discoverers["ferry_shards"] = lambda: sorted([*real(), "report..final.txt"])
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        plan = Planner(defs, catalog, defs.resources["store"].get(), instance)
        added = plan.discover()
        assert added["ferry_shards"] == ["a.txt", "z.txt"]
        assert "contains '..'" in plan.refused["ferry_shards"]["report..final.txt"]
        states = plan.status([parse_key("documents/ferry")])
        assert [(s.partition, s.state) for s in states] == [("a.txt", "missing"), ("z.txt", "missing")]
        steps = plan.materialize(parse_key("deduplicated/ferry"), None, log=lambda m: None)
        assert all(s.success for s in steps) and steps[-1].asset_keys == ["deduplicated/ferry"]
    finally:
        instance.dispose()
