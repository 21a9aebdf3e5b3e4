"""Approach-3 fit on the Epoch/Chinchilla points: batched multi-start BFGS vs a scipy loop.

Both solvers minimise the same Huber-on-log-loss objective with the same analytic gradient
from the same 4,500-point start grid; the baseline calls scipy.optimize.minimize(L-BFGS-B)
once per start, which is how the fit is usually written.

    python benchmarks/fit.py                     # full scipy loop (about 2 minutes)
    python benchmarks/fit.py --scipy-starts 450  # time every 10th start, extrapolate

Prints both times side by side, whether the optima agree, and a final JSON line.
"""

from __future__ import annotations

import os
import sys

# Put the repository root in place of this script's folder on the import path before any
# other import: sibling benchmark scripts (benchmarks/tokenize.py) would otherwise shadow
# standard-library modules of the same name.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = REPO_ROOT

import argparse  # noqa: E402 - after the import path is set
import json  # noqa: E402 - after the import path is set
import time  # noqa: E402 - after the import path is set
from pathlib import Path  # noqa: E402 - after the import path is set

import numpy as np  # noqa: E402 - after the import path is set

from scaling.chinchilla import (  # noqa: E402 - after the import path is set
    EPOCH_POINTS_CSV,
    StartGrid,
    epoch_points,
    fit_chinchilla_arrays,
)

NAMES = ("E", "A", "B", "alpha", "beta")


def timed(solver: str, params, tokens, loss, starts: np.ndarray):
    wall, cpu = time.perf_counter(), time.process_time()
    fit = fit_chinchilla_arrays(params, tokens, loss, solver=solver, starts=starts)
    return fit, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=EPOCH_POINTS_CSV)
    parser.add_argument(
        "--scipy-starts",
        type=int,
        default=None,
        help="run the scipy loop on an evenly strided subset of this many starts and extrapolate its time",
    )
    args = parser.parse_args()

    points = epoch_points(args.data)
    params, tokens, loss = points.params, points.tokens, points.loss
    grid = StartGrid().points()
    print(f"data: {args.data} ({loss.size} points); start grid: {len(grid)} points")

    batched, batched_wall, batched_cpu = timed("batched", params, tokens, loss, grid)
    print(f"batched BFGS done in {batched_wall:.2f} s", flush=True)

    if args.scipy_starts is None or args.scipy_starts >= len(grid):
        scipy_grid, extrapolated = grid, False
    else:
        stride = max(1, len(grid) // max(args.scipy_starts, 1))
        scipy_grid, extrapolated = grid[::stride][: args.scipy_starts], True
    print(f"scipy L-BFGS-B loop over {len(scipy_grid)} starts ...", flush=True)
    reference, scipy_wall, scipy_cpu = timed("scipy", params, tokens, loss, scipy_grid)
    scale = len(grid) / len(scipy_grid)
    scipy_wall_full, scipy_cpu_full = scipy_wall * scale, scipy_cpu * scale

    objective_gap = abs(batched.objective - reference.objective) / reference.objective
    param_gap = max(abs(getattr(batched, n) / getattr(reference, n) - 1.0) for n in NAMES)
    same_optimum = objective_gap < 1e-6 and param_gap < 1e-3

    scipy_label = "scipy loop (extrapolated)" if extrapolated else "scipy loop"
    print()
    print(f"{'':28}{'batched (ours)':>18}{scipy_label:>28}")
    print(f"{'starts run':28}{len(grid):>18}{len(scipy_grid):>28}")
    print(f"{'wall seconds, 4,500 starts':28}{batched_wall:>18.2f}{scipy_wall_full:>28.2f}")
    print(f"{'CPU seconds, 4,500 starts':28}{batched_cpu:>18.2f}{scipy_cpu_full:>28.2f}")
    print(f"{'best objective':28}{batched.objective:>18.10f}{reference.objective:>28.10f}")
    for name in NAMES:
        print(f"{name:28}{getattr(batched, name):>18.6g}{getattr(reference, name):>28.6g}")
    print(f"speedup (wall): {scipy_wall_full / batched_wall:.1f}x")
    if extrapolated:
        print(f"NOTE: scipy timed on {len(scipy_grid)} of {len(grid)} starts and scaled by {scale:.1f}; "
              "not measured in full.")
    print(f"same optimum: {same_optimum} (objective gap {objective_gap:.2e}, largest parameter gap {param_gap:.2e})")
    print(
        json.dumps(
            {
                "benchmark": "chinchilla_fit",
                "starts": len(grid),
                "batched_seconds": round(batched_wall, 3),
                "batched_cpu_seconds": round(batched_cpu, 3),
                "scipy_seconds": round(scipy_wall_full, 3),
                "scipy_cpu_seconds": round(scipy_cpu_full, 3),
                "scipy_starts_timed": len(scipy_grid),
                "scipy_extrapolated": extrapolated,
                "speedup": round(scipy_wall_full / batched_wall, 2),
                "same_optimum": same_optimum,
                "batched": batched.to_dict(),
                "scipy": reference.to_dict(),
            }
        )
    )


if __name__ == "__main__":
    main()
