"""Kubernetes objects for a training run, as pure functions over typed config: the accelerator a
run asks for, the Pod (one host) or the headless Service and Indexed Job (a multi-host TPU
slice), and everything `kubectl apply` needs for one run. No cluster, no Dagster, no kubernetes
import: unit tested, rendered into `deploy/k8s/`, and checked against the real schema."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from marin_resources.placement import (
    PROCESS_ID_ENV,
    PlacementError,
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



def render_manifests(cfg: PodSpecConfig) -> list[dict[str, Any]]:
    """Everything ``kubectl apply`` needs for one run: a Pod, or a Service + Indexed Job."""
    if isinstance(cfg.accelerator, TpuRequest) and cfg.accelerator.multi_host:
        return [build_headless_service_spec(cfg), build_training_job_spec(cfg)]
    return [build_training_pod_spec(cfg)]

