"""Resources chosen by environment. This is the only place that reads MARIN_* variables and finds
the project file (`marin.yaml`, see `marin_resources.project`); assets receive everything through
resources and the deployment.

- `local` (default): embedded instance, local launcher, the store at MARIN_PREFIX, else the project
  file's `store:`, else `./local_store`.
- `prod`: a store is required (MARIN_PREFIX or the project file's), cloud clients from dagster-gcp /
  dagster-aws for gs:// or s3://,
  and, with MARIN_TRAINING_IMAGE set, training in
  Kubernetes pods sized by each run's `resources` (GPU nodes labelled MARIN_GPU_TYPE). With a bucket
  prefix the pods mount nothing; with a path prefix the store is the volume MARIN_STORE_CLAIM
  mounted at MARIN_PREFIX.

Both launchers implement `marin_resources.launchers.TrainingLauncher`, the type the training
assets ask for under the resource key `launcher`.

In either environment `MARIN_RAY=local` spreads the chunks of one huge shard over a local Ray
(`marin_resources.ray_parallel`): at most MARIN_RAY_CPUS workers (default: the cores), chunks of
about MARIN_RAY_CHUNK_MB (default 32), as many as fill those workers evenly; a pass that is cheap
per byte (`deduplicated`) groups its shards into tasks of MARIN_RAY_CHUNK_DOCS documents (default
200,000). `MARIN_RAY=cluster` sends them to the running Ray cluster at RAY_ADDRESS (`host:port` of
its head, or `ray://host:port` for Ray Client) instead, balanced over MARIN_RAY_CPUS if it names
the cluster's CPUs. Unset or `off`: a shard is filtered in one piece. MARIN_DEDUP_BATCH_SHARDS
(default 8) is how many new shards the dedup index decides together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from marin_resources.project import ProjectFile, find_project_file, load_project_file
from marin_resources.ray_address import ray_host_port
from marin_resources.storage.store import local_store_problem
from marin_resources.typed_config import ConfigError

DEFAULT_PREFIX = "./local_store"
ENVIRONMENTS = ("local", "prod")
RAY_MODES = ("off", "local", "cluster")
STORE_SCHEMES = ("file", "gs", "gcs", "s3")
PROCESS_OUTPUTS = ("console", "file")
TRAIN_POOLS = ("cpu-train", "gpu", "tpu")
# A bound on JAX's compilation cache. Setting one also makes JAX take a file lock around each entry's
# read and write, so processes that compile the same step at once never read a half-written entry.
JAX_CACHE_MAX_BYTES = 4 << 30


@dataclass(frozen=True)
class MarinSettings:
    """Runtime settings read once from the environment and the project file; none of them enter a
    fingerprint. The project file's other sections do, through the `Deployment` they extend."""

    env: str
    prefix: str
    sources_file: str | None
    runs_file: str | None
    registry_file: str | None = None
    """The tokenization registry (MARIN_REGISTRY); None: the bundled registry.yaml."""
    sweeps_file: str | None = None
    """The scaling sweeps (MARIN_SWEEPS); None: the bundled sweeps.yaml."""
    train_pool: str = "cpu-train"
    training_image: str | None = None
    training_namespace: str = "default"
    store_claim: str = "marin-store"
    gpu_type: str = "nvidia-h100-80gb"
    wandb_online: bool = False
    process_output: str = "console"
    """Where local training/eval processes print: ``console`` or ``file`` (their run directory)."""
    ray: str = "off"
    """Data parallelism inside a run: ``off`` (one piece), ``local`` (Ray in the run's process) or
    ``cluster`` (the Ray cluster at ``ray_address``)."""
    ray_address: str | None = None
    """RAY_ADDRESS, read only with ``MARIN_RAY=cluster``."""
    ray_cpus: int | None = 1
    """MARIN_RAY_CPUS: the local Ray's workers (default: the cores); with ``cluster``, the cluster's
    CPUs if set, over which a step's chunks are then balanced."""
    ray_chunk_mb: int = 32
    ray_chunk_docs: int = 200_000
    dedup_batch_shards: int = 8
    """New shards the dedup index decides together (MARIN_DEDUP_BATCH_SHARDS)."""
    suites_file: str | None = None
    """The eval suites file (MARIN_SUITES); None: the bundled suites.yaml."""
    eval_suite: str | None = None
    """The suite ``harness_eval`` runs (MARIN_EVAL_SUITE); None: the file's ``default_suite``."""
    project: ProjectFile | None = None
    """The project file (MARIN_CONFIG, else ./marin.yaml); None: the built-in definitions alone."""
    prefix_named_by: str = "default"
    """Where ``prefix`` came from: ``MARIN_PREFIX``, the project file's path, or ``default``."""
    jax_compilation_cache: str | None = None
    """JAX's persistent compilation cache for training and eval processes (MARIN_JAX_CACHE; ``off``:
    none). Locally it defaults to JAX_COMPILATION_CACHE_DIR, else DAGSTER_HOME's
    ``jax_compilation_cache``: a run started again (resumed, retried, rebuilt) compiles nothing. On a
    cluster, name a directory every pod mounts. A runtime choice: a cached executable is the one a
    compile would give."""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, cwd: Path | None = None) -> MarinSettings:
        e = os.environ if environ is None else environ
        env = e.get("MARIN_ENV", "local")
        if env not in ENVIRONMENTS:
            raise ConfigError(f"MARIN_ENV must be one of {', '.join(ENVIRONMENTS)}, got {env!r}")
        project_path = find_project_file(e, Path.cwd() if cwd is None else cwd)
        project = load_project_file(project_path) if project_path is not None else None
        # An explicit MARIN_PREFIX wins over the project file (a deployment's or a test's override).
        prefix, named_by, where = e.get("MARIN_PREFIX"), "MARIN_PREFIX", "MARIN_PREFIX="
        if not prefix and project is not None and project.store:
            prefix, named_by, where = project.store, str(project.path), f"{project.path}: store: "
        if env == "prod" and not prefix:
            raise ConfigError("MARIN_ENV=prod needs a store: MARIN_PREFIX or the project file's `store:` "
                              "(for example gs://bucket/marin or s3://bucket/marin)")
        if not prefix:
            prefix, named_by = DEFAULT_PREFIX, "default"
        scheme = prefix.split("://", 1)[0] if "://" in prefix else "file"
        if scheme not in STORE_SCHEMES:
            raise ConfigError(f"{where}{prefix}: {scheme}:// is not a store this project writes to "
                              f"(a local path, file://, gs://, gcs:// or s3://)")
        if "://" not in prefix:
            prefix = str(Path(prefix).expanduser().resolve())
        if scheme == "file":
            problem = local_store_problem(Path(prefix.removeprefix("file://")))
            if problem is not None:
                raise ConfigError(f"{where}{prefix}: {problem}")
        pool = e.get("MARIN_TRAIN_POOL", "gpu" if env == "prod" else "cpu-train")
        if pool not in TRAIN_POOLS:
            raise ConfigError(f"MARIN_TRAIN_POOL must be one of {', '.join(TRAIN_POOLS)}, got {pool!r}")
        process_output = e.get("MARIN_PROCESS_OUTPUT", "console")
        if process_output not in PROCESS_OUTPUTS:
            raise ConfigError(f"MARIN_PROCESS_OUTPUT must be one of {', '.join(PROCESS_OUTPUTS)}, "
                              f"got {process_output!r}")
        ray = e.get("MARIN_RAY") or "off"
        if ray not in RAY_MODES:
            raise ConfigError(f"MARIN_RAY must be one of {', '.join(RAY_MODES)}, got {ray!r}")
        ray_address = None
        if ray == "cluster":
            ray_address = e.get("RAY_ADDRESS")
            if not ray_address:
                raise ConfigError("MARIN_RAY=cluster needs RAY_ADDRESS: the head's host:port (on a node of the "
                                 "cluster) or ray://host:port (Ray Client, from anywhere)")
            ray_host_port(ray_address)  # a malformed address fails when the code location loads
        ray_cpus = _positive_int(e, "MARIN_RAY_CPUS", None if ray == "cluster" else os.cpu_count() or 1)
        ray_chunk_mb = _positive_int(e, "MARIN_RAY_CHUNK_MB", 32)
        ray_chunk_docs = _positive_int(e, "MARIN_RAY_CHUNK_DOCS", 200_000)
        dedup_batch_shards = _positive_int(e, "MARIN_DEDUP_BATCH_SHARDS", 8)
        jax_cache = e.get("MARIN_JAX_CACHE")
        if not jax_cache and env == "local":  # JAX's own variable, else beside the instance
            jax_cache = e.get("JAX_COMPILATION_CACHE_DIR") or (
                str(Path(e["DAGSTER_HOME"]) / "jax_compilation_cache") if e.get("DAGSTER_HOME") else None)
        return cls(env=env, prefix=prefix, sources_file=e.get("MARIN_SOURCES") or None,
                   runs_file=e.get("MARIN_RUNS") or None, registry_file=e.get("MARIN_REGISTRY") or None,
                   sweeps_file=e.get("MARIN_SWEEPS") or None,
                   train_pool=pool,
                   training_image=e.get("MARIN_TRAINING_IMAGE") or None,
                   training_namespace=e.get("MARIN_TRAINING_NAMESPACE", "default"),
                   store_claim=e.get("MARIN_STORE_CLAIM", "marin-store"),
                   gpu_type=e.get("MARIN_GPU_TYPE", "nvidia-h100-80gb"),
                   # Only whether a key exists is read here; the value travels as a Dagster EnvVar/secret ref.
                   wandb_online=bool(e.get("WANDB_API_KEY")), process_output=process_output,
                   ray=ray, ray_address=ray_address, ray_cpus=ray_cpus, ray_chunk_mb=ray_chunk_mb,
                   ray_chunk_docs=ray_chunk_docs, dedup_batch_shards=dedup_batch_shards,
                   suites_file=e.get("MARIN_SUITES") or None, eval_suite=e.get("MARIN_EVAL_SUITE") or None,
                   project=project, prefix_named_by=named_by,
                   jax_compilation_cache=None if jax_cache == "off" else jax_cache)


