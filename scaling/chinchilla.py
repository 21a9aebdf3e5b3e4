"""Approach 3 of Hoffmann et al.: fit L(N, D) = E + A / N^alpha + B / D^beta directly.

The fit follows the Epoch AI replication: parameters theta = (a, b, e, alpha, beta) with
A = exp(a), B = exp(b), E = exp(e); the prediction is
``log L = logsumexp(a - alpha log N, b - beta log D, e)``; the objective is the sum of Huber
losses (delta 1e-3) of ``log L_pred - log L``; L-BFGS is started from every point of a
4,500-point grid and the best end point wins.

Starting thousands of independent scalar optimisations from Python is slow (one
``scipy.optimize.minimize`` call per start). Here all starts advance together: one numpy
evaluation computes the objective and analytic gradient for every start still running,
and a batched BFGS (a dense 5x5 inverse Hessian per start, which is cheaper than L-BFGS
bookkeeping in five dimensions) with a batched Armijo backtracking line search moves them.
``solver="scipy"`` keeps the one-start-at-a-time loop as the reference the benchmark and
tests compare against.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from .runs import Runs

PARAM_NAMES = ("a", "b", "e", "alpha", "beta")  # column order of start and end points
HUBER_DELTA = 1e-3
BLOCK_ELEMENTS = 32_768
# Epoch AI's 245 points read off Figure 4 of Hoffmann et al. 2022 (source and fits: scaling/data/README.md).
EPOCH_POINTS_CSV = Path(__file__).parent / "data" / "chinchilla_points.csv"
EPOCH_DROPPED = 5


def epoch_points(path: str | Path = EPOCH_POINTS_CSV) -> Runs:
    """The Epoch points as the replication fits them: tokens D = C / (6 N), and the 5 highest-loss
    points dropped (240 remain)."""
    with Path(path).open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    params = np.array([float(r["Model Size"]) for r in rows])
    flops = np.array([float(r["Training FLOP"]) for r in rows])
    loss = np.array([float(r["loss"]) for r in rows])
    keep = np.argsort(loss, kind="stable")[:-EPOCH_DROPPED]
    return Runs(flops[keep], params[keep], flops[keep] / (6.0 * params[keep]), loss[keep])


@dataclass(frozen=True)
class StartGrid:
    """Cartesian grid of starting points; defaults are Epoch's 6 x 6 x 5 x 5 x 5 = 4,500 starts."""

    a: tuple[float, ...] = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
    b: tuple[float, ...] = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
    e: tuple[float, ...] = (-1.0, -0.5, 0.0, 0.5, 1.0)
    alpha: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0)
    beta: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0)

    def points(self) -> np.ndarray:
        """All starts as an array of shape (starts, 5) in ``PARAM_NAMES`` order."""
        mesh = np.meshgrid(self.a, self.b, self.e, self.alpha, self.beta, indexing="ij")
        return np.stack([m.ravel() for m in mesh], axis=1).astype(np.float64)

    def __len__(self) -> int:
        return len(self.a) * len(self.b) * len(self.e) * len(self.alpha) * len(self.beta)


def predict_loss(theta, params: np.ndarray | float, tokens: np.ndarray | float) -> np.ndarray:
    """L(N, D) for parameters theta = (a, b, e, alpha, beta), in log space (logsumexp) as the fit
    itself computes it, so a large exponent cannot overflow N^alpha."""
    a, b, e, alpha, beta = theta
    log_n = np.log(np.asarray(params, dtype=np.float64))
    log_d = np.log(np.asarray(tokens, dtype=np.float64))
    return np.exp(np.logaddexp(np.logaddexp(a - alpha * log_n, b - beta * log_d), e))


