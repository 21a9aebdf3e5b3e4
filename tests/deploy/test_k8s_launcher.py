"""K8sPipesLauncher end to end against an in-process fake API server + kubelet.

The single-host path goes through the real ``dagster_k8s.PipesK8sClient`` (its pod building,
Pipes bootstrap env, waiting and log parsing); only the HTTP client underneath is replaced. The
fake kubelet executes the container command locally, so the Pipes messages Dagster receives are
written by a real ``dagster_pipes`` child process that sees exactly the env the pod would get.
"""

import json
import sys

import dagster as dg
import kubernetes

from marin_resources.k8s import GpuRequest, K8sPipesLauncher, SecretEnvRefConfig, TpuRequest

SECRET_VALUE = "wandb-key-7f3c9d1e-MUST-NOT-LEAK"  # planted in the fake cluster's Secret
to_dict = kubernetes.client.ApiClient().sanitize_for_serialization

# The "training program": reports one materialization through Pipes, like the real entrypoint.
CHILD = r"""
import os
from dagster_pipes import open_dagster_pipes

with open_dagster_pipes() as pipes:
    worker = int(os.environ.get("TPU_WORKER_ID", "0"))
    pipes.log.info(f"host {worker} finished")
    pipes.report_asset_materialization(
        metadata={
            "worker": worker,
            "secret_len": len(os.environ["WANDB_API_KEY"]),
            "mode": os.environ["WANDB_MODE"],
            "hosts": os.environ.get("TPU_WORKER_HOSTNAMES", ""),
        }
    )
print("training stdout line")
"""


def make_launcher() -> K8sPipesLauncher:
    return K8sPipesLauncher(
        image="registry.example/marin:1",
        namespace="training",
        service_account="marin-trainer",
        kubeconfig_file="/etc/marin/kubeconfig",
        secret_env=[
            SecretEnvRefConfig(
                env_name="WANDB_API_KEY", secret_name="marin-secrets", key="wandb-api-key"
            )
        ],
        poll_interval_s=0.01,
    )


def materialize_with(accelerator, command):
    @dg.asset
    def trained_model(context: dg.AssetExecutionContext, k8s: K8sPipesLauncher):
        return k8s.run(
            context,
            run_name="llama-test",
            command=command,
            env={"WANDB_MODE": "offline"},
            accelerator=accelerator,
        ).get_materialize_result()

    return dg.materialize([trained_model], resources={"k8s": make_launcher()}, raise_on_error=False)


def materializations(result):
    return [
        e.event_specific_data.materialization
        for e in result.all_events
        if e.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION
    ]


def test_gpu_pod_runs_through_pipes_k8s_client(cluster):
    result = materialize_with(
        GpuRequest(count=2, gpu_type="nvidia-l4"), [sys.executable, "-c", CHILD]
    )
    assert result.success

    [ran] = cluster.pods.values()
    assert ran.exit_code == 0
    submitted = to_dict(ran.pod)  # exactly what PipesK8sClient sent to the API server
    spec, container = submitted["spec"], submitted["spec"]["containers"][0]
    assert submitted["metadata"]["namespace"] == "training"
    assert submitted["metadata"]["labels"]["marin.dev/run-name"] == "llama-test"
    assert submitted["metadata"]["labels"]["dagster/run-id"] == result.run_id
    assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert spec["serviceAccountName"] == "marin-trainer"
    env = {e["name"]: e for e in container["env"]}
    assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "marin-secrets",
        "key": "wandb-api-key",
    }
    assert "DAGSTER_PIPES_CONTEXT" in env and "DAGSTER_PIPES_MESSAGES" in env
    assert SECRET_VALUE not in json.dumps(submitted)
    assert cluster.kube_config_calls == [("/etc/marin/kubeconfig", None)]
    assert ("pod", ran.pod.metadata.name) in cluster.deleted

    [mat] = materializations(result)
    assert mat.metadata["worker"].value == 0
    assert mat.metadata["secret_len"].value == len(SECRET_VALUE)  # kubelet resolved the ref
    assert mat.metadata["mode"].value == "offline"
    # Nothing Dagster stored contains the secret either.
    assert all(SECRET_VALUE not in str(e) for e in result.all_events)


def test_failing_pod_fails_the_asset_with_its_logs(cluster):
    command = [sys.executable, "-c", "import sys; print('loss went NaN at step 12'); sys.exit(3)"]
    result = materialize_with(GpuRequest(count=1, gpu_type="nvidia-l4"), command)
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    message = str(failure.event_specific_data.error)
    assert "loss went NaN at step 12" in message


def test_multi_host_tpu_runs_one_pod_per_host_and_only_host_0_reports(cluster):
    tpu = TpuRequest(tpu_type="v5litepod-16", topology="4x4", hosts=4)
    result = materialize_with(tpu, [sys.executable, "-c", CHILD])
    assert result.success

    pods = sorted(
        cluster.pods.values(),
        key=lambda p: p.pod.metadata.annotations["batch.kubernetes.io/job-completion-index"],
    )
    assert len(pods) == 4 and all(p.exit_code == 0 for p in pods)
    # Every host ran the program, but only host 0's log carries Pipes messages.
    assert "__dagster_pipes_version" in "\n".join(pods[0].log_lines)
    for host in pods[1:]:
        assert "training stdout line" in host.log_lines
        assert "__dagster_pipes_version" not in "\n".join(host.log_lines)

    [mat] = materializations(result)  # one report for the whole slice
    assert mat.metadata["worker"].value == 0
    assert mat.metadata["secret_len"].value == len(SECRET_VALUE)
    [job] = cluster.jobs.values()
    [service] = cluster.services.values()
    assert mat.metadata["hosts"].value == ",".join(
        f"{job.metadata.name}-{i}.{service.metadata.name}" for i in range(4)
    )
    assert job.metadata.labels["dagster/run-id"] == result.run_id
    assert SECRET_VALUE not in json.dumps(to_dict(job))
    assert ("job", job.metadata.name) in cluster.deleted
    assert ("propagation", "Foreground") in cluster.deleted
    assert ("service", service.metadata.name) in cluster.deleted


def test_multi_host_failure_on_a_follower_fails_the_run(cluster):
    command = [
        sys.executable,
        "-c",
        "import os, sys; sys.exit(0 if os.environ['TPU_WORKER_ID'] == '0' else 5)",
    ]
    tpu = TpuRequest(tpu_type="v4-16", topology="2x2x2", hosts=2)
    result = materialize_with(tpu, command)
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert "failed job pods" in str(failure.event_specific_data.error)
    assert [kind for kind, _ in cluster.deleted].count("job") == 1


def test_rejected_job_reports_the_api_error_and_cleans_up_the_service(cluster):
    cluster.reject_jobs_with = "exceeded quota: tpu-v5-lite-podslice"
    tpu = TpuRequest(tpu_type="v5litepod-16", topology="4x4", hosts=4)
    result = materialize_with(tpu, [sys.executable, "-c", CHILD])
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert "exceeded quota" in str(failure.event_specific_data.error)
    assert not cluster.pods
    [service] = cluster.services.values()
    assert ("service", service.metadata.name) in cluster.deleted
