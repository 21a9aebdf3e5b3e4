"""Kubernetes manifests for Levanter training and a Dagster Pipes launcher that submits them.

Single-host work (CPU, a GPU node, a single-host TPU slice) runs as one Pod through
``dagster_k8s.PipesK8sClient``. A multi-host TPU slice needs one Pod per TPU VM host, so it
runs as an Indexed Job plus a headless Service (GKE's documented pattern): every host gets a
stable DNS name ``<job>-<index>.<service>``, ``TPU_WORKER_ID`` and ``TPU_WORKER_HOSTNAMES``.
All hosts run the same training program, but only host 0 writes Dagster Pipes messages; the
others have their message channel pointed at ``/dev/null``, so Dagster sees exactly one
reporter per slice.

The package, one job a module:

- ``manifests``: the objects, pure functions over typed config (no cluster, no Dagster, no
  kubernetes import), unit tested, checked against the real schema, and rendered into
  ``deploy/k8s/`` by ``render`` (``python -m marin_resources.k8s render ...``);
- ``pipes_launcher``: ``K8sPipesLauncher``, the Dagster resource that submits them and reads the
  reports (``dagster_k8s`` and ``kubernetes`` are imported when it launches: they add seconds to the
  code location's load time);
- ``bucket_pipes``: Pipes through the store's bucket, for pods that share no volume with the run worker;
- ``training_launcher``: ``K8sTrainingLauncher``, the ``TrainingLauncher`` of a cluster.
"""

from marin_resources.k8s.bucket_pipes import BucketPipes, bucket_pipes
from marin_resources.k8s.manifests import (
    CacheVolume,
    CpuRequest,
    GpuRequest,
    K8sSpecError,
    PodSpecConfig,
    SecretEnvRef,
    TpuRequest,
    accelerator_for,
    build_headless_service_spec,
    build_training_job_spec,
    build_training_pod_spec,
    parse_accelerator,
    render_manifests,
    tpu_slice,
    tpu_worker_hostnames,
)
from marin_resources.k8s.pipes_launcher import K8sPipesLauncher, SecretEnvRefConfig
from marin_resources.k8s.render import main
from marin_resources.k8s.training_launcher import K8sTrainingLauncher

__all__ = [
    "BucketPipes",
    "CacheVolume",
    "CpuRequest",
    "GpuRequest",
    "K8sPipesLauncher",
    "K8sSpecError",
    "K8sTrainingLauncher",
    "PodSpecConfig",
    "SecretEnvRef",
    "SecretEnvRefConfig",
    "TpuRequest",
    "accelerator_for",
    "bucket_pipes",
    "build_headless_service_spec",
    "build_training_job_spec",
    "build_training_pod_spec",
    "main",
    "parse_accelerator",
    "render_manifests",
    "tpu_slice",
    "tpu_worker_hostnames",
]
