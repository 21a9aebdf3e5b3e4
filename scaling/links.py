"""Links from a fitted loss to a downstream metric: forecast a task's accuracy from a loss forecast.

Marin (after the OLMo model-ladder recipe) forecasts task accuracy in two steps: a scaling law
forecasts the loss, and a sigmoid fitted over the ladder's (loss, accuracy) pairs maps that loss to
accuracy:

    acc(L) = floor + (ceiling - floor) / (1 + exp(k * (L - L0))),   k > 0

so accuracy falls from ``ceiling`` towards ``floor`` as the loss grows. For a multiple-choice task
``floor`` is fixed at chance (known, and where small models sit), leaving ``ceiling``, ``k`` and
``L0`` to fit; without a chance level ``floor`` is fitted too.

Pure numpy/scipy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

LINKS = ("sigmoid",)


class LinkFitError(ValueError):
    pass


@dataclass(frozen=True)
class SigmoidLink:
    floor: float
    ceiling: float
    k: float
    loss_mid: float
    """L0: the loss at which accuracy is halfway between floor and ceiling."""
    rmse: float
    points: int

    def predict(self, loss):
        loss = np.asarray(loss, dtype=float)
        return self.floor + (self.ceiling - self.floor) / (1.0 + np.exp(np.clip(self.k * (loss - self.loss_mid),
                                                                                -60, 60)))

    def to_dict(self) -> dict:
        return {"link": "sigmoid", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> SigmoidLink:
        return cls(**{k: data[k] for k in ("floor", "ceiling", "k", "loss_mid", "rmse", "points")})


def fit_sigmoid_link(losses, metric, *, chance: float | None = None, upper: float = 1.0) -> SigmoidLink:
    """Least-squares sigmoid through (loss, metric) pairs; ``chance`` fixes the floor."""
    from scipy.optimize import least_squares

    x = np.asarray(losses, dtype=float)
    y = np.asarray(metric, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise LinkFitError(f"losses and metric must be 1-D and the same length, got {x.shape} and {y.shape}")
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    free = 3 if chance is not None else 4
    if len(x) < free + 1:
        raise LinkFitError(f"a sigmoid link needs at least {free + 1} finite (loss, metric) pairs, got {len(x)}")
    if np.ptp(x) == 0:
        raise LinkFitError("every run has the same loss; the link's slope is undetermined")

    def unpack(theta):
        if chance is None:
            floor, ceiling, log_k, mid = theta
        else:
            ceiling, log_k, mid = theta
            floor = chance
        return floor, ceiling, math.exp(log_k), mid

    def residuals(theta):
        floor, ceiling, k, mid = unpack(theta)
        return floor + (ceiling - floor) / (1.0 + np.exp(np.clip(k * (x - mid), -60, 60))) - y

    span = float(np.ptp(x))
    low_floor = min(chance if chance is not None else float(y.min()), float(y.min()))
    starts = []
    for mid in np.quantile(x, [0.25, 0.5, 0.75]):
        for log_k in (math.log(1.0 / span), math.log(4.0 / span), math.log(16.0 / span)):
            ceiling = min(upper, max(float(y.max()), low_floor + 1e-3) + 0.05)
            starts.append([ceiling, log_k, mid] if chance is not None
                           else [float(y.min()), ceiling, log_k, mid])
    lower_ceiling = (chance if chance is not None else 0.0) + 1e-6
    bounds_low = ([lower_ceiling, -20.0, -np.inf] if chance is not None else [-np.inf, lower_ceiling, -20.0, -np.inf])
    bounds_high = ([upper, 20.0, np.inf] if chance is not None else [upper, upper, 20.0, np.inf])
    best = None
    for start in starts:
        start = np.clip(start, np.array(bounds_low) + 1e-9, np.array(bounds_high) - 1e-9)
        result = least_squares(residuals, start, bounds=(bounds_low, bounds_high))
        if best is None or result.cost < best.cost:
            best = result
    floor, ceiling, k, mid = unpack(best.x)
    rmse = float(np.sqrt(np.mean(residuals(best.x) ** 2)))
    return SigmoidLink(floor=float(floor), ceiling=float(ceiling), k=float(k), loss_mid=float(mid), rmse=rmse,
                       points=int(len(x)))


def link_interval(link: SigmoidLink, loss: float, loss_low: float | None, loss_high: float | None):
    """The metric forecast and its interval: the link is decreasing, so the loss interval's high end
    gives the metric's low end."""
    point = float(link.predict(loss))
    low = None if loss_high is None else float(link.predict(loss_high))
    high = None if loss_low is None else float(link.predict(loss_low))
    return point, low, high
