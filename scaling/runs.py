"""Loading and validating training-run tables (one row per finished run).

Every fit consumes columns ``flops``, ``params``, ``tokens`` and ``loss``; other columns are
ignored. Inputs can be a CSV path, a list of dicts, or a polars/pandas DataFrame. Anything
that cannot be fitted is rejected with a ``RunsError`` naming the row and column, because a
silently dropped or mis-parsed run would bias the fitted law without any trace.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RUN_COLUMNS = ("flops", "params", "tokens", "loss")


class RunsError(ValueError):
    """A runs table that cannot be fitted; the message says which row/column and why."""


@dataclass(frozen=True)
class Runs:
    flops: np.ndarray
    params: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray

    def __len__(self) -> int:
        return int(self.loss.size)

    def subset(self, index: np.ndarray) -> Runs:
        return Runs(self.flops[index], self.params[index], self.tokens[index], self.loss[index])


def read_runs_csv(path: str | Path, columns: Sequence[str] = RUN_COLUMNS) -> list[dict[str, str]]:
    """Raw rows of a CSV file; checks only that the file exists, has a header and the columns."""
    path = Path(path)
    if not path.is_file():
        raise RunsError(f"{path}: no such file")
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        header = [name.strip() for name in (reader.fieldnames or [])]
        if not header:
            raise RunsError(f"{path}: empty file (expected a header with {', '.join(columns)})")
        missing = [c for c in columns if c not in header]
        if missing:
            raise RunsError(
                f"{path}: missing required column(s) {', '.join(missing)}; found columns: {', '.join(header)}"
            )
        reader.fieldnames = header
        return list(reader)


def to_records(runs: Any) -> list[Mapping[str, Any]]:
    """Accept a list of mappings or a polars/pandas DataFrame (duck-typed, neither is imported)."""
    if hasattr(runs, "to_dicts"):  # polars
        return list(runs.to_dicts())
    if hasattr(runs, "to_dict") and hasattr(runs, "columns"):  # pandas
        return list(runs.to_dict("records"))
    if isinstance(runs, Mapping):
        raise RunsError("expected a list of runs (one mapping per run), got a single mapping")
    return list(runs)


def parse_runs(records: Iterable[Mapping[str, Any]], source: str = "runs") -> Runs:
    """Validate records and convert them into arrays."""
    return Runs(**_parse_columns(records, source, RUN_COLUMNS))


def _parse_columns(records: Iterable[Mapping[str, Any]], source: str, columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Row numbers in messages are 1-based data rows (for a CSV, data row k is file line k + 1)."""
    records = list(records)
    if not records:
        raise RunsError(f"{source}: no runs (the table has no data rows)")
    missing = [c for c in columns if c not in records[0]]
    if missing:
        raise RunsError(f"{source}: missing required column(s) {', '.join(missing)}; found: {', '.join(map(str, records[0]))}")
    values: dict[str, list[float]] = {c: [] for c in columns}
    for row_number, record in enumerate(records, start=1):
        for column in columns:
            raw = record.get(column)
            values[column].append(_positive_number(raw, source, row_number, column))
    return {c: np.asarray(values[c], dtype=np.float64) for c in columns}


def _positive_number(raw: Any, source: str, row_number: int, column: str) -> float:
    where = f"{source} row {row_number}, column {column!r}"
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        raise RunsError(f"{where}: empty value")
    if isinstance(raw, bool):
        raise RunsError(f"{where}: expected a number, got {raw!r}")
    try:
        value = float(raw.strip() if isinstance(raw, str) else raw)
    except (TypeError, ValueError):
        raise RunsError(f"{where}: not a number: {raw!r}") from None
    if not math.isfinite(value):
        raise RunsError(f"{where}: not a finite number: {raw!r}")
    if value <= 0:
        raise RunsError(f"{where}: must be positive, got {value:g}")
    return value


def load_runs(runs: Any, *, derive_tokens: bool = False) -> Runs:
    """Load runs from a CSV path, list of dicts or DataFrame.

    With ``derive_tokens``, a table without a ``tokens`` column gets tokens = flops / (6 params),
    the Chinchilla convention for dense transformers (used by the Epoch data set, which reports
    only parameters and training FLOPs).
    """
    if isinstance(runs, (str, Path)):
        source = str(runs)
        wanted = ("flops", "params", "loss") if derive_tokens else RUN_COLUMNS
        records: list[Mapping[str, Any]] = read_runs_csv(runs, wanted)
    else:
        source = "runs"
        records = to_records(runs)
    if derive_tokens and records and "tokens" not in records[0]:
        parsed = _parse_columns(records, source, ("flops", "params", "loss"))
        return Runs(parsed["flops"], parsed["params"], parsed["flops"] / (6.0 * parsed["params"]), parsed["loss"])
    return parse_runs(records, source)
