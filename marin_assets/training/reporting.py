"""Report progress and results from a training/eval process, through Dagster Pipes when launched by it.

``dagster_pipes.open_dagster_pipes`` returns a MagicMock outside Pipes (and warns); we detect
that case explicitly and print to stderr instead, so the same entry points run as plain CLIs.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from typing import Any, Iterator, Mapping, Protocol

from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

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


@contextlib.contextmanager
def open_reporter() -> Iterator[Reporter]:
    if PipesEnvVarParamsLoader().is_dagster_pipes_process():
        with open_dagster_pipes() as context:
            yield PipesReporter(context)
    else:
        yield ConsoleReporter()
