"""Quality classifiers: a fastText model (trained from pinned sources, or adopted by URI) and Marin's
model-free compression ratio. Pure functions; the Dagster wiring is in ``refine.py``.

A classifier gives each document a score (``quality_score``, higher is better). Which documents
survive is decided later, over the corpus being filtered: the ``1 - keep_fraction`` quantile of
all scored documents, read from mergeable per-shard sketches (``sketch.py``), never from the
classifier's training data.
"""

from __future__ import annotations

import hashlib
import re
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from marin_assets.curation.fasttext_models import FastTextClassifier, FastTextTrainConfig, train_fasttext
from marin_resources.config_identity import identity, runtime
from marin_resources.typed_config import typed_config

CLASSIFIERS = ("fasttext", "compression")
POSITIVE, NEGATIVE = "hq", "lq"
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")


# The identities a quality config's fields belong to (marin_resources/config_identity.py): the trained
# classifier's, an adopted one's, the keep threshold's and each scored source's filtered documents'.
CLASSIFIER = "quality_classifier"
ADOPTED = "adopted_classifier"
THRESHOLD = "quality_threshold"
FILTERED = "filtered"


@typed_config
@dataclass(frozen=True)
class QualityConfig:
    """The ``quality:`` block of the sources YAML, less its source lists."""

    # fasttext: a fastText model (trained from `positive`/`negative`, or adopted from `model_uri`);
    # compression: zlib compressed size over text size, no model.
    classifier: str = identity("fasttext", scopes=[THRESHOLD, FILTERED])
    keep_fraction: float = identity(0.8, scopes=[THRESHOLD])
    # An adopted model: any fsspec URL (gs://, s3://, hf://, local) and the sha256 of its bytes.
    model_uri: str | None = runtime(None)
    model_sha256: str | None = identity(None, scopes=[ADOPTED])
    # The label whose probability is the score (DCLM's OH+ELI5 model: __label__hq).
    positive_label: str = identity("__label__" + POSITIVE, scopes=[CLASSIFIER, ADOPTED])
    # Only the start of a document is scored (None: all of it); fastText's cost is linear in length.
    score_max_chars: int | None = identity(100_000, scopes=[FILTERED])
    # Relative accuracy of the corpus-wide score sketch, and so of the keep threshold.
    sketch_relative_accuracy: float = identity(0.01, scopes=[THRESHOLD, FILTERED])
    # Training: documents are cut into examples of about this many characters at paragraph breaks.
    example_chars: int = identity(2000, scopes=[CLASSIFIER])
    # Classes are balanced to the smaller one, at most this many examples each.
    max_examples_per_class: int = identity(20_000, scopes=[CLASSIFIER])
    # One example in this many (by a hash of its text) is held out to measure accuracy.
    holdout_every: int = identity(10, scopes=[CLASSIFIER])
    # fastText's settings for small supervised sets (its own defaults, 5 epochs at lr 0.1, leave the
    # demo's scores within 0.2% of 0.5, too close for a 1% sketch to rank); 32 x 100k buckets keep
    # the model at 16 MB.
    epoch: int = identity(20, scopes=[CLASSIFIER])
    lr: float = identity(0.5, scopes=[CLASSIFIER])
    dim: int = identity(32, scopes=[CLASSIFIER])
    word_ngrams: int = identity(2, scopes=[CLASSIFIER])
    min_count: int = identity(2, scopes=[CLASSIFIER])
    bucket: int = identity(100_000, scopes=[CLASSIFIER])
    seed: int = identity(0, scopes=[CLASSIFIER])

    def __post_init__(self) -> None:
        if self.classifier not in CLASSIFIERS:
            raise ValueError(f"quality.classifier must be one of {CLASSIFIERS}, got {self.classifier!r}")
        if not 0.0 < self.keep_fraction <= 1.0:
            raise ValueError(f"quality.keep_fraction: must be in (0, 1], got {self.keep_fraction}")
        if (self.model_uri is None) != (self.model_sha256 is None):
            raise ValueError("quality.model_uri and quality.model_sha256 go together: an adopted model is "
                             "identified by the sha256 of its bytes")
        if self.model_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.model_sha256):
            raise ValueError(f"quality.model_sha256: expected 64 lowercase hex digits, got {self.model_sha256!r}")
        if self.classifier == "compression" and self.model_uri is not None:
            raise ValueError("quality.model_uri: the compression classifier has no model")
        if self.holdout_every < 2:
            raise ValueError(f"quality.holdout_every: must be >= 2, got {self.holdout_every}")

    @property
    def train_config(self) -> FastTextTrainConfig:
        return FastTextTrainConfig(epoch=self.epoch, lr=self.lr, dim=self.dim, word_ngrams=self.word_ngrams,
                                   min_count=self.min_count, bucket=self.bucket, seed=self.seed)