def check_ray_reachable(settings: MarinSettings) -> None:
    """With ``MARIN_RAY=cluster``, RayUnavailableError unless the cluster answers: the CLI asks before
    it starts any run, so a dead cluster stops it before anything is built."""
    if settings.ray == "cluster":
        from marin_resources.ray_parallel import check_reachable

        check_reachable(settings.ray_address)


def _positive_int(environ, name: str, default: int | None) -> int | None:
    value = environ.get(name)
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def default_executor() -> dg.ExecutorDefinition:
    """Dagster's default executor (`multiprocess` or `in_process`, chosen by run config) with
    `in_process` as its default: a run is one process. Partitions are small and training runs in
    its own process or pod anyway, while a process per step costs a Python start and a code-location
    load each; the CLI already asks for in_process, and now a sensor's or automation's run, which
    cannot carry run config, gets the same."""
    base = dg.multi_or_in_process_executor
    return dg.ExecutorDefinition(name=base.name, config_schema=dg.Field(base.config_schema.config_type,
                                                                        default_value={"in_process": {}}),
                                 requirements=base.get_requirements, executor_creation_fn=base.executor_creation_fn,
                                 description=default_executor.__doc__)


def store_resource(settings: MarinSettings):
    """The `store` resource (`MarinStore`); building it opens nothing, `.get()` does."""
    from marin_resources.artifacts import MarinStore
    from marin_resources.storage.object_stores import storage_options

    return MarinStore(prefix=settings.prefix, storage_options=storage_options(settings.prefix))


