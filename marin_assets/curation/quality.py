"""Model-based quality classifier: hashed n-gram features + logistic regression.

The classifier is a small, reproducible artifact: a weight vector over a
hashed feature space (stable CRC32 hashing, so scores do not depend on
Python's per-process hash seed), saved as ``weights.npz`` plus ``config.json``.
Documents are kept when their score is at least the ``1 - keep_fraction``
quantile of the scores of the batch being filtered, as Marin does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import polars as pl

from marin_resources.typed_config import typed_config

FEATURE_VERSION = 1
_TOKEN_RE = re.compile(r"\w+", re.UNICODE)


@typed_config
@dataclass(frozen=True)
class QualityConfig:
    n_features: int = 2**18
    word_ngrams: tuple[int, int] = (1, 2)
    # Character n-grams inside words; (0, 0) switches them off.
    char_ngrams: tuple[int, int] = (3, 5)
    # Only the start of a document is featurised: the cost is linear in length
    # and style is evident within a few pages.
    max_chars: int = 20_000
    l2: float = 1.0
    max_iter: int = 200
    keep_fraction: float = 0.8


@dataclass
class QualityModel:
    config: QualityConfig
    weights: np.ndarray  # float64, shape (n_features,)
    bias: float
    training_summary: dict = field(default_factory=dict)


def _hash(token: str) -> int:
    return zlib.crc32(token.encode("utf-8"))


@lru_cache(maxsize=500_000)
def _word_hashes(word: str, lo: int, hi: int) -> tuple[int, ...]:
    """Unigram plus character n-gram hashes of one word.

    Words follow Zipf's law, so caching per word removes most of the hashing.
    """
    hashes = [_hash("w1\x1f" + word)]
    padded = "<" + word + ">"
    for n in range(max(lo, 1), hi + 1):
        for i in range(len(padded) - n + 1):
            hashes.append(_hash("c" + padded[i : i + n]))
    return tuple(hashes)


def _features(text: str, cfg: QualityConfig) -> tuple[np.ndarray, np.ndarray]:
    """Sparse (indices, values): log-scaled, L2-normalised hashed counts."""
    words = _TOKEN_RE.findall(text[: cfg.max_chars].lower())
    hashes: list[int] = []
    lo, hi = cfg.word_ngrams
    clo, chi = cfg.char_ngrams
    if lo <= 1 <= hi:
        for word in words:
            hashes.extend(_word_hashes(word, clo, chi) if chi > 0 else _word_hashes(word, 1, 0))
    elif chi > 0:
        for word in words:
            hashes.extend(_word_hashes(word, clo, chi)[1:])
    for n in range(max(lo, 2), hi + 1):
        for i in range(len(words) - n + 1):
            hashes.append(_hash("w" + str(n) + "\x1f" + "\x1f".join(words[i : i + n])))
    if not hashes:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    idx, counts = np.unique(np.asarray(hashes, dtype=np.int64) % cfg.n_features, return_counts=True)
    values = np.log1p(counts.astype(np.float64))
    return idx, values / np.linalg.norm(values)


def featurize(texts: Sequence[str], cfg: QualityConfig):
    """CSR matrix (n_texts x n_features) of hashed n-gram features."""
    from scipy import sparse

    indptr = [0]
    all_idx: list[np.ndarray] = []
    all_val: list[np.ndarray] = []
    for text in texts:
        idx, val = _features(text, cfg)
        all_idx.append(idx)
        all_val.append(val)
        indptr.append(indptr[-1] + len(idx))
    indices = np.concatenate(all_idx) if all_idx else np.zeros(0, dtype=np.int64)
    data = np.concatenate(all_val) if all_val else np.zeros(0)
    return sparse.csr_matrix((data, indices, np.asarray(indptr)), shape=(len(texts), cfg.n_features))


def _as_texts(examples: Sequence[str] | pl.DataFrame | pl.Series, text_column: str = "text") -> list[str]:
    if isinstance(examples, pl.DataFrame):
        return examples[text_column].to_list()
    if isinstance(examples, pl.Series):
        return examples.to_list()
    return list(examples)


def train_quality_classifier(
    positives: Sequence[str] | pl.DataFrame | pl.Series,
    negatives: Sequence[str] | pl.DataFrame | pl.Series,
    cfg: QualityConfig | None = None,
) -> QualityModel:
    """Fit L2-regularised logistic regression (L-BFGS) on hashed n-grams.

    DataFrames are read through their ``text`` column. Classes are weighted
    to balance, so an unequal number of examples does not bias the scores.
    """
    from scipy.optimize import minimize

    cfg = cfg or QualityConfig()
    pos, neg = _as_texts(positives), _as_texts(negatives)
    if not pos or not neg:
        raise ValueError(f"need positive and negative examples, got {len(pos)} and {len(neg)}")
    x = featurize(pos + neg, cfg)
    y = np.concatenate([np.ones(len(pos)), np.zeros(len(neg))])
    sample_weight = np.where(y == 1, len(y) / (2 * len(pos)), len(y) / (2 * len(neg)))
    n = len(y)

    def loss_and_grad(params: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = params[:-1], params[-1]
        z = x @ w + b
        # log(1 + exp(-z)) for positives, log(1 + exp(z)) for negatives, stably.
        signed = np.where(y == 1, -z, z)
        losses = np.logaddexp(0.0, signed)
        p = 1.0 / (1.0 + np.exp(-z))
        residual = sample_weight * (p - y) / n
        loss = float(sample_weight @ losses / n + 0.5 * cfg.l2 * (w @ w) / n)
        grad_w = x.T @ residual + cfg.l2 * w / n
        return loss, np.concatenate([grad_w, [residual.sum()]])

    result = minimize(
        loss_and_grad,
        np.zeros(cfg.n_features + 1),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": cfg.max_iter},
    )
    weights, bias = result.x[:-1], float(result.x[-1])
    train_scores = 1.0 / (1.0 + np.exp(-(x @ weights + bias)))
    summary = {
        "n_positive": len(pos),
        "n_negative": len(neg),
        "train_accuracy": float(np.mean((train_scores >= 0.5) == (y == 1))),
        "final_loss": float(result.fun),
        "iterations": int(result.nit),
        "converged": bool(result.success),
    }
    return QualityModel(config=cfg, weights=weights, bias=bias, training_summary=summary)


def score(model: QualityModel, texts: Sequence[str] | pl.DataFrame | pl.Series) -> np.ndarray:
    """Probability of the positive ("high quality") class for each text."""
    texts = _as_texts(texts)
    if not texts:
        return np.zeros(0)
    z = featurize(texts, model.config) @ model.weights + model.bias
    return 1.0 / (1.0 + np.exp(-z))


def quality_threshold(scores: np.ndarray, keep_fraction: float) -> float:
    """Score at the ``1 - keep_fraction`` quantile; keep scores >= it."""
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    if len(scores) == 0:
        return float("-inf")
    return float(np.quantile(scores, 1.0 - keep_fraction))


def apply_quality_filter(
    df: pl.DataFrame, model: QualityModel, keep_fraction: float | None = None
) -> tuple[pl.DataFrame, pl.DataFrame, float]:
    """Add a ``quality_score`` column and split into (kept, dropped, threshold).

    ``keep_fraction`` defaults to the model's config.
    """
    fraction = model.config.keep_fraction if keep_fraction is None else keep_fraction
    scores = score(model, df["text"].to_list()) if df.height else np.zeros(0)
    threshold = quality_threshold(scores, fraction)
    scored = df.with_columns(pl.Series("quality_score", scores, dtype=pl.Float64))
    keep = pl.col("quality_score") >= threshold
    return scored.filter(keep), scored.filter(~keep), threshold


def save_quality_model(model: QualityModel, directory: str | Path) -> Path:
    """Write ``weights.npz`` and ``config.json`` into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "weights.npz", weights=model.weights, bias=np.array([model.bias]))
    meta = {
        "feature_version": FEATURE_VERSION,
        "config": dataclasses.asdict(model.config),
        "training_summary": model.training_summary,
    }
    (out / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return out


def load_quality_model(directory: str | Path) -> QualityModel:
    src = Path(directory)
    meta = json.loads((src / "config.json").read_text())
    if meta.get("feature_version") != FEATURE_VERSION:
        raise ValueError(
            f"{src}: quality model has feature_version {meta.get('feature_version')}, "
            f"this code computes version {FEATURE_VERSION}; retrain it"
        )
    raw = meta["config"]
    cfg = QualityConfig(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    )
    arrays = np.load(src / "weights.npz")
    weights = arrays["weights"]
    if weights.shape != (cfg.n_features,):
        raise ValueError(f"{src}: weights shape {weights.shape} does not match n_features {cfg.n_features}")
    return QualityModel(
        config=cfg, weights=weights, bias=float(arrays["bias"][0]), training_summary=meta["training_summary"]
    )
