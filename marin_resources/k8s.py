"""Kubernetes manifests for Levanter training and a Dagster Pipes launcher that submits them.

Single-host work (CPU, a GPU node, a single-host TPU slice) runs as one Pod through
``dagster_k8s.PipesK8sClient``. A multi-host TPU slice needs one Pod per TPU VM host, so it
runs as an Indexed Job plus a headless Service (GKE's documented pattern): every host gets a
stable DNS name ``<job>-<index>.<service>``, ``TPU_WORKER_ID`` and ``TPU_WORKER_HOSTNAMES``.
All hosts run the same training program, but only host 0 writes Dagster Pipes messages; the
others have their message channel pointed at ``/dev/null``, so Dagster sees exactly one
reporter per slice.

The manifest builders are pure functions over typed config (no cluster, no kubernetes import)
so they can be unit tested and rendered into ``deploy/k8s/`` with
``python -m marin_resources.k8s render ...``. ``dagster_k8s`` and ``kubernetes`` are imported
lazily because they add seconds to the code location's load time.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shlex
import string
import sys
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import dagster as dg
from pydantic import Field

from marin_resources.launchers import ProcessCommand, TrainingLauncher, build_command_and_env
from marin_resources.object_stores import PIPES_BUCKET_ENV
from marin_resources.placement import (
    PROCESS_ID_ENV,
    PlacementError,
    ResourceSpec,
    process_group,
    tpu_generation,
    tpu_slice_geometry,
)

# GKE node labels and taints (https://cloud.google.com/kubernetes-engine/docs/how-to/gpus,
# https://cloud.google.com/kubernetes-engine/docs/concepts/tpus).
GKE_GPU_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
GKE_TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
GKE_TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
GPU_RESOURCE = "nvidia.com/gpu"
TPU_RESOURCE = "google.com/tpu"

RUN_NAME_LABEL = "marin.dev/run-name"
POOL_LABEL = "marin.dev/pool"
DAGSTER_RUN_ID_LABEL = "dagster/run-id"
JOB_COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"

TRAINING_CONTAINER_NAME = "training"
# Port the TPU runtime uses between the hosts of one slice (GKE multi-host examples expose it).
TPU_RUNTIME_PORT = 8471

# Dagster Pipes message channels are chosen by the DAGSTER_PIPES_MESSAGES env var; this value is
# dagster_pipes.encode_env_var({"path": "/dev/null"}), the same sink dagster_k8s uses for
# secondary containers. Non-leader TPU hosts get it so their reports go nowhere.
_PIPES_MESSAGES_ENV = "DAGSTER_PIPES_MESSAGES"
_PIPES_DEV_NULL_WRITER = "eJyrVipILMlQslJQ0k9JLdPPK83JUaoFAEmRBuA="
# Indexed Jobs set JOB_COMPLETION_INDEX in every container; the wrapper keeps host 0's Pipes
# channel and silences the others, then execs the real command with its arguments untouched.
_LEADER_ONLY_PIPES_SCRIPT = (
    'if [ "${JOB_COMPLETION_INDEX:-0}" != "0" ]; then '
    f"export {_PIPES_MESSAGES_ENV}='{_PIPES_DEV_NULL_WRITER}'; fi; "
    'exec "$@"'
)

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_TOPOLOGY_RE = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")
# Pod hostnames of an Indexed Job are "<job>-<index>" and must stay a DNS label (<= 63 chars).
_MAX_RESOURCE_NAME = 52


class K8sSpecError(ValueError):
    """A training pod/job config that Kubernetes (or GKE) would reject or misplace."""


# ----------------------------------------------------------------------------- accelerators


@dataclass(frozen=True)
class CpuRequest:
    """No accelerator: the pod lands on any node that fits its cpu/memory requests."""


@dataclass(frozen=True)
class GpuRequest:
    """``count`` NVIDIA GPUs of one GKE accelerator type (e.g. ``nvidia-h100-80gb``) on one node."""

    count: int
    gpu_type: str

    def __post_init__(self) -> None:
        if self.count < 1:
            raise K8sSpecError(f"GPU count must be >= 1, got {self.count}")
        if not self.gpu_type or not _LABEL_VALUE_RE.match(self.gpu_type):
            raise K8sSpecError(f"GPU type {self.gpu_type!r} is not a valid GKE accelerator label")


@dataclass(frozen=True)
class TpuRequest:
    """A whole TPU slice: Cloud TPU type (``v5litepod-16``), ICI topology (``4x4``), VM hosts."""

    tpu_type: str
    topology: str
    hosts: int

    def __post_init__(self) -> None:
        try:
            generation, gen = tpu_generation(self.tpu_type)
        except PlacementError as exc:
            raise K8sSpecError(str(exc)) from None
        size = self.tpu_type.rpartition("-")[2]
        if not _TOPOLOGY_RE.match(self.topology):
            raise K8sSpecError(f"TPU topology {self.topology!r} must look like 4x4 or 2x2x4")
        if self.hosts < 1:
            raise K8sSpecError(f"TPU hosts must be >= 1, got {self.hosts}")
        chips_from_type, remainder = divmod(int(size), gen.cores_per_chip)
        chips_from_topology = math.prod(int(d) for d in self.topology.split("x"))
        if remainder or chips_from_type != chips_from_topology:
            raise K8sSpecError(
                f"TPU type {self.tpu_type} has {int(size) / gen.cores_per_chip:g} chips but "
                f"topology {self.topology} has {chips_from_topology}"
            )
        per_host, remainder = divmod(chips_from_topology, self.hosts)
        if remainder or per_host not in gen.chips_per_host:
            raise K8sSpecError(
                f"{self.tpu_type} ({chips_from_topology} chips) cannot be split over "
                f"{self.hosts} hosts: {generation} hosts carry {gen.chips_per_host} chips"
            )

    @property
    def gke_accelerator(self) -> str:
        return tpu_generation(self.tpu_type)[1].gke_accelerator

    @property
    def chips_per_host(self) -> int:
        return math.prod(int(d) for d in self.topology.split("x")) // self.hosts

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1


AcceleratorRequest = CpuRequest | GpuRequest | TpuRequest


def tpu_slice(tpu_type: str) -> TpuRequest:
    """The whole slice a Cloud TPU type names: ``v5litepod-16`` is 16 chips, 4x4, on 4 hosts."""
    try:
        _, topology, hosts = tpu_slice_geometry(tpu_type)
    except PlacementError as exc:
        raise K8sSpecError(str(exc)) from None
    return TpuRequest(tpu_type=tpu_type, topology=topology, hosts=hosts)


def accelerator_for(resources, gpu_type: str) -> AcceleratorRequest:
    """The pod-level request for a run spec's ``ResourceSpec`` (``gpu_type`` is the cluster's GPU label).

    A TPU run's ``device_count`` must be the slice's chip count (one JAX device per chip on v4 and
    later), so a spec cannot ask for 16 devices and quietly get a 4-chip slice.
    """
    if resources.accelerator == "gpu":
        return GpuRequest(count=resources.device_count, gpu_type=gpu_type)
    if resources.accelerator == "tpu":
        request = tpu_slice(resources.tpu_type or "")
        chips = request.chips_per_host * request.hosts
        if resources.device_count != chips:
            raise K8sSpecError(f"resources.device_count={resources.device_count} but {request.tpu_type} has "
                               f"{chips} chips (one JAX device each)")
        return request
    return CpuRequest()


def parse_accelerator(text: str) -> AcceleratorRequest:
    """Parse ``cpu``, ``gpu:<type>:<count>`` or ``tpu:<type>:<topology>:<hosts>``."""
    kind, *parts = text.split(":")
    try:
        if kind == "cpu" and not parts:
            return CpuRequest()
        if kind == "gpu" and len(parts) == 2:
            return GpuRequest(count=int(parts[1]), gpu_type=parts[0])
        if kind == "tpu" and len(parts) == 3:
            return TpuRequest(tpu_type=parts[0], topology=parts[1], hosts=int(parts[2]))
    except ValueError as exc:
        raise K8sSpecError(f"bad accelerator {text!r}: {exc}") from exc
    raise K8sSpecError(
        f"bad accelerator {text!r}; use cpu, gpu:<type>:<count> or tpu:<type>:<topology>:<hosts>"
    )


# ----------------------------------------------------------------------------- pod config


@dataclass(frozen=True)
class SecretEnvRef:
    """Env var ``env_name`` filled by the kubelet from key ``key`` of Secret ``secret_name``.

    Only the reference enters the manifest; the value never passes through Dagster.
    """

    env_name: str
    secret_name: str
    key: str


@dataclass(frozen=True)
class CacheVolume:
    """A directory for token caches / checkpoints: a PVC when ``claim_name`` is set, else an
    emptyDir (node-local scratch, optionally capped by ``size_limit``)."""

    mount_path: str
    claim_name: str | None = None
    size_limit: str | None = None


@dataclass(frozen=True)
class PodSpecConfig:
    run_name: str
    image: str
    command: tuple[str, ...]
    accelerator: AcceleratorRequest = field(default_factory=CpuRequest)
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: tuple[SecretEnvRef, ...] = ()
    cpu: str = "4"
    memory: str = "16Gi"
    namespace: str = "default"
    service_account: str | None = None
    cache_volume: CacheVolume | None = None
    dagster_run_id: str | None = None
    pool: str | None = None
    """The Dagster pool whose slot the launching step holds; a label, for quotas and dashboards."""
    # Size of the tmpfs mounted at /dev/shm on GPU pods; NCCL's intra-node transport needs more
    # than the container runtime's 64 MiB default.
    gpu_shared_memory: str = "16Gi"

    def __post_init__(self) -> None:
        if not self.command:
            raise K8sSpecError("command must not be empty")
        if not self.image:
            raise K8sSpecError("image must not be empty")
        if not self.run_name:
            raise K8sSpecError("run_name must not be empty")
        for label, value in (
            (RUN_NAME_LABEL, self.run_name),
            (DAGSTER_RUN_ID_LABEL, self.dagster_run_id or ""),
            (POOL_LABEL, self.pool or ""),
        ):
            if len(value) > 63 or not _LABEL_VALUE_RE.match(value):
                raise K8sSpecError(f"{label} value {value!r} is not a valid Kubernetes label value")
        for quantity in (self.cpu, self.memory, self.gpu_shared_memory):
            if not _QUANTITY_RE.match(quantity):
                raise K8sSpecError(f"{quantity!r} is not a Kubernetes resource quantity")
        names = [*self.env, *(ref.env_name for ref in self.secret_env)]
        for name in names:
            if not _ENV_NAME_RE.match(name):
                raise K8sSpecError(f"env var name {name!r} is not a valid identifier")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise K8sSpecError(f"env vars set twice (plain and/or secret): {duplicates}")
        for name, value in self.env.items():
            if not isinstance(value, str):
                raise K8sSpecError(f"env var {name} must be a string, got {type(value).__name__}")

    @property
    def resource_name(self) -> str:
        """DNS-1123 name for the Pod/Job, unique per Dagster run when a run id is known."""
        base = re.sub(r"[^a-z0-9-]+", "-", self.run_name.lower()).strip("-") or "run"
        suffix = f"-{self.dagster_run_id[:8].lower()}" if self.dagster_run_id else ""
        base = base[: _MAX_RESOURCE_NAME - len("marin-") - len(suffix)].rstrip("-")
        return f"marin-{base}{suffix}"

    @property
    def labels(self) -> dict[str, str]:
        labels = {"app.kubernetes.io/part-of": "marin", RUN_NAME_LABEL: self.run_name}
        if self.dagster_run_id:
            labels[DAGSTER_RUN_ID_LABEL] = self.dagster_run_id
        if self.pool:
            labels[POOL_LABEL] = self.pool
        return labels


# ----------------------------------------------------------------------------- builders


def _env_list(cfg: PodSpecConfig) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in cfg.env.items()]
    env += [
        {
            "name": ref.env_name,
            "valueFrom": {"secretKeyRef": {"name": ref.secret_name, "key": ref.key}},
        }
        for ref in cfg.secret_env
    ]
    return env


def _container(cfg: PodSpecConfig) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": cfg.cpu, "memory": cfg.memory}
    limits: dict[str, Any] = {"memory": cfg.memory}
    accel = cfg.accelerator
    # Extended resources must have request == limit; stating both keeps the manifest explicit.
    # Quantities are strings, as in the API's own schema (ResourceRequirements: map[str]str).
    if isinstance(accel, GpuRequest):
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(accel.count)
    elif isinstance(accel, TpuRequest):
        requests[TPU_RESOURCE] = limits[TPU_RESOURCE] = str(accel.chips_per_host)

    container: dict[str, Any] = {
        "name": TRAINING_CONTAINER_NAME,
        "image": cfg.image,
        "command": list(cfg.command),
        "env": _env_list(cfg),
        "resources": {"requests": requests, "limits": limits},
    }
    mounts = []
    if cfg.cache_volume is not None:
        mounts.append({"name": "cache", "mountPath": cfg.cache_volume.mount_path})
    if isinstance(accel, GpuRequest):
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if mounts:
        container["volumeMounts"] = mounts
    if isinstance(accel, TpuRequest) and accel.multi_host:
        container["ports"] = [{"containerPort": TPU_RUNTIME_PORT, "protocol": "TCP"}]
    return container


def _pod_spec(cfg: PodSpecConfig) -> dict[str, Any]:
    accel = cfg.accelerator
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [_container(cfg)]}
    if cfg.service_account:
        spec["serviceAccountName"] = cfg.service_account
    if isinstance(accel, GpuRequest):
        spec["nodeSelector"] = {GKE_GPU_ACCELERATOR_LABEL: accel.gpu_type}
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    elif isinstance(accel, TpuRequest):
        spec["nodeSelector"] = {
            GKE_TPU_ACCELERATOR_LABEL: accel.gke_accelerator,
            GKE_TPU_TOPOLOGY_LABEL: accel.topology,
        }
        spec["tolerations"] = [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    volumes = []
    if cfg.cache_volume is not None:
        cache = cfg.cache_volume
        if cache.claim_name:
            volumes.append(
                {"name": "cache", "persistentVolumeClaim": {"claimName": cache.claim_name}}
            )
        else:
            empty_dir = {"sizeLimit": cache.size_limit} if cache.size_limit else {}
            volumes.append({"name": "cache", "emptyDir": empty_dir})
    if isinstance(accel, GpuRequest):
        volumes.append(
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.gpu_shared_memory}}
        )
    if volumes:
        spec["volumes"] = volumes
    return spec


def build_training_pod_spec(cfg: PodSpecConfig) -> dict[str, Any]:
    """Full ``v1/Pod`` manifest for a single-host training run (CPU, GPU node, 1-host TPU)."""
    if isinstance(cfg.accelerator, TpuRequest) and cfg.accelerator.multi_host:
        raise K8sSpecError(
            f"{cfg.accelerator.tpu_type} spans {cfg.accelerator.hosts} hosts; one pod cannot "
            "hold it. Use build_training_job_spec (Indexed Job, one pod per host)."
        )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": cfg.resource_name, "namespace": cfg.namespace, "labels": cfg.labels},
        "spec": _pod_spec(cfg),
    }


def headless_service_name(cfg: PodSpecConfig) -> str:
    return f"{cfg.resource_name}-hosts"


def tpu_worker_hostnames(cfg: PodSpecConfig) -> list[str]:
    """DNS names of the slice's hosts: Indexed Job pods are ``<job>-<i>`` under the subdomain."""
    accel = _require_multi_host_tpu(cfg)
    service = headless_service_name(cfg)
    return [f"{cfg.resource_name}-{i}.{service}" for i in range(accel.hosts)]


