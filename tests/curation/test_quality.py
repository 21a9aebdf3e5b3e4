"""fastText quality classifiers (trained reproducibly, or adopted and checked), the compression-ratio
classifier, and fastText language ID as a stand-in for lid.176."""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest

from marin_assets.curation.fasttext_models import (
    FastTextClassifier,
    FastTextTrainConfig,
    ModelFileError,
    check_fasttext_bytes,
    fetch_model,
    sha256_hex,
    train_fasttext,
)
from marin_assets.curation.filters import FilterConfig, apply_filters
from marin_assets.curation.quality import (
    QualityConfig,
    QualityScorer,
    compression_ratios,
    split_examples,
    train_quality_model,
    training_set,
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
    return "\n".join(rng.choice([
        f"ERROR {rng.randint(100, 599)} /api/v{rng.randint(1, 3)}/items?id={rng.randint(1, 9999)}",
        f"Click here to subscribe | Login | Cart ({rng.randint(0, 9)})",
        f"{rng.randint(1, 28)}/{rng.randint(1, 12)}/2024 {rng.randint(0, 23)}:00 price ${rng.randint(1, 999)}.99",
        f"def handler_{rng.randint(0, 99)}(request): return json_response(status={rng.randint(200, 500)})",
    ]) for _ in range(rng.randint(4, 8)))


_SMALL = QualityConfig(example_chars=200, dim=16, epoch=10, lr=0.05, bucket=20_000, min_count=1, holdout_every=5)


@pytest.fixture(scope="module")
def corpus():
    rng = random.Random(7)
    return [_prose(rng) for _ in range(150)], [_boilerplate(rng) for _ in range(150)]


@pytest.fixture(scope="module")
def trained(corpus):
    return train_quality_model(*corpus, _SMALL)


def test_training_gives_the_same_bytes_from_the_same_texts_in_any_order(corpus, trained):
    positives, negatives = corpus
    model, summary = trained
    shuffled_pos, shuffled_neg = positives[::-1], random.Random(1).sample(negatives, len(negatives))
    again, _ = train_quality_model(shuffled_pos, shuffled_neg, _SMALL)
    assert sha256_hex(again) == sha256_hex(model)
    assert summary["held_out_accuracy"] >= 0.95 and summary["examples_held_out"] > 10
    different, _ = train_quality_model(positives, negatives, QualityConfig(**{**_SMALL.__dict__, "seed": 7}))
    assert sha256_hex(different) != sha256_hex(model)


def test_scores_rank_unseen_prose_above_boilerplate(trained):
    rng = random.Random(99)
    scorer = QualityScorer(_SMALL, trained[0])
    prose = scorer.score([_prose(rng) for _ in range(20)])
    boiler = scorer.score([_boilerplate(rng) for _ in range(20)])
    assert prose.min() > boiler.max()
    assert scorer.score([]).shape == (0,)


def test_training_set_is_balanced_cut_and_held_out_by_hash(corpus):
    positives, negatives = corpus
    examples = training_set(positives[:50], negatives, _SMALL)
    labels = [label for label, _ in examples.train + examples.held_out]
    assert labels.count("hq") == labels.count("lq")
    assert examples.available["hq"] >= 50
    assert split_examples("a\n\nbb\n\n\n" + "c" * 300 + "\n\nd", 3) == ["a\n\nbb", "c" * 300, "d"]
    with pytest.raises(ValueError, match="need positive and negative"):
        training_set([], negatives, _SMALL)


def test_compression_ratio_orders_repetition_prose_and_noise():
    rng = random.Random(5)
    repeated = "Subscribe to our newsletter for updates.\n" * 60
    prose = " ".join(_prose(rng) for _ in range(6))
    noise = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789+/") for _ in range(2000))
    ratios = compression_ratios([repeated, prose, noise, ""])
    assert ratios[0] < 0.1 < ratios[1] < ratios[2] and ratios[3] == 0.0
    scorer = QualityScorer(QualityConfig(classifier="compression"))
    assert np.array_equal(scorer.score([repeated, prose]), ratios[:2])


def test_a_corrupt_or_wrong_model_is_one_clear_error(tmp_path, trained):
    model = trained[0]
    assert check_fasttext_bytes(model).labels == ("__label__hq", "__label__lq")
    for bad, message in [(model[: len(model) // 2], "truncated in"), (model[:6], "truncated in header"),
                         (b"\x00" * 4096, "not a fastText model \\(magic"), (model + b"xx", "unexpected bytes")]:
        with pytest.raises(ModelFileError, match=message) as err:
            FastTextClassifier(bad, "q.bin")
        assert "\n" not in str(err.value) and str(err.value).startswith("q.bin: ")
    with pytest.raises(ModelFileError, match="no label '__label__cc'"):
        QualityScorer(QualityConfig(positive_label="__label__cc"), model)
    path = tmp_path / "model.bin"
    path.write_bytes(model)
    assert fetch_model(str(path), sha256_hex(model), "quality model") == model
    with pytest.raises(ModelFileError, match="sha256 is .* expected 0{64}"):
        fetch_model(str(path), "0" * 64, "quality model")
    with pytest.raises(ModelFileError, match="no such file"):
        fetch_model(str(tmp_path / "missing.bin"), "0" * 64, "quality model")
    path.write_bytes(model[:1000])
    with pytest.raises(ModelFileError, match="truncated"):
        fetch_model(str(path), sha256_hex(model[:1000]), "quality model")


# Sentences written for this test, in the supervised format of fastText's lid.176 (__label__<code>).
LANGUAGE_SENTENCES = {
    "en": ["The children walked to the market with their grandmother every morning.",
           "We could not find the key, so we waited in the garden until evening.",
           "The river was cold and the boats stayed in the harbour all week.",
           "She wrote a long letter to her brother about the harvest and the weather."],
    "de": ["Die Kinder gingen jeden Morgen mit ihrer Großmutter auf den Markt.",
           "Wir konnten den Schlüssel nicht finden und warteten bis zum Abend im Garten.",
           "Der Fluss war kalt, und die Boote blieben die ganze Woche im Hafen.",
           "Sie schrieb ihrem Bruder einen langen Brief über die Ernte und das Wetter."],
    "fr": ["Les enfants allaient au marché avec leur grand-mère tous les matins.",
           "Nous ne trouvions pas la clé, alors nous avons attendu dans le jardin jusqu'au soir.",
           "La rivière était froide et les bateaux sont restés au port toute la semaine.",
           "Elle écrivit une longue lettre à son frère sur la récolte et le temps qu'il faisait."],
}


@pytest.fixture(scope="module")
def language_model() -> bytes:
    examples = [(lang, sentence) for _ in range(20) for lang, sentences in LANGUAGE_SENTENCES.items()
                for sentence in sentences[:3]]
    return train_fasttext(examples, FastTextTrainConfig(epoch=25, dim=16, word_ngrams=1, min_count=1, bucket=20_000))


def test_fasttext_language_id_stands_in_for_langid(language_model):
    model = FastTextClassifier(language_model, "lid")
    held_out = [sentences[3] for sentences in LANGUAGE_SENTENCES.values()]
    langs, probs = model.top_labels(held_out, 5000)
    assert langs == ["en", "de", "fr"] and (probs > 0.5).all()

    def identify(texts, sample_chars):
        found, scores = model.top_labels(texts, sample_chars)
        return found, scores.tolist()

    docs = pl.DataFrame({"id": ["a", "b", "c"], "text": held_out})
    result = apply_filters(docs, FilterConfig(languages=("en", "fr"), min_words=None, min_stop_words=None,
                                              min_language_score=0.5), identify)
    assert result.kept["lang"].to_list() == ["en", "fr"]
    assert result.dropped["reason"].to_list() == ["language"] and result.dropped["lang"].to_list() == ["de"]
