"""Pod/Job manifests: valid Kubernetes objects, correct GKE placement, secrets by reference only."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes
import pytest
import yaml

from marin_resources.k8s import (
    CacheVolume,
    CpuRequest,
    GpuRequest,
    K8sSpecError,
    PodSpecConfig,
    SecretEnvRef,
    TpuRequest,
    build_headless_service_spec,
    build_training_job_spec,
    build_training_pod_spec,
    main,
    parse_accelerator,
    tpu_worker_hostnames,
)

API = kubernetes.client.ApiClient()
PLANTED_SECRET = "wandb-key-7f3c9d1e-MUST-NOT-LEAK"
REPO = Path(__file__).resolve().parents[2]


def deserialize(manifest: dict, klass: str):
    return API._ApiClient__deserialize(manifest, klass)


def assert_round_trips(manifest: dict, klass: str):
    """Deserialize into the typed client model and back; any misspelled or misplaced key is
    dropped by the model and shows up as a difference."""
    model = deserialize(manifest, klass)
    assert API.sanitize_for_serialization(model) == manifest
    return model


def make_cfg(**overrides) -> PodSpecConfig:
    values = dict(
        run_name="llama-150m",
        image="registry.example/marin:1",
        command=("python", "-m", "levanter.main.train_lm", "--config_path", "/cache/train.yaml"),
        env={"WANDB_MODE": "online"},
        secret_env=(SecretEnvRef("WANDB_API_KEY", "marin-secrets", "wandb-api-key"),),
        dagster_run_id="0b7e1f6c-3a1d-4c55-9a0e-2c6d7f1e9b21",
        namespace="training",
        service_account="marin-trainer",
    )
    values.update(overrides)
    return PodSpecConfig(**values)


def test_cpu_pod_is_a_valid_pod_without_accelerator_placement():
    manifest = build_training_pod_spec(make_cfg(accelerator=CpuRequest()))
    pod = assert_round_trips(manifest, "V1Pod")
    assert pod.api_version == "v1" and pod.kind == "Pod"
    assert pod.spec.restart_policy == "Never"
    assert pod.spec.service_account_name == "marin-trainer"
    assert pod.metadata.labels["marin.dev/run-name"] == "llama-150m"
    assert pod.metadata.labels["dagster/run-id"] == "0b7e1f6c-3a1d-4c55-9a0e-2c6d7f1e9b21"
    assert pod.metadata.name == "marin-llama-150m-0b7e1f6c"
    assert pod.spec.node_selector is None and pod.spec.tolerations is None
    limits = pod.spec.containers[0].resources.limits
    assert "nvidia.com/gpu" not in limits and "google.com/tpu" not in limits


def test_gpu_pod_requests_gpus_on_matching_nodes():
    cfg = make_cfg(
        accelerator=GpuRequest(count=8, gpu_type="nvidia-h100-80gb"),
        cache_volume=CacheVolume(mount_path="/cache", claim_name="marin-cache"),
    )
    pod = assert_round_trips(build_training_pod_spec(cfg), "V1Pod")
    container = pod.spec.containers[0]
    assert container.resources.limits["nvidia.com/gpu"] == "8"
    assert container.resources.requests["nvidia.com/gpu"] == "8"
    assert pod.spec.node_selector == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    [toleration] = pod.spec.tolerations
    assert (toleration.key, toleration.operator, toleration.effect) == (
        "nvidia.com/gpu",
        "Exists",
        "NoSchedule",
    )
    mounts = {m.name: m.mount_path for m in container.volume_mounts}
    assert mounts == {"cache": "/cache", "dshm": "/dev/shm"}
    volumes = {v.name: v for v in pod.spec.volumes}
    assert volumes["cache"].persistent_volume_claim.claim_name == "marin-cache"
    assert volumes["dshm"].empty_dir.medium == "Memory"


def test_secret_env_is_a_reference_and_the_value_never_appears():
    cfg = make_cfg(accelerator=GpuRequest(count=1, gpu_type="nvidia-l4"))
    manifest = build_training_pod_spec(cfg)
    pod = assert_round_trips(manifest, "V1Pod")
    env = {e.name: e for e in pod.spec.containers[0].env}
    ref = env["WANDB_API_KEY"].value_from.secret_key_ref
    assert (ref.name, ref.key) == ("marin-secrets", "wandb-api-key")
    assert env["WANDB_API_KEY"].value is None
    assert env["WANDB_MODE"].value == "online"

    # The config type cannot carry a secret value at all; putting one in plain env is the only
    # way to leak it, and then it is visibly plain env -- check the reference path stays clean.
    text = json.dumps(manifest)
    assert PLANTED_SECRET not in text
    leaky = build_training_pod_spec(make_cfg(env={"OTHER": PLANTED_SECRET}))
    assert PLANTED_SECRET in json.dumps(leaky)  # the check above can fail


def test_single_host_tpu_pod():
    cfg = make_cfg(accelerator=TpuRequest(tpu_type="v5litepod-4", topology="2x2", hosts=1))
    pod = assert_round_trips(build_training_pod_spec(cfg), "V1Pod")
    assert pod.spec.containers[0].resources.limits["google.com/tpu"] == "4"
    assert pod.spec.node_selector == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x2",
    }
    assert pod.spec.tolerations[0].key == "google.com/tpu"


def test_multi_host_tpu_refuses_a_single_pod():
    cfg = make_cfg(accelerator=TpuRequest(tpu_type="v5litepod-16", topology="4x4", hosts=4))
    with pytest.raises(K8sSpecError, match="Indexed Job"):
        build_training_pod_spec(cfg)


def test_each_indexed_job_pod_joins_the_process_group_that_process_group_defines():
    from marin_resources.launchers import local_process_groups
    from marin_resources.placement import ProcessGroup, process_group

    cfg = make_cfg(accelerator=TpuRequest(tpu_type="v5litepod-16", topology="4x4", hosts=4))
    env = build_training_job_spec(cfg)["spec"]["template"]["spec"]["containers"][0]["env"]
    annotation = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    for index in range(4):
        # What the kubelet gives pod `index`: values as written, the completion index where referenced.
        resolved = {e["name"]: e["value"] if "value" in e else str(index) for e in env
                    if "value" in e or e["valueFrom"].get("fieldRef", {}).get("fieldPath") == annotation}
        group = process_group(tpu_worker_hostnames(cfg), index)
        assert ProcessGroup.from_env(resolved) == group
        assert group.coordinator_address == f"{tpu_worker_hostnames(cfg)[0]}:8476" and group.process_count == 4
    # The local launcher's processes: the same function over 127.0.0.1, at one free port.
    local = local_process_groups(2)
    port = int(local[0].coordinator_address.rsplit(":", 1)[1])
    assert local == [process_group(["127.0.0.1"] * 2, i, port) for i in range(2)]


def test_multi_host_tpu_job_has_one_pod_per_host_and_stable_hostnames():
    cfg = make_cfg(accelerator=TpuRequest(tpu_type="v5litepod-16", topology="4x4", hosts=4))
    job = assert_round_trips(build_training_job_spec(cfg), "V1Job")
    service = assert_round_trips(build_headless_service_spec(cfg), "V1Service")

    assert job.spec.completion_mode == "Indexed"
    assert job.spec.completions == job.spec.parallelism == 4
    assert job.spec.backoff_limit == 0
    pod_spec = job.spec.template.spec
    assert pod_spec.restart_policy == "Never"
    assert pod_spec.subdomain == service.metadata.name
    assert service.spec.cluster_ip == "None"
    assert service.spec.selector == {"job-name": job.metadata.name}
    assert pod_spec.node_selector == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    container = pod_spec.containers[0]
    assert container.resources.limits["google.com/tpu"] == "4"  # 16 chips / 4 hosts
    env = {e.name: e for e in container.env}
    assert env["TPU_WORKER_ID"].value_from.field_ref.field_path == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    hostnames = env["TPU_WORKER_HOSTNAMES"].value.split(",")
    assert hostnames == tpu_worker_hostnames(cfg)
    assert hostnames == [f"{job.metadata.name}-{i}.{service.metadata.name}" for i in range(4)]
    assert all(len(h.split(".")[0]) <= 63 for h in hostnames)
    # The user's command is passed through unchanged after the leader-only-Pipes wrapper.
    assert container.command[:2] == ["/bin/sh", "-c"]
    assert container.command[4:] == list(cfg.command)
    assert env["WANDB_API_KEY"].value_from.secret_key_ref.name == "marin-secrets"
    assert PLANTED_SECRET not in json.dumps(build_training_job_spec(cfg))


@pytest.mark.parametrize(
    "tpu_type, topology, hosts, chips_per_host, gke",
    [
        ("v5litepod-16", "4x4", 4, 4, "tpu-v5-lite-podslice"),
        ("v4-32", "2x2x4", 4, 4, "tpu-v4-podslice"),  # v4 type names count TensorCores
        ("v5p-16", "2x2x2", 2, 4, "tpu-v5p-slice"),
        ("v6e-8", "2x4", 1, 8, "tpu-v6e-slice"),
    ],
)
def test_tpu_slice_arithmetic(tpu_type, topology, hosts, chips_per_host, gke):
    tpu = TpuRequest(tpu_type=tpu_type, topology=topology, hosts=hosts)
    assert tpu.chips_per_host == chips_per_host
    assert tpu.gke_accelerator == gke


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tpu_type="v5litepod-16", topology="4x8", hosts=4), "topology 4x8 has 32"),
        (dict(tpu_type="v5litepod-16", topology="4x4", hosts=3), "cannot be split"),
        (dict(tpu_type="v9-16", topology="4x4", hosts=4), "unknown TPU type"),
        (dict(tpu_type="v5litepod-16", topology="4by4", hosts=4), "must look like"),
    ],
)
def test_bad_tpu_requests_are_rejected(kwargs, message):
    with pytest.raises(K8sSpecError, match=message):
        TpuRequest(**kwargs)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(run_name="has spaces"), "label value"),
        (dict(env={"WANDB_API_KEY": "x"}), "set twice"),
        (dict(env={"BAD-NAME": "x"}), "not a valid identifier"),
        (dict(memory="16 gigs"), "resource quantity"),
        (dict(command=()), "command must not be empty"),
    ],
)
def test_bad_pod_configs_are_rejected(overrides, message):
    with pytest.raises(K8sSpecError, match=message):
        make_cfg(**overrides)


def test_long_run_names_still_give_dns_safe_job_and_host_names():
    cfg = make_cfg(
        run_name="Scaling_Law.sweep.llama-1b-lr3e-4-wd0.1-warmup2000-cosine-seed7"[:63],
        accelerator=TpuRequest(tpu_type="v5litepod-16", topology="4x4", hosts=4),
    )
    name = cfg.resource_name
    assert len(name) <= 52 and name == name.lower() and not name.endswith("-")
    assert_round_trips(build_training_job_spec(cfg), "V1Job")


def test_parse_accelerator():
    assert parse_accelerator("cpu") == CpuRequest()
    assert parse_accelerator("gpu:nvidia-h100-80gb:8") == GpuRequest(8, "nvidia-h100-80gb")
    assert parse_accelerator("tpu:v5litepod-16:4x4:4") == TpuRequest("v5litepod-16", "4x4", 4)
    with pytest.raises(K8sSpecError):
        parse_accelerator("gpu:8")


# The committed templates in deploy/k8s are generated by the render CLI; re-rendering with the
# command line stored in each file's header must reproduce it exactly, so they cannot drift.
TEMPLATES = sorted((REPO / "deploy" / "k8s").glob("*.yaml"))


def test_templates_exist():
    names = {p.name for p in TEMPLATES}
    assert {"train-gpu-pod.yaml", "train-tpu-multihost.yaml"} <= names


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_committed_templates_match_the_builder(path, tmp_path, monkeypatch):
    import shlex

    header = path.read_text().splitlines()[0]
    prefix = "# Generated by: python -m marin_resources.k8s "
    assert header.startswith(prefix)
    argv = shlex.split(header[len(prefix) :])
    out = tmp_path / "out.yaml"
    assert main([*argv[: argv.index("--")], "--out", str(out), *argv[argv.index("--") :]]) == 0
    assert out.read_text().splitlines()[1:] == path.read_text().splitlines()[1:]

    kinds = {"Pod": "V1Pod", "Job": "V1Job", "Service": "V1Service"}
    for doc in yaml.safe_load_all(path.read_text()):
        assert_round_trips(doc, kinds[doc["kind"]])
