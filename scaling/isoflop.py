"""Approach 2 of Hoffmann et al. (IsoFLOP profiles) and the loss envelope L(C).

For every compute budget the runs trace a valley of loss against model size. A robust
quadratic in log tokens (and, separately, in log params) locates the bottom of each valley:
D*(C), N*(C) and L*(C). Power laws N* = k_N C^a and D* = k_D C^b are fitted in log space
through those optima, and the envelope L(C) = E + A C^-alpha through the optimal losses.
Only budgets whose minimum lies inside their sampled runs (interior optima) enter the power laws
and the envelope, as in Hoffmann et al. and Delphi: a vertex beyond the sampled range is an
extrapolation of the quadratic, not an observed optimum. With fewer than three interior optima,
or when the fitted envelope predicts what no run could be (E <= 0, a model that spends its budget
on more or fewer FLOPs per parameter and token than the fit runs do, an interval of zero width),
the envelope is refused with an ``EnvelopeRefused`` saying why, never returned.
Uncertainty comes from a seeded bootstrap that redoes every fit on resampled valleys;
intervals are percentiles of the refitted predictions. By default it resamples *residuals*:
each budget keeps its model sizes and gets the fitted valley plus residuals drawn with
replacement (inflated by sqrt(n / (n - 3)) for the quadratic's three coefficients). Resampling
*runs* instead (``resample="runs"``) is the textbook case bootstrap, but with the five or so
runs of a small sweep most replicates lack three distinct sizes and cannot be fitted.
A valley of exactly three runs has no residuals: its optimum then does not vary, and the
interval carries only the other budgets' noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .runs import Runs, RunsError

QUADRATIC_MIN_RUNS = 3
# E + A C^-alpha has three parameters.
ENVELOPE_MIN_BUDGETS = 3
# How far a prediction's FLOPs per parameter per token, C / (N* D*), may stray beyond the fit runs'
# own range: it moves with a model's shape (attention, embeddings), by tens of percent, not by
# multiples; N* and D* are separate power laws, and nothing else ties their product to the budget.
SPEND_TOLERANCE = 2.0
# A bootstrap interval narrower than this fraction of its value is the point fit replicated (no
# replicate could vary), not an interval.
ZERO_WIDTH = 1e-9


class EnvelopeRefused(RunsError):
    """The runs give no sane envelope (too few interior optima, or an impossible prediction); the
    message says which."""


@dataclass(frozen=True)
class IsoflopOptions:
    # Runs belong to the same budget when their FLOPs are within this relative distance of the
    # smallest FLOPs in the group; realised FLOPs differ slightly from the nominal budget
    # because steps and batch sizes are integers.
    budget_tolerance: float = 0.05
    bootstrap_samples: int = 200
    resample: Literal["residuals", "runs"] = "residuals"
    seed: int = 0
    interval: float = 0.95
    # Huber threshold of the robust quadratic, in units of the robust residual scale (MAD).
    huber_k: float = 1.345
    irls_iterations: int = 50

    def __post_init__(self) -> None:
        if not 0 < self.interval < 1:
            raise ValueError(f"interval must be in (0, 1), got {self.interval}")
        if self.bootstrap_samples < 0:
            raise ValueError("bootstrap_samples must be >= 0")
        if self.budget_tolerance < 0:
            raise ValueError("budget_tolerance must be >= 0")
        if self.resample not in ("residuals", "runs"):
            raise ValueError(f"resample must be 'residuals' or 'runs', got {self.resample!r}")


@dataclass(frozen=True)
class BudgetFit:
    """Quadratic valleys of one budget; coefficients are for (x - center) with x a log."""

    flops: float
    runs: int
    tokens_center: float
    tokens_coef: tuple[float, float, float]
    params_center: float
    params_coef: tuple[float, float, float]
    params: float
    tokens: float
    loss: float
    # Whether both minima lie inside the sampled range (outside means an extrapolated optimum).
    interior: bool
    # The sampled (smallest, largest) tokens and params of the budget's runs.
    tokens_range: tuple[float, float] = field(repr=False)
    params_range: tuple[float, float] = field(repr=False)
    run_indices: tuple[int, ...] = field(repr=False, default=())

    def to_dict(self) -> dict[str, float | int | bool]:
        return {
            "flops": self.flops,
            "params": self.params,
            "tokens": self.tokens,
            "loss": self.loss,
            "runs": self.runs,
            "interior": self.interior,
        }

    def outside(self) -> str:
        """Where a non-interior minimum lies, against the sampled range."""
        parts = []
        for name, unit, value, (low, high) in (("D*", "tokens", self.tokens, self.tokens_range),
                                                ("N*", "params", self.params, self.params_range)):
            if value > high:
                parts.append(f"{name} {value:.3g} > {high:.3g} sampled {unit}")
            elif value < low:
                parts.append(f"{name} {value:.3g} < {low:.3g} sampled {unit}")
        return "minimum outside its runs (" + "; ".join(parts) + ")"


@dataclass(frozen=True)
class IsoflopProfiles:
    """Every budget's valley: those with a vertex (interior or not), and those without one."""

    budgets: list[BudgetFit]
    # Budgets without a vertex (too few distinct sizes, not convex): flops, runs, reason.
    unfitted: list[dict[str, float | str]]

    @property
    def interior(self) -> list[BudgetFit]:
        return [b for b in self.budgets if b.interior]

    @property
    def outside(self) -> list[BudgetFit]:
        return [b for b in self.budgets if not b.interior]

    def left_out(self) -> list[dict[str, float | str]]:
        """Every budget the envelope does not use, with why; in increasing FLOPs."""
        outside = [{**b.to_dict(), "reason": b.outside()} for b in self.outside]
        return sorted(self.unfitted + outside, key=lambda entry: entry["flops"])


