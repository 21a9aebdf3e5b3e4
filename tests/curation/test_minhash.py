"""MinHash signatures: bit-identical to datasketch, consistent with the scalar definitions, cached safely."""

from __future__ import annotations

import io
import random

import numpy as np
import polars as pl
import pytest
from datasketch import MinHash

from marin_assets.curation import kernels, minhash
from marin_assets.curation.minhash import (
    MinHashConfig,
    SignatureTable,
    compute_signatures,
    empty_signature_mask,
    estimate_jaccard,
    exact_jaccard,
    load_signatures,
    minhash_texts,
    permutations,
    save_signatures,
    shingle_hash32,
    shingle_hash64,
    shingle_hashes,
    shingle_sets,
    shingle_tokens,
    shingles,
    tokenize,
)

# Written for these tests: mixed scripts, punctuation, short and tokenless documents.
TEXTS = [
    "The committee met on Tuesday; it decided (after a long debate) to postpone the vote.",
    "THE Committee met on tuesday -- it decided, after a long debate, to postpone the vote!",
    "Émigré naïveté: the café served crème brûlée to the Straße's guests at 9:30_pm.",
    "東京の天気は晴れです。明日も晴れるでしょう。 Snow in Zürich, rain in Kraków, sun in Αθήνα.",
    "short doc",
    "one",
    "",
    "   ... --- !!! ",
    "emoji 🙂 between words 🙂🙂 and a tab\tand\r\nnewlines\n\nhere with numbers 12 345 6.78",
    " ".join(f"word{i % 37}" for i in range(500)),
]


def random_words(rng: random.Random, count: int) -> str:
    vocabulary = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "lamp", "quiet", "swift",
                  "Ärger", "façade", "naïve", "über", "日本", "данные", "x", "y2", "z_3", "404"]
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def test_tokenize_lowercases_and_splits_on_ascii_non_word_bytes():
    assert tokenize("Hello, World! it's 2024_v2") == [b"hello", b"world", b"it", b"s", b"2024_v2"]
    assert tokenize("Émigré CAFÉ—déjà") == ["émigré".encode(), "café—déjà".encode()]
    assert tokenize(" \n\t.,;") == []
    assert shingle_tokens("a b", 5) == [(b"a", b"b")]
    assert shingle_tokens("a b c", 2) == [(b"a", b"b"), (b"b", b"c")]
    assert shingles("A, b. C", 2) == [b"a b", b"b c"]
    assert shingle_tokens("", 5) == []


def test_vectorized_shingle_hashes_match_scalar_definition(monkeypatch):
    rng = random.Random(3)
    texts = TEXTS + [random_words(rng, rng.randint(0, 40)) for _ in range(50)]
    # Tiny batches force documents onto batch boundaries.
    monkeypatch.setattr(minhash, "_BATCH_TEXT_CHARS", 100)
    for shingle_size in (1, 2, 5, 9):
        hashed = shingle_hashes(texts, shingle_size)
        expected = [shingle_hash64(s) for text in texts for s in shingle_tokens(text, shingle_size)]
        expected_docs = [i for i, text in enumerate(texts) for _ in shingle_tokens(text, shingle_size)]
        assert hashed.hashes.tolist() == expected
        assert hashed.doc_index.tolist() == expected_docs
        sets = shingle_sets(texts, shingle_size)
        for text, hash_set in zip(texts, sets):
            assert hash_set.tolist() == sorted({shingle_hash64(s) for s in shingle_tokens(text, shingle_size)})


def test_permutations_are_datasketch_affine32():
    for num_perm, seed in ((128, 1), (64, 42), (256, 7)):
        a, b = permutations(num_perm, seed)
        reference = MinHash(num_perm=num_perm, seed=seed)
        assert reference.scheme == "affine32"
        assert np.array_equal(a, reference.permutations[0]) and np.array_equal(b, reference.permutations[1])


