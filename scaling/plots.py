"""PNG figures of the fits (matplotlib, Agg backend, nothing shown on screen).

Each ``plot_*`` function draws into a fresh figure and returns the PNG bytes; with ``path``
it also writes them there.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .chinchilla import ChinchillaFit
from .isoflop import BudgetFit, IsoflopFit
from .mixture import MixtureOptimum, MixtureRegression
from .runs import Runs

# The face of the banner a refused envelope's figure carries; tests find the banner by it.
BANNER_FACE = "#fde2dd"
BANNER_EDGE = "#a50f15"


def _pyplot():
    # Select Agg before pyplot is first imported so no display is ever needed.
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, path: str | Path | None, description: str | None = None) -> bytes:
    """PNG bytes of ``fig`` (closed); ``description`` goes into the PNG's Description text chunk."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight",
                metadata={"Description": description} if description else None)
    _pyplot().close(fig)
    data = buffer.getvalue()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    return data


def _draw_isoflops(ax, budgets: Sequence[BudgetFit], runs: Runs) -> None:
    """Each budget's runs, valley and vertex; a budget whose vertex lies outside its runs is dashed,
    without a star, since no law is fitted through it. With no budget, the runs alone."""
    drawn = sorted(budgets, key=lambda b: b.flops)
    colors = _pyplot().get_cmap("viridis")(np.linspace(0.0, 0.9, max(len(drawn), 1)))
    for budget, color in zip(drawn, colors):
        members = np.asarray(budget.run_indices, dtype=int)
        tokens, loss = runs.tokens[members], runs.loss[members]
        label = f"{budget.flops:.1e} FLOPs" + ("" if budget.interior else " (minimum outside its runs: left out)")
        ax.scatter(tokens, loss, s=14, color=color, label=label)
        grid = np.linspace(np.log(tokens.min()), np.log(tokens.max()), 100)
        u = grid - budget.tokens_center
        c0, c1, c2 = budget.tokens_coef
        ax.plot(np.exp(grid), c0 + c1 * u + c2 * u * u, color=color, linewidth=1,
                linestyle="-" if budget.interior else "--")
        if budget.interior:
            ax.scatter([budget.tokens], [budget.loss], marker="*", s=90, color=color, edgecolors="black", zorder=3)
    if not drawn:
        ax.scatter(runs.tokens, runs.loss, s=14, color="gray", label="runs")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss")
    ax.set_title("IsoFLOP profiles (stars: interior optima)")
    ax.legend(fontsize=7)


def _draw_envelope(ax, fit: IsoflopFit) -> None:
    flops = np.array([b.flops for b in fit.budgets])
    loss = np.array([b.loss for b in fit.budgets])
    ax.scatter(flops, loss, color="black", s=20, label="per-budget optimum", zorder=3)
    span = np.concatenate([flops, fit.predict_flops])
    grid = np.geomspace(span.min() / 1.5, span.max() * 1.5, 200)
    law = fit.law
    ax.plot(grid, law.loss(grid), color="tab:blue", label=f"E + A C^-{law.alpha:.3f}, E={law.E:.3f}")
    predictions = fit.predictions()
    if predictions:
        pf = np.array([p["flops"] for p in predictions])
        pl = np.array([p["loss"] for p in predictions])
        low = np.array([np.nan if p["loss_low"] is None else p["loss_low"] for p in predictions])
        high = np.array([np.nan if p["loss_high"] is None else p["loss_high"] for p in predictions])
        # A point estimate may sit (just) outside its bootstrap percentiles, e.g. when every replicate
        # refits the same three runs per budget; draw no negative bar.
        errors = np.vstack([pl - low, high - pl])
        ax.errorbar(pf, pl, yerr=np.where(np.isfinite(errors), np.maximum(errors, 0.0), 0.0), fmt="o", color="tab:red",
                    capsize=4, label=f"prediction ({fit.options.interval:.0%} bootstrap interval)")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("loss")
    ax.set_title("Loss envelope L(C)")
    ax.legend(fontsize=7)


