"""Command line: ``python -m scaling {isoflop,chinchilla,recipe} ...``; JSON on stdout.

Bad input exits with status 2 and a one-line message on stderr naming the problem.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import fit_chinchilla, fit_isoflop
from .isoflop import IsoflopOptions
from .recipe import MicroRecipe, Recipe
from .runs import RunsError

INPUT_ERROR = 2


def _flops_list(text: str) -> list[float]:
    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated FLOPs such as 1e21,1e22; got {text!r}") from None
    if not values or any(not (v > 0 and v != float("inf")) for v in values):
        raise argparse.ArgumentTypeError(f"FLOPs must be positive finite numbers; got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scaling", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    iso = commands.add_parser("isoflop", help="approach 2: per-budget optima, power laws, L(C) envelope")
    iso.add_argument("runs", help="CSV with columns flops, params, tokens, loss (others ignored)")
    iso.add_argument("--predict", type=_flops_list, default=[],
                     help="comma-separated budgets to predict, e.g. 1e21,1e22")
    iso.add_argument("--plot", help="write a PNG (isoFLOP profiles + envelope with intervals) here")
    iso.add_argument("--bootstrap", type=int, default=IsoflopOptions.bootstrap_samples, help="bootstrap replicates")
    iso.add_argument("--resample", choices=("residuals", "runs"), default=IsoflopOptions.resample,
                     help="bootstrap resampling: valley residuals (default) or whole runs")
    iso.add_argument("--seed", type=int, default=IsoflopOptions.seed)
    iso.add_argument("--interval", type=float, default=IsoflopOptions.interval, help="interval coverage, e.g. 0.95")
    iso.add_argument(
        "--budget-tolerance",
        type=float,
        default=IsoflopOptions.budget_tolerance,
        help="relative FLOPs difference within which runs share a budget",
    )

    chin = commands.add_parser("chinchilla", help="approach 3: fit L(N, D) = E + A/N^alpha + B/D^beta")
    chin.add_argument(
        "runs",
        help="CSV with columns params, tokens, loss (flops optional); without a tokens column, "
        "tokens = flops / (6 params)",
    )
    chin.add_argument("--solver", choices=("batched", "scipy"), default="batched")

    rec = commands.add_parser("recipe", help="list the candidate runs of a recipe for given budgets")
    rec.add_argument("scale", choices=("micro", "delphi"))
    rec.add_argument("budgets", type=_flops_list, help="comma-separated FLOPs budgets")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "isoflop":
            options = IsoflopOptions(
                budget_tolerance=args.budget_tolerance,
                bootstrap_samples=args.bootstrap,
                resample=args.resample,
                seed=args.seed,
                interval=args.interval,
            )
            result = fit_isoflop(args.runs, args.predict, options=options, plot=args.plot)
        elif args.command == "chinchilla":
            result = fit_chinchilla(args.runs, derive_tokens=True, solver=args.solver)
        else:
            recipe = MicroRecipe() if args.scale == "micro" else Recipe()
            result = [c.to_dict() for budget in args.budgets for c in recipe.candidates(budget)]
    except (RunsError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return INPUT_ERROR
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
