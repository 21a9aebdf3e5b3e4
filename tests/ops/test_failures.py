"""Failed materializations are read back from the instance, by the library and by `marin failures`."""

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime

import dagster as dg
import pytest

from marin_assets.planning import parse_key
from marin_resources.failures import failed_materializations

TEXT = "Grey clouds gathered over the valley as the farmers brought the last of the hay into the barns. " * 20


class Threshold(dg.Config):
    min_rows: int


@dg.asset(key=["ops", "strict_table"], partitions_def=dg.StaticPartitionsDefinition(["2024", "2025"]))
def strict_table(context: dg.AssetExecutionContext, config: Threshold) -> None:
    raise ValueError(f"only 3 rows in {context.partition_key}, need {config.min_rows}")


def parse_time(value: str) -> datetime:
    stamp = datetime.fromisoformat(value)
    assert stamp.tzinfo is not None
    return stamp


@pytest.mark.slow  # real runs of the curation stage
def test_vanished_shard_and_failing_asset_are_recorded(tmp_path, curation_planner):
    watched = tmp_path / "in"
    watched.mkdir()
    for name in ("kept", "vanishing"):
        (watched / f"{name}.txt").write_text(f"{name}. {TEXT}")
    plan = curation_planner(f"sources:\n  - name: valley\n    uri: {watched}/*.txt\n    format: text\n"
                            "    files_per_shard: 1\n")
    instance = plan.instance
    home, sources = tmp_path / "home", tmp_path / "sources.yaml"

    started = datetime.now(UTC).replace(microsecond=0)
    plan.discover()
    vanishing = next(k for k in plan.partitions_of(parse_key("raw/valley")) if k.startswith("vanishing"))
    # The shard was listed, then its file went away before the run read it.
    (watched / "vanishing.txt").unlink()
    steps = plan.materialize(parse_key("raw/valley"), vanishing, log=lambda m: None)
    assert [s.success for s in steps] == [False]

    bad = dg.materialize([strict_table], partition_key="2025", instance=instance, raise_on_error=False,
                         run_config={"ops": {"ops__strict_table": {"config": {"min_rows": 10}}}})
    assert not bad.success

    rows = {row["run_id"]: row for row in failed_materializations(instance)}

    shard_row = rows[steps[0].run_id]
    assert shard_row["assets"] == shard_row["failed_assets"] == ["raw/valley"]
    assert shard_row["partition"] == vanishing
    assert shard_row["error"].startswith("FileNotFoundError") and "vanishing.txt" in shard_row["error"]
    assert shard_row["step"] == "raw__valley_raw"
    assert shard_row["tags"]["marin/cli"] == "materialize"
    assert parse_time(shard_row["time"]) >= started

    asset_row = rows[bad.run_id]
    assert asset_row["assets"] == asset_row["failed_assets"] == ["ops/strict_table"]
    assert asset_row["partition"] == "2025"
    assert asset_row["config"]["ops"]["ops__strict_table"]["config"] == {"min_rows": 10}
    assert asset_row["error"] == "ValueError: only 3 rows in 2025, need 10"
    assert parse_time(asset_row["time"]) >= started
    assert len(rows) == 2

    # The same record through the CLI, from a fresh process on the same DAGSTER_HOME.
    env = {**os.environ, "DAGSTER_HOME": str(home), "MARIN_SOURCES": str(sources),
           "MARIN_PREFIX": str(tmp_path / "store")}
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "failures", "--json"], env=env,
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = {row["run_id"]: row for row in json.loads(proc.stdout)}
    assert listed.keys() == rows.keys()
    for run_id, row in rows.items():
        for field in ("assets", "failed_assets", "partition", "config", "error", "time", "step"):
            assert listed[run_id][field] == row[field], field
    assert time.time() - parse_time(listed[bad.run_id]["time"]).timestamp() < 600