def compression_ratios(texts: Sequence[str]) -> np.ndarray:
    """zlib-compressed bytes over UTF-8 bytes per text (0 for an empty text).

    Marin's model-free signal: boilerplate, repeated lines and templated pages compress far better
    than prose (a low ratio), random strings and encoded blobs barely compress (near or above 1).
    """
    out = np.zeros(len(texts))
    for i, text in enumerate(texts):
        raw = text.encode("utf-8")
        if raw:
            out[i] = len(zlib.compress(raw, 6)) / len(raw)
    return out


def split_examples(text: str, example_chars: int) -> list[str]:
    """A document cut at paragraph breaks into pieces of about ``example_chars`` (a longer paragraph is
    one piece): one training example each, so a 150 KB play is not one example among few."""
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in _PARAGRAPH_BREAK.split(text):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        current.append(paragraph)
        size += len(paragraph)
        if size >= example_chars:
            pieces.append("\n\n".join(current))
            current, size = [], 0
    if current:
        pieces.append("\n\n".join(current))
    return pieces


def _hash_order(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


@dataclass(frozen=True)
class TrainingSet:
    train: list[tuple[str, str]]  # (label, text), in the order fastText reads them
    held_out: list[tuple[str, str]]
    available: dict[str, int]  # examples per class before balancing


def training_set(positives: Sequence[str], negatives: Sequence[str], cfg: QualityConfig) -> TrainingSet:
    """Examples in a fixed order that depends on the texts only: cut into pieces, ordered by the sha256
    of each piece, balanced by keeping the first ``n`` of each class, held out by hash, interleaved."""
    classes = {}
    for label, texts in ((POSITIVE, positives), (NEGATIVE, negatives)):
        pieces = sorted({piece for text in texts for piece in split_examples(text, cfg.example_chars)},
                        key=_hash_order)
        classes[label] = pieces
    if not classes[POSITIVE] or not classes[NEGATIVE]:
        raise ValueError(f"need positive and negative examples, got {len(classes[POSITIVE])} and "
                         f"{len(classes[NEGATIVE])}")
    n = min(len(classes[POSITIVE]), len(classes[NEGATIVE]), cfg.max_examples_per_class)
    train: list[tuple[str, str]] = []
    held_out: list[tuple[str, str]] = []
    for i in range(n):
        for label in (POSITIVE, NEGATIVE):
            text = classes[label][i]
            (held_out if _hash_order(text)[-1] % cfg.holdout_every == 0 else train).append((label, text))
    return TrainingSet(train, held_out, {label: len(pieces) for label, pieces in classes.items()})


def train_quality_model(positives: Sequence[str], negatives: Sequence[str],
                        cfg: QualityConfig) -> tuple[bytes, dict]:
    """A fastText ``.bin`` (labels ``__label__hq``/``__label__lq``) and a summary with held-out accuracy.

    The same texts and config give the same bytes: the example order is fixed and fastText runs on
    one thread with a fixed seed.
    """
    examples = training_set(positives, negatives, cfg)
    started = time.perf_counter()
    model_bytes = train_fasttext(examples.train, cfg.train_config)
    train_seconds = time.perf_counter() - started
    summary = {"examples_train": len(examples.train), "examples_held_out": len(examples.held_out),
               "available_positive": examples.available[POSITIVE],
               "available_negative": examples.available[NEGATIVE], "train_seconds": round(train_seconds, 3)}
    if examples.held_out:
        model = FastTextClassifier(model_bytes, "trained model")
        probs = model.probabilities([text for _, text in examples.held_out], cfg.positive_label)
        truth = np.array([label == POSITIVE for label, _ in examples.held_out])
        summary["held_out_accuracy"] = round(float(np.mean((probs >= 0.5) == truth)), 6)
    return model_bytes, summary


class QualityScorer:
    """Scores for one classifier: ``score(texts)`` is an array, higher is better."""

    def __init__(self, cfg: QualityConfig, model_bytes: bytes | None = None, name: str = "quality model") -> None:
        self.cfg = cfg
        self.model = None
        if cfg.classifier == "fasttext":
            if model_bytes is None:
                raise ValueError("the fasttext classifier needs its model")
            self.model = FastTextClassifier(model_bytes, name, required_labels=[cfg.positive_label])

    def score(self, texts: Sequence[str]) -> np.ndarray:
        if self.model is None:
            return compression_ratios(texts)
        return self.model.probabilities(texts, self.cfg.positive_label, self.cfg.score_max_chars)
