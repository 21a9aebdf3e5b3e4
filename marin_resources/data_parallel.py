"""Data parallelism inside one run: a step with one large input (a huge shard) maps a pure
function over row ranges of it.

Partitions already spread a corpus over processes and pods, one run each; this is for the one
input too big for one core's patience. `DataParallel` (the default everywhere) runs the input in
one piece in the step's process. `RayDataParallel` cuts it into ranges of about `chunk_bytes`
and runs one Ray task per range through dagster-ray's resource, on a local Ray started lazily,
the first time a step has more than one range, with a bounded CPU count, no dashboard and no
usage stats. Which one a deployment gets is chosen by environment (`MARIN_RAY`, see
`marin_resources.environments`); the results are the same either way, so the choice never
enters an artifact's identity.

`RayDataParallel` lives in `marin_resources.ray_parallel`, imported only where it is chosen;
Ray itself only inside its `map`, never when the code location loads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import dagster as dg
import numpy as np

from marin_resources.parallel_map import ParallelMap

Chunk = TypeVar("Chunk")
Result = TypeVar("Result")


def weighted_ranges(weights: Sequence[int], target: int | None) -> list[tuple[int, int]]:
    """Consecutive row ranges ``[start, end)`` covering every row in order: a row belongs to the
    range of ``target`` its first unit falls in (counting every row's weight before it: bytes,
    documents), so each range holds about ``target``. None: one range."""
    if target is None or len(weights) == 0:
        return [(0, len(weights))]
    if target <= 0:
        raise ValueError(f"chunk size must be positive, got {target}")
    sizes = np.asarray(weights, dtype=np.int64)
    bucket = (np.cumsum(sizes) - sizes) // target
    bounds = [0, *(np.flatnonzero(np.diff(bucket)) + 1).tolist(), len(sizes)]
    return list(zip(bounds[:-1], bounds[1:]))


def balanced_ranges(weights: Sequence[int], target: int, slots: int | None) -> list[tuple[int, int]]:
    """`weighted_ranges` of about `target` each, made smaller so that their count is a multiple of
    `slots`, the tasks that run at once (at most twice as many ranges): three chunks on two slots
    take two chunks' time, four smaller ones one and a half."""
    ranges = weighted_ranges(weights, target)
    if slots is None or len(ranges) <= 1 or len(ranges) % slots == 0:
        return ranges
    count = min(-(-len(ranges) // slots) * slots, 2 * len(ranges))
    total = int(np.asarray(weights, dtype=np.int64).sum())
    return weighted_ranges(weights, max(1, -(-total // count)))


class DataParallel(dg.ConfigurableResource):
    """A step's input in one piece, in the step's own process."""

    dedup_batch_shards: int = 8
    """New shards the dedup index decides per batch. Each batch matches its keys against every
    committed run, so a first build of many shards wants large batches (fewer passes over the
    index); a batch's spilled keys bound one pass's memory. The decisions do not depend on it."""

    def ranges(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """How rows of these byte sizes are cut into chunks."""
        return weighted_ranges(sizes, None)

    def document_ranges(self, documents: Sequence[int]) -> list[tuple[int, int]]:
        """How units of a pass that is cheap per byte (``deduplicated``'s), holding these numbers
        of documents, are grouped into chunks."""
        return weighted_ranges(documents, None)

    def worth_spreading(self, nbytes: int) -> bool:
        """Whether work over ``nbytes`` of input pays for being spread (here: nothing is spread)."""
        return False

    def map(self, context: dg.AssetExecutionContext, fn: Callable[[Chunk, Any], Result], chunks: Sequence[Chunk],
            shared: Any) -> list[Result]:
        """``[fn(chunk, shared) for chunk in chunks]``, in order."""
        return [fn(chunk, shared) for chunk in chunks]

    def parallel_map(self, context: dg.AssetExecutionContext) -> ParallelMap:
        """This resource's `map` for one step, as the pure libraries take it (`ParallelMap`)."""
        return functools.partial(self.map, context)
