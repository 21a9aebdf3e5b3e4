from __future__ import annotations

import json
import random

import numpy as np
import polars as pl
import pytest

from marin_assets.curation.quality import (
    QualityConfig,
    apply_quality_filter,
    load_quality_model,
    quality_threshold,
    save_quality_model,
    score,
    train_quality_classifier,
)

_SUBJECTS = ["the old sailor", "a young weaver", "the quiet teacher", "her brother", "the travelling singer"]
_VERBS = ["remembered", "carried", "painted", "described", "followed", "mended"]
_OBJECTS = ["the winter harbour", "a basket of apples", "the long road home", "an unfinished letter", "the garden wall"]
_TAILS = ["before the rain began.", "while the children slept.", "as the bells rang out.", "with great care."]


def _prose(rng: random.Random) -> str:
    return " ".join(
        f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        for _ in range(rng.randint(4, 8))
    )


def _boilerplate(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(4, 8)):
        lines.append(
            rng.choice(
                [
                    f"ERROR {rng.randint(100, 599)} /api/v{rng.randint(1, 3)}/items?id={rng.randint(1, 9999)}",
                    f"Click here to subscribe | Login | Cart ({rng.randint(0, 9)})",
                    f"{rng.randint(1, 28)}/{rng.randint(1, 12)}/2024 {rng.randint(0, 23)}:00 price ${rng.randint(1, 999)}.99",
                    f"def handler_{rng.randint(0, 99)}(request): return json_response(status={rng.randint(200, 500)})",
                ]
            )
        )
    return "\n".join(lines)


@pytest.fixture(scope="module")
def corpus():
    rng = random.Random(7)
    positives = [_prose(rng) for _ in range(60)]
    negatives = [_boilerplate(rng) for _ in range(60)]
    return positives, negatives


_SMALL = QualityConfig(n_features=2**14, max_iter=100)


def test_classifier_separates_clearly_separable_classes(corpus):
    positives, negatives = corpus
    model = train_quality_classifier(positives[:40], negatives[:40], _SMALL)
    assert model.training_summary["train_accuracy"] == 1.0
    held_pos = score(model, positives[40:])
    held_neg = score(model, negatives[40:])
    assert held_pos.min() > held_neg.max()
    assert held_pos.mean() > 0.8 and held_neg.mean() < 0.2


def test_accepts_dataframes_and_rejects_empty_classes(corpus):
    positives, negatives = corpus
    model = train_quality_classifier(pl.DataFrame({"text": positives[:10]}), pl.Series(negatives[:10]), _SMALL)
    assert model.training_summary["n_positive"] == 10
    with pytest.raises(ValueError, match="need positive and negative"):
        train_quality_classifier([], negatives, _SMALL)


def test_keep_fraction_keeps_the_right_count(corpus):
    positives, negatives = corpus
    model = train_quality_classifier(positives[:40], negatives[:40], _SMALL)
    docs = pl.DataFrame({"id": [str(i) for i in range(40)], "text": positives[40:] + negatives[40:]})
    kept, dropped, threshold = apply_quality_filter(docs, model, keep_fraction=0.5)
    assert kept.height == 20 and dropped.height == 20
    assert set(kept["text"]) == set(positives[40:])  # the better half is the prose
    assert (kept["quality_score"] >= threshold).all() and (dropped["quality_score"] < threshold).all()
    kept_quarter, _, _ = apply_quality_filter(docs, model, keep_fraction=0.25)
    assert kept_quarter.height == 10
    assert quality_threshold(np.arange(100, dtype=float), 0.3) == pytest.approx(69.3)
    with pytest.raises(ValueError):
        quality_threshold(np.arange(3, dtype=float), 0.0)


def test_save_and_load_round_trip(tmp_path, corpus):
    positives, negatives = corpus
    model = train_quality_classifier(positives[:20], negatives[:20], _SMALL)
    save_quality_model(model, tmp_path / "model")
    loaded = load_quality_model(tmp_path / "model")
    assert loaded.config == model.config
    np.testing.assert_array_equal(score(loaded, positives[20:30]), score(model, positives[20:30]))
    meta = json.loads((tmp_path / "model" / "config.json").read_text())
    meta["feature_version"] = 0
    (tmp_path / "model" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="retrain"):
        load_quality_model(tmp_path / "model")