def build_resources(settings: MarinSettings) -> dict[str, Any]:
    """The resource dict for `dg.Definitions`."""
    from marin_resources.artifacts import ArtifactHandleIOManager
    from marin_resources.io_managers import ValueIOManagerFactory

    store = store_resource(settings)
    resources: dict[str, Any] = {
        "store": store,
        "artifact_io_manager": ArtifactHandleIOManager(store=store),
        "io_manager": ValueIOManagerFactory(store=store),
    }
    resources["data_parallel"] = _data_parallel(settings)
    cloud = _cloud_resources(settings) if settings.env == "prod" else {}
    resources.update(cloud)
    resources.update(_launcher_resources(settings, cloud))
    return resources


def _launcher_resources(settings: MarinSettings, cloud: dict[str, Any]) -> dict[str, Any]:
    from marin_resources.launchers import LocalPipesLauncher
    from marin_resources.storage.object_stores import store_process_env

    # The store's endpoints and region, named for the process (a local one would also inherit them).
    process_env = store_process_env()
    if settings.jax_compilation_cache:
        process_env.update(jax_cache_env(settings.jax_compilation_cache))
    if settings.env != "prod" or not settings.training_image:
        return {"launcher": LocalPipesLauncher(wandb_api_key=dg.EnvVar("WANDB_API_KEY") if settings.wandb_online
                                               else None, output_to_file=settings.process_output == "file",
                                               extra_env=process_env)}
    from marin_resources.k8s import K8sTrainingLauncher, SecretEnvRefConfig

    secrets = [SecretEnvRefConfig(env_name="WANDB_API_KEY", secret_name="marin-secrets", key="wandb-api-key")] \
        if settings.wandb_online else []
    on_bucket = "://" in settings.prefix
    return {"launcher": K8sTrainingLauncher(image=settings.training_image, namespace=settings.training_namespace,
                                            store_prefix=settings.prefix,
                                            store_claim=None if on_bucket else settings.store_claim,
                                            gpu_type=settings.gpu_type, secret_env=secrets,
                                            s3=cloud.get("s3"), gcs=cloud.get("gcs"), extra_env=process_env)}


