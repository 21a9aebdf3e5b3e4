"""Dagster Pipes through an object store: a pod reports back without a shared volume or readable logs."""

from __future__ import annotations

import random
import string
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from marin_resources.k8s.manifests import K8sSpecError
from marin_resources.storage.object_stores import PIPES_BUCKET_ENV

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