@pytest.mark.slow  # real runs of the curation stage
def test_failed_error_check_fails_the_step_and_is_recorded(tmp_path, curation_planner):
    """Issue #17: ERROR checks failed (quarantine bound, accounting) while the CLI said ok and
    `marin failures` listed nothing. Issue #30: a shard of nothing but quarantine failed
    documents_accounted with balanced counts; it is an empty shard, a warning."""
    watched = tmp_path / "in"
    watched.mkdir()
    (watched / "good.jsonl").write_text(json.dumps({"text": f"good. {TEXT}"}) + "\n")
    (watched / "noise.jsonl").write_text("\n".join([json.dumps({"text": TEXT}), *["{not json"] * 4]) + "\n")
    (watched / "only_binary.jsonl").write_bytes(bytes(range(14, 32)) * 50)
    plan = curation_planner(f"sources:\n  - name: noisy\n    uri: {watched}/*.jsonl\n    files_per_shard: 1\n")
    plan.discover()
    steps = plan.materialize(parse_key("documents/noisy"), "noise.jsonl", log=lambda m: None)
    assert steps[-1].ran and not steps[-1].success
    assert "documents/noisy:documents_quarantine_bound" in steps[-1].error
    assert "quarantine_fraction=0.8 > bound=0.2: quarantined=4 of the records=5 read" in steps[-1].error
    # Reused later, the artifact keeps its verdict: the command still fails.
    again = plan.materialize(parse_key("documents/noisy"), "noise.jsonl", log=lambda m: None)
    assert not again[-1].ran and not again[-1].success and "quarantine_bound" in again[-1].error
    good = plan.materialize(parse_key("documents/noisy"), "good.jsonl", log=lambda m: None)
    assert all(s.success for s in good)
    empty = plan.materialize(parse_key("documents/noisy"), "only_binary.jsonl", log=lambda m: None)
    assert all(s.success for s in empty)
    (warning,) = [e for e in _check_evaluations(plan.instance, empty[-1].run_id)
                  if e.check_name == "documents_quarantine_bound"]
    assert not warning.passed and warning.severity == dg.AssetCheckSeverity.WARN
    assert warning.description.startswith("an empty shard: documents=0 of records=1")

    rows = [r for r in failed_materializations(plan.instance) if r["run_id"] == steps[-1].run_id]
    failed = {r["error"].split(" (")[0] for r in rows}
    assert failed == {"AssetCheckFailed: documents/noisy:documents_quarantine_bound"}
    assert all(r["partition"] == "noise.jsonl" and r["failed_assets"] == ["documents/noisy"] for r in rows)
    assert not [r for r in failed_materializations(plan.instance) if r["partition"] == "only_binary.jsonl"]


def _check_evaluations(instance: dg.DagsterInstance, run_id: str) -> list:
    return [entry.dagster_event.event_specific_data
            for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)]


class UnreachableStore(dg.ConfigurableResource):
    """A store whose endpoint does not answer: it fails when the run starts its resources."""

    def create_resource(self, context):
        from marin_resources.storage.object_stores import StoreUnavailableError

        raise StoreUnavailableError("store s3://gone/x: cannot reach bucket gone at http://127.0.0.1:9 "
                                    "(EndpointConnectionError: Could not connect)")


@dg.asset(key=["ops", "needs_store"])
def needs_store(store: dg.ResourceParam[object]) -> None:
    return None


def test_a_run_that_fails_before_any_step_quotes_its_cause(tmp_path):
    """Issue #30: a run whose store could not be reached was summed up as Dagster's generic
    'Execution of run ... failed. An exception was thrown during execution.'"""
    from marin_assets.catalog import Catalog
    from marin_assets.planning import Planner
    from marin_resources.storage.store import ArtifactStore

    defs = dg.Definitions(assets=[needs_store], resources={"store": UnreachableStore()})
    with dg.instance_for_test() as instance:
        plan = Planner(defs, Catalog(), ArtifactStore(str(tmp_path / "store")), instance)
        (step,) = plan.materialize(dg.AssetKey(["ops", "needs_store"]), None, log=lambda m: None, force=True)
        assert not step.success
        assert step.error.startswith("failed before any step: StoreUnavailableError: store s3://gone/x: "
                                     "cannot reach bucket gone"), step.error
        (row,) = failed_materializations(instance)
        assert row["error"] == step.error and row["step"] is None


