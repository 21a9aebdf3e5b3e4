"""New files become partitions and runs for exactly those shards."""

import json

import dagster as dg
import pytest

from marin_assets.automation import PINS_INPUTS_TAG
from marin_assets.curation.assets import build_curation_stage
from marin_assets.curation.config import load_curation_config
from marin_assets.curation.discovery import discover_shards
from marin_assets.curation.sensors import CURSOR_FINGERPRINT_CHARS, diff_shards
from marin_assets.deployment import Deployment
from marin_assets.planning import Planner, parse_key
from marin_assets.stages import build_stage
from marin_resources.environments import MarinSettings, build_resources

TEXT = "The quick brown fox jumps over the lazy dog near the river bank today. " * 30


def write_sources(tmp_path, watched):
    path = tmp_path / "sources.yaml"
    path.write_text(f"sources:\n  - name: letters\n    uri: {watched}/*.txt\n    format: text\n"
                    "    files_per_shard: 1\n")
    return path


def make_defs(tmp_path, sources):
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SOURCES": str(sources)})
    stage_defs, catalog = build_stage(build_curation_stage, settings, Deployment.load(settings))
    defs = dg.Definitions.merge(stage_defs, dg.Definitions(resources=build_resources(settings)))
    return defs, catalog


def test_diff_shards_is_pure_and_detects_new_and_changed(tmp_path):
    watched = tmp_path / "in"
    watched.mkdir()
    (watched / "a.txt").write_text(TEXT)
    source = load_curation_config(write_sources(tmp_path, watched)).source("letters")
    shards = discover_shards(source)
    first = diff_shards(shards, set(), {})
    assert [s.key for s in first.new] == [shards[0].key] and first.changed == []
    again = diff_shards(shards, {shards[0].key}, first.cursor)
    assert again.new == [] and again.changed == []
    (watched / "a.txt").write_text(TEXT + " more")
    changed = diff_shards(discover_shards(source), {shards[0].key}, first.cursor)
    assert [s.key for s in changed.changed] == [shards[0].key]


def test_the_cursor_holds_a_run_keys_share_of_each_fingerprint_and_reads_a_whole_one(tmp_path):
    """75,000 whole fingerprints were 7 MB of cursor a tick; a prefix as long as the run key's is
    kept, and a cursor written before (whole fingerprints) still tells a changed shard from the rest."""
    watched = tmp_path / "in"
    watched.mkdir()
    for name in ("a", "b"):
        (watched / f"{name}.txt").write_text(f"{name} {TEXT}")
    source = load_curation_config(write_sources(tmp_path, watched)).source("letters")
    shards = discover_shards(source)
    keys = {s.key for s in shards}
    cursor = diff_shards(shards, set(), {}).cursor
    assert cursor == {s.key: s.fingerprint[:CURSOR_FINGERPRINT_CHARS] for s in shards}
    whole = {s.key: s.fingerprint for s in shards}
    assert diff_shards(shards, keys, whole).changed == [] and diff_shards(shards, keys, cursor).changed == []
    (watched / "b.txt").write_text(f"b, changed {TEXT}")
    for before in (whole, cursor):
        assert [s.key for s in diff_shards(discover_shards(source), keys, before).changed] == ["b.txt"]


