"""A partition key the store refuses costs that partition alone: discovery skips and reports it."""

from marin_assets.planning import parse_key

TEXT = "The ferry crossed the grey water twice an hour, carrying carts, cattle and sleepy clerks. " * 10


def test_refused_key_is_reported_alone_and_status_does_not_crash(tmp_path, curation_planner):
    data = tmp_path / "in"
    data.mkdir()
    for name in ("a.txt", "z.txt"):
        (data / name).write_text(f"{name}. {TEXT}")
    plan = curation_planner(f"sources:\n  - name: ferry\n    uri: {data}/*.txt\n    format: text\n"
                            "    files_per_shard: 1\n")
    # A discoverer that yields a key no store may use, next to good ones (shard_key never does this).
    real = plan.catalog.discoverers["ferry_shards"]
    plan.catalog.discoverers["ferry_shards"] = lambda: sorted([*real(), "report..final.txt"])
    added = plan.discover()
    assert added["ferry_shards"] == ["a.txt", "z.txt"]
    assert "contains '..'" in plan.refused["ferry_shards"]["report..final.txt"]
    states = plan.status([parse_key("documents/ferry")])
    assert [(s.partition, s.state) for s in states] == [("a.txt", "missing"), ("z.txt", "missing")]
    steps = plan.materialize(parse_key("deduplicated/ferry"), None, log=lambda m: None)
    assert all(s.success for s in steps) and "deduplicated/ferry" in steps[-1].asset_keys
