"""RegMix's last step: regress a sweep's losses on its mixture weights and predict the best mixture.

Each run of a mixture-weight sweep trains on one set of weights over the mixture's components and
reports a loss (say, on one eval set, or the mean over several). The weights are normalized to sum
to 1 (what the data loader samples by), and the loss is fitted as a linear function of them with no
intercept (Scheffé's linear mixture model):

    loss ~ sum_j c_j w_j        (or log loss ~ sum_j c_j w_j with ``log_loss``)

Because the weights sum to 1, an intercept would duplicate the coefficients; without one each
``c_j`` reads directly as the loss the model predicts for training on component ``j`` alone.
Only components some run gives weight to are fitted; the others are not swept and stay at 0.

A linear model's minimum over the simplex is a vertex: the single best component, reached by
extrapolating to a corner the sweep may never have run. As RegMix does, the best mixture is
instead the average of the ``top_k`` best of ``samples`` points drawn uniformly from the simplex
with a fixed seed (deterministic), and the vertex is reported beside it. The prediction says
where it lies beyond the swept weights (``extrapolated``), since a linear fit is only trusted near
its data.

Uncertainty: R^2 and leave-one-out (LOO) errors of each run (refit without it; a run that alone
measures some direction of the weights cannot be predicted without it, and says so), a Student-t
prediction interval of a new run at the predicted mixture (exact for a correct linear model with
normal errors, optimistic otherwise; the LOO error is the model-free check), and the best mixture
refitted without each run in turn (how far one run moves it).

Refused (``MixtureFitRefused``, one line): fewer than ``components + 2`` runs (the coefficients
plus two residual degrees of freedom, so the interval has a scale), weights that do not vary, weights
whose variations cannot tell components apart (rank-deficient), and non-finite (or, for
``log_loss``, non-positive) losses.

Pure numpy and scipy; no Dagster import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# The coefficients plus two residual degrees of freedom: with one, the interval's t quantile is
# 12.7 at 95% and the fit's error has a single degree of freedom to be measured from.
EXTRA_RUNS = 2
# A weight this far outside the swept range (after normalization) counts as extrapolated.
WEIGHT_TOLERANCE = 1e-9


class MixtureFitRefused(ValueError):
    """The runs give no regression on their weights; the message says why, in one line."""


@dataclass(frozen=True)
class MixtureOptions:
    log_loss: bool = False
    """Fit log(loss) instead of the loss: multiplicative effects of the weights."""
    samples: int = 100_000
    """Simplex points the best mixture is searched among."""
    top_k: int = 100
    """The best mixture is the mean weights of this many best sampled points."""
    seed: int = 0
    interval: float = 0.9
    """Coverage of the prediction interval of the best mixture's loss."""

    def __post_init__(self):
        if not 0 < self.interval < 1:
            raise ValueError(f"interval must be in (0, 1), got {self.interval}")
        if not 0 < self.top_k <= self.samples:
            raise ValueError(f"top_k must be in [1, samples={self.samples}], got {self.top_k}")


def normalized_weights(points: Sequence[Mapping[str, float]]) -> tuple[tuple[str, ...], np.ndarray]:
    """The components some point weighs (sorted) and each point's weights over them, summing to 1."""
    components = tuple(sorted({c for p in points for c, w in p.items() if w > 0}))
    matrix = np.array([[float(p.get(c, 0.0)) for c in components] for p in points], dtype=float).reshape(
        len(points), len(components))
    totals = matrix.sum(axis=1)
    if np.any(totals <= 0):
        raise MixtureFitRefused(f"run {int(np.argmin(totals))} gives no component a weight above 0")
    return components, matrix / totals[:, None]


