"""A mergeable quantile sketch with relative accuracy (DDSketch, Masson et al. 2019).

Values fall into logarithmic buckets: bucket ``i`` holds values in ``(gamma**(i-1), gamma**i]``
with ``gamma = (1 + alpha) / (1 - alpha)``, so any value inside a bucket is within a relative
``alpha`` of the bucket's representative ``2 * gamma**i / (gamma + 1)``. A sketch is a count per
bucket (negative values mirrored, near-zero values in one zero bucket), so merging is adding
counts: the merged sketch of a corpus is the same whatever order its shards are merged in, and the
same as one sketch over all its values. That lets each shard of ``filtered/<source>`` sketch its own
scores and a corpus-wide quantile be read from the merge without holding the scores.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

SKETCH_FORMAT = 1
# Smaller magnitudes share the zero bucket: scores are probabilities or ratios, never this small in a useful way.
MIN_INDEXABLE = 1e-9


@dataclass
class QuantileSketch:
    relative_accuracy: float = 0.01
    positive: Counter = field(default_factory=Counter)
    negative: Counter = field(default_factory=Counter)
    zero: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.relative_accuracy < 1.0:
            raise ValueError(f"relative_accuracy must be in (0, 1), got {self.relative_accuracy}")

    @property
    def gamma(self) -> float:
        return (1 + self.relative_accuracy) / (1 - self.relative_accuracy)

    @property
    def count(self) -> int:
        return self.zero + sum(self.positive.values()) + sum(self.negative.values())

    def bucket_index(self, values: np.ndarray) -> np.ndarray:
        """Bucket of each (positive) magnitude: ``ceil(log_gamma(value))``."""
        return np.ceil(np.log(values) / math.log(self.gamma)).astype(np.int64)

    def add(self, values: Iterable[float] | np.ndarray) -> QuantileSketch:
        array = np.asarray(values, dtype=np.float64).ravel()
        if np.isnan(array).any():
            raise ValueError("cannot sketch NaN scores")
        for sign, store in ((1.0, self.positive), (-1.0, self.negative)):
            magnitudes = array[sign * array > MIN_INDEXABLE] * sign
            if magnitudes.size:
                buckets, counts = np.unique(self.bucket_index(magnitudes), return_counts=True)
                store.update(dict(zip(buckets.tolist(), counts.tolist(), strict=True)))
        self.zero += int((np.abs(array) <= MIN_INDEXABLE).sum())
        return self

    def merge(self, other: QuantileSketch) -> QuantileSketch:
        if other.relative_accuracy != self.relative_accuracy:
            raise ValueError(f"cannot merge sketches of relative accuracy {self.relative_accuracy} "
                             f"and {other.relative_accuracy}")
        self.positive.update(other.positive)
        self.negative.update(other.negative)
        self.zero += other.zero
        return self

    def _ordered_buckets(self) -> list[tuple[int, int, int]]:
        """(sign, bucket, count) from the smallest value to the largest."""
        return ([(-1, b, self.negative[b]) for b in sorted(self.negative, reverse=True)]
                + ([(0, 0, self.zero)] if self.zero else [])
                + [(1, b, self.positive[b]) for b in sorted(self.positive)])

    def quantile_bucket(self, q: float) -> tuple[int, int]:
        """(sign, bucket) holding the value of rank ``floor(q * (count - 1))``, the lower-rank convention."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if self.count == 0:
            raise ValueError("quantile of an empty sketch")
        rank = math.floor(q * (self.count - 1))
        seen = 0
        for sign, bucket, n in self._ordered_buckets():
            seen += n
            if seen > rank:
                return sign, bucket
        raise AssertionError("unreachable: rank below count")

    def bucket_value(self, sign: int, bucket: int) -> float:
        """The bucket's representative: within ``relative_accuracy`` of every value in it."""
        return 0.0 if sign == 0 else sign * 2 * self.gamma**bucket / (self.gamma + 1)

    def bucket_lower_edge(self, sign: int, bucket: int) -> float:
        """A value just below the bucket: every value of the bucket, and above it, is greater."""
        if sign == 0:
            return -MIN_INDEXABLE
        if sign > 0:
            return max(self.gamma ** (bucket - 1), MIN_INDEXABLE)
        return math.nextafter(-(self.gamma**bucket), -math.inf)

    def quantile(self, q: float) -> float:
        return self.bucket_value(*self.quantile_bucket(q))

    def to_json(self) -> str:
        """Canonical JSON: equal sketches serialise to equal bytes."""
        return json.dumps({"format": SKETCH_FORMAT, "relative_accuracy": self.relative_accuracy, "zero": self.zero,
                           "positive": sorted(self.positive.items()), "negative": sorted(self.negative.items())},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> QuantileSketch:
        data = json.loads(text)
        if data.get("format") != SKETCH_FORMAT:
            raise ValueError(f"quantile sketch format {data.get('format')!r}, expected {SKETCH_FORMAT}")
        return cls(relative_accuracy=data["relative_accuracy"], zero=int(data["zero"]),
                   positive=Counter({int(b): int(n) for b, n in data["positive"]}),
                   negative=Counter({int(b): int(n) for b, n in data["negative"]}))


def keep_threshold(sketch: QuantileSketch, keep_fraction: float) -> float:
    """Scores strictly above this are kept: the lower edge of the bucket holding the ``1 - keep_fraction``
    quantile. Keeping whole buckets makes the decision depend on the bucket only, so it is the same on
    every shard and stable while the quantile stays in its bucket; the kept share is ``keep_fraction``
    up to the documents that share the quantile's bucket."""
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    if keep_fraction == 1.0 or sketch.count == 0:
        return float("-inf")
    return sketch.bucket_lower_edge(*sketch.quantile_bucket(1.0 - keep_fraction))
