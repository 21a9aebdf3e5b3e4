"""Shared fixtures: synthetic isoFLOP sweeps drawn from a known Chinchilla law, and the
Epoch/Chinchilla reference points the repository carries (scaling/data)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import scaling.chinchilla


@dataclass(frozen=True)
class KnownLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta with C = 6 N D; its compute-optimal frontier is
    known in closed form, which is what the approach-2 fits must recover."""

    E: float = 1.7
    A: float = 400.0
    B: float = 410.0
    alpha: float = 0.34
    beta: float = 0.28

    def loss(self, n, d):
        return self.E + self.A / np.asarray(n) ** self.alpha + self.B / np.asarray(d) ** self.beta

    @property
    def params_exponent(self) -> float:
        return self.beta / (self.alpha + self.beta)

    @property
    def loss_exponent(self) -> float:
        return self.alpha * self.beta / (self.alpha + self.beta)

    def optimal_params(self, flops):
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        return g * (np.asarray(flops) / 6.0) ** self.params_exponent

    def optimal_tokens(self, flops):
        return np.asarray(flops) / (6.0 * self.optimal_params(flops))

    def optimal_loss(self, flops):
        return self.loss(self.optimal_params(flops), self.optimal_tokens(flops))

    def sweep(self, budgets, sizes_per_budget=9, spread=4.0, noise=0.0, seed=0,
              centre=1.0) -> list[dict[str, float]]:
        """Runs at model sizes log-spaced within [centre N*/spread, centre N* spread] of every budget."""
        rng = np.random.default_rng(seed)
        rows = []
        for flops in budgets:
            for factor in centre * np.geomspace(1.0 / spread, spread, sizes_per_budget):
                n = float(self.optimal_params(flops) * factor)
                d = flops / (6.0 * n)
                loss = float(self.loss(n, d) * np.exp(rng.normal(0.0, noise)))
                rows.append({"flops": float(flops), "params": n, "tokens": d, "loss": loss})
        return rows


@pytest.fixture
def known_law() -> KnownLaw:
    return KnownLaw()


def write_csv(path: Path, rows: list[dict], columns: list[str] | None = None) -> Path:
    columns = columns or list(rows[0])
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture
def csv_writer():
    """write_csv(path, rows, columns=None) -> path."""
    return write_csv


@pytest.fixture(scope="session")
def epoch_points() -> dict[str, np.ndarray]:
    """The 240 Epoch points: tokens = C / (6 N), the 5 highest-loss points dropped."""
    runs = scaling.chinchilla.epoch_points()
    return {"flops": runs.flops, "params": runs.params, "tokens": runs.tokens, "loss": runs.loss}