@dataclass(frozen=True)
class EnvelopeLaw:
    """L*(C) = E + A C^-alpha, N*(C) = params_coef C^params_exponent, D*(C) likewise."""

    E: float
    A: float
    alpha: float
    params_coef: float
    params_exponent: float
    tokens_coef: float
    tokens_exponent: float

    def loss(self, flops: np.ndarray | float) -> np.ndarray:
        return self.E + self.A * np.asarray(flops, dtype=np.float64) ** -self.alpha

    def params(self, flops: np.ndarray | float) -> np.ndarray:
        return self.params_coef * np.asarray(flops, dtype=np.float64) ** self.params_exponent

    def tokens(self, flops: np.ndarray | float) -> np.ndarray:
        return self.tokens_coef * np.asarray(flops, dtype=np.float64) ** self.tokens_exponent

    def to_dict(self) -> dict[str, float]:
        return {
            "E": self.E,
            "A": self.A,
            "alpha": self.alpha,
            "params_coef": self.params_coef,
            "params_exponent": self.params_exponent,
            "tokens_coef": self.tokens_coef,
            "tokens_exponent": self.tokens_exponent,
        }


@dataclass(frozen=True)
class IsoflopFit:
    # The budgets with an interior optimum, which the laws are fitted through.
    budgets: list[BudgetFit]
    law: EnvelopeLaw
    predict_flops: np.ndarray
    # Bootstrap replicate predictions, shape (used replicates, len(predict_flops)).
    boot_loss: np.ndarray = field(repr=False)
    boot_params: np.ndarray = field(repr=False)
    boot_tokens: np.ndarray = field(repr=False)
    # Every budget left out of the laws, with the reason (`IsoflopProfiles.left_out`).
    skipped: list[dict[str, float | str]]
    options: IsoflopOptions
    # Budgets whose valley has a vertex outside its runs: drawn, never fitted through.
    outside: list[BudgetFit]

    def intervals(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return percentile_interval(samples, self.options.interval)

    def predictions(self) -> list[dict[str, float | None]]:
        rows = []
        bounds = {
            "loss": (self.law.loss(self.predict_flops), self.intervals(self.boot_loss)),
            "params": (self.law.params(self.predict_flops), self.intervals(self.boot_params)),
            "tokens": (self.law.tokens(self.predict_flops), self.intervals(self.boot_tokens)),
        }
        for i, flops in enumerate(self.predict_flops):
            row: dict[str, float | None] = {"flops": float(flops)}
            for name, (point, (low, high)) in bounds.items():
                row[name] = float(point[i])
                row[f"{name}_low"] = finite_or_none(low[i])
                row[f"{name}_high"] = finite_or_none(high[i])
            rows.append(row)
        return rows

    def to_dict(self) -> dict:
        return {
            "optima": [b.to_dict() for b in self.budgets],
            "law": self.law.to_dict(),
            "predictions": self.predictions(),
            "skipped": self.skipped,
            "bootstrap": {
                "samples": self.options.bootstrap_samples,
                "resample": self.options.resample,
                "used": int(self.boot_loss.shape[0]),
                "seed": self.options.seed,
                "interval": self.options.interval,
            },
        }


def percentile_interval(samples: np.ndarray, coverage: float) -> tuple[np.ndarray, np.ndarray]:
    """Central percentile bounds of bootstrap replicates, per column of ``samples`` (replicates,
    predictions); NaN where there are no replicates."""
    if samples.shape[0] == 0:
        nan = np.full(samples.shape[1:], np.nan)
        return nan, nan
    tail = 100.0 * (1.0 - coverage) / 2.0
    return np.percentile(samples, tail, axis=0), np.percentile(samples, 100.0 - tail, axis=0)


def finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def group_budgets(flops: np.ndarray, tolerance: float) -> list[np.ndarray]:
    """Indices of the runs of each budget, budgets in increasing FLOPs."""
    order = np.argsort(flops, kind="stable")
    groups: list[list[int]] = []
    group_start = -np.inf
    for i in order:
        if flops[i] > group_start * (1.0 + tolerance):
            groups.append([])
            group_start = flops[i]
        groups[-1].append(int(i))
    return [np.asarray(g) for g in groups]


def robust_quadratic(x: np.ndarray, y: np.ndarray,
                     options: IsoflopOptions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Huber-IRLS quadratic fits of many (x, y) sets at once.

    x, y: (sets, points). Returns centers (sets,), coefficients (sets, 3) of
    y = c0 + c1 (x - center) + c2 (x - center)^2, and a mask of sets that could be fitted
    (at least three distinct x values).
    """
    center = x.mean(axis=1)
    xc = x - center[:, None]
    design = np.stack([np.ones_like(xc), xc, xc * xc], axis=-1)
    distinct = np.array([np.unique(row).size for row in x])
    ok = distinct >= 3
    weights = np.ones_like(y)
    coef = np.zeros((x.shape[0], 3))
    y_scale = np.abs(y).mean(axis=1)
    for _ in range(options.irls_iterations):
        weighted = design * weights[..., None]
        gram = np.einsum("spi,spj->sij", weighted, design)
        gram[~ok] = np.eye(3)  # placeholder for unfittable sets so the batch solve stays regular
        rhs = np.einsum("spi,sp->si", weighted, y)
        coef = np.linalg.solve(gram, rhs[..., None])[..., 0]
        residual = y - np.einsum("spi,si->sp", design, coef)
        mad = np.median(np.abs(residual - np.median(residual, axis=1, keepdims=True)), axis=1)
        # Floor the scale so that an (almost) exact fit does not turn weights into noise.
        scale = np.maximum(1.4826 * mad, 1e-9 * (1.0 + y_scale))
        threshold = (options.huber_k * scale)[:, None]
        abs_res = np.abs(residual)
        new_weights = np.where(abs_res <= threshold, 1.0, threshold / np.maximum(abs_res, 1e-300))
        converged = np.abs(new_weights - weights).max() < 1e-8
        weights = new_weights
        if converged:
            break
    return center, coef, ok


def _quadratic_minimum(center: np.ndarray, coef: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arg-min, min value and convexity mask of c0 + c1 u + c2 u^2 with u = x - center."""
    convex = coef[:, 2] > 0
    curvature = np.where(convex, coef[:, 2], 1.0)
    shift = -coef[:, 1] / (2.0 * curvature)
    return center + shift, coef[:, 0] - coef[:, 1] ** 2 / (4.0 * curvature), convex


def fit_envelope(flops: np.ndarray, loss: np.ndarray) -> tuple[float, float, float]:
    """Least-squares L = E + A C^-alpha with E >= 0, A >= 0.

    For a fixed alpha the model is linear in (E, A), so only alpha is searched (a grid, then a
    bounded scalar refinement) and E, A come from a closed-form 2-parameter solve.
    """
    # Imported here: scipy.optimize takes about a second to import, and `import scaling` should
    # stay cheap for the Dagster code location.
    from scipy.optimize import minimize_scalar

    reference = np.exp(np.mean(np.log(flops)))
    scaled = flops / reference

    def solve(alpha: float) -> tuple[float, float, float]:
        basis = scaled**-alpha
        design = np.stack([np.ones_like(basis), basis], axis=1)
        (e, a), *_ = np.linalg.lstsq(design, loss, rcond=None)
        if e < 0:
            e, a = 0.0, float(basis @ loss / (basis @ basis))
        if a < 0:
            e, a = float(loss.mean()), 0.0
        sse = float(np.sum((e + a * basis - loss) ** 2))
        return sse, float(e), float(a)

    grid = np.geomspace(1e-3, 3.0, 60)
    errors = [solve(alpha)[0] for alpha in grid]
    best = int(np.argmin(errors))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, grid.size - 1)]
    refined = minimize_scalar(lambda al: solve(al)[0], bounds=(low, high), method="bounded", options={"xatol": 1e-10})
    alpha = float(refined.x) if refined.fun <= errors[best] else float(grid[best])
    _, e, a_scaled = solve(alpha)
    return e, a_scaled * reference**alpha, alpha