@pytest.mark.parametrize("num_perm,seed,shingle_size", [(128, 1, 5), (64, 9, 3), (256, 1234, 1)])
def test_sha1_mode_equals_datasketch_default_minhash(num_perm, seed, shingle_size, monkeypatch):
    monkeypatch.setattr(minhash, "_PERMUTATION_BLOCK", 7)  # documents span permutation blocks
    config = MinHashConfig(shingle_size=shingle_size, num_perm=num_perm, seed=seed, hash_mode="sha1")
    signatures = minhash_texts(TEXTS, config)
    for text, signature in zip(TEXTS, signatures):
        reference = MinHash(num_perm=num_perm, seed=seed)
        reference.update_batch(shingles(text, shingle_size))
        assert np.array_equal(signature, reference.hashvalues)


@pytest.mark.parametrize("implementation", [pytest.param("kernel", marks=pytest.mark.compiled_kernels), "numpy"])
@pytest.mark.parametrize("num_perm,seed,shingle_size", [(128, 1, 5), (64, 9, 3), (32, 5, 13)])
def test_fast_mode_equals_datasketch_with_our_shingle_hash(num_perm, seed, shingle_size, implementation, monkeypatch):
    monkeypatch.setattr(minhash, "_PERMUTATION_BLOCK", 11)
    monkeypatch.setattr(minhash, "_BATCH_TEXT_CHARS", 64)
    monkeypatch.setattr(minhash, "_KERNEL_BATCH_CHARS", 64)
    if implementation == "numpy":
        monkeypatch.setitem(kernels.MODULES, "_minhash", None)
    config = MinHashConfig(shingle_size=shingle_size, num_perm=num_perm, seed=seed)
    signatures = minhash_texts(TEXTS, config)
    for text, signature in zip(TEXTS, signatures):
        reference = MinHash(num_perm=num_perm, seed=seed, hashfunc=shingle_hash32)
        reference.update_batch(shingle_tokens(text, shingle_size))
        assert np.array_equal(signature, reference.hashvalues)
    assert empty_signature_mask(signatures).tolist() == [not tokenize(text) for text in TEXTS]


def test_fast_estimates_are_as_accurate_as_datasketch_sha1():
    """On pairs spanning Jaccard 0..1, |estimate - exact| of the fast hash matches datasketch's."""
    rng = random.Random(11)
    pairs = []
    for _ in range(150):
        words = random_words(rng, 300).split()
        rate = rng.uniform(0.0, 0.3)
        edited = [f"edit{rng.randrange(999)}" if rng.random() < rate else word for word in words]
        pairs.append((" ".join(words), " ".join(edited)))
    texts = [text for pair in pairs for text in pair]
    fast = minhash_texts(texts, MinHashConfig())
    sha1 = minhash_texts(texts, MinHashConfig(hash_mode="sha1"))
    sets = shingle_sets(texts, 5)
    exact = np.array([exact_jaccard(sets[2 * i], sets[2 * i + 1]) for i in range(len(pairs))])
    assert exact.min() < 0.2 and exact.max() > 0.9
    fast_error = np.array([estimate_jaccard(fast[2 * i], fast[2 * i + 1]) for i in range(len(pairs))]) - exact
    sha1_error = np.array([estimate_jaccard(sha1[2 * i], sha1[2 * i + 1]) for i in range(len(pairs))]) - exact
    # 128 permutations: standard error sqrt(J(1-J)/128) <= 0.044, so mean absolute errors ~0.02-0.03.
    assert np.abs(fast_error).mean() < 0.04 and np.abs(sha1_error).mean() < 0.04
    assert abs(np.abs(fast_error).mean() - np.abs(sha1_error).mean()) < 0.01
    assert abs(fast_error.mean()) < 0.01  # unbiased: the mean signed error is near zero