def _require_multi_host_tpu(cfg: PodSpecConfig) -> TpuRequest:
    accel = cfg.accelerator
    if not (isinstance(accel, TpuRequest) and accel.multi_host):
        raise K8sSpecError(
            "an Indexed Job is only for multi-host TPU slices; use build_training_pod_spec "
            f"for {accel}"
        )
    return accel


def build_headless_service_spec(cfg: PodSpecConfig) -> dict[str, Any]:
    """``v1/Service`` with no cluster IP that gives each host pod its DNS record."""
    _require_multi_host_tpu(cfg)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": headless_service_name(cfg),
            "namespace": cfg.namespace,
            "labels": cfg.labels,
        },
        "spec": {
            "clusterIP": "None",
            "selector": {"job-name": cfg.resource_name},
            # Hosts must resolve each other before they report ready (JAX initializes first).
            "publishNotReadyAddresses": True,
        },
    }


def build_training_job_spec(cfg: PodSpecConfig) -> dict[str, Any]:
    """``batch/v1`` Indexed Job with one pod per TPU host of a multi-host slice.

    Every pod gets ``TPU_WORKER_ID`` (its completion index) and ``TPU_WORKER_HOSTNAMES`` (all
    hosts, index order), which JAX's GKE TPU cluster detection reads, and the same group as the
    ``MARIN_*`` variables of `process_group` (coordinator on host 0), which the training process
    joins. The command is wrapped so only index 0 keeps its Dagster Pipes message channel.
    """
    accel = _require_multi_host_tpu(cfg)
    pod_spec = _pod_spec(cfg)
    pod_spec["subdomain"] = headless_service_name(cfg)
    container = pod_spec["containers"][0]
    container["command"] = [
        "/bin/sh",
        "-c",
        _LEADER_ONLY_PIPES_SCRIPT,
        "marin-tpu-host",
        *cfg.command,
    ]
    def completion_index() -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": f"metadata.annotations['{JOB_COMPLETION_INDEX_ANNOTATION}']"}}

    group_env = process_group(tpu_worker_hostnames(cfg), 0).env()
    container["env"] += [
        {"name": "TPU_WORKER_ID", "valueFrom": completion_index()},
        {"name": "TPU_WORKER_HOSTNAMES", "value": ",".join(tpu_worker_hostnames(cfg))},
        # The job's process group, as `process_group` defines it for every launcher; the process id
        # is the pod's completion index, so it is filled in by the kubelet.
        *({"name": name, "value": value} for name, value in group_env.items() if name != PROCESS_ID_ENV),
        {"name": PROCESS_ID_ENV, "valueFrom": completion_index()},
    ]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": cfg.resource_name, "namespace": cfg.namespace, "labels": cfg.labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": accel.hosts,
            "parallelism": accel.hosts,
            # A slice is all-or-nothing: a lost host kills the SPMD program, and retries belong
            # to Dagster's run/step retry policy, not to the Job controller.
            "backoffLimit": 0,
            "template": {"metadata": {"labels": cfg.labels}, "spec": pod_spec},
        },
    }


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


