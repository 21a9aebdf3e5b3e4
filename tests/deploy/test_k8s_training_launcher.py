"""The `checkpoint` asset itself, with the prod `launcher` bound, against the fake API server.

The run spec's `resources` must reach the pod: the asset (not a direct launcher call) is what
is materialized, so a wiring break between spec and launcher fails here. The fake kubelet runs
tests/deploy/fake_train_main.py in place of the training entry point, so no training happens.
"""

import dataclasses
import sys
from pathlib import Path

import dagster as dg
import kubernetes
import pytest
import yaml

from marin_assets.stages import build_stage
from marin_assets.training.assets import CHECKPOINT_VERSION, build_training_stage
from marin_assets.training.spec import load_run_registry
from marin_resources.artifacts import ArtifactHandleIOManager, MarinStore
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.k8s import K8sSpecError, K8sTrainingLauncher, SecretEnvRefConfig, tpu_slice
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import producer_info, writing

to_dict = kubernetes.client.ApiClient().sanitize_for_serialization
FAKE_TRAIN_MAIN = str(Path(__file__).with_name("fake_train_main.py"))
TINY_MODEL = {"hidden_dim": 64, "intermediate_dim": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
              "seq_len": 128}
RUNS = {
    "h100x8": {"accelerator": "gpu", "device_count": 8, "pool": "gpu"},
    "v5e16": {"accelerator": "tpu", "device_count": 16, "tpu_type": "v5litepod-16", "pool": "tpu"},
    "gpu-in-tpu-pool": {"accelerator": "gpu", "device_count": 1, "pool": "tpu"},
}


def run_entry(resources: dict) -> dict:
    return {"mixture": "m", "tokenizer": "t", "model": TINY_MODEL, "optimizer": {"learning_rate": 0.001},
            "train_batch_size": 16, "num_train_steps": 7, "resources": resources}


def commit_inputs(store) -> None:
    """Committed cache, mixture and tokenizer artifacts, as the tokenization stage leaves them (the
    cache's files are never read: the fake pod does not train; the checkpoint records its manifest)."""
    mixture = {"cache_dir": None, "train_weights": {"m": 1.0},
               "configs": {"m": {"cache_dir": store.artifact_uri("tokenized/m", "v1", None,
                                                                 fingerprint=fingerprint({"name": "tokenized/m"})),
                                 "train_urls": [], "validation_urls": []}}}
    for key, name, payload in (("tokenized/m", "ledger.json", {}), ("mixture/m", "data.json", mixture),
                               ("tokenizer/t", "tokenizer.json", {"model": {}})):
        with writing(store, key, "v1", None, fingerprint=fingerprint({"name": key}), run_id="test") as writer:
            writer.write_json(name, payload)
            writer.commit(config={"name": key}, upstream=[], producer=producer_info("test"))


def make_deployment(tmp_path, cluster, prefix: str, storage_options: dict | None = None, **launcher_kwargs):
    runs_file = tmp_path / "runs.yaml"
    runs_file.write_text(yaml.safe_dump({"runs": {name: run_entry(r) for name, r in RUNS.items()}}))
    settings = MarinSettings.from_env({"MARIN_PREFIX": prefix, "MARIN_RUNS": str(runs_file)})
    resources = build_resources(settings)
    if storage_options:
        resources["store"] = MarinStore(prefix=settings.prefix, storage_options=storage_options)
        resources["artifact_io_manager"] = ArtifactHandleIOManager(store=resources["store"])
    commit_inputs(resources["store"].get())
    cluster.programs["marin_assets.training.train_main"] = [sys.executable, FAKE_TRAIN_MAIN]
    resources["launcher"] = K8sTrainingLauncher(
        image="registry.example/marin:1", namespace="training", store_prefix=settings.prefix,
        kubeconfig_file="/etc/marin/kubeconfig", poll_interval_s=0.01,
        secret_env=[SecretEnvRefConfig(env_name="WANDB_API_KEY", secret_name="marin-secrets", key="wandb-api-key")],
        **{"extra_env": {"AWS_ENDPOINT_URL": "http://s3.internal:9000"}, **launcher_kwargs})
    return settings, resources


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("runs", sorted(RUNS))
        for pool in ("gpu", "tpu"):
            instance.event_log_storage.set_concurrency_slots(pool, 1)
        yield instance


