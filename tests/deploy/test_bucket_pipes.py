"""Pods that share no volume with the run worker report through the bucket (moto_server / GCS emulator).

The launcher injects the Pipes context and reads messages with dagster-aws's / dagster-gcp's own
S3/GCS injector and reader; the pod's ``open_reporter`` opens the matching loader and writer.
Nothing is mounted and nothing is read from pod logs.
"""

import sys

import dagster as dg
import kubernetes
import pytest

from marin_assets.training.commands import train_command
from marin_resources.k8s import (
    GpuRequest,
    K8sPipesLauncher,
    K8sSpecError,
    K8sTrainingLauncher,
    TpuRequest,
    bucket_pipes,
)

to_dict = kubernetes.client.ApiClient().sanitize_for_serialization

# The training program's reporting path, as train_main uses it.
CHILD = r"""
import os
from marin_assets.training.reporting import open_reporter

with open_reporter() as reporter:
    worker = int(os.environ.get("TPU_WORKER_ID", "0"))
    reporter.log(f"host {worker} done")
    reporter.materialization({"worker": worker, "final_step": 12})
"""


def run_through_bucket(store_uri: str, accelerator, cluster, **clients):
    launcher = K8sPipesLauncher(image="registry.example/marin:1", namespace="training", poll_interval_s=0.01,
                                load_incluster_config=False)

    @dg.asset
    def trained(context: dg.AssetExecutionContext):
        pipes = bucket_pipes(store_uri, interval_s=0.05, **clients)
        return launcher.run(context, run_name="bucket-run", command=[sys.executable, "-c", CHILD],
                            env={}, accelerator=accelerator, pipes=pipes).get_materialize_result()

    return dg.materialize([trained], raise_on_error=False)


def only_materialization(result):
    [mat] = [e.event_specific_data.materialization for e in result.all_events
             if e.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION]
    return mat


@pytest.mark.slow  # pods against the S3 emulator
def test_gpu_pod_reports_through_s3_with_no_volume(s3_env, cluster):
    import s3fs

    store_uri, options = s3_env
    result = run_through_bucket(store_uri, GpuRequest(count=8, gpu_type="nvidia-h100-80gb"), cluster)
    assert result.success, [str(e) for e in result.all_events if e.is_failure]
    assert only_materialization(result).metadata["final_step"].value == 12

    [ran] = cluster.pods.values()
    pod = to_dict(ran.pod)
    assert [v["name"] for v in pod["spec"].get("volumes", [])] == ["dshm"]  # NCCL's tmpfs, no store volume
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["MARIN_PIPES_BUCKET"] == "s3"
    from dagster_pipes import decode_param

    assert decode_param(env["DAGSTER_PIPES_CONTEXT"])["bucket"] == store_uri.split("/")[2]
    # The messages stayed under the store's .pipes/ folder (the context file is deleted after the run).
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    assert fs.find(f"{store_uri}/.pipes")


@pytest.mark.slow  # pods against the S3 emulator
def test_multi_host_tpu_leader_reports_through_s3_and_the_other_hosts_stay_silent(s3_env, cluster):
    store_uri, _ = s3_env
    result = run_through_bucket(store_uri, TpuRequest(tpu_type="v5litepod-16", topology="4x4", hosts=4), cluster)
    assert result.success, [str(e) for e in result.all_events if e.is_failure]
    assert only_materialization(result).metadata["worker"].value == 0
    assert len(cluster.pods) == 4 and all(p.exit_code == 0 for p in cluster.pods.values())


@pytest.mark.slow  # a pod against the GCS emulator
def test_gcs_pod_reports_through_the_bucket(gcs_server, gcs_prefix, monkeypatch, cluster):
    from dagster_gcp import GCSResource

    store_uri, _ = gcs_prefix
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    cluster.base_env.update({"STORAGE_EMULATOR_HOST": gcs_server, "GOOGLE_CLOUD_PROJECT": "test"})
    result = run_through_bucket(store_uri, GpuRequest(count=1, gpu_type="nvidia-l4"), cluster,
                                gcs=GCSResource(project="test"))
    assert result.success, [str(e) for e in result.all_events if e.is_failure]
    assert only_materialization(result).metadata["final_step"].value == 12


def test_training_launcher_mounts_nothing_on_a_bucket_and_needs_the_claim_on_a_path(s3_env):
    store_uri, _ = s3_env
    volume, pipes = K8sTrainingLauncher(image="i", store_prefix=store_uri)._store_placement("/tmp/staging/run")
    assert volume is None and pipes.pod_env == {"MARIN_PIPES_BUCKET": "s3"}
    with pytest.raises(K8sSpecError, match="set store_claim"):
        K8sTrainingLauncher(image="i", store_prefix="/mnt/marin")._store_placement("/mnt/marin/x")
    with pytest.raises(K8sSpecError, match="not under the shared store mount"):
        K8sTrainingLauncher(image="i", store_prefix="/mnt/marin", store_claim="c")._store_placement("/tmp/run")


def test_a_missing_bucket_fails_the_launch_with_one_line_naming_the_uri(s3_env, cluster, tmp_path):
    store_uri, _ = s3_env
    missing = "s3://no-such-bucket-7c1d/store"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train_config.yaml").write_text("trainer: {}\n")
    launcher = K8sTrainingLauncher(image="i", store_prefix=missing, load_incluster_config=False, poll_interval_s=0.01)

    @dg.asset
    def trained(context: dg.AssetExecutionContext):
        launcher.run_process(context, train_command(str(run_dir / "train_config.yaml"), str(run_dir)))

    result = dg.materialize([trained], raise_on_error=False)
    assert not result.success and not cluster.pods
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    message = str(failure.event_specific_data.error.message)
    assert f"cannot stage {run_dir} for the training pod at {missing}/.launches/" in message
    assert "NoSuchBucket" in message or "not exist" in message.lower()