@dataclass(frozen=True)
class ChinchillaFit:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float
    starts: int
    seconds: float
    solver: str
    # End point, objective and stopping-test status of every start, for diagnostics and
    # solver comparisons.
    end_points: np.ndarray = field(repr=False, compare=False)
    end_objectives: np.ndarray = field(repr=False, compare=False)
    converged: np.ndarray = field(repr=False, compare=False)

    def predict(self, params: np.ndarray | float, tokens: np.ndarray | float) -> np.ndarray:
        theta = (np.log(self.A), np.log(self.B), np.log(self.E), self.alpha, self.beta)
        return predict_loss(theta, params, tokens)

    def to_dict(self) -> dict[str, float | int]:
        return {
            "E": self.E,
            "A": self.A,
            "B": self.B,
            "alpha": self.alpha,
            "beta": self.beta,
            "objective": self.objective,
            "starts": self.starts,
            "seconds": self.seconds,
        }


class HuberLogLossObjective:
    """Sum over runs of Huber(log L_pred - log L), evaluated for a batch of parameter vectors."""

    def __init__(self, params: np.ndarray, tokens: np.ndarray, loss: np.ndarray, delta: float = HUBER_DELTA):
        self.log_n = np.log(np.asarray(params, dtype=np.float64))
        self.log_d = np.log(np.asarray(tokens, dtype=np.float64))
        self.log_l = np.log(np.asarray(loss, dtype=np.float64))
        self.delta = float(delta)
        # Right-hand sides for the gradient reductions: sum(w) and sum(w * log x) in one matmul.
        self._n_basis = np.stack([np.ones_like(self.log_n), self.log_n], axis=1)
        self._d_basis = np.stack([np.ones_like(self.log_d), self.log_d], axis=1)
        # Left-hand sides that build a - alpha log N (and b - beta log D) in one matmul.
        self._n_rows = np.stack([np.ones_like(self.log_n), -self.log_n])
        self._d_rows = np.stack([np.ones_like(self.log_d), -self.log_d])
        # Starts are evaluated in blocks whose (starts x runs) temporaries are ~256 KB each, so
        # that they stay in a core's L2 cache and are reused by the allocator: on the Epoch
        # data (240 runs) 128-row blocks are 2x faster than 256-row ones, 20x faster than one
        # 4,500-row block.
        self.block_rows = max(8, BLOCK_ELEMENTS // self.log_n.size)

    def value_and_grad(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """theta: (starts, 5). Returns objective (starts,) and gradient (starts, 5)."""
        theta = np.asarray(theta, dtype=np.float64)
        if theta.shape[0] <= self.block_rows:
            return self._value_and_grad_block(theta)
        value = np.empty(theta.shape[0])
        grad = np.empty_like(theta)
        for begin in range(0, theta.shape[0], self.block_rows):
            rows = slice(begin, begin + self.block_rows)
            value[rows], grad[rows] = self._value_and_grad_block(theta[rows])
        return value, grad

    def _value_and_grad_block(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(all="ignore"):
            value, grad, underflow = self._block(theta, per_row_shift=True)
        if underflow.any():
            # All three terms underflowed for some run: redo those rows with a per-element shift.
            value[underflow], grad[underflow], _ = self._block(theta[underflow], per_row_shift=False)
        return value, grad

    def _block(self, theta: np.ndarray, per_row_shift: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b, e, alpha, beta = theta.T
        # logsumexp needs a shift. One per row is cheapest: the largest N term of a row is
        # known in closed form (the term is linear in log N), the shifted terms come out of a
        # single (rows x 2) @ (2 x runs) product, and the e term becomes a per-row scalar.
        # It is exact unless the terms span more than exp's range within a row; such rows
        # are flagged and redone with a per-element shift.
        if per_row_shift:
            top_n = a - np.minimum(alpha * self.log_n.min(), alpha * self.log_n.max())
            top_d = b - np.minimum(beta * self.log_d.min(), beta * self.log_d.max())
            shift = np.maximum(np.maximum(top_n, top_d), e)
            term_n = np.stack([a - shift, alpha], axis=1) @ self._n_rows
            term_d = np.stack([b - shift, beta], axis=1) @ self._d_rows
            shift = shift[:, None]
        else:
            term_n = a[:, None] - alpha[:, None] * self.log_n
            term_d = b[:, None] - beta[:, None] * self.log_d
            shift = np.maximum(np.maximum(term_n, term_d), e[:, None])
            term_n -= shift
            term_d -= shift
        np.exp(term_n, out=term_n)
        np.exp(term_d, out=term_d)
        term_e = np.exp(e[:, None] - shift)
        total = term_n + term_d
        total += term_e
        underflow = ~(total.min(axis=1) > 0.0)
        residual = np.log(total)
        residual += shift
        residual -= self.log_l
        # Huber(r) = c * (r - c / 2) with c = clip(r, -delta, delta); c is also Huber'(r).
        clipped = np.clip(residual, -self.delta, self.delta)
        residual -= 0.5 * clipped
        residual *= clipped
        value = residual.sum(axis=1)
        # The logsumexp derivative with respect to each term is that term's softmax weight.
        weight = np.divide(clipped, total, out=residual)
        term_n *= weight
        term_d *= weight
        grad_n = term_n @ self._n_basis
        grad_d = term_d @ self._d_basis
        grad = np.empty_like(theta)
        grad[:, 0] = grad_n[:, 0]
        grad[:, 1] = grad_d[:, 0]
        grad[:, 2] = weight.sum(axis=1) * term_e[:, 0] if per_row_shift else (weight * term_e).sum(axis=1)
        grad[:, 3] = -grad_n[:, 1]
        grad[:, 4] = -grad_d[:, 1]
        return value, grad, underflow

    def scalar(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = self.value_and_grad(np.asarray(theta, dtype=np.float64)[None, :])
        return float(value[0]), grad[0]


@dataclass(frozen=True)
class BatchedBFGSOptions:
    # Rounds of (one trial point per unfinished start); on the Chinchilla data every start
    # meets a stopping test within about 3,600 rounds, most within 200.
    max_evaluations: int = 10000
    # Stop when the largest gradient component is below gtol, or when an accepted step lowers
    # the objective by less than ftol * max(|f|, 1) (scipy L-BFGS-B's default tolerances).
    gtol: float = 1e-5
    ftol: float = 2.220446049250313e-09
    armijo: float = 1e-4
    # A start whose backtracking shrinks the step below this is at a numerical minimum.
    min_step: float = 1e-12


def batched_bfgs(
    value_and_grad, x0: np.ndarray, options: BatchedBFGSOptions = BatchedBFGSOptions()
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Minimise independently from every row of x0.

    Returns end points, objective values, and a mask of the starts that met a stopping test
    (the others ran out of ``max_evaluations``).

    Every start is its own small state machine (take a step, or backtrack), so that one
    vectorised evaluation per round serves all unfinished starts; a start that needs many
    backtracks does not hold the others back.
    """
    x = np.array(x0, dtype=np.float64, copy=True)
    starts, dim = x.shape
    eye = np.eye(dim)
    f, g = value_and_grad(x)
    # Before the first curvature pair the step is steepest descent of unit length, since the
    # gradient's scale says nothing about the distance to the minimum.
    inv_hess = eye / np.maximum(np.linalg.norm(g, axis=1), 1.0)[:, None, None]
    fresh = np.ones(starts, dtype=bool)
    direction = -np.einsum("sij,sj->si", inv_hess, g)
    slope = np.einsum("si,si->s", direction, g)
    step = np.ones(starts)
    active = np.isfinite(f) & (np.abs(g).max(axis=1) > options.gtol)

    for _ in range(options.max_evaluations):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        f_try, g_try = value_and_grad(x[idx] + step[idx, None] * direction[idx])
        f_old = f[idx]
        accept = np.isfinite(f_try) & (f_try <= f_old + options.armijo * step[idx] * slope[idx])

        rejected = idx[~accept]
        if rejected.size:
            # Backtrack to the minimiser of the quadratic through f(0), f'(0) and f(t),
            # kept within [t/10, t/2] so that the step neither stalls nor barely shrinks.
            t = step[rejected]
            excess = f_try[~accept] - f[rejected] - slope[rejected] * t
            with np.errstate(divide="ignore", invalid="ignore"):
                t_quad = -slope[rejected] * t * t / (2.0 * excess)
            t_quad = np.where(np.isfinite(t_quad), t_quad, 0.5 * t)
            step[rejected] = np.clip(t_quad, 0.1 * t, 0.5 * t)
            active[rejected[step[rejected] < options.min_step]] = False  # counted as converged

        acc = idx[accept]
        if acc.size == 0:
            continue
        s = step[acc, None] * direction[acc]
        y = g_try[accept] - g[acc]
        f_new = f_try[accept]
        hess = inv_hess[acc]
        sy = np.einsum("si,si->s", s, y)
        curved = sy > 1e-12 * np.linalg.norm(s, axis=1) * np.linalg.norm(y, axis=1)
        if curved.any():
            hc, sc, yc = hess[curved], s[curved], y[curved]
            old_hc = hc.copy()
            with np.errstate(over="ignore", divide="ignore"):
                rho = 1.0 / sy[curved]
            first = fresh[acc[curved]]
            if first.any():
                # Shanno-Phua scaling of the initial inverse Hessian from the first curvature pair.
                gamma = sy[curved][first] / np.einsum("si,si->s", yc[first], yc[first])
                hc[first] = eye * gamma[:, None, None]
            with np.errstate(over="ignore", invalid="ignore"):
                hy = np.einsum("sij,sj->si", hc, yc)
                yhy = np.einsum("si,si->s", yc, hy)
                hc = (
                    hc
                    - rho[:, None, None] * (hy[:, :, None] * sc[:, None, :] + sc[:, :, None] * hy[:, None, :])
                    + ((1.0 + rho * yhy) * rho)[:, None, None] * sc[:, :, None] * sc[:, None, :]
                )
            # A curvature pair near the float limits (a vanishing step) can overflow the update; such a
            # start keeps its previous inverse Hessian.
            broken = ~np.isfinite(hc).all(axis=(1, 2))
            hc[broken] = old_hc[broken]
            hess[curved] = hc
            fresh[acc[curved]] = False
        g_new = g_try[accept]
        new_direction = -np.einsum("sij,sj->si", hess, g_new)
        new_slope = np.einsum("si,si->s", new_direction, g_new)
        uphill = ~(new_slope < 0)
        if uphill.any():
            # Lost positive definiteness numerically: restart from scaled steepest descent.
            scale = np.maximum(np.linalg.norm(g_new[uphill], axis=1), 1.0)
            hess[uphill] = eye / scale[:, None, None]
            fresh[acc[uphill]] = True
            new_direction[uphill] = -g_new[uphill] / scale[:, None]
            new_slope[uphill] = np.einsum("si,si->s", new_direction[uphill], g_new[uphill])

        decrease = f_old[accept] - f_new
        converged = (decrease <= options.ftol * np.maximum(np.maximum(np.abs(f_old[accept]), np.abs(f_new)), 1.0)) | (
            np.abs(g_new).max(axis=1) <= options.gtol
        )
        x[acc] += s
        f[acc] = f_new
        g[acc] = g_new
        inv_hess[acc] = hess
        direction[acc] = new_direction
        slope[acc] = new_slope
        step[acc] = 1.0
        active[acc[converged]] = False
    return x, f, ~active


def fit_chinchilla_arrays(
    params: np.ndarray,
    tokens: np.ndarray,
    loss: np.ndarray,
    *,
    delta: float = HUBER_DELTA,
    grid: StartGrid = StartGrid(),
    solver: Literal["batched", "scipy"] = "batched",
    starts: np.ndarray | None = None,
) -> ChinchillaFit:
    """Fit approach 3. ``starts`` overrides ``grid`` with explicit (k, 5) starting points in
    ``PARAM_NAMES`` order."""
    columns = [np.asarray(c, dtype=np.float64).reshape(-1) for c in (params, tokens, loss)]
    if len({c.size for c in columns}) != 1:
        raise ValueError(f"params, tokens and loss differ in length: {[c.size for c in columns]}")
    if columns[0].size < len(PARAM_NAMES):
        raise ValueError(f"{columns[0].size} runs; fitting 5 parameters needs at least 5")
    if not all(np.all(np.isfinite(c) & (c > 0)) for c in columns):
        raise ValueError("params, tokens and loss must be positive finite numbers")
    objective = HuberLogLossObjective(*columns, delta)
    x0 = grid.points() if starts is None else np.atleast_2d(np.asarray(starts, dtype=np.float64))
    if x0.shape[1] != len(PARAM_NAMES):
        raise ValueError(f"starting points need {len(PARAM_NAMES)} columns {PARAM_NAMES}, got shape {x0.shape}")
    began = time.perf_counter()
    if solver == "batched":
        ends, values, converged = batched_bfgs(objective.value_and_grad, x0)
    elif solver == "scipy":
        ends, values, converged = _scipy_loop(objective, x0)
    else:
        raise ValueError(f"unknown solver {solver!r}; expected 'batched' or 'scipy'")
    seconds = time.perf_counter() - began
    values = np.where(np.isfinite(values), values, np.inf)
    best = int(np.argmin(values))
    a, b, e, alpha, beta = ends[best]
    return ChinchillaFit(
        E=float(np.exp(e)),
        A=float(np.exp(a)),
        B=float(np.exp(b)),
        alpha=float(alpha),
        beta=float(beta),
        objective=float(values[best]),
        starts=int(x0.shape[0]),
        seconds=seconds,
        solver=solver,
        end_points=ends,
        end_objectives=values,
        converged=converged,
    )


def _scipy_loop(objective: HuberLogLossObjective, x0: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from scipy.optimize import minimize

    ends = np.empty_like(x0)
    values = np.empty(x0.shape[0])
    converged = np.empty(x0.shape[0], dtype=bool)
    for i, start in enumerate(x0):
        result = minimize(objective.scalar, start, jac=True, method="L-BFGS-B")
        ends[i] = result.x
        values[i] = result.fun
        converged[i] = result.success
    return ends, values, converged


def bootstrap_chinchilla(
    fit: ChinchillaFit,
    params: np.ndarray,
    tokens: np.ndarray,
    loss: np.ndarray,
    predict_params: np.ndarray,
    predict_tokens: np.ndarray,
    *,
    samples: int = 200,
    seed: int = 0,
    starts: int = 32,
    delta: float = HUBER_DELTA,
) -> np.ndarray:
    """Predictions of approach-3 fits to runs resampled with replacement: (used replicates, predictions).

    Each replicate restarts from the original fit's ``starts`` best end points (a full grid per
    replicate would cost the grid's time again, and the resampled optimum lies near one of
    them). Replicates with fewer than five distinct runs cannot fit five parameters and are
    not counted.
    """
    columns = [np.asarray(c, dtype=np.float64).reshape(-1) for c in (params, tokens, loss)]
    at_n, at_d = (np.asarray(c, dtype=np.float64).reshape(-1) for c in (predict_params, predict_tokens))
    order = np.argsort(np.where(np.isfinite(fit.end_objectives), fit.end_objectives, np.inf))
    x0 = fit.end_points[order[: max(1, starts)]]
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(samples):
        draw = rng.integers(0, columns[0].size, size=columns[0].size)
        if np.unique(draw).size < len(PARAM_NAMES):
            continue
        objective = HuberLogLossObjective(*(c[draw] for c in columns), delta)
        ends, values, _ = batched_bfgs(objective.value_and_grad, x0)
        values = np.where(np.isfinite(values), values, np.inf)
        rows.append(predict_loss(ends[int(np.argmin(values))], at_n, at_d))
    return np.array(rows) if rows else np.empty((0, at_n.size))