@pytest.mark.slow  # launched runs whose workers are killed
@pytest.mark.parametrize("kill_in", ["trained", "parsed_hook"])
def test_a_run_whose_worker_is_killed_is_told_apart(tmp_path, kill_in):
    """Issue #30: `marin failures` said 'run failed before any step' for a run whose worker was
    killed mid-step. A real worker process kills itself (SIGKILL) inside its second step, or in a
    success hook of its first (that step has ended, the next has not started); the orphan reaper
    marks its run failed (its tags name the dead process), as after any kill."""
    from marin_assets.catalog import Catalog
    from marin_assets.planning import Planner
    from marin_resources.storage.store import ArtifactStore

    home = tmp_path / "home"
    home.mkdir()
    worker = f"""
import os, signal, socket
import dagster as dg
from marin_assets.planning import CLI_TAG, HOST_TAG, PID_TAG

@dg.success_hook
def kill_worker(context):
    if {kill_in!r} == "parsed_hook":
        os.kill(os.getpid(), signal.SIGKILL)

@dg.asset(key=["ops", "parsed"], hooks={{kill_worker}})
def parsed():
    return 1

@dg.asset(key=["ops", "trained"], deps=[parsed])
def trained():
    if {kill_in!r} == "trained":
        os.kill(os.getpid(), signal.SIGKILL)

with dg.DagsterInstance.from_config({str(home)!r}) as instance:
    dg.materialize([parsed, trained], instance=instance, tags={{CLI_TAG: "materialize",
                   HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}})
"""
    killed = subprocess.run([sys.executable, "-c", worker], env={**os.environ, "DAGSTER_HOME": str(home)},
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]
    with dg.DagsterInstance.from_config(str(home)) as instance:
        plan = Planner(dg.Definitions(), Catalog(), ArtifactStore(str(tmp_path / "store")), instance)
        (run_id,) = plan.reap_orphaned_runs(lambda m: None)
        (row,) = failed_materializations(instance)
    assert row["run_id"] == run_id and row["step"] == "ops__trained"
    assert row["failed_assets"] == ["ops/trained"] and row["assets"] == ["ops/parsed", "ops/trained"]
    told = {"trained": "killed mid-step (worker gone): step ops__trained started and never ended; ",
            "parsed_hook": "killed between steps (worker gone): step ops__parsed ended and step ops__trained "
                           "never started; "}[kill_in]
    assert row["error"].startswith(told), row["error"]


def test_a_step_that_refuses_its_input_is_told_apart_from_a_failed_build(tmp_path):
    """`input_refused` (a missing config.json, an export step that is not there) marks the failure so
    that `marin materialize` exits 2 as for any refusal; an ordinary exception stays a failed build (1)."""
    from marin_assets.catalog import Catalog
    from marin_assets.planning import Planner
    from marin_resources.artifacts import input_refused
    from marin_resources.storage.store import ArtifactStore

    @dg.asset
    def imported():
        raise input_refused("/weights: no config.json; a Hugging Face model directory has one")

    @dg.asset
    def crashed():
        raise RuntimeError("out of disk")

    with dg.instance_for_test() as instance:
        planner = Planner(dg.Definitions(assets=[imported, crashed]), Catalog(), ArtifactStore(str(tmp_path)),
                          instance)
        refused, = planner.materialize(dg.AssetKey("imported"), None, log=lambda m: None)
        failed, = planner.materialize(dg.AssetKey("crashed"), None, log=lambda m: None)
    assert not refused.success and refused.refused and "no config.json" in refused.error, refused
    assert not failed.success and not failed.refused and "out of disk" in failed.error, failed