def plot_isoflops(fit: IsoflopFit, runs: Runs, path: str | Path | None = None) -> bytes:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    _draw_isoflops(ax, [*fit.budgets, *fit.outside], runs)
    return _finish(fig, path)


def plot_envelope(fit: IsoflopFit, path: str | Path | None = None) -> bytes:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    _draw_envelope(ax, fit)
    return _finish(fig, path)


def plot_optimal_allocation(fit: IsoflopFit, path: str | Path | None = None) -> bytes:
    """N*(C) and D*(C): per-budget optima, fitted power laws and predicted values with intervals."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    flops = np.array([b.flops for b in fit.budgets])
    span = np.concatenate([flops, fit.predict_flops])
    grid = np.geomspace(span.min() / 1.5, span.max() * 1.5, 200)
    predictions = fit.predictions()
    for name, color, law in (("params", "tab:green", fit.law.params), ("tokens", "tab:purple", fit.law.tokens)):
        ax.scatter(flops, [getattr(b, name) for b in fit.budgets], color=color, s=20, zorder=3)
        ax.plot(grid, law(grid), color=color, label=f"{name}* ~ C^{getattr(fit.law, name + '_exponent'):.3f}")
        for p in predictions:
            if p[f"{name}_low"] is not None and p[f"{name}_high"] is not None:
                ax.plot([p["flops"]] * 2, [p[f"{name}_low"], p[f"{name}_high"]], color=color, linewidth=3, alpha=0.5)
            ax.scatter([p["flops"]], [p[name]], color=color, marker="D", s=25)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_title("Compute-optimal parameters and tokens")
    ax.legend(fontsize=7)
    return _finish(fig, path)


def plot_isoflop_summary(fit: IsoflopFit, runs: Runs, path: str | Path | None = None) -> bytes:
    """Two panels side by side: isoFLOP profiles, and the envelope with predictions."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    _draw_isoflops(left, [*fit.budgets, *fit.outside], runs)
    _draw_envelope(right, fit)
    return _finish(fig, path)


def plot_envelope_refused(runs: Runs, budgets: Sequence[BudgetFit], reason: str,
                          path: str | Path | None = None) -> bytes:
    """The isoFLOP profiles under a banner saying why no envelope was fitted (``reason``, e.g.
    EnvelopeRefused's message); the banner's text is also the PNG's Description."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    _draw_isoflops(ax, budgets, runs)
    return _finish_refused(fig, f"Envelope not fitted: {reason}", path)


def _finish_refused(fig, banner: str, path: str | Path | None) -> bytes:
    """`_finish` under a banner saying why nothing was fitted; the banner is also the PNG's Description."""
    fig.text(0.5, 1.02, textwrap.fill(banner, 110), ha="center", va="bottom", fontsize=10, weight="bold",
             color=BANNER_EDGE, bbox={"boxstyle": "round,pad=0.6", "facecolor": BANNER_FACE, "edgecolor": BANNER_EDGE})
    return _finish(fig, path, description=banner)


