"""deploy/dagster.yaml is a valid Dagster 1.13 instance and really runs on PostgreSQL.

The PostgreSQL test creates a throwaway database ``marin_test_<random>`` on the local server
(127.0.0.1:5432, user postgres, trust auth) and drops it afterwards. Two things in the file need
a cluster and a bucket, so they are stubbed at their client boundary while still constructed
from our config: the K8sRunLauncher's in-cluster kubeconfig load, and the GCS client behind the
compute log manager (it checks that the bucket exists).
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTANCE_YAML = REPO / "deploy" / "dagster.yaml"
SET_POOLS = REPO / "deploy" / "set_pools.sh"


def instance_env(db_name: str) -> dict[str, str]:
    return {
        "DAGSTER_PG_HOST": "127.0.0.1",
        "DAGSTER_PG_PORT": "5432",
        "DAGSTER_PG_USER": "postgres",
        "DAGSTER_PG_PASSWORD": "unused-with-trust-auth",
        "DAGSTER_PG_DB": db_name,
        "MARIN_COMPUTE_LOG_BUCKET": "marin-test-logs",
        "MARIN_K8S_JOB_NAMESPACE": "marin-runs",
        "MARIN_INSTANCE_CONFIGMAP": "dagster-instance",
    }


def test_instance_yaml_matches_dagster_instance_schema(tmp_path, monkeypatch):
    from marin_resources.dagster_private import instance_yaml_config, plugin_config_errors

    for k, v in instance_env("unused").items():
        monkeypatch.setenv(k, v)
    shutil.copy(INSTANCE_YAML, tmp_path / "dagster.yaml")
    config = instance_yaml_config(str(tmp_path))

    # The top-level schema treats plugin config as opaque; check each plugin's own schema.
    for section in ("run_launcher", "run_coordinator", "compute_logs"):
        assert not plugin_config_errors(config[section]), section
    assert config["telemetry"] == {"enabled": False}


@pytest.fixture
def dagster_home(tmp_path, pg_database, monkeypatch):
    for k, v in instance_env(pg_database).items():
        monkeypatch.setenv(k, v)
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(INSTANCE_YAML, home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


class _ExistingBucket:
    def __init__(self, name):
        self.name = name

    def exists(self):
        return True


class _GcsClient:
    def bucket(self, name):
        return _ExistingBucket(name)


def test_instance_runs_on_postgres_with_k8s_launcher(dagster_home, monkeypatch):
    import dagster as dg
    import kubernetes
    from dagster_gcp.gcs import compute_log_manager as gcs_logs
    from dagster_k8s import K8sRunLauncher
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

    in_cluster_loads = []
    monkeypatch.setattr(
        kubernetes.config, "load_incluster_config", lambda: in_cluster_loads.append(1)
    )
    monkeypatch.setattr(gcs_logs.storage, "Client", _GcsClient)

    instance = dg.DagsterInstance.from_config(str(dagster_home))
    try:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)

        launcher = instance.run_launcher
        assert isinstance(launcher, K8sRunLauncher)
        assert in_cluster_loads == [1]
        assert launcher.job_namespace == "marin-runs"
        assert launcher.instance_config_map == "dagster-instance"
        assert launcher.postgres_password_secret == "dagster-postgresql-secret"
        assert launcher.service_account_name == "marin-dagster-runs"
        assert "MARIN_TRAINING_IMAGE" in launcher.env_vars

        assert isinstance(instance.run_coordinator, dg.QueuedRunCoordinator)
        concurrency = instance.get_concurrency_config()
        assert concurrency.run_queue_config.max_concurrent_runs == 32
        assert concurrency.pool_config.default_pool_limit == 4
        assert concurrency.pool_config.pool_granularity.value == "op"
        assert isinstance(instance.compute_log_manager, gcs_logs.GCSComputeLogManager)
        assert not instance.telemetry_enabled

        # Storage round trip through the real database.
        instance.report_runless_asset_event(
            dg.AssetMaterialization("tokenized_corpus", metadata={"tokens": 1234})
        )
        event = instance.get_latest_materialization_event(dg.AssetKey("tokenized_corpus"))
        assert event.asset_materialization.metadata["tokens"].value == 1234
    finally:
        instance.dispose()


@pytest.mark.slow  # three `dagster instance concurrency set` processes, ~5 s each on 2 cores
def test_set_pools_script_sets_per_pool_limits(dagster_home):
    import dagster as dg

    env = {**os.environ, "MARIN_POOL_GPU": "3"}
    bad = subprocess.run(
        ["bash", str(SET_POOLS)],
        env={**env, "MARIN_POOL_TPU": "two"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "pool tpu" in bad.stderr
    assert "Set concurrency limit" not in bad.stdout  # validated before writing anything

    done = subprocess.run(
        ["bash", str(SET_POOLS)], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr

    instance = dg.DagsterInstance.from_config(str(dagster_home))
    try:
        storage = instance.event_log_storage
        limits = {
            pool: storage.get_concurrency_info(pool).slot_count
            for pool in ("cpu-train", "gpu", "tpu")
        }
        assert limits == {"cpu-train": 4, "gpu": 3, "tpu": 1}
    finally:
        instance.dispose()


def test_each_partition_run_is_its_own_kubernetes_job(dagster_home, monkeypatch):
    """Rendered, not run (no cluster here): the instance's K8sRunLauncher turns the run of each
    shard partition into one Job in the runs namespace, running the code location's image with
    the run worker's requests, the runs' service account and the database password by reference."""
    import dagster as dg
    import kubernetes
    from dagster_gcp.gcs import compute_log_manager as gcs_logs

    from marin_resources.dagster_private import launch_run_context, python_job_origin

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(gcs_logs.storage, "Client", _GcsClient)
    for name in ("MARIN_TRAINING_IMAGE", "MARIN_TRAINING_NAMESPACE", "MARIN_GPU_TYPE"):
        monkeypatch.setenv(name, f"value-of-{name}")

    @dg.asset(key=["filtered", "web"], partitions_def=dg.StaticPartitionsDefinition(["shard-00000", "shard-00001"]))
    def filtered():
        return None

    job = dg.Definitions(assets=[filtered]).resolve_implicit_global_asset_job_def()
    origin = python_job_origin(job.name, "/opt/venv/bin/python", "marin_assets.definitions", "defs", "/app",
                               "us-docker.pkg.dev/p/marin/marin-dagster:abc")
    instance = dg.DagsterInstance.from_config(str(dagster_home))
    try:
        created = []
        launcher = instance.run_launcher
        monkeypatch.setattr(launcher._api_client, "create_namespaced_job_with_retries",
                            lambda body, namespace: created.append((namespace, body)))
        runs = [instance.create_run_for_job(job, tags={"dagster/partition": shard}, job_code_origin=origin,
                                            asset_selection={filtered.key})
                for shard in ("shard-00000", "shard-00001")]
        for run in runs:
            launcher.launch_run(launch_run_context(run))
    finally:
        instance.dispose()

    assert [namespace for namespace, _ in created] == ["marin-runs", "marin-runs"]
    jobs = [body for _, body in created]
    assert [j.metadata.labels["dagster/run-id"] for j in jobs] == [r.run_id for r in runs]
    assert len({j.metadata.name for j in jobs}) == 2
    for body in jobs:
        pod = body.spec.template.spec
        (container,) = pod.containers
        assert container.image == "us-docker.pkg.dev/p/marin/marin-dagster:abc"
        assert container.args[:5] == ["/opt/venv/bin/python", "-m", "dagster", "api", "execute_run"]
        assert container.resources.requests == {"cpu": "2", "memory": "4Gi"}
        assert pod.service_account_name == "marin-dagster-runs"
        password = next(e for e in container.env if e.name == "DAGSTER_PG_PASSWORD")
        assert password.value is None and password.value_from.secret_key_ref.name == "dagster-postgresql-secret"