# ----------------------------------------------------------------------------- Pipes through a bucket

PIPES_KEY_DIR = ".pipes"


@dataclass(frozen=True)
class BucketPipes:
    """Dagster Pipes context and messages exchanged through an object store, so a pod needs
    neither a volume shared with the run worker nor readable logs to report back."""

    context_injector: Any
    message_reader: Any
    pod_env: Mapping[str, str] = field(default_factory=dict)


def split_bucket_uri(uri: str) -> tuple[str, str, str]:
    """``s3://bucket/a/b`` -> (``s3``, ``bucket``, ``a/b``)."""
    scheme, sep, rest = uri.partition("://")
    bucket, _, path = rest.partition("/")
    if not sep or scheme not in ("s3", "gs") or not bucket:
        raise K8sSpecError(f"{uri!r} is not an s3:// or gs:// URI")
    return scheme, bucket, path.strip("/")


def bucket_pipes(store_uri: str, *, s3=None, gcs=None, interval_s: float = 10.0) -> BucketPipes:
    """Pipes channels under ``{store_uri}/.pipes/`` with dagster-aws / dagster-gcp's own injector
    and reader; ``s3``/``gcs`` are their resources (clients and credentials)."""
    scheme, bucket, path = split_bucket_uri(store_uri)
    key_dir = f"{path}/{PIPES_KEY_DIR}/" if path else f"{PIPES_KEY_DIR}/"

    def keyed(reader_class):
        class KeyedReader(reader_class):
            """Messages under the store's ``.pipes/`` folder rather than at the bucket root."""

            @contextmanager
            def get_params(self):
                with super().get_params() as params:
                    name = "".join(random.choices(string.ascii_letters, k=30))
                    yield {**params, "key_prefix": f"{key_dir}{name}"}

        return KeyedReader

    if scheme == "s3":
        from dagster_aws.pipes import PipesS3ContextInjector, PipesS3MessageReader
        from dagster_aws.s3 import S3Resource

        client = (s3 or S3Resource()).get_client()
        injector = PipesS3ContextInjector(bucket=bucket, client=client, key_prefix=key_dir)
        reader = keyed(PipesS3MessageReader)(bucket=bucket, client=client, interval=interval_s)
    else:
        from dagster_gcp import GCSResource

        try:
            from dagster_gcp.pipes import PipesGCSContextInjector, PipesGCSMessageReader
        except ImportError as exc:  # dagster_gcp.pipes imports its Dataproc client first
            raise ImportError(f"Pipes through {store_uri} need dagster-gcp's dataproc extra "
                              f"(google-cloud-dataproc): {exc}") from exc

        client = (gcs or GCSResource()).get_client()
        injector = PipesGCSContextInjector(bucket=bucket, client=client, key_prefix=key_dir)
        reader = keyed(PipesGCSMessageReader)(bucket=bucket, client=client, interval=interval_s)
    return BucketPipes(context_injector=injector, message_reader=reader,
                       pod_env={PIPES_BUCKET_ENV: scheme})


