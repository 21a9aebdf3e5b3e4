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


def read_runs_csv(path: str | Path) -> tuple[list[str], list[dict[str, str]]]:
    """Header and raw rows of a CSV file; checks only that the file exists and has a header."""
    path = Path(path)
    if not path.is_file():
        raise RunsError(f"{path}: no such file")
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        header = [name.strip() for name in (reader.fieldnames or [])]
        if not header:
            raise RunsError(f"{path}: empty file (expected a header with {', '.join(RUN_COLUMNS)})")
        reader.fieldnames = header
        return header, list(reader)


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
        raise RunsError(f"{source}: missing required column(s) {', '.join(missing)}; "
                        f"found: {', '.join(map(str, records[0]))}")
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

    With ``derive_tokens`` (used by approach 3, which needs only params, tokens and loss), one
    of ``tokens``/``flops`` may be missing and is derived from C = 6 N D, the Chinchilla
    convention for dense transformers (the Epoch data set reports only N and C).
    """
    if isinstance(runs, (str, Path)):
        source = str(runs)
        header, records = read_runs_csv(runs)
    else:
        source = "runs"
        records = to_records(runs)
        header = [str(name) for name in records[0]] if records else []
    if derive_tokens and "tokens" not in header and "flops" in header:
        parsed = _parse_columns(records, source, ("flops", "params", "loss"))
        parsed["tokens"] = parsed["flops"] / (6.0 * parsed["params"])
        return Runs(**parsed)
    if derive_tokens and "flops" not in header and "tokens" in header:
        parsed = _parse_columns(records, source, ("params", "tokens", "loss"))
        parsed["flops"] = 6.0 * parsed["params"] * parsed["tokens"]
        return Runs(**parsed)
    _require_columns(header, source)
    return parse_runs(records, source)


def _require_columns(header: Sequence[str], source: str) -> None:
    missing = [c for c in RUN_COLUMNS if c not in header]
    if missing and header:
        raise RunsError(f"{source}: missing required column(s) {', '.join(missing)}; "
                        f"found columns: {', '.join(header)}")