def plot_joint_forecast(
    fit: ChinchillaFit, runs: Runs, forecasts: list[dict] = (), path: str | Path | None = None
) -> bytes:
    """Approach 3 against tokens: the fitted runs, L(N, D) along each model size, and forecasts.

    ``forecasts``: dicts with ``params``, ``tokens``, ``loss`` and optional ``loss_low``,
    ``loss_high`` and ``label``; each is drawn with its interval on its own size's curve.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = sorted({float(n) for n in runs.params} | {float(f["params"]) for f in forecasts})
    colors = dict(zip(sizes, plt.get_cmap("plasma")(np.linspace(0.0, 0.85, len(sizes)))))
    tokens = np.concatenate([runs.tokens, [float(f["tokens"]) for f in forecasts]])
    grid = np.geomspace(tokens.min() / 1.3, tokens.max() * 1.3, 200)
    for n in sizes:
        ax.plot(grid, fit.predict(n, grid), color=colors[n], linewidth=0.8, alpha=0.7)
    for n in sorted(set(runs.params.tolist())):
        members = runs.params == n
        ax.scatter(runs.tokens[members], runs.loss[members], s=16, color=colors[float(n)], label=f"N={n:,.0f}")
    for f in forecasts:
        low, high = f.get("loss_low"), f.get("loss_high")
        # A point estimate may sit (just) outside its bootstrap percentiles; draw no negative bar.
        yerr = None if low is None or high is None else [[max(f["loss"] - low, 0.0)], [max(high - f["loss"], 0.0)]]
        ax.errorbar([f["tokens"]], [f["loss"]], yerr=yerr, fmt="D", color=colors[float(f["params"])],
                    markeredgecolor="black", capsize=4, label=f.get("label", f"forecast N={f['params']:,.0f}"))
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss")
    ax.set_title(f"L(N, D) = {fit.E:.3g} + {fit.A:.3g}/N^{fit.alpha:.3g} + {fit.B:.3g}/D^{fit.beta:.3g}")
    ax.legend(fontsize=6, ncol=2)
    return _finish(fig, path)


def plot_mixture_fit(fit: MixtureRegression, optimum: MixtureOptimum, runs: Sequence[str], target: str,
                     path: str | Path | None = None) -> bytes:
    """Left: each run's ``target`` loss against the fit's prediction, with and without the run (LOO).
    Right: the predicted best mixture per component, beside the range of weights the runs swept and
    the best mixture's spread when each run is left out."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    low, high = float(min(fit.losses.min(), fit.fitted.min())), float(max(fit.losses.max(), fit.fitted.max()))
    left.plot([low, high], [low, high], color="grey", linewidth=0.8, label="prediction = actual")
    left.scatter(fit.losses, fit.fitted, s=18, color="#1f77b4", label=f"fitted (R² = {fit.r2:.3f})")
    known = np.isfinite(fit.loo)
    rmse = fit.loo_rmse
    left.scatter(fit.losses[known], fit.loo[known], s=22, marker="x", color="#d62728",
                 label="left out" + ("" if rmse is None else f" (LOO RMSE = {rmse:.3g})"))
    for name, actual, fitted in zip(runs, fit.losses, fit.fitted):
        left.annotate(name, (actual, fitted), fontsize=6, xytext=(3, 3), textcoords="offset points")
    left.set_xlabel(f"actual {target}")
    left.set_ylabel(f"predicted {target}")
    left.legend(fontsize=7)
    rows = np.arange(len(fit.components))
    swept_low, swept_high = fit.weights.min(axis=0), fit.weights.max(axis=0)
    right.barh(rows, swept_high - swept_low, left=swept_low, height=0.6, color="#dddddd", label="swept by the runs")
    best = np.array([optimum.weights[c] for c in fit.components])
    refits = np.array([[w[c] for c in fit.components] for w in optimum.loo_weights if w is not None])
    xerr = None if not len(refits) else [np.maximum(best - refits.min(axis=0), 0),
                                          np.maximum(refits.max(axis=0) - best, 0)]
    right.errorbar(best, rows, xerr=xerr, fmt="D", color="#2ca02c", capsize=4,
                   label="predicted best (bars: refitted without each run)")
    right.set_yticks(rows, [f"{c}  (alone: {v:.3g})" for c, v in zip(fit.components, fit.predict(
        np.eye(len(fit.components))))], fontsize=7)
    right.set_xlim(-0.02, 1.02)
    right.set_xlabel("weight (normalized)")
    right.set_title(f"best mixture: {target} = {optimum.loss:.4g} [{optimum.loss_low:.4g}, {optimum.loss_high:.4g}]",
                    fontsize=9)
    right.legend(fontsize=7, loc="lower right")
    return _finish(fig, path)


def plot_mixture_refused(runs: Sequence[str], losses: Sequence[float], target: str, reason: str,
                         path: str | Path | None = None) -> bytes:
    """Each run's ``target`` loss under a banner saying why no regression was fitted (``reason``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(np.arange(len(runs)), losses, color="#bbbbbb")
    ax.set_xticks(np.arange(len(runs)), runs, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(target)
    return _finish_refused(fig, f"Mixture weights not fitted: {reason}", path)
