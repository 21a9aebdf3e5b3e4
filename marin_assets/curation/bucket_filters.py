"""Bloom filters over the buckets of a dedup key run, one per row group.

A run is sorted by bucket, so a row group's min/max statistics bracket a range of bucket hashes.
Bucket hashes are uniform, so a batch of new keys lands in almost every range even when none of
them is in the run: the statistics alone made a 128 MiB shard read about 81% of a large index
(docs/scaling-out.md). A filter per row group says which of the new buckets may be in it; a group
none of them may be in is not read. A filter never misses a bucket that is there, so the keys
read, and every decision, are the same as without it.

Format (`<run>.filter.npy`, beside its run): a uint8 array, one row per row group as written, of
`BITS_PER_KEY` bits per key of the largest group, little-endian bit order; bucket `b` sets bits
`(lo + i * hi) mod m` for `i < HASHES`, with `lo`, `hi` its low and high 32 bits (`hi` odd). At 8
bits and 6 hashes a bucket that is not in a group passes its filter about 2% of the time, and
the filters are about 8% of the run's bytes (1 byte a key against about 13).
"""

import io
from collections.abc import Sequence

import numpy as np

BITS_PER_KEY = 8
HASHES = 6
SUFFIX = ".filter.npy"


def filter_path(run_path: str) -> str:
    """Where the filters of the run at ``run_path`` (a ``.parquet`` file) are stored."""
    return run_path.removesuffix(".parquet") + SUFFIX


def _positions(buckets: np.ndarray, bits: int) -> np.ndarray:
    """The filter bits of each bucket: shape (len(buckets), HASHES)."""
    low = buckets & np.uint64(0xFFFFFFFF)
    high = (buckets >> np.uint64(32)) | np.uint64(1)
    steps = np.arange(HASHES, dtype=np.uint64)
    return (low[:, None] + steps[None, :] * high[:, None]) % np.uint64(bits)


def build_filters(buckets: np.ndarray, group_rows: Sequence[int]) -> np.ndarray:
    """The filters of a run whose bucket column is ``buckets`` (uint64, in run order), written in
    row groups of ``group_rows`` keys each: shape (groups, bytes), with `BITS_PER_KEY` bits per key
    of the largest group."""
    buckets = np.asarray(buckets, dtype=np.uint64)
    if sum(group_rows) != buckets.size:
        raise ValueError(f"{buckets.size} buckets in row groups of {sum(group_rows)} rows")
    bits = -(-max(group_rows, default=1) * BITS_PER_KEY // 8) * 8
    group_of = np.repeat(np.arange(len(group_rows), dtype=np.uint64), group_rows)[:, None]
    flat = np.zeros(len(group_rows) * bits, dtype=bool)
    flat[(group_of * np.uint64(bits) + _positions(buckets, bits)).ravel()] = True
    return np.packbits(flat.reshape(len(group_rows), bits), axis=1, bitorder="little")


def filters_bytes(filters: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, filters, allow_pickle=False)
    return buffer.getvalue()


def read_filters(data: bytes) -> np.ndarray:
    filters = np.load(io.BytesIO(data), allow_pickle=False)
    if filters.dtype != np.uint8 or filters.ndim != 2:
        raise ValueError(f"a bucket filter file holds uint8 rows, not {filters.dtype} of {filters.ndim} dimensions")
    return filters


def may_hold(filters: np.ndarray, group: int, buckets: np.ndarray) -> bool:
    """Whether row group ``group`` may hold one of ``buckets`` (False: it holds none of them)."""
    if buckets.size == 0:
        return False
    row = filters[group]
    positions = _positions(np.asarray(buckets, dtype=np.uint64), row.size * 8)
    set_bits = (row[positions >> np.uint64(3)] >> (positions & np.uint64(7)).astype(np.uint8)) & 1
    return bool(set_bits.all(axis=1).any())
