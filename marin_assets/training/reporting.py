"""Report progress and results from a training/eval process, through Dagster Pipes when launched by it.

``dagster_pipes.open_dagster_pipes`` returns a MagicMock outside Pipes (and warns); we detect
that case explicitly and print to stderr instead, so the same entry points run as plain CLIs.

A pod that shares no volume with its launcher gets its Pipes context and message channel in a
bucket (``MARIN_PIPES_BUCKET=s3|gs``, set by ``marin_resources.k8s.bucket_pipes``); any channel
whose params name no bucket (host 0's /dev/null sink on the other TPU hosts) keeps the default.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from dagster_pipes import (
    DAGSTER_PIPES_CONTEXT_ENV_VAR,
    DAGSTER_PIPES_MESSAGES_ENV_VAR,
    PipesEnvVarParamsLoader,
    decode_param,
    open_dagster_pipes,
)

from marin_resources.storage.object_stores import PIPES_BUCKET_ENV

PATH_KEYS_SUFFIX = ("_path", "_dir", "_png")


class Reporter(Protocol):
    def log(self, message: str) -> None: ...

    def custom_message(self, payload: Mapping[str, Any]) -> None: ...

    def materialization(self, metadata: Mapping[str, Any], *, asset_key: str | None = None) -> None: ...


def pipes_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Drop unset/non-finite values and tag path-like keys so Dagster renders them as paths."""
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            continue
        if isinstance(value, str) and key.endswith(PATH_KEYS_SUFFIX):
            out[key] = {"raw_value": value, "type": "path"}
        elif isinstance(value, (dict, list)):
            out[key] = {"raw_value": value, "type": "json"}
        else:
            out[key] = value
    return out


class PipesReporter:
    def __init__(self, context):
        self._context = context

    def log(self, message: str) -> None:
        self._context.log.info(message)

    def custom_message(self, payload: Mapping[str, Any]) -> None:
        self._context.report_custom_message(dict(payload))

    def materialization(self, metadata: Mapping[str, Any], *, asset_key: str | None = None) -> None:
        self._context.report_asset_materialization(metadata=pipes_metadata(metadata), asset_key=asset_key)


class ConsoleReporter:
    """Outside Pipes: progress goes to stderr, the final metadata as one JSON line."""

    def log(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def custom_message(self, payload: Mapping[str, Any]) -> None:
        pass  # per-step values are already in metrics.jsonl and the log line

    def materialization(self, metadata: Mapping[str, Any], *, asset_key: str | None = None) -> None:
        print(json.dumps({"materialization": dict(metadata)}, default=str), file=sys.stderr, flush=True)


def bucket_channels(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """``open_dagster_pipes`` loader/writer arguments for channels that live in a bucket."""
    scheme = environ.get(PIPES_BUCKET_ENV)
    if not scheme:
        return {}
    if scheme == "s3":
        import boto3
        from dagster_pipes import PipesS3ContextLoader as Loader
        from dagster_pipes import PipesS3MessageWriter as Writer

        client = boto3.client("s3")
    elif scheme == "gs":
        from dagster_pipes import PipesGCSContextLoader as Loader
        from dagster_pipes import PipesGCSMessageWriter as Writer
        from google.cloud import storage

        client = storage.Client()
    else:
        raise ValueError(f"{PIPES_BUCKET_ENV}={scheme!r}: expected s3 or gs")
    channels: dict[str, Any] = {}
    if "bucket" in decode_param(environ[DAGSTER_PIPES_CONTEXT_ENV_VAR]):
        channels["context_loader"] = Loader(client)
    if "bucket" in decode_param(environ[DAGSTER_PIPES_MESSAGES_ENV_VAR]):
        # Flush every few seconds: a training step report should not wait the default 10 s.
        channels["message_writer"] = Writer(client, interval=2)
    return channels


@contextlib.contextmanager
def open_reporter() -> Iterator[Reporter]:
    if PipesEnvVarParamsLoader().is_dagster_pipes_process():
        with open_dagster_pipes(**bucket_channels()) as context:
            yield PipesReporter(context)
    else:
        yield ConsoleReporter()
