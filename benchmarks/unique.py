"""Distinct values of large integer arrays: `np.unique` against `marin_assets.arrays.sorted_unique`.

    python -m benchmarks.unique [--sizes 100000 1000000 4000000] [--repeats 3]

The arrays dedup and decontamination take the distinct values of: 64-bit n-gram hashes and bucket
keys (nearly all distinct, a tenth repeated), and document ids (each repeated a few times). Best of
``--repeats`` seconds each, side by side, the results compared; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from marin_assets.arrays import sorted_unique


def arrays(size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    hashes = rng.integers(0, 2**64 - 1, size, dtype=np.uint64)
    return {"uint64 hashes, 10% repeated": np.concatenate([hashes, hashes[: size // 10]]),
            "int64 document ids, x4": np.repeat(np.arange(size // 4, dtype=np.int64), 4)[rng.permutation(size)]}


def best_seconds(fn, values: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn(values)
        best = min(best, time.perf_counter() - started)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    print(f"numpy {np.__version__}")
    print(f"{'array':30s} {'values':>10s} {'np.unique s':>12s} {'sorted_unique s':>16s} {'speedup':>8s}")
    for size in args.sizes:
        for name, values in arrays(size, rng).items():
            baseline, expected = best_seconds(np.unique, values, args.repeats)
            ours, got = best_seconds(sorted_unique, values, args.repeats)
            same = bool(np.array_equal(expected, got) and expected.dtype == got.dtype)
            rows.append({"array": name, "values": int(values.size), "np_unique_s": round(baseline, 4),
                         "sorted_unique_s": round(ours, 4), "speedup": round(baseline / ours, 2), "same": same})
            print(f"{name:30s} {values.size:>10,d} {baseline:>12.3f} {ours:>16.3f} {baseline / ours:>7.1f}x"
                  f"{'' if same else '  RESULTS DIFFER'}")
    print(json.dumps({"benchmark": "unique", "numpy": np.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