@pytest.mark.slow  # sensor ticks and their runs
def test_sensor_adds_partition_and_requests_only_the_new_shard(tmp_path):
    watched = tmp_path / "in"
    watched.mkdir()
    for name in ("a", "b"):
        (watched / f"{name}.txt").write_text(f"{name} {TEXT}")
    defs, catalog = make_defs(tmp_path, write_sources(tmp_path, watched))
    sensor = defs.get_sensor_def("letters_new_shards")
    with dg.instance_for_test() as instance:
        ctx = dg.build_sensor_context(instance=instance, definitions=defs)
        result = sensor(ctx)
        keys = sorted(r.partition_key for r in result.run_requests)
        assert len(keys) == 2
        assert result.dynamic_partitions_requests[0].partition_keys == keys
        # Each shard's listing fingerprint is observed as the source asset's data version.
        listed = discover_shards(load_curation_config(write_sources(tmp_path, watched)).source("letters"))
        assert sorted((e.partition, e.tags["dagster/data_version"]) for e in result.asset_events) == sorted(
            (s.key, s.fingerprint) for s in listed)
        instance.add_dynamic_partitions("letters_shards", keys)

        cursor = result.cursor
        idle = sensor(dg.build_sensor_context(instance=instance, definitions=defs, cursor=cursor))
        assert not idle.run_requests

        # Drop a real file into the watched directory: one partition, one run, idempotent run key.
        (watched / "c.txt").write_text(f"c {TEXT}")
        tick = sensor(dg.build_sensor_context(instance=instance, definitions=defs, cursor=cursor))
        assert len(tick.run_requests) == 1
        new_key = tick.run_requests[0].partition_key
        assert new_key not in keys and "c" in new_key
        assert tick.dynamic_partitions_requests[0].partition_keys == [new_key]
        assert tick.run_requests[0].run_key.startswith(new_key + ":")
        assert json.loads(tick.cursor).keys() == set(keys) | {new_key}

        # Only that shard runs; the others stay untouched.
        instance.add_dynamic_partitions("letters_shards", [new_key])
        store = defs.resources["store"].get()
        plan = Planner(defs, catalog, store, instance)
        for key in keys:
            plan_steps = plan.materialize(parse_key("documents/letters"), key, log=lambda m: None)
            assert all(s.success for s in plan_steps)
        before = {k: store.find("documents/letters", "v1", k).finished_at for k in keys}
        steps = plan.materialize(parse_key("documents/letters"), new_key, log=lambda m: None)
        assert [s.partition for s in steps if s.ran] == [new_key]
        assert {k: store.find("documents/letters", "v1", k).finished_at for k in keys} == before
        assert plan.state(parse_key("documents/letters"), new_key).state == "fresh"


@pytest.mark.slow  # builds the curation stage (sources, hashes)
def test_new_shards_wait_while_a_training_reads_the_source(tmp_path):
    watched = tmp_path / "in"
    watched.mkdir()
    (watched / "a.txt").write_text(f"a {TEXT}")
    defs, _ = make_defs(tmp_path, write_sources(tmp_path, watched))

    @dg.asset(key="checkpoint", deps=[dg.AssetKey(["documents", "letters_documents"])],
              tags={PINS_INPUTS_TAG: "true"})
    def checkpoint():
        return None

    defs = dg.Definitions.merge(defs, dg.Definitions(assets=[checkpoint]))
    sensor = defs.get_sensor_def("letters_new_shards")
    with dg.instance_for_test() as instance:
        training = instance.add_run(dg.DagsterRun(job_name="__ASSET_JOB", run_id="0123456789abcdef",
                                                  status=dg.DagsterRunStatus.STARTED,
                                                  asset_selection=frozenset({checkpoint.key})))
        waiting = sensor(dg.build_sensor_context(instance=instance, definitions=defs))
        assert not waiting.run_requests and not waiting.dynamic_partitions_requests and waiting.cursor is None
        assert waiting.skip_reason.skip_message == ("1 new or changed shard(s) wait until the training that reads "
                                                    "them ends: checkpoint (run 01234567)")
        instance.report_run_failed(training)
        assert len(sensor(dg.build_sensor_context(instance=instance, definitions=defs)).run_requests) == 1


def test_failure_report_asset_lists_failed_runs(tmp_path):
    from marin_assets.reports.assets import failure_report
    from marin_resources.artifacts import MarinStore
    from marin_resources.io_managers import ValueIOManagerFactory

    @dg.asset
    def broken():
        raise RuntimeError("planted failure for the report")

    io = ValueIOManagerFactory(store=MarinStore(prefix=str(tmp_path)))
    with dg.instance_for_test() as instance:
        failed = dg.materialize([broken], instance=instance, raise_on_error=False)
        assert not failed.success
        result = dg.materialize([failure_report], instance=instance, resources={"io_manager": io})
    frame = result.output_for_node("reports__failures_reports")
    assert frame.height == 1 and frame["run_id"][0] == failed.run_id
    assert "planted failure" in frame["error"][0] and frame["assets"][0] == "broken"


