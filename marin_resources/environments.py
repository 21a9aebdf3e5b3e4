"""Resources chosen by environment. This is the only place that reads MARIN_* variables;
assets receive everything through resources.

- `local` (default): embedded instance, `./local_store` prefix (or MARIN_PREFIX), local launcher.
- `prod`: MARIN_PREFIX is required (gs:// or s3://), cloud clients from dagster-gcp / dagster-aws,
  strict fingerprints unless MARIN_STRICT=0, and the Kubernetes launcher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PREFIX = "./local_store"
ENVIRONMENTS = ("local", "prod")
TRAIN_POOLS = ("cpu-train", "gpu", "tpu")


@dataclass(frozen=True)
class MarinSettings:
    """Runtime settings read once from the environment; none of them enter a fingerprint."""

    env: str
    prefix: str
    strict_fingerprints: bool
    sources_file: str | None
    runs_file: str | None
    train_pool: str = "cpu-train"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "MarinSettings":
        e = os.environ if environ is None else environ
        env = e.get("MARIN_ENV", "local")
        if env not in ENVIRONMENTS:
            raise ValueError(f"MARIN_ENV must be one of {', '.join(ENVIRONMENTS)}, got {env!r}")
        prefix = e.get("MARIN_PREFIX")
        if env == "prod" and not prefix:
            raise ValueError("MARIN_ENV=prod needs MARIN_PREFIX (for example gs://bucket/marin or s3://bucket/marin)")
        prefix = prefix or DEFAULT_PREFIX
        if "://" not in prefix:
            prefix = str(Path(prefix).expanduser().resolve())
        strict = e.get("MARIN_STRICT", "1" if env == "prod" else "0").lower() in ("1", "true", "yes")
        pool = e.get("MARIN_TRAIN_POOL", "gpu" if env == "prod" else "cpu-train")
        if pool not in TRAIN_POOLS:
            raise ValueError(f"MARIN_TRAIN_POOL must be one of {', '.join(TRAIN_POOLS)}, got {pool!r}")
        return cls(env=env, prefix=prefix, strict_fingerprints=strict, sources_file=e.get("MARIN_SOURCES") or None,
                   runs_file=e.get("MARIN_RUNS") or None, train_pool=pool)


def build_resources(settings: MarinSettings) -> dict[str, Any]:
    """The resource dict for `dg.Definitions`."""
    from marin_resources.artifacts import ArtifactHandleIOManager, MarinStore
    from marin_resources.io_managers import ValueIOManagerFactory

    store = MarinStore(prefix=settings.prefix, strict_fingerprints=settings.strict_fingerprints)
    resources: dict[str, Any] = {
        "store": store,
        "artifact_io_manager": ArtifactHandleIOManager(store=store),
        "io_manager": ValueIOManagerFactory(store=store),
    }
    resources.update(_launcher_resources(settings))
    if settings.env == "prod":
        resources.update(_cloud_resources(settings))
    return resources


def _launcher_resources(settings: MarinSettings) -> dict[str, Any]:
    try:
        from marin_resources.launchers import LocalPipesLauncher
    except ImportError:  # training stage not installed in this build
        return {}
    if settings.env == "prod":
        try:
            from marin_resources.k8s import K8sPipesLauncher
        except ImportError:
            return {"launcher": LocalPipesLauncher()}
        return {"launcher": K8sPipesLauncher()}
    return {"launcher": LocalPipesLauncher()}


def _cloud_resources(settings: MarinSettings) -> dict[str, Any]:
    """Cloud clients for prod; storage itself goes through fsspec with the same credentials."""
    if settings.prefix.startswith("s3://"):
        from dagster_aws.s3 import S3Resource

        return {"s3": S3Resource()}
    if settings.prefix.startswith("gs://"):
        from dagster_gcp import GCSResource

        return {"gcs": GCSResource()}
    return {}
