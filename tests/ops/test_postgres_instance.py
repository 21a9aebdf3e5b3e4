"""Real materializations on the production instance config (deploy/dagster.yaml) against the
machine's PostgreSQL, and two concurrent writers of one partition that corrupt nothing.

The instance keeps deploy/dagster.yaml's storage, run queue, concurrency and monitoring; the
Kubernetes run launcher and the GCS compute logs are dropped (no cluster, no bucket here), so
runs use the default launcher and local compute logs. The database is a throwaway
``marin_test_<random>`` on 127.0.0.1:5432 (user postgres, trust auth), dropped afterwards.
PostgreSQL being down is a failure with the reason, not a skip: CI starts the server.

Run as a script (``python test_postgres_instance.py worker ...``) this file is one racing writer.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import ArtifactHandleIOManager, Built, MarinStore, marin_asset, materialize_artifact
from marin_resources.keys import asset_key
from marin_resources.storage.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
DAYS = dg.StaticPartitionsDefinition(["2024-01-01", "2024-01-02"])
RACE_PARTITION = "2024-01-02"


def build_assets(prefix: str, gate_dir: Path | None = None):
    """One store-backed asset. With `gate_dir`, the writer holding the lease announces itself and
    waits for `go` before committing, so the test controls exactly when the race ends."""

    spec = ArtifactSpec.fixed("ops/daily_counts", "v1", {"unit": "documents"})

    @marin_asset(spec, partitions_def=DAYS)
    def daily_counts(context: dg.AssetExecutionContext, store: MarinStore):
        def build(writer) -> Built:
            run_id = context.run.run_id
            with writer.open("counts.json") as fh:
                fh.write(json.dumps({"day": context.partition_key, "writer": run_id}).encode())
            if gate_dir is not None:
                (gate_dir / f"holding-{run_id}").touch()
                deadline = time.monotonic() + 120
                while not (gate_dir / "go").exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError("the test never let the lease holder commit")
                    time.sleep(0.05)
            with writer.open("summary.txt") as fh:
                fh.write(f"written by {run_id}\n".encode())
            return Built(metrics={"rows": 2})

        return materialize_artifact(context, store, spec, upstream=[], build=build)

    store = MarinStore(prefix=prefix)
    return [daily_counts], {"store": store, "artifact_io_manager": ArtifactHandleIOManager(store=store)}


def instance_env(db_name: str) -> dict[str, str]:
    return {"DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": "5432", "DAGSTER_PG_USER": "postgres",
            "DAGSTER_PG_PASSWORD": "unused-with-trust-auth", "DAGSTER_PG_DB": db_name}


@pytest.fixture
def pg_home(tmp_path, pg_database, monkeypatch):
    for key, value in instance_env(pg_database).items():
        monkeypatch.setenv(key, value)
    config = yaml.safe_load((REPO / "deploy" / "dagster.yaml").read_text())
    del config["run_launcher"], config["compute_logs"]
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


@pytest.mark.slow  # PostgreSQL, and racing writer processes
def test_assets_materialize_and_race_safely_on_postgres(pg_home, tmp_path):
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

    from marin_resources.failures import failed_materializations

    prefix = str(tmp_path / "store")
    assets, resources = build_assets(prefix)
    instance = dg.DagsterInstance.from_config(str(pg_home))
    try:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        assert isinstance(instance.run_launcher, dg.DefaultRunLauncher)
        assert instance.get_concurrency_config().run_queue_config.max_concurrent_runs == 32

        first = dg.materialize(assets, partition_key="2024-01-01", instance=instance, resources=resources)
        assert first.success
        store = ArtifactStore(prefix)
        manifest = store.find("ops/daily_counts", "v1", "2024-01-01")
        event = instance.get_latest_materialization_event(asset_key("ops/daily_counts"))
        assert event.run_id == first.run_id
        assert event.asset_materialization.tags["dagster/data_version"] == manifest.data_version
        assert event.asset_materialization.metadata["marin/reused"].value is False
        again = dg.materialize(assets, partition_key="2024-01-01", instance=instance, resources=resources)
        reused = again.asset_materializations_for_node("ops__daily_counts_ops")[0]
        assert reused.metadata["marin/reused"].value is True

        # Two writers of the same partition at once, each its own process and Dagster run.
        gate = tmp_path / "gate"
        gate.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        workers = [subprocess.Popen([sys.executable, __file__, "worker", str(pg_home), prefix, str(gate)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        try:
            deadline = time.monotonic() + 120
            while all(w.poll() is None for w in workers):
                assert time.monotonic() < deadline, "neither writer finished"
                time.sleep(0.1)
            # The first to finish is the one refused the lease; only now may the holder commit.
            (gate / "go").touch()
            outputs = []
            for worker in workers:
                out, err = worker.communicate(timeout=120)
                assert worker.returncode == 0, err
                outputs.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
        winners = [o for o in outputs if o["success"]]
        losers = [o for o in outputs if not o["success"]]
        assert len(winners) == 1 and len(losers) == 1, outputs
        assert [p.name for p in gate.glob("holding-*")] == [f"holding-{winners[0]['run_id']}"]

        rows = [r for r in failed_materializations(instance) if r["run_id"] == losers[0]["run_id"]]
        assert len(rows) == 1
        assert rows[0]["error"].startswith("ArtifactLockedError")
        assert winners[0]["run_id"] in rows[0]["error"] and rows[0]["partition"] == RACE_PARTITION
        assert rows[0]["failed_assets"] == ["ops/daily_counts"]
        assert instance.get_run_by_id(winners[0]["run_id"]).status == dg.DagsterRunStatus.SUCCESS

        committed = store.find("ops/daily_counts", "v1", RACE_PARTITION)
        assert committed is not None and store.verify(committed) == []
        assert committed.producer["run_id"] == winners[0]["run_id"]
        assert sorted(f.path for f in committed.files) == ["counts.json", "summary.txt"]
        assert json.loads(Path(committed.uri, "counts.json").read_text())["writer"] == winners[0]["run_id"]
        assert not Path(committed.uri, ".lock").exists()
        latest = instance.get_latest_materialization_event(asset_key("ops/daily_counts"))
        assert latest.run_id == winners[0]["run_id"]
        assert latest.asset_materialization.tags["dagster/data_version"] == committed.data_version
    finally:
        instance.dispose()


def _race_worker(home: str, prefix: str, gate: str) -> None:
    assets, resources = build_assets(prefix, Path(gate))
    instance = dg.DagsterInstance.from_config(home)
    try:
        result = dg.materialize(assets, partition_key=RACE_PARTITION, instance=instance, resources=resources,
                                raise_on_error=False)
        print(json.dumps({"run_id": result.run_id, "success": result.success}))
    finally:
        instance.dispose()


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _race_worker(*sys.argv[2:5])