def jax_cache_env(directory: str) -> dict[str, str]:
    """The environment that gives a training or eval process JAX's compilation cache at ``directory``."""
    return {"JAX_COMPILATION_CACHE_DIR": directory,
            # Every compilation, not only those over JAX's default of a second: on CPU most of a small
            # model's compile time is in many short ones (measured: 45 entries, 1 MB, for a sweep run).
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_COMPILATION_CACHE_MAX_SIZE": str(JAX_CACHE_MAX_BYTES)}


def _data_parallel(settings: MarinSettings):
    chunk_bytes = settings.ray_chunk_mb * 1024 * 1024
    if settings.ray == "local":
        from marin_resources.ray_parallel import local_ray_parallel

        return local_ray_parallel(num_cpus=settings.ray_cpus, chunk_bytes=chunk_bytes,
                                  dedup_batch_shards=settings.dedup_batch_shards,
                                  chunk_documents=settings.ray_chunk_docs)
    if settings.ray == "cluster":
        from marin_resources.ray_parallel import cluster_ray_parallel

        return cluster_ray_parallel(address=settings.ray_address, cpus=settings.ray_cpus, chunk_bytes=chunk_bytes,
                                    dedup_batch_shards=settings.dedup_batch_shards,
                                    chunk_documents=settings.ray_chunk_docs)
    from marin_resources.data_parallel import DataParallel

    return DataParallel(dedup_batch_shards=settings.dedup_batch_shards)


def _cloud_resources(settings: MarinSettings) -> dict[str, Any]:
    """Cloud clients for prod; storage itself goes through fsspec with the same credentials."""
    if settings.prefix.startswith("s3://"):
        from dagster_aws.s3 import S3Resource

        return {"s3": S3Resource()}
    if settings.prefix.startswith("gs://"):
        from dagster_gcp import GCSResource

        return {"gcs": GCSResource()}
    return {}
