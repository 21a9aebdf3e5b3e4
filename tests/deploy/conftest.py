"""Fixtures for tests/deploy.

``cluster``: an in-process stand-in for the Kubernetes API server and kubelet.

It implements just the CoreV1Api/BatchV1Api calls that dagster_k8s and our launcher make, and
"runs" each created pod by executing its container command locally with the env the kubelet
would give it (plain values, secretKeyRef lookups, downward-API fieldRefs, and
JOB_COMPLETION_INDEX for Indexed Job pods). Pod logs are the process's stdout+stderr with
kubelet-style timestamps, which is what PipesK8sPodLogsMessageReader parses.

Pods run synchronously at creation time, so by the time Dagster polls they have terminated.
``programs`` swaps a ``python -m MODULE`` container command for a stand-in (so an asset's
training pod can run without real training). ``on_pod_start`` callbacks see each pod as it
starts, while the launching step still holds whatever it holds (e.g. its pool slot);
``on_pod_exit`` callbacks run when its process has ended (e.g. to drop what the pod's own disk
held, which a real pod takes with it).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import kubernetes
import pytest
from dagster_k8s.client import DagsterKubernetesClient
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStatus,
    V1Job,
    V1JobStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodStatus,
    V1Service,
)

_API = kubernetes.client.ApiClient()
FAKE_SECRET_VALUE = "wandb-key-7f3c9d1e-MUST-NOT-LEAK"
_FIELD_REF_ANNOTATION = re.compile(r"^metadata\.annotations\['(.+)'\]$")


def to_model(body: Any, klass: str) -> Any:
    """Parse a request body the way the API server would: dicts become typed models."""
    if isinstance(body, dict):
        return _API._ApiClient__deserialize(body, klass)
    return body


def to_dict(model: Any) -> dict[str, Any]:
    return _API.sanitize_for_serialization(model)


class NotFound(kubernetes.client.ApiException):
    def __init__(self, what: str):
        super().__init__(status=404, reason=f"{what} not found")


@dataclass
class _RawResponse:
    """What the client returns with ``_preload_content=False``: an urllib3 response, which
    callers either iterate chunk by chunk or read whole via ``.data``."""

    data: bytes

    def __iter__(self):
        return iter(self.data.splitlines(keepends=True))


@dataclass
class RanPod:
    pod: V1Pod
    exit_code: int
    log_lines: list[str]


@dataclass
class FakeCluster:
    secrets: dict[tuple[str, str], str] = field(default_factory=dict)
    pods: dict[str, RanPod] = field(default_factory=dict)
    jobs: dict[str, V1Job] = field(default_factory=dict)
    services: dict[str, V1Service] = field(default_factory=dict)
    deleted: list[tuple[str, str]] = field(default_factory=list)
    kube_config_calls: list[tuple[str | None, str | None]] = field(default_factory=list)
    # Set to make the API server refuse Job creation (admission webhook, quota, ...).
    reject_jobs_with: str | None = None
    base_env: dict[str, str] = field(
        default_factory=lambda: {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")}
    )
    # module -> argv that replaces "<python> -m module" in a container command
    programs: dict[str, list[str]] = field(default_factory=dict)
    on_pod_start: list[Callable[[V1Pod], None]] = field(default_factory=list)
    on_pod_exit: list[Callable[[V1Pod], None]] = field(default_factory=list)

    def _program(self, argv: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(argv):
            if argv[i + 1 : i + 2] == ["-m"] and argv[i + 2 : i + 3] and argv[i + 2] in self.programs:
                out += self.programs[argv[i + 2]]
                i += 3
            else:
                out.append(argv[i])
                i += 1
        return out

    # -- kubelet ------------------------------------------------------------------------------

    def _resolve_env(self, pod: V1Pod, extra: dict[str, str]) -> dict[str, str]:
        env = dict(self.base_env)
        env.update(extra)
        for var in pod.spec.containers[0].env or []:
            if var.value_from is None:
                env[var.name] = var.value or ""
            elif var.value_from.secret_key_ref is not None:
                ref = var.value_from.secret_key_ref
                env[var.name] = self.secrets[(ref.name, ref.key)]
            elif var.value_from.field_ref is not None:
                match = _FIELD_REF_ANNOTATION.match(var.value_from.field_ref.field_path)
                assert match, f"fake kubelet cannot resolve {var.value_from.field_ref.field_path}"
                env[var.name] = pod.metadata.annotations[match.group(1)]
            else:
                raise AssertionError(f"unsupported env source for {var.name}")
        return env

    def _run(self, pod: V1Pod, extra_env: dict[str, str] | None = None) -> None:
        container = pod.spec.containers[0]
        for callback in self.on_pod_start:
            callback(pod)
        proc = subprocess.run(
            self._program(container.command + (container.args or [])),
            env=self._resolve_env(pod, extra_env or {}),
            capture_output=True,
            text=True,
            timeout=120,
        )
        for callback in self.on_pod_exit:
            callback(pod)
        lines = proc.stdout.splitlines() + proc.stderr.splitlines()
        pod.status = V1PodStatus(
            phase="Succeeded" if proc.returncode == 0 else "Failed",
            container_statuses=[
                V1ContainerStatus(
                    name=container.name,
                    image=container.image,
                    image_id="",
                    ready=False,
                    restart_count=0,
                    state=V1ContainerState(
                        terminated=V1ContainerStateTerminated(exit_code=proc.returncode)
                    ),
                )
            ],
        )
        self.pods[pod.metadata.name] = RanPod(pod=pod, exit_code=proc.returncode, log_lines=lines)

    # -- CoreV1Api ----------------------------------------------------------------------------

    def create_namespaced_pod(self, namespace: str, body: Any) -> V1Pod:
        pod = to_model(body, "V1Pod")
        pod.metadata.namespace = namespace
        self._run(pod)
        return pod

    def list_namespaced_pod(self, namespace: str, field_selector=None, label_selector=None, **_):
        pods = [p.pod for p in self.pods.values() if p.pod.metadata.namespace == namespace]
        if field_selector:
            key, _, value = field_selector.partition("=")
            assert key == "metadata.name", field_selector
            pods = [p for p in pods if p.metadata.name == value]
        if label_selector:
            wanted = dict(part.split("=", 1) for part in label_selector.split(","))
            pods = [
                p
                for p in pods
                if all((p.metadata.labels or {}).get(k) == v for k, v in wanted.items())
            ]
        return SimpleNamespace(items=pods)

    def read_namespaced_pod_log(self, name: str, namespace: str, _preload_content=True, **kwargs):
        if name not in self.pods:
            raise NotFound(f"pod {name}")
        stamp = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
        stamped = [
            f"{(stamp + dt.timedelta(microseconds=i)).strftime('%Y-%m-%dT%H:%M:%S.%fZ')} {line}"
            for i, line in enumerate(self.pods[name].log_lines)
        ]
        if kwargs.get("tail_lines"):
            stamped = stamped[-kwargs["tail_lines"] :]
        text = "".join(line + "\n" for line in stamped)
        return text if _preload_content else _RawResponse(text.encode())

    def delete_namespaced_pod(self, name: str, namespace: str, **_):
        self.deleted.append(("pod", name))

    def create_namespaced_service(self, namespace: str, body: Any) -> V1Service:
        service = to_model(body, "V1Service")
        self.services[service.metadata.name] = service
        return service

    def delete_namespaced_service(self, name: str, namespace: str, **_):
        self.deleted.append(("service", name))

    def list_namespaced_event(self, namespace: str, **_):
        return SimpleNamespace(items=[])

    # -- BatchV1Api: an Indexed Job controller ------------------------------------------------

    def create_namespaced_job(self, namespace: str, body: Any) -> V1Job:
        if self.reject_jobs_with:
            raise kubernetes.client.ApiException(status=422, reason=self.reject_jobs_with)
        job = to_model(body, "V1Job")
        assert job.spec.completion_mode == "Indexed", "fake controller only does Indexed Jobs"
        job.metadata.namespace = namespace
        self.jobs[job.metadata.name] = job
        template = job.spec.template
        for index in range(job.spec.completions):
            pod_dict = to_dict(V1Pod(metadata=template.metadata, spec=template.spec))
            pod = to_model(pod_dict, "V1Pod")
            pod.metadata = V1ObjectMeta(
                name=f"{job.metadata.name}-{index}-x{index}q7z",
                namespace=namespace,
                labels={**(template.metadata.labels or {}), "job-name": job.metadata.name},
                annotations={"batch.kubernetes.io/job-completion-index": str(index)},
            )
            pod.spec.hostname = f"{job.metadata.name}-{index}"
            self._run(pod, extra_env={"JOB_COMPLETION_INDEX": str(index)})
        return job

    def _job_pods(self, job_name: str) -> list[RanPod]:
        return [
            p
            for p in self.pods.values()
            if (p.pod.metadata.labels or {}).get("job-name") == job_name
        ]

    def list_namespaced_job(self, namespace: str, field_selector=None, **_):
        _, _, name = (field_selector or "").partition("=")
        return SimpleNamespace(items=[j for n, j in self.jobs.items() if n == name])

    def read_namespaced_job_status(self, name: str, namespace: str, **_):
        if name not in self.jobs:
            raise NotFound(f"job {name}")
        pods = self._job_pods(name)
        job = self.jobs[name]
        job.status = V1JobStatus(
            active=0,
            succeeded=sum(p.exit_code == 0 for p in pods),
            failed=sum(p.exit_code != 0 for p in pods),
        )
        return job

    def delete_namespaced_job(self, name: str, namespace: str, propagation_policy=None, **_):
        if name not in self.jobs:
            raise NotFound(f"job {name}")
        self.deleted.append(("job", name))
        self.deleted.append(("propagation", propagation_policy))


@pytest.fixture
def cluster(monkeypatch) -> FakeCluster:
    """A FakeCluster wired under dagster_k8s: kubeconfig loading is recorded, not performed,
    and every DagsterKubernetesClient talks to the fake."""
    fake = FakeCluster(secrets={("marin-secrets", "wandb-api-key"): FAKE_SECRET_VALUE})
    monkeypatch.setattr(
        kubernetes.config,
        "load_kube_config",
        lambda config_file=None, context=None, **_: fake.kube_config_calls.append(
            (config_file, context)
        ),
    )
    monkeypatch.setattr(
        DagsterKubernetesClient,
        "production_client",
        staticmethod(
            lambda **_: DagsterKubernetesClient(
                batch_api=fake,
                core_api=fake,
                logger=lambda _msg: None,
                sleeper=lambda _s: None,
                timer=time.time,
            )
        ),
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return fake


@pytest.fixture
def s3_env(s3_server, s3_prefix, monkeypatch, cluster):
    """(store URI, s3fs options) of a fresh moto bucket; the run worker's clients and the fake pods
    reach it through the standard variables only (AWS_ENDPOINT_URL and credentials)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    cluster.base_env.update({"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing",
                             "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    return s3_prefix
