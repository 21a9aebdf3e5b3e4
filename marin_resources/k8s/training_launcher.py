"""`K8sTrainingLauncher`: the `TrainingLauncher` whose processes run in pods, the run directory
travelling through the store when the pod cannot mount it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg
from pydantic import Field

from marin_resources.k8s.bucket_pipes import BucketPipes, bucket_pipes
from marin_resources.k8s.manifests import CacheVolume, K8sSpecError, accelerator_for
from marin_resources.k8s.pipes_launcher import K8sPipesLauncher
from marin_resources.launchers import ProcessCommand, TrainingLauncher, build_command_and_env
from marin_resources.placement import (
    ResourceSpec,
)

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


