"""The prod `launcher` builds the same training command as the local one, in a pod that mounts the store."""

from types import SimpleNamespace

import pytest

from marin_resources.k8s import (CpuRequest, GpuRequest, K8sSpecError, K8sTrainingLauncher, SecretEnvRefConfig,
                                 build_training_pod_spec)


def launcher(**kw):
    return K8sTrainingLauncher(image="registry.example/marin:1", namespace="training", store_claim="marin-store",
                               store_mount_path="/mnt/marin", load_incluster_config=False,
                               secret_env=[SecretEnvRefConfig(env_name="WANDB_API_KEY", secret_name="marin-secrets",
                                                              key="wandb-api-key")], **kw)


def capture(monkeypatch, res):
    seen = {}

    def fake_run(self, context, *, run_name, command, env, accelerator, cache_volume=None, extras=None):
        seen.update(run_name=run_name, command=command, env=env, accelerator=accelerator, cache_volume=cache_volume,
                    pod=build_training_pod_spec(self.pod_config(run_name=run_name, command=command, env=env,
                                                                accelerator=accelerator, cache_volume=cache_volume)))
        return "invocation"

    monkeypatch.setattr(K8sTrainingLauncher, "run", fake_run)
    return seen


def test_training_pod_mounts_store_and_runs_train_main(monkeypatch):
    res = launcher()
    seen = capture(monkeypatch, res)
    context = SimpleNamespace(has_partition_key=True, partition_key="nano_shakespeare",
                              run=SimpleNamespace(run_id="r1"))
    out = res.run_training(context, train_config_path="/mnt/marin/checkpoint/v1/x/train_config.yaml",
                           output_dir="/mnt/marin/checkpoint/v1/x", accelerator="gpu", device_count=8)
    assert out == "invocation"
    assert seen["command"][1:3] == ["-m", "marin_assets.training.train_main"]
    assert seen["accelerator"] == GpuRequest(count=8, gpu_type="nvidia-h100-80gb")
    assert seen["run_name"] == "train-nano-shakespeare"
    assert seen["env"]["JAX_PLATFORMS"] == "" and "WANDB_API_KEY" not in seen["env"]
    container = seen["pod"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert any(m["mountPath"] == "/mnt/marin" for m in container["volumeMounts"])
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "marin-store" for v in seen["pod"]["spec"]["volumes"])
    refs = [e for e in container["env"] if e["name"] == "WANDB_API_KEY"]
    assert refs and refs[0]["valueFrom"]["secretKeyRef"] == {"name": "marin-secrets", "key": "wandb-api-key"}


def test_eval_on_cpu_and_refuses_paths_outside_the_shared_store(monkeypatch):
    res = launcher()
    seen = capture(monkeypatch, res)
    context = SimpleNamespace(has_partition_key=True, partition_key="r", run=SimpleNamespace(run_id="r1"))
    res.run_eval(context, train_config_path="/mnt/marin/c/train_config.yaml", output_dir="/mnt/marin/eval/v1/r")
    assert seen["accelerator"] == CpuRequest() and "marin_assets.training.eval_main" in seen["command"]
    with pytest.raises(K8sSpecError, match="shared store mount"):
        res.run_training(context, train_config_path="/tmp/c.yaml", output_dir="/tmp/local")