# ----------------------------------------------------------------------------- training launcher

# Run directories travel through the store under this folder while a bucket-mode pod runs.
LAUNCH_DIR = ".launches"


def _is_under(path: str, root: str) -> bool:
    root = root.rstrip("/")
    return path == root or path.startswith(root + "/")


class K8sTrainingLauncher(K8sPipesLauncher, TrainingLauncher):
    """The prod ``launcher`` (a ``TrainingLauncher``): the command ``LocalPipesLauncher`` would run,
    in a pod sized by the run spec's ``resources``.

    The store is either a volume (``store_prefix`` is a path, ``store_claim`` the PVC mounted
    there, so the pod and the run worker see the same files) or a bucket (``store_prefix`` is
    ``s3://`` or ``gs://``): then nothing is mounted, Pipes context and messages go through the
    bucket, the run directory travels through it (``marin_resources.mirrored_run``), and the pod
    needs the bucket and nothing else.
    """

    store_prefix: str = Field(description="MARIN_PREFIX: where the store volume is mounted, or an s3:// / gs:// URI")
    store_claim: str | None = Field(default=None, description="PVC holding the store when store_prefix is a path")
    gpu_type: str = Field(default="nvidia-h100-80gb", description="GKE accelerator label of the cluster's GPU nodes")
    s3: dg.ConfigurableResource | None = None
    """dagster_aws.s3.S3Resource for an s3:// store (default: S3Resource(), credentials from the environment)."""
    gcs: dg.ConfigurableResource | None = None
    """dagster_gcp.GCSResource for a gs:// store (default: GCSResource(), credentials from the environment)."""
    pipes_interval_s: float = 10.0

    def wandb_online(self) -> bool:
        # The API key reaches the pod through secret_env (a secretKeyRef), never as a value here.
        return any(s.env_name == "WANDB_API_KEY" for s in self.secret_env)

    def _store_placement(self, output_dir: str) -> tuple[CacheVolume | None, BucketPipes | None]:
        prefix = self.store_prefix.rstrip("/")
        if "://" in prefix:
            return None, bucket_pipes(prefix, s3=self.s3, gcs=self.gcs, interval_s=self.pipes_interval_s)
        if not self.store_claim:
            raise K8sSpecError(f"store {prefix} is a path: set store_claim to the PersistentVolumeClaim mounted there")
        if not _is_under(output_dir, prefix):
            raise K8sSpecError(f"{output_dir} is not under the shared store mount {prefix}; "
                               "set MARIN_PREFIX to the mount path in prod")
        return CacheVolume(mount_path=prefix, claim_name=self.store_claim), None

    def run_process(self, context, process: ProcessCommand, *, resources: ResourceSpec = ResourceSpec(),
                    extras: Mapping[str, Any] | None = None):
        accelerator = accelerator_for(resources, self.gpu_type)
        cache_volume, pipes = self._store_placement(process.output_dir)
        launch = build_command_and_env(process, accelerator=resources.accelerator, cpu_devices=resources.device_count,
                                       python_executable="python", extra_env=self.extra_env)
        run_name = f"{process.kind}-{context.partition_key if context.has_partition_key else 'run'}"

        def run(command: Sequence[str]):
            return self.run(context, run_name=run_name[:63].lower().replace("_", "-"), command=command,
                            env=launch.env, accelerator=accelerator, cache_volume=cache_volume, extras=extras,
                            pool=resources.pool, pipes=pipes)

        if pipes is None:
            return run(launch.command)
        return self._run_mirrored(context, process, run, launch.command)

    def _run_mirrored(self, context, process: ProcessCommand, run, command: Sequence[str]):
        """Carry the run directory (and inputs outside it) through the bucket: up before the pod
        starts, back down after it ends, whatever its outcome, so logs and partial results of a
        failed attempt reach the run worker too."""
        from marin_resources import mirrored_run

        output_dir = process.output_dir
        remote = f"{self.store_prefix.rstrip('/')}/{LAUNCH_DIR}/{context.run.run_id}/{process.kind}"
        uploads: list[tuple[str, str, str]] = []  # (flag, local, uri)
        if "://" not in output_dir:
            uploads.append(("--output", output_dir, f"{remote}/run"))
        for path in process.inputs:
            if "://" not in path and not _is_under(path, output_dir):
                uploads.append(("--input", path, f"{remote}/{os.path.basename(path)}"))
        flags: list[str] = []
        for flag, local, uri in uploads:
            try:
                mirrored_run.upload(local, uri)
            except Exception as exc:  # the SDKs raise their own types for a missing bucket or bad credentials
                mirrored_run.remove_quietly(remote)
                raise dg.Failure(f"cannot stage {local} for the training pod at {uri}: "
                                 f"{type(exc).__name__}: {exc}") from exc
            flags += [flag, f"{local}={uri}"]
        try:
            return run(["python", "-m", "marin_resources.mirrored_run", *flags, "--", *command])
        finally:
            if "://" not in output_dir:
                mirrored_run.download(f"{remote}/run", output_dir)
            mirrored_run.remove(remote)