def test_signature_files_round_trip_and_reject_other_configs(tmp_path):
    config = MinHashConfig(num_perm=64, seed=3)
    docs = pl.DataFrame({"id": [f"id{i}" for i in range(len(TEXTS))], "text": TEXTS})
    table = compute_signatures(docs, config)
    path = tmp_path / "shard.parquet"
    save_signatures(table, path)
    loaded = load_signatures(path, config)
    assert loaded.config == config
    assert list(loaded.ids) == list(table.ids) and np.array_equal(loaded.hashvalues, table.hashvalues)
    buffer = io.BytesIO()
    save_signatures(table, buffer)
    assert np.array_equal(load_signatures(buffer.getvalue()).hashvalues, table.hashvalues)
    with pytest.raises(ValueError, match="computed with"):
        load_signatures(path, MinHashConfig(num_perm=64, seed=4))
    plain = tmp_path / "plain.parquet"
    pl.DataFrame({"id": ["a"]}).write_parquet(plain)
    with pytest.raises(ValueError, match="not a signature file"):
        load_signatures(plain)

    frame = table.to_frame()
    assert frame.schema == pl.Schema({"id": pl.Utf8, "signature": pl.Array(pl.UInt32, 64)})
    again = SignatureTable.from_frame(frame, config)
    assert np.array_equal(again.hashvalues, table.hashvalues)
    with pytest.raises(ValueError, match="signature column must be"):
        SignatureTable.from_frame(frame, MinHashConfig(num_perm=128))


def test_invalid_inputs_are_rejected():
    with pytest.raises(ValueError, match="shingle_size"):
        MinHashConfig(shingle_size=0)
    with pytest.raises(ValueError, match="hash_mode"):
        MinHashConfig(hash_mode="md5")
    with pytest.raises(ValueError, match="'text'"):
        compute_signatures(pl.DataFrame({"id": ["a"]}), MinHashConfig())
    with pytest.raises(ValueError, match="null"):
        null_text = pl.DataFrame({"id": ["a"], "text": [None]}, schema={"id": pl.Utf8, "text": pl.Utf8})
        compute_signatures(null_text, MinHashConfig())
    with pytest.raises(ValueError, match="does not match"):
        SignatureTable(np.array(["a"], dtype=object), np.zeros((2, 128), np.uint32), MinHashConfig())


def test_empty_frame_has_empty_signatures():
    table = compute_signatures(pl.DataFrame(schema={"id": pl.Utf8, "text": pl.Utf8}), MinHashConfig())
    assert table.hashvalues.shape == (0, 128) and len(table) == 0


@pytest.mark.compiled_kernels
@pytest.mark.parametrize("shingle_size,num_perm,seed", [(5, 128, 1), (1, 16, 3), (2, 64, 9), (9, 40, 2**32 - 1)])
def test_kernel_signatures_equal_the_numpy_definition(shingle_size, num_perm, seed, monkeypatch):
    rng = random.Random(shingle_size)
    texts = TEXTS + [random_words(rng, rng.randrange(0, 400)) for _ in range(300)] + ["x" * 70_000, "a\x00b c"]
    config = MinHashConfig(shingle_size=shingle_size, num_perm=num_perm, seed=seed)
    expected = minhash.numpy_minhash_texts(texts, config)
    assert np.array_equal(minhash.minhash_texts(texts, config), expected)
    monkeypatch.setattr(minhash, "_KERNEL_BATCH_CHARS", 1000)  # many kernel calls, documents split across none
    assert np.array_equal(minhash.minhash_texts(texts, config), expected)


@pytest.mark.compiled_kernels
def test_kernel_rejects_inconsistent_arrays():
    a, b = permutations(8, 1)
    multipliers = np.ones(5, dtype=np.uint64)
    with pytest.raises(ValueError, match="inconsistent"):
        kernels.MODULES["_minhash"].signatures(b"ab", np.array([2], np.int64), 5, a, b, multipliers, 3,
                                               np.zeros((1, 7), np.uint32))
    with pytest.raises(ValueError, match="out of range"):
        kernels.MODULES["_minhash"].signatures(b"ab", np.array([9], np.int64), 5, a, b, multipliers, 3,
                                               np.zeros((1, 8), np.uint32))