@pytest.fixture
def deployment(tmp_path, cluster, instance):
    """The store on a volume mounted at MARIN_PREFIX in the run worker and in every pod."""
    return (*make_deployment(tmp_path, cluster, str(tmp_path / "store"), store_claim="marin-store"), instance)


def materialize_checkpoint(deployment, run: str, pool: str, cluster, synthetic_deployment):
    settings, resources, instance = deployment
    runs = load_run_registry(settings.runs_file)
    defs, _ = build_stage(build_training_stage, dataclasses.replace(settings, train_pool=pool),
                          synthetic_deployment(runs=runs))
    [checkpoint] = [a for a in defs.assets if a.key == dg.AssetKey("checkpoint")]
    slots_while_running = []
    cluster.on_pod_start.append(
        lambda pod: slots_while_running.append(
            [(s.run_id, s.step_key) for s in instance.event_log_storage.get_concurrency_info(pool).claimed_slots]))
    result = dg.materialize([checkpoint], partition_key=run, instance=instance, resources=resources,
                            raise_on_error=False)
    return result, slots_while_running


def test_8_h100_run_gets_a_pod_with_8_gpus_on_h100_nodes_holding_the_gpu_slot(deployment, cluster,
                                                                               synthetic_deployment):
    result, slots = materialize_checkpoint(deployment, "h100x8", "gpu", cluster, synthetic_deployment)
    assert result.success, result.all_events

    [ran] = cluster.pods.values()
    pod = to_dict(ran.pod)
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert pod["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["metadata"]["labels"]["marin.dev/pool"] == "gpu"
    assert container["command"][1:3] == ["-m", "marin_assets.training.train_main"]
    env = {e["name"]: e for e in container["env"]}
    assert env["JAX_PLATFORMS"]["value"] == ""  # JAX finds the GPUs, not an inherited "cpu"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://s3.internal:9000"  # the store's endpoint reaches the pod
    # The step held the gpu pool's one slot while its pod ran.
    assert slots == [[(result.run_id, "checkpoint")]]

    manifest = deployment[1]["store"].get().find("checkpoint", CHECKPOINT_VERSION, "h100x8")
    assert manifest is not None and manifest.metrics["final_step"] == 7


def test_v5litepod_16_run_is_a_4_host_indexed_job_with_a_4x4_topology(deployment, cluster, synthetic_deployment):
    result, slots = materialize_checkpoint(deployment, "v5e16", "tpu", cluster, synthetic_deployment)
    assert result.success, result.all_events

    [job] = cluster.jobs.values()
    job = to_dict(job)
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                        "cloud.google.com/gke-tpu-topology": "4x4"}
    container = pod_spec["containers"][0]
    assert container["resources"]["limits"]["google.com/tpu"] == "4"  # 16 chips over 4 hosts
    hostnames = next(e["value"] for e in container["env"] if e["name"] == "TPU_WORKER_HOSTNAMES")
    assert len(hostnames.split(",")) == 4
    assert job["metadata"]["labels"]["marin.dev/pool"] == "tpu"
    assert len(cluster.pods) == 4 and all(p.exit_code == 0 for p in cluster.pods.values())
    assert slots == [[(result.run_id, "checkpoint")]] * 4

    manifest = deployment[1]["store"].get().find("checkpoint", CHECKPOINT_VERSION, "v5e16")
    assert manifest is not None


def test_a_run_asking_for_another_pool_is_refused_before_any_pod(deployment, cluster, synthetic_deployment):
    result, _ = materialize_checkpoint(deployment, "gpu-in-tpu-pool", "gpu", cluster, synthetic_deployment)
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert "asks for pool 'tpu'" in str(failure.event_specific_data.error)
    assert not cluster.pods and not cluster.jobs


@pytest.mark.parametrize("tpu_type, topology, hosts", [("v5litepod-8", "2x4", 1), ("v5litepod-16", "4x4", 4),
                                                       ("v4-8", "2x2x1", 1), ("v5p-64", "2x4x4", 8),
                                                       ("v6e-256", "16x16", 64)])
def test_tpu_types_name_whole_slices(tpu_type, topology, hosts):
    slice_ = tpu_slice(tpu_type)
    assert (slice_.topology, slice_.hosts) == (topology, hosts)


