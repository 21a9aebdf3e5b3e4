"""The dedup index's bucket filters: one Bloom filter per row group of a key run."""

import numpy as np
import pytest

from marin_assets.curation.bucket_filters import (
    build_filters,
    filter_path,
    filters_bytes,
    may_hold,
    read_filters,
)


def random_buckets(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64, size=count, dtype=np.uint64)


def test_every_bucket_passes_its_own_groups_filter_and_about_two_percent_of_others_do():
    buckets = np.sort(random_buckets(8192 * 3 + 100, seed=1))
    groups = [8192, 8192, 8192, 100]  # as written: full groups and a short last one
    filters = read_filters(filters_bytes(build_filters(buckets, groups)))
    assert filters.shape == (4, 8192)  # 8 bits per key of the largest group
    starts = np.cumsum([0, *groups])
    for group in range(4):
        members = buckets[starts[group]:starts[group + 1]]
        # No false negative, bucket by bucket.
        assert all(may_hold(filters, group, members[i:i + 1]) for i in range(0, members.size, 97))
        assert may_hold(filters, group, members)
    strangers = random_buckets(20_000, seed=2)
    passed = sum(may_hold(filters, 0, strangers[i:i + 1]) for i in range(strangers.size))
    assert 0.005 < passed / strangers.size < 0.04, passed  # 8 bits, 6 hashes: about 2.2%
    # The short last group holds 100 keys in as many bits as a full one: almost nothing passes it.
    assert sum(may_hold(filters, 3, strangers[i:i + 1]) for i in range(2000)) <= 2
    assert not may_hold(filters, 0, np.array([], dtype=np.uint64))


def test_groups_that_do_not_add_up_or_a_damaged_file_are_refused():
    with pytest.raises(ValueError, match="10 buckets in row groups of 12 rows"):
        build_filters(random_buckets(10, seed=3), [8, 4])
    with pytest.raises(ValueError, match="uint8 rows"):
        read_filters(filters_bytes(np.zeros((2, 3), dtype=np.int64)))
    assert filter_path("keys/p0003/000007.parquet") == "keys/p0003/000007.filter.npy"


def test_the_same_run_gives_the_same_bytes():
    buckets = np.sort(random_buckets(5000, seed=4))
    groups = [4096, 904]
    assert filters_bytes(build_filters(buckets, groups)) == filters_bytes(build_filters(buckets.copy(), groups))