class Daemon:
    """What the daemon does with a tick's result: its partitions added, its cursor kept, and each
    run request launched unless its run key was launched before (Dagster's dedup)."""

    def __init__(self, instance, defs):
        self.instance, self.defs, self.cursor, self.run_keys, self.launched = instance, defs, None, set(), []

    def tick(self):
        sensor = self.defs.get_sensor_def("letters_new_shards")
        result = sensor(dg.build_sensor_context(instance=self.instance, definitions=self.defs, cursor=self.cursor))
        for request in result.dynamic_partitions_requests:
            self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        for run in result.run_requests:
            if run.run_key not in self.run_keys:
                self.run_keys.add(run.run_key)
                self.launched.append(run.partition_key)
        self.cursor = result.cursor or self.cursor
        return result


def letters(tmp_path, names):
    watched = tmp_path / "in"
    watched.mkdir()
    for name in names:
        (watched / f"{name}.txt").write_text(f"{name} {TEXT}")
    return watched, *make_defs(tmp_path, write_sources(tmp_path, watched))


@pytest.mark.parametrize("moment", ["before the tick", "during the tick"])
def test_a_partition_added_by_discovery_racing_a_tick_is_run_once(tmp_path, monkeypatch, moment):
    """`marin` discovery adds a new file's partition before the sensor's tick, or during it (after
    the sensor read the partitions and listed the files): the shard is requested exactly once, and
    the shards already built are not requested again."""
    from marin_assets.curation import sensors

    watched, defs, catalog = letters(tmp_path, ["a", "b"])
    with dg.instance_for_test() as instance:
        daemon = Daemon(instance, defs)
        daemon.tick()
        assert sorted(daemon.launched) == ["a.txt", "b.txt"]
        (watched / "c.txt").write_text(f"c {TEXT}")
        plan = Planner(defs, catalog, defs.resources["store"].get(), instance)
        if moment == "before the tick":
            plan.discover()
        else:
            listed = sensors.discover_shards

            def list_then_race(*args):
                shards = listed(*args)
                plan.discover()  # the sensor has read the partitions and listed: now the CLI adds c
                return shards

            monkeypatch.setattr(sensors, "discover_shards", list_then_race)
        daemon.tick()
        monkeypatch.undo()
        daemon.tick()
        assert sorted(daemon.launched) == ["a.txt", "b.txt", "c.txt"]
        assert sorted(instance.get_dynamic_partitions("letters_shards")) == ["a.txt", "b.txt", "c.txt"]


def test_a_shard_discovery_added_and_already_built_or_building_is_not_run_again(tmp_path):
    """Partitions the sensor never saw are run only when nobody built them or is building them:
    the one materialized and the one in a queued run are left alone; the third is run."""
    _, defs, catalog = letters(tmp_path, ["a", "b", "c"])
    with dg.instance_for_test() as instance:
        Planner(defs, catalog, defs.resources["store"].get(), instance).discover()
        raw = dg.AssetKey(["raw", "letters_raw"])
        instance.report_runless_asset_event(dg.AssetMaterialization(raw, partition="a.txt"))
        instance.create_run_for_job(defs.resolve_implicit_global_asset_job_def(), asset_selection={raw},
                                    tags={"dagster/partition": "b.txt"}, status=dg.DagsterRunStatus.NOT_STARTED)
        daemon = Daemon(instance, defs)
        daemon.tick()
        daemon.tick()
        assert daemon.launched == ["c.txt"]


def test_a_partition_a_sensor_adds_during_discovery_is_not_retired(tmp_path, monkeypatch):
    """`marin` discovery lists the files, then the sensor adds the partition of a file that landed
    after that listing: discovery does not retire it as missing from its (older) listing."""
    watched, defs, catalog = letters(tmp_path, ["a"])
    with dg.instance_for_test() as instance:
        plan = Planner(defs, catalog, defs.resources["store"].get(), instance)
        (name, listed), = catalog.discoverers.items()

        def list_then_race():
            keys = listed()
            (watched / "b.txt").write_text(f"b {TEXT}")
            Daemon(instance, defs).tick()  # the sensor lists both files and adds both partitions
            return keys

        monkeypatch.setitem(catalog.discoverers, name, list_then_race)
        plan.discover()
        assert sorted(instance.get_dynamic_partitions(name)) == ["a.txt", "b.txt"]