# ----------------------------------------------------------------------------- render CLI


def render_manifests(cfg: PodSpecConfig) -> list[dict[str, Any]]:
    """Everything ``kubectl apply`` needs for one run: a Pod, or a Service + Indexed Job."""
    if isinstance(cfg.accelerator, TpuRequest) and cfg.accelerator.multi_host:
        return [build_headless_service_spec(cfg), build_training_job_spec(cfg)]
    return [build_training_pod_spec(cfg)]


def _parse_secret_ref(text: str) -> SecretEnvRef:
    env_name, sep, ref = text.partition("=")
    secret_name, sep2, key = ref.partition(":")
    if not (sep and sep2 and env_name and secret_name and key):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ENV_NAME=SECRET_NAME:KEY")
    return SecretEnvRef(env_name=env_name, secret_name=secret_name, key=key)


def _parse_env(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return name, value


def main(argv: Sequence[str] | None = None) -> int:
    import yaml

    parser = argparse.ArgumentParser(prog="python -m marin_resources.k8s")
    sub = parser.add_subparsers(dest="cmd", required=True)
    render = sub.add_parser("render", help="print the Kubernetes manifests for one training run")
    render.add_argument("--run-name", required=True)
    render.add_argument("--image", required=True)
    render.add_argument("--accelerator", type=parse_accelerator, default=CpuRequest())
    render.add_argument("--namespace", default="default")
    render.add_argument("--service-account")
    render.add_argument("--cpu", default="4")
    render.add_argument("--memory", default="16Gi")
    render.add_argument("--env", type=_parse_env, action="append", default=[])
    render.add_argument("--secret-env", type=_parse_secret_ref, action="append", default=[])
    render.add_argument("--cache-mount", help="mount path of the cache volume")
    render.add_argument("--cache-claim", help="PVC for the cache volume (default: emptyDir)")
    render.add_argument("--out", help="write here instead of stdout")
    render.add_argument("command", nargs="+", help="training command (after --)")
    args = parser.parse_args(argv)

    try:
        cfg = PodSpecConfig(
            run_name=args.run_name,
            image=args.image,
            command=tuple(args.command),
            accelerator=args.accelerator,
            env=dict(args.env),
            secret_env=tuple(args.secret_env),
            cpu=args.cpu,
            memory=args.memory,
            namespace=args.namespace,
            service_account=args.service_account,
            cache_volume=(
                CacheVolume(mount_path=args.cache_mount, claim_name=args.cache_claim)
                if args.cache_mount
                else None
            ),
        )
        docs = render_manifests(cfg)
    except K8sSpecError as exc:
        parser.error(str(exc))
    text = yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)
    header = (
        "# Generated by: python -m marin_resources.k8s "
        + shlex.join(sys.argv[1:] if argv is None else argv)
        + "\n"
    )
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(header + text)
    else:
        sys.stdout.write(header + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
