"""Artifact identity: canonical JSON, fingerprints, config diffs and safe partition keys.

Identity is the config that defines an artifact. Runtime choices (resources,
storage prefix, region, parallelism) are deliberately kept out of it so that the
same artifact built on a laptop or on a TPU pod has the same fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from enum import Enum
from pathlib import PurePath
from typing import Any


class InvalidPartitionKeyError(ValueError):
    """A partition key that could escape the storage prefix or is unreadable as a path segment."""


def to_jsonable(value: Any) -> Any:
    """Convert dataclasses, paths, enums, tuples and sets into plain JSON types."""
    # Plain JSON types first, by exact type (no subclass is among them): a status fingerprints the
    # identity of every partition of a stage, 75,000 of them, and most of their nodes are these.
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is dict:
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if kind is list:
        return [to_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(to_jsonable(v) for v in value)
    if isinstance(value, Enum):
        return to_jsonable(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        # JSON has no NaN/inf; keep them distinguishable instead of failing.
        return repr(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"cannot put {type(value).__name__} into an artifact identity: {value!r}")


def canonical_json(value: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8 kept as is."""
    return json.dumps(to_jsonable(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fingerprint(config: Any) -> str:
    """sha256 of the canonical JSON of an identity-bearing config."""
    return hashlib.sha256(canonical_json(config).encode("utf-8")).hexdigest()


def changed_fields(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the fields that differ between two configs (added, removed or changed)."""
    old, new = to_jsonable(old), to_jsonable(new)
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                out.append(path)
            else:
                out.extend(changed_fields(old[key], new[key], path))
        return out
    return [] if old == new else [prefix or "<root>"]


_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}$")


def validate_partition_key(key: str) -> str:
    """Return the key if it is one safe, human-readable path segment; raise otherwise.

    Rejects `..`, absolute paths, path separators, control characters, and
    anything outside a conservative character set, so that a key can never
    address a location outside its asset's directory.
    """
    if not isinstance(key, str) or not key:
        raise InvalidPartitionKeyError(f"partition key must be a non-empty string, got {key!r}")
    problems = []
    if "/" in key or "\\" in key:
        problems.append("contains a path separator")
    if ".." in key:
        problems.append("contains '..'")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        problems.append("contains control characters")
    if not problems and not _SAFE_KEY.match(key):
        problems.append("must start with a letter or digit and use only letters, digits and . _ = + - (max 200)")
    if problems:
        raise InvalidPartitionKeyError(f"invalid partition key {key!r}: {', '.join(problems)}")
    return key


def safe_partition_key(text: str) -> str:
    """Turn arbitrary text (a file name, a run name) into a valid partition key."""
    cleaned = re.sub(r"[^A-Za-z0-9._=+-]+", "-", text).strip("-.")
    cleaned = re.sub(r"\.{2,}", ".", cleaned)
    if not cleaned or not cleaned[0].isalnum():
        cleaned = "p" + cleaned
    return validate_partition_key(cleaned[:200])
