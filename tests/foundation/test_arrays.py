"""`marin_assets.arrays.sorted_unique` is `np.unique`'s result, by another route."""

import numpy as np
import pytest

from marin_assets.arrays import sorted_unique

RNG = np.random.default_rng(7)


@pytest.mark.parametrize("values", [
    RNG.integers(0, 2**64 - 1, 50_000, dtype=np.uint64),  # n-gram hashes, bucket keys
    RNG.integers(0, 300, 50_000),  # document ids, many repeats
    RNG.integers(-5, 5, (40, 30)).astype(np.int32),  # 2-D: flattened, as np.unique does
    np.array([3, 3, 3], dtype=np.uint64),
    np.array([9], dtype=np.int64),
    np.empty(0, dtype=np.uint64),
])
def test_sorted_unique_equals_numpys_unique(values):
    ours, numpys = sorted_unique(values), np.unique(values)
    assert ours.dtype == numpys.dtype and ours.shape == numpys.shape
    np.testing.assert_array_equal(ours, numpys)


def test_sorted_unique_leaves_its_input_alone():
    values = np.array([5, 1, 5, 2], dtype=np.uint64)
    sorted_unique(values)
    np.testing.assert_array_equal(values, [5, 1, 5, 2])