@dataclass(frozen=True)
class MixtureRegression:
    """A fitted ``loss ~ sum_j c_j w_j`` (in log space when ``log_loss``) over ``components``."""

    components: tuple[str, ...]
    coefficients: np.ndarray
    log_loss: bool
    weights: np.ndarray
    """The runs' normalized weights (runs x components)."""
    losses: np.ndarray
    fitted: np.ndarray
    """Each run's loss as the fit predicts it, with the run in the fit."""
    loo: np.ndarray
    """Each run's loss predicted by the fit without it; NaN where that fit has no answer."""
    residual_scale: float
    """sqrt(residual sum of squares / (runs - components)), in the fitted space."""
    gram_inverse: np.ndarray

    @property
    def degrees_of_freedom(self) -> int:
        return len(self.losses) - len(self.components)

    @property
    def r2(self) -> float:
        total = float(np.sum((self.losses - self.losses.mean()) ** 2))
        return 1.0 - float(np.sum((self.losses - self.fitted) ** 2)) / total if total > 0 else float("nan")

    @property
    def loo_errors(self) -> np.ndarray:
        return self.loo - self.losses

    @property
    def loo_rmse(self) -> float | None:
        errors = self.loo_errors[np.isfinite(self.loo_errors)]
        return float(np.sqrt(np.mean(errors ** 2))) if errors.size else None

    def predict(self, weights: np.ndarray) -> np.ndarray:
        """The loss at normalized weights (rows over ``components``)."""
        return self._to_loss(np.asarray(weights, dtype=float) @ self.coefficients)

    def interval(self, weights: np.ndarray, coverage: float) -> tuple[float, float]:
        """Student-t prediction interval of one new run's loss at ``weights``."""
        from scipy import stats

        x = np.asarray(weights, dtype=float)
        spread = self.residual_scale * np.sqrt(1.0 + x @ self.gram_inverse @ x)
        quantile = stats.t.ppf(0.5 + coverage / 2, self.degrees_of_freedom)
        centre = float(x @ self.coefficients)
        return float(self._to_loss(centre - quantile * spread)), float(self._to_loss(centre + quantile * spread))

    def _to_loss(self, values):
        return np.exp(values) if self.log_loss else values


def _least_squares(weights: np.ndarray, targets: np.ndarray) -> np.ndarray | None:
    """The coefficients, or None when the weights do not determine them all (rank-deficient)."""
    if np.linalg.matrix_rank(weights) < weights.shape[1]:
        return None
    return np.linalg.lstsq(weights, targets, rcond=None)[0]


def fit_mixture_regression(points: Sequence[Mapping[str, float]], losses: Sequence[float], *,
                           log_loss: bool = False) -> MixtureRegression:
    """Fit each run's loss on its weights (``points[i]``: ``{component: weight}``, any scale);
    `MixtureFitRefused` when the runs cannot give the fit (see the module's docstring)."""
    if len(points) != len(losses):
        raise ValueError(f"{len(points)} sets of weights for {len(losses)} losses")
    y = np.asarray(losses, dtype=float)
    if not np.all(np.isfinite(y)):
        raise MixtureFitRefused(f"losses must be finite, got {[float(v) for v in y if not np.isfinite(v)]}")
    if log_loss and np.any(y <= 0):
        raise MixtureFitRefused("log_loss needs losses above 0")
    components, w = normalized_weights(points)
    if len(points) < 2 or np.allclose(w, w[0], rtol=0, atol=WEIGHT_TOLERANCE):
        raise MixtureFitRefused(f"the weights do not vary: all {len(points)} run(s) train on the same mixture")
    wanted = len(components) + EXTRA_RUNS
    if len(points) < wanted:
        raise MixtureFitRefused(f"too few runs: {len(points)} for {len(components)} weighed components "
                                f"({', '.join(components)}); the linear fit needs at least {wanted} "
                                f"(a coefficient each and {EXTRA_RUNS} to measure its error)")
    rank = int(np.linalg.matrix_rank(w))
    if rank < len(components):
        raise MixtureFitRefused(f"the weights vary in {rank - 1} independent direction(s), not the "
                                f"{len(components) - 1} that {len(components)} components need: some components' "
                                "weights move together, so their effects cannot be told apart; add runs that vary "
                                "them independently")
    target = np.log(y) if log_loss else y
    coefficients = _least_squares(w, target)
    to_loss = np.exp if log_loss else (lambda v: v)
    fitted = to_loss(w @ coefficients)
    loo = np.full(len(y), np.nan)
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        refit = _least_squares(w[keep], target[keep])
        if refit is not None:
            loo[i] = to_loss(w[i] @ refit)
    residuals = target - w @ coefficients
    scale = float(np.sqrt(np.sum(residuals ** 2) / (len(y) - len(components))))
    return MixtureRegression(components, coefficients, log_loss, w, y, fitted, loo, scale,
                             np.linalg.inv(w.T @ w))


