"""The mergeable quantile sketch behind the corpus-wide keep threshold."""

import random

import numpy as np
import pytest

from marin_assets.curation.sketch import QuantileSketch, keep_threshold


def _shards(seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Probability-like scores with a heavy low tail, in shards of uneven size, plus exact zeros and negatives.
    shards = [rng.beta(5, 1.5, size=n) for n in (1, 40, 977, 3000, 12)]
    shards.append(np.array([0.0, 0.0, -0.25, -3.0, 1e-12]))
    return shards


@pytest.mark.parametrize("q", [0.0, 0.01, 0.1, 0.5, 0.9, 0.999, 1.0])
def test_quantile_is_within_relative_accuracy_of_the_exact_one(q):
    values = np.concatenate(_shards())
    sketch = QuantileSketch(0.01).add(values)
    exact = np.sort(values)[int(np.floor(q * (len(values) - 1)))]
    assert abs(sketch.quantile(q) - exact) <= 0.01 * abs(exact) + 1e-9
    assert sketch.count == len(values)


def test_merge_is_independent_of_shard_order_and_equals_one_sketch():
    shards = _shards()
    whole = QuantileSketch(0.01).add(np.concatenate(shards)).to_json()
    for seed in range(5):
        order = list(range(len(shards)))
        random.Random(seed).shuffle(order)
        merged = QuantileSketch(0.01)
        for i in order:
            merged.merge(QuantileSketch.from_json(QuantileSketch(0.01).add(shards[i]).to_json()))
        assert merged.to_json() == whole


def test_keep_threshold_keeps_the_fraction_up_to_the_sketch_error():
    values = np.concatenate(_shards())
    sketch = QuantileSketch(0.01).add(values)
    for fraction in (0.1, 0.5, 0.8, 0.9):
        threshold = keep_threshold(sketch, fraction)
        kept = values > threshold
        # Everything at or above the exact quantile is kept; below it, only values within the sketch error.
        exact = np.sort(values)[int(np.floor((1 - fraction) * (len(values) - 1)))]
        assert kept[values >= exact].all()
        assert (values[kept & (values < exact)] >= exact * (1 - 0.02)).all()
        assert fraction <= kept.mean() <= fraction + 0.05
    assert keep_threshold(sketch, 1.0) == float("-inf")


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="NaN"):
        QuantileSketch().add([0.5, float("nan")])
    with pytest.raises(ValueError, match="relative accuracy"):
        QuantileSketch(0.01).merge(QuantileSketch(0.02))
    with pytest.raises(ValueError, match="empty"):
        QuantileSketch().quantile(0.5)
    with pytest.raises(ValueError, match="format"):
        QuantileSketch.from_json('{"format": 99}')