def test_unknown_or_odd_tpu_types_and_device_count_mismatches_are_refused(tmp_path):
    from marin_assets.training.spec import ResourceSpec
    from marin_resources.k8s import accelerator_for

    with pytest.raises(K8sSpecError, match="unknown TPU type"):
        tpu_slice("v9-16")
    with pytest.raises(K8sSpecError, match="not a slice size"):
        tpu_slice("v5litepod-12")
    with pytest.raises(K8sSpecError, match="device_count=8 but v5litepod-16 has 16 chips"):
        accelerator_for(ResourceSpec(accelerator="tpu", device_count=8, tpu_type="v5litepod-16"), "unused")


@pytest.mark.slow  # a training process against the S3/GCS emulators
@pytest.mark.parametrize("run, pool, hosts", [("h100x8", "gpu", 1), ("v5e16", "tpu", 4)])
def test_on_a_bucket_the_training_pod_mounts_nothing_and_its_run_directory_travels_through_the_bucket(
        tmp_path, cluster, instance, s3_env, run, pool, hosts, synthetic_deployment):
    """A pod with only the bucket: its disk starts without the run worker's files and loses its own
    when it ends, so the config it reads and the summary the asset commits both went through S3."""
    import shutil

    import s3fs

    prefix, options = s3_env
    from marin_resources.storage.object_stores import store_process_env

    settings, resources = make_deployment(tmp_path, cluster, prefix, options, pipes_interval_s=0.05,
                                          extra_env=store_process_env())
    cluster.programs["marin_resources.mirrored_run"] = [sys.executable, "-m", "marin_resources.mirrored_run"]
    run_dirs = []

    def pod_disk_is_its_own(pod):
        command = pod.spec.containers[0].command
        run_dir = command[command.index("--output") + 1].split("=", 1)[0]
        run_dirs.append(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)

    cluster.on_pod_start.append(pod_disk_is_its_own)
    cluster.on_pod_exit.append(pod_disk_is_its_own)

    result = materialize_checkpoint((settings, resources, instance), run, pool, cluster, synthetic_deployment)[0]
    assert result.success, [str(e.event_specific_data.error) for e in result.all_events if e.is_step_failure]

    assert len(cluster.pods) == hosts and all(p.exit_code == 0 for p in cluster.pods.values())
    for ran in cluster.pods.values():
        # Nothing mounted but NCCL's tmpfs on GPU nodes: no store volume.
        assert [v["name"] for v in to_dict(ran.pod)["spec"].get("volumes", [])] in (["dshm"], [])
    manifest = resources["store"].get().find("checkpoint", CHECKPOINT_VERSION, run)
    assert manifest.uri.startswith(prefix) and manifest.metrics["final_step"] == 7
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    assert not fs.exists(f"{prefix}/.launches/{result.run_id}")  # the carried run directory is cleaned up
    assert len(run_dirs) == 2 * hosts


def test_prod_environment_picks_the_k8s_launcher_with_the_bucket_client_or_the_volume(monkeypatch):
    from dagster_aws.s3 import S3Resource

    from marin_resources.launchers import LocalPipesLauncher, TrainingLauncher

    prod = {"MARIN_ENV": "prod", "MARIN_TRAINING_IMAGE": "registry.example/marin:1",
            "MARIN_GPU_TYPE": "nvidia-h200-141gb"}
    on_bucket = build_resources(MarinSettings.from_env({**prod, "MARIN_PREFIX": "s3://bucket/marin"}))
    launcher = on_bucket["launcher"]
    assert isinstance(launcher, K8sTrainingLauncher) and isinstance(launcher, TrainingLauncher)
    assert launcher.store_claim is None and isinstance(launcher.s3, S3Resource) and launcher.s3 is on_bucket["s3"]
    assert launcher.gpu_type == "nvidia-h200-141gb"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio.internal:9000")
    with_endpoint = build_resources(MarinSettings.from_env({**prod, "MARIN_PREFIX": "s3://bucket/marin"}))["launcher"]
    assert with_endpoint.extra_env == {"AWS_ENDPOINT_URL": "http://minio.internal:9000"}
    on_volume = build_resources(MarinSettings.from_env({**prod, "MARIN_PREFIX": "/mnt/marin",
                                                        "MARIN_STORE_CLAIM": "marin-pvc"}))["launcher"]
    assert (on_volume.store_prefix, on_volume.store_claim) == ("/mnt/marin", "marin-pvc")
    local = build_resources(MarinSettings.from_env({"MARIN_PREFIX": "/tmp/x"}))["launcher"]
    assert isinstance(local, LocalPipesLauncher) and isinstance(local, TrainingLauncher)