def _power_law(flops: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    exponent, intercept = np.polyfit(np.log(flops), np.log(values), 1)
    return float(np.exp(intercept)), float(exponent)


def _fit_valleys(log_tokens: np.ndarray, log_params: np.ndarray, loss: np.ndarray, options: IsoflopOptions):
    """Optima of many versions of one budget's valley; arrays of shape (versions, runs in budget).

    Returns the quadratic centers and coefficients (tokens, params), N*, D*, L*, a validity mask
    (three distinct sizes and convex in both) and an interior mask (both vertices inside the
    version's sampled range), each with one entry per version.
    """
    t_center, t_coef, t_ok = robust_quadratic(log_tokens, loss, options)
    p_center, p_coef, p_ok = robust_quadratic(log_params, loss, options)
    log_d, loss_min, t_convex = _quadratic_minimum(t_center, t_coef)
    log_n, _, p_convex = _quadratic_minimum(p_center, p_coef)
    valid = t_ok & p_ok & t_convex & p_convex
    interior = ((log_tokens.min(axis=1) <= log_d) & (log_d <= log_tokens.max(axis=1))
                & (log_params.min(axis=1) <= log_n) & (log_n <= log_params.max(axis=1)))
    return t_center, t_coef, p_center, p_coef, np.exp(log_n), np.exp(log_d), loss_min, valid, interior


def _quadratic_values(center: float, coef: np.ndarray, x: np.ndarray) -> np.ndarray:
    u = x - center
    return coef[0] + coef[1] * u + coef[2] * u * u


def isoflop_profiles(runs: Runs, options: IsoflopOptions = IsoflopOptions()) -> IsoflopProfiles:
    """Every budget's valley and its vertex, interior or not (RunsError for a budget of fewer than 3 runs)."""
    groups = group_budgets(runs.flops, options.budget_tolerance)
    for group in groups:
        if group.size < QUADRATIC_MIN_RUNS:
            raise RunsError(
                f"budget {np.median(runs.flops[group]):.3g} FLOPs has {group.size} run(s); "
                f"a quadratic fit needs at least {QUADRATIC_MIN_RUNS}"
            )
    budgets: list[BudgetFit] = []
    unfitted: list[dict[str, float | str]] = []
    for group in groups:
        flops = float(np.median(runs.flops[group]))
        log_t, log_p = np.log(runs.tokens[group]), np.log(runs.params[group])
        t_center, t_coef, p_center, p_coef, n_opt, d_opt, l_opt, valid, interior = _fit_valleys(
            log_t[None], log_p[None], runs.loss[group][None], options
        )
        if not valid[0]:
            reason = (
                "fewer than 3 distinct model sizes"
                if min(np.unique(runs.tokens[group]).size, np.unique(runs.params[group]).size) < 3
                else "loss is not convex in log tokens/params (no interior minimum)"
            )
            unfitted.append({"flops": flops, "runs": int(group.size), "reason": reason})
            continue
        budgets.append(
            BudgetFit(
                flops=flops,
                runs=int(group.size),
                tokens_center=float(t_center[0]),
                tokens_coef=tuple(float(c) for c in t_coef[0]),
                params_center=float(p_center[0]),
                params_coef=tuple(float(c) for c in p_coef[0]),
                params=float(n_opt[0]),
                tokens=float(d_opt[0]),
                loss=float(l_opt[0]),
                interior=bool(interior[0]),
                run_indices=tuple(int(i) for i in group),
                tokens_range=(float(runs.tokens[group].min()), float(runs.tokens[group].max())),
                params_range=(float(runs.params[group].min()), float(runs.params[group].max())),
            )
        )
    return IsoflopProfiles(budgets, unfitted)


def fit_isoflop_runs(runs: Runs, predict: list[float] | np.ndarray,
                     options: IsoflopOptions = IsoflopOptions()) -> IsoflopFit:
    """Approach 2 through the interior optima; EnvelopeRefused when they cannot give a sane envelope."""
    predict_flops = np.asarray(predict, dtype=np.float64).reshape(-1)
    if np.any(~np.isfinite(predict_flops)) or np.any(predict_flops <= 0):
        raise ValueError(f"prediction budgets must be positive finite FLOPs, got {predict_flops.tolist()}")
    profiles = isoflop_profiles(runs, options)
    budgets = profiles.interior
    skipped = profiles.left_out()
    if len(budgets) < ENVELOPE_MIN_BUDGETS:
        left_out = "; ".join(f"{entry['flops']:.3g} FLOPs: {entry['reason']}" for entry in skipped)
        raise EnvelopeRefused(
            f"not enough interior optima: {len(budgets)} of {len(profiles.budgets) + len(profiles.unfitted)} "
            f"budget(s) have their loss minimum inside their runs, and the envelope E + A C^-alpha needs at "
            f"least {ENVELOPE_MIN_BUDGETS}" + (f" (left out: {left_out})" if left_out else "")
        )
    law = _fit_law(
        np.array([b.flops for b in budgets]),
        np.array([b.params for b in budgets]),
        np.array([b.tokens for b in budgets]),
        np.array([b.loss for b in budgets]),
    )
    _refuse_flat_envelope(law, budgets)
    # Budgets without an interior optimum stay out of the bootstrap too, so that every replicate
    # refits the same set of budgets as the point estimate.
    boot_loss, boot_params, boot_tokens = _bootstrap(budgets, runs, predict_flops, options)
    fit = IsoflopFit(budgets, law, predict_flops, boot_loss, boot_params, boot_tokens, skipped, options,
                     profiles.outside)
    _refuse_impossible_predictions(fit, runs)
    return fit


def _refuse_flat_envelope(law: EnvelopeLaw, budgets: list[BudgetFit]) -> None:
    """E and A at their bound of 0: the optima do not bend toward a floor (or do not fall at all)."""
    if law.E > 0 and law.A > 0:
        return
    losses = ", ".join(f"{b.loss:.4g}" for b in budgets)
    bound = f"E = {law.E:.3g}" if law.E <= 0 else f"A = {law.A:.3g}"
    raise EnvelopeRefused(
        f"envelope refused: {bound} at its bound of 0; the optimal losses {losses} do not flatten toward "
        "an irreducible loss as compute grows, so E + A C^-alpha is not identified"
    )


def _refuse_impossible_predictions(fit: IsoflopFit, runs: Runs) -> None:
    """A prediction needs at least one parameter and one token, must spend its budget at about the
    FLOPs per parameter and token the fit runs spend (`SPEND_TOLERANCE`), and any interval it has
    must have a width."""
    spent = runs.flops / (runs.params * runs.tokens)
    low, high = spent.min() / SPEND_TOLERANCE, spent.max() * SPEND_TOLERANCE
    for row in fit.predictions():
        flops, params, tokens = row["flops"], row["params"], row["tokens"]
        where = (f"envelope refused: at {flops:.3g} FLOPs it predicts N* = {params:.3g} parameters and "
                 f"D* = {tokens:.3g} tokens")
        if params < 1 or tokens < 1:
            raise EnvelopeRefused(f"{where}: less than one parameter or token")
        if not low <= flops / (params * tokens) <= high:
            raise EnvelopeRefused(
                f"{where}, which spend {flops / (params * tokens):.3g} FLOPs per parameter per token; the fit runs "
                f"spend {spent.min():.3g}..{spent.max():.3g} ({SPEND_TOLERANCE:g}x either way allowed)"
            )
        flat = [name for name in ("loss", "params", "tokens")
                if row[f"{name}_low"] is not None and row[f"{name}_high"] is not None
                and row[f"{name}_high"] - row[f"{name}_low"] <= ZERO_WIDTH * abs(row[name])]
        if flat:
            raise EnvelopeRefused(
                f"envelope refused: zero-width intervals of {', '.join(flat)} at {flops:.3g} FLOPs: every "
                f"bootstrap replicate refitted the same optima (a valley of {QUADRATIC_MIN_RUNS} runs has no "
                "residuals to resample); give a budget more runs, or fit without the bootstrap for point estimates"
            )


def _fit_law(flops: np.ndarray, params: np.ndarray, tokens: np.ndarray, loss: np.ndarray) -> EnvelopeLaw:
    e, a, alpha = fit_envelope(flops, loss)
    n_coef, n_exp = _power_law(flops, params)
    d_coef, d_exp = _power_law(flops, tokens)
    return EnvelopeLaw(e, a, alpha, n_coef, n_exp, d_coef, d_exp)


def _bootstrap(budgets: list[BudgetFit], runs: Runs, predict_flops: np.ndarray, options: IsoflopOptions):
    # Intervals exist only for predictions; with none requested there is nothing to resample.
    replicates = options.bootstrap_samples if predict_flops.size else 0
    rng = np.random.default_rng(options.seed)
    per_budget = []
    for budget in budgets:
        group = np.asarray(budget.run_indices)
        log_tokens, log_params, loss = np.log(runs.tokens[group]), np.log(runs.params[group]), runs.loss[group]
        draws = rng.integers(0, group.size, size=(replicates, group.size))
        if options.resample == "runs":
            versions = (log_tokens[draws], log_params[draws], loss[draws])
        else:
            fitted = _quadratic_values(budget.tokens_center, np.asarray(budget.tokens_coef), log_tokens)
            dof = group.size - 3
            residuals = (loss - fitted) * np.sqrt(group.size / dof) if dof > 0 else np.zeros_like(loss)
            versions = (np.tile(log_tokens, (replicates, 1)), np.tile(log_params, (replicates, 1)),
                        fitted + residuals[draws])
        per_budget.append(_fit_valleys(*versions, options) if replicates else None)
    budget_flops = np.array([b.flops for b in budgets])
    loss_rows, params_rows, tokens_rows = [], [], []
    for r in range(replicates):
        # As in the point fit, a budget counts only where its resampled valley has an interior vertex.
        usable = [k for k, fit in enumerate(per_budget) if fit[7][r] and fit[8][r]]
        if len(usable) < ENVELOPE_MIN_BUDGETS:
            continue  # this resample left too few fittable budgets; it is not counted as used
        law = _fit_law(
            budget_flops[usable],
            np.array([per_budget[k][4][r] for k in usable]),
            np.array([per_budget[k][5][r] for k in usable]),
            np.array([per_budget[k][6][r] for k in usable]),
        )
        with np.errstate(over="ignore", invalid="ignore"):
            predicted = law.loss(predict_flops), law.params(predict_flops), law.tokens(predict_flops)
        if not all(np.all(np.isfinite(p)) for p in predicted):
            continue  # a replicate whose power laws overflow at the targets is not a usable fit either
        loss_rows.append(predicted[0])
        params_rows.append(predicted[1])
        tokens_rows.append(predicted[2])

    def stacked(rows: list[np.ndarray]) -> np.ndarray:
        return np.array(rows) if rows else np.empty((0, predict_flops.size))

    return stacked(loss_rows), stacked(params_rows), stacked(tokens_rows)