@dataclass(frozen=True)
class MixtureOptimum:
    weights: dict[str, float]
    """The predicted best mixture: the mean of the ``top_k`` best sampled points."""
    loss: float
    loss_low: float
    loss_high: float
    vertex: str
    """The component whose vertex the linear model ranks best (its exact minimum)."""
    vertex_loss: float
    extrapolated: dict[str, tuple[float, float]]
    """Components whose predicted weight lies outside the range the runs swept: {name: (low, high)}."""
    loo_weights: list[dict[str, float] | None]
    """The best mixture refitted without each run in turn (None where that fit has no answer)."""

    def to_dict(self) -> dict:
        return {"weights": self.weights, "loss": self.loss, "loss_low": self.loss_low, "loss_high": self.loss_high,
                "vertex": self.vertex, "vertex_loss": self.vertex_loss,
                "extrapolated": {c: list(r) for c, r in self.extrapolated.items()},
                "loo_weights": self.loo_weights}


def simplex_samples(dimensions: int, options: MixtureOptions) -> np.ndarray:
    """``options.samples`` points drawn uniformly from the simplex (Dirichlet(1, ..., 1)), by the seed."""
    return np.random.default_rng(options.seed).dirichlet(np.ones(dimensions), size=options.samples)


def _top_k_mean(coefficients: np.ndarray, samples: np.ndarray, top_k: int) -> np.ndarray:
    scores = samples @ coefficients
    best = np.argpartition(scores, top_k - 1)[:top_k] if top_k < len(scores) else np.arange(len(scores))
    return samples[best].mean(axis=0)


def best_mixture(fit: MixtureRegression, options: MixtureOptions = MixtureOptions()) -> MixtureOptimum:
    """The mixture the fit predicts best, its loss and interval, and how stable it is (LOO)."""
    samples = simplex_samples(len(fit.components), options)
    best = _top_k_mean(fit.coefficients, samples, options.top_k)
    low, high = fit.interval(best, options.interval)
    vertex = int(np.argmin(fit.coefficients))
    swept_low, swept_high = fit.weights.min(axis=0), fit.weights.max(axis=0)
    extrapolated = {c: (float(swept_low[j]), float(swept_high[j])) for j, c in enumerate(fit.components)
                    if not swept_low[j] - WEIGHT_TOLERANCE <= best[j] <= swept_high[j] + WEIGHT_TOLERANCE}
    target = np.log(fit.losses) if fit.log_loss else fit.losses
    loo_weights: list[dict[str, float] | None] = []
    for i in range(len(fit.losses)):
        keep = np.arange(len(fit.losses)) != i
        refit = _least_squares(fit.weights[keep], target[keep])
        loo_weights.append(None if refit is None else dict(zip(fit.components, map(float, _top_k_mean(
            refit, samples, options.top_k)))))
    return MixtureOptimum(dict(zip(fit.components, map(float, best))), float(fit.predict(best)), low, high,
                          fit.components[vertex], float(fit.predict(np.eye(len(fit.components))[vertex])),
                          extrapolated, loo_weights)
