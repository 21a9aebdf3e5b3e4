"""`K8sPipesLauncher`: a Dagster resource that runs a training command in Kubernetes and streams
its Dagster Pipes reports back (`dagster_k8s` and `kubernetes` are imported when it launches)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import dagster as dg
from pydantic import Field

from marin_resources.k8s.bucket_pipes import BucketPipes
from marin_resources.k8s.manifests import (
    JOB_COMPLETION_INDEX_ANNOTATION,
    AcceleratorRequest,
    CacheVolume,
    PodSpecConfig,
    SecretEnvRef,
    TpuRequest,
    build_headless_service_spec,
    build_training_job_spec,
    build_training_pod_spec,
)

# ----------------------------------------------------------------------------- Dagster resource


class SecretEnvRefConfig(dg.Config):
    env_name: str
    secret_name: str
    key: str


class K8sPipesLauncher(dg.ConfigurableResource):
    """Runs a training command in Kubernetes and streams its Dagster Pipes reports back.

    Single-host requests go through ``dagster_k8s.PipesK8sClient`` with our pod spec as the
    base; multi-host TPU requests create a headless Service + Indexed Job and read Pipes
    messages from host 0's logs.
    """

    image: str = Field(
        description="Training image (the code-location image built from deploy/Dockerfile)."
    )
    namespace: str = "default"
    service_account: str | None = None
    load_incluster_config: bool | None = Field(
        default=None,
        description="True inside the cluster; None autodetects via KUBERNETES_SERVICE_HOST.",
    )
    kubeconfig_file: str | None = None
    kube_context: str | None = None
    secret_env: list[SecretEnvRefConfig] = Field(default_factory=list)
    cpu: str = "8"
    memory: str = "32Gi"
    poll_interval_s: float = 10.0
    pod_wait_timeout_s: float = 7 * 24 * 3600.0

    def pod_config(
        self,
        *,
        run_name: str,
        command: Sequence[str],
        env: Mapping[str, str],
        accelerator: AcceleratorRequest,
        dagster_run_id: str | None = None,
        cache_volume: CacheVolume | None = None,
        pool: str | None = None,
    ) -> PodSpecConfig:
        return PodSpecConfig(
            run_name=run_name,
            image=self.image,
            command=tuple(command),
            accelerator=accelerator,
            env=dict(env),
            secret_env=tuple(
                SecretEnvRef(env_name=s.env_name, secret_name=s.secret_name, key=s.key)
                for s in self.secret_env
            ),
            cpu=self.cpu,
            memory=self.memory,
            namespace=self.namespace,
            service_account=self.service_account,
            cache_volume=cache_volume,
            dagster_run_id=dagster_run_id,
            pool=pool,
        )

    def run(
        self,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        *,
        run_name: str,
        command: Sequence[str],
        env: Mapping[str, str],
        accelerator: AcceleratorRequest,
        cache_volume: CacheVolume | None = None,
        extras: Mapping[str, Any] | None = None,
        pool: str | None = None,
        pipes: BucketPipes | None = None,
    ) -> dg.PipesClientCompletedInvocation:
        """Run ``command`` in a pod (an Indexed Job for a multi-host TPU slice).

        Pipes context and messages travel in the pod's env and logs, or through ``pipes`` (a
        bucket) when given: then the pod needs no volume and no log access to report.
        """
        cfg = self.pod_config(
            run_name=run_name,
            command=command,
            env={**env, **(pipes.pod_env if pipes else {})},
            accelerator=accelerator,
            dagster_run_id=context.run.run_id,
            cache_volume=cache_volume,
            pool=pool,
        )
        if isinstance(accelerator, TpuRequest) and accelerator.multi_host:
            return self._run_indexed_job(context, cfg, extras, pipes)
        return self._run_pod(context, cfg, extras, pipes)

    def _run_pod(self, context, cfg: PodSpecConfig, extras,
                 pipes: BucketPipes | None) -> dg.PipesClientCompletedInvocation:
        from dagster_k8s import PipesK8sClient

        manifest = build_training_pod_spec(cfg)
        client = PipesK8sClient(
            load_incluster_config=self.load_incluster_config,
            kubeconfig_file=self.kubeconfig_file,
            kube_context=self.kube_context,
            poll_interval=self.poll_interval_s,
            context_injector=pipes.context_injector if pipes else None,
            message_reader=pipes.message_reader if pipes else None,
        )
        # PipesK8sClient names the pod itself and appends the Pipes bootstrap env vars to the
        # first container; everything else (resources, selectors, secret refs) is ours.
        return client.run(
            context=context,
            namespace=cfg.namespace,
            base_pod_meta=manifest["metadata"],
            base_pod_spec=manifest["spec"],
            extras=extras,
            pod_wait_timeout=self.pod_wait_timeout_s,
        )

    def _load_kube_config(self) -> None:
        import kubernetes

        if self.load_incluster_config:
            kubernetes.config.load_incluster_config()
        else:
            kubernetes.config.load_kube_config(
                config_file=self.kubeconfig_file, context=self.kube_context
            )

    def _run_indexed_job(
        self, context, cfg: PodSpecConfig, extras, pipes: BucketPipes | None
    ) -> dg.PipesClientCompletedInvocation:
        from dagster_k8s.client import DagsterKubernetesClient, WaitForPodState
        from dagster_k8s.pipes import PipesK8sPodLogsMessageReader

        self._load_kube_config()
        client = DagsterKubernetesClient.production_client()
        reader = pipes.message_reader if pipes else PipesK8sPodLogsMessageReader()
        with dg.open_pipes_session(
            context=context,
            extras=extras,
            context_injector=pipes.context_injector if pipes else dg.PipesEnvContextInjector(),
            message_reader=reader,
        ) as session:
            cfg = replace(cfg, env={**cfg.env, **session.get_bootstrap_env_vars()})
            service = build_headless_service_spec(cfg)
            job = build_training_job_spec(cfg)
            job_name, namespace = job["metadata"]["name"], cfg.namespace
            client.core_api.create_namespaced_service(namespace, service)
            try:
                client.batch_api.create_namespaced_job(namespace, job)
                leader = self._wait_for_leader_pod(client, job_name, namespace)
                client.wait_for_pod(
                    leader,
                    namespace,
                    wait_for_state=WaitForPodState.Ready,
                    wait_time_between_attempts=self.poll_interval_s,
                    wait_timeout=self.pod_wait_timeout_s,
                )
                if isinstance(reader, PipesK8sPodLogsMessageReader):
                    reader.consume_pod_logs(
                        context=context, core_api=client.core_api, pod_name=leader, namespace=namespace
                    )
                client.wait_for_job_success(
                    job_name,
                    namespace,
                    wait_timeout=self.pod_wait_timeout_s,
                    wait_time_between_attempts=self.poll_interval_s,
                    num_pods_to_wait_for=job["spec"]["completions"],
                )
            finally:
                # Foreground deletion takes the host pods down with the Job. A 404 means the
                # object never got created; that must not mask the error that got us here.
                _delete_if_present(
                    client.batch_api.delete_namespaced_job,
                    job_name,
                    namespace,
                    propagation_policy="Foreground",
                )
                _delete_if_present(
                    client.core_api.delete_namespaced_service,
                    service["metadata"]["name"],
                    namespace,
                )
        return dg.PipesClientCompletedInvocation(session)

    def _wait_for_leader_pod(self, client, job_name: str, namespace: str) -> str:
        """Name of the job's index-0 pod (the only one that writes Pipes messages)."""
        deadline = client.timer() + self.pod_wait_timeout_s
        pods = client.wait_for_job_to_have_pods(
            job_name,
            namespace,
            wait_timeout=self.pod_wait_timeout_s,
            wait_time_between_attempts=self.poll_interval_s,
        )
        while True:
            for pod in pods:
                annotations = pod.metadata.annotations or {}
                if annotations.get(JOB_COMPLETION_INDEX_ANNOTATION) == "0":
                    return pod.metadata.name
            if client.timer() > deadline:
                raise TimeoutError(f"job {job_name} never created its index-0 pod")
            client.sleeper(self.poll_interval_s)
            pods = client.get_pods_in_job(job_name, namespace)


def _delete_if_present(delete, *args, **kwargs) -> None:
    import kubernetes

    try:
        delete(*args, **kwargs)
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise


