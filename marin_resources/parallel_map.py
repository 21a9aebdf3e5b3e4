"""How a pure step hands out its units of work: a `ParallelMap` is ``map(fn, items, shared)``
returning ``[fn(item, shared) for item in items]`` in order, wherever the calls run. The
token cache (a shard to encode, a shard file to assemble) and the dedup index (a shard's keys, a
bucket range's pass) take one; `in_process_map` is the default, and a step's `DataParallel`
resource gives one that may spread the units over Ray (`DataParallel.parallel_map`). No Dagster
here: the libraries that take one stay free of it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

ParallelMap = Callable[[Callable[[Any, Any], Any], Sequence[Any], Any], list]


def in_process_map(fn: Callable[[Any, Any], Any], items: Sequence[Any], shared: Any) -> list:
    """``[fn(item, shared) for item in items]``: one unit after another in this process."""
    return [fn(item, shared) for item in items]
