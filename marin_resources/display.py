"""How metrics read in the web UI: floats to 4 significant digits, byte counts and durations in
human units, lists of records as tables. Only the UI's copy is rounded; manifests keep the raw
values (`marin/...` metrics are read back by code)."""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from marin_resources.progress import human_bytes, human_duration  # noqa: F401 (re-exported)

SIGNIFICANT_DIGITS = 4


def round_significant(value: float, digits: int = SIGNIFICANT_DIGITS) -> float:
    if not math.isfinite(value) or value == 0:
        return value
    return float(f"{value:.{digits}g}")


def parse_duration(text: str) -> float:
    """Seconds of a :func:`human_duration` string (to its precision), for code that reads the UI's metadata."""
    parts = text.split()
    units = {"s": 1, "min": 60, "h": 3600}
    if len(parts) % 2 or not parts or any(unit not in units for unit in parts[1::2]):
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(number) * units[unit] for number, unit in zip(parts[0::2], parts[1::2]))


def is_byte_count(name: str) -> bool:
    leaf = name.rsplit("/", 1)[-1]
    return leaf == "bytes" or leaf.endswith("_bytes")


def is_duration(name: str) -> bool:
    leaf = name.rsplit("/", 1)[-1]
    return leaf == "seconds" or leaf.endswith("_seconds")


def records_table(rows: Sequence[Mapping[str, Any]]) -> dg.MetadataValue:
    """Records (eval samples, a fit's optima and predictions) as a UI table; numbers to 4 significant digits."""
    def cell(value: Any) -> str:
        if value is None:
            return ""
        return f"{value:.{SIGNIFICANT_DIGITS}g}" if isinstance(value, float) else str(value)

    columns = list(dict.fromkeys(k for row in rows for k in row))
    schema = dg.TableSchema(columns=[dg.TableColumn(c, "string") for c in columns])
    return dg.MetadataValue.table(records=[dg.TableRecord({c: cell(row.get(c)) for c in columns}) for row in rows],
                                  schema=schema)


def png_markdown(png: bytes, title: str) -> dg.MetadataValue:
    """A PNG plot as Markdown with the image embedded: the UI renders it without reaching the store."""
    return dg.MetadataValue.md(f"![{title}](data:image/png;base64,{base64.b64encode(png).decode()})")


def display_value(name: str, value: Any) -> Any:
    """The UI's rendering of one metric (a MetadataValue, or a plain value Dagster renders as is)."""
    if isinstance(value, bool) or value is None or isinstance(value, dg.MetadataValue):
        return value
    if isinstance(value, (int, float)) and is_byte_count(name):
        return dg.MetadataValue.text(human_bytes(value))
    if isinstance(value, (int, float)) and is_duration(name):
        return dg.MetadataValue.text(human_duration(value))
    if isinstance(value, float):
        return round_significant(value)
    if isinstance(value, (dict, list)):
        return dg.MetadataValue.json(value)
    return value


def display_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    return {name: display_value(name, value) for name, value in metadata.items()}
