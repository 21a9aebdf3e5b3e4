"""Exact and fuzzy dedup on a corpus of real text (Python stdlib docstrings) with planted duplicates."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import random
import warnings
from itertools import combinations

import numpy as np
import polars as pl
import pytest

from marin_assets.curation import dedup, dedup_passes, minhash
from marin_assets.curation.dedup import (
    DECISION_SCHEMA,
    DUPLICATES_SCHEMA,
    Shard,
    candidate_probability,
    decision_path,
    dedup_source,
    lsh_threshold,
    update_index,
)
from marin_assets.curation.dedup_index import DedupConfig, IndexDir, ShardInput, read_registry
from marin_assets.curation.dedup_passes import key_partition
from marin_assets.curation.minhash import (
    MinHashConfig,
    compute_signatures,
    load_signatures,
    save_signatures,
    shingle_tokens,
)

# Stdlib modules whose public docstrings are English prose; importing them has no side effects.
DOCSTRING_MODULES = (
    "argparse", "ast", "asyncio", "calendar", "collections", "concurrent.futures", "configparser",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
    "fractions", "ftplib", "functools", "gettext", "gzip", "heapq", "http.client", "http.cookiejar",
    "imaplib", "inspect", "ipaddress", "itertools", "json", "logging", "mailbox", "multiprocessing",
    "numbers", "optparse", "os", "pathlib", "pdb", "pickle", "pprint", "queue", "random", "re",
    "sched", "secrets", "selectors", "shutil", "smtplib", "socket", "sqlite3", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "traceback", "typing",
    "unittest", "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom",
    "zipfile",
)
SHINGLE_SIZE = 5


def tuple_set_jaccard(set_a: set, set_b: set) -> float:
    if not set_a or not set_b:
        return 0.0
    return len(set_a & set_b) / len(set_a | set_b)


def true_jaccard(a: str, b: str) -> float:
    """Jaccard of the shingle sets as token tuples: independent of any hashing."""
    return tuple_set_jaccard(set(shingle_tokens(a, SHINGLE_SIZE)), set(shingle_tokens(b, SHINGLE_SIZE)))


def docstring_documents(min_words: int = 150) -> list[str]:
    """Docstrings of each module grouped into documents of at least ``min_words`` words, made
    mutually dissimilar (true Jaccard < 0.2) so planted duplicates are the only duplicates."""
    documents: list[str] = []
    for module_name in DOCSTRING_MODULES:
        module = importlib.import_module(module_name)
        texts = [inspect.getdoc(module) or ""]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # typing.io and friends warn on access
            for name in sorted(vars(module)):
                member = getattr(module, name)
                if not name.startswith("_") and getattr(member, "__module__", None) == module.__name__:
                    texts.append(inspect.getdoc(member) or "")
        chunk: list[str] = []
        for text in filter(None, texts):
            chunk.append(text)
            if sum(len(part.split()) for part in chunk) >= min_words:
                documents.append("\n\n".join(chunk))
                chunk = []
    distinct: list[str] = []
    shingle_sets = []
    for document in documents:
        shingles = set(shingle_tokens(document, SHINGLE_SIZE))
        if all(len(shingles & other) / len(shingles | other) < 0.2 for other in shingle_sets):
            distinct.append(document)
            shingle_sets.append(shingles)
    return distinct


def substitute_words(text: str, count: int, vocabulary: list[str], rng: random.Random) -> str:
    words = text.split()
    for position in rng.sample(range(len(words)), count):
        words[position] = rng.choice(vocabulary)
    return " ".join(words)


def frame(texts: list[str], source_ids: list[str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "id": [hashlib.sha256(text.encode()).hexdigest() for text in texts],
            "text": texts,
            "source": ["docstrings"] * len(texts),
            "source_id": source_ids,
            "metadata": ['{"lang": "en"}'] * len(texts),
        },
        schema={"id": pl.Utf8, "text": pl.Utf8, "source": pl.Utf8, "source_id": pl.Utf8, "metadata": pl.Utf8},
    )


def make_shards(texts: list[str], num_shards: int, config: MinHashConfig, seed: int = 0) -> list[Shard]:
    rng = random.Random(seed)
    assignment = [rng.randrange(num_shards) for _ in texts]
    shards = []
    for shard_index in range(num_shards):
        members = [i for i, shard in enumerate(assignment) if shard == shard_index]
        docs = frame([texts[i] for i in members], [f"doc-{i}" for i in members])
        shards.append(Shard(f"shard-{shard_index:03d}", docs, compute_signatures(docs, config)))
    return shards


@pytest.fixture(scope="module")
def planted_corpus() -> dict:
    """Base documents plus variants: close (0.2-0.8% of words substituted, at least one; Jaccard
    about 0.9-0.97), far (4-12% substituted; Jaccard about 0.4-0.78, where LSH proposes some pairs
    that verification must reject), and exact copies."""
    rng = random.Random(1234)
    bases = docstring_documents()
    assert len(bases) >= 150, "the stdlib should give well over 150 distinct docstring documents"
    vocabulary = sorted({word for text in bases for word in text.split()})
    texts = list(bases)
    close_pairs, far_pairs = [], []
    for index in range(0, 60):
        count = max(1, round(len(bases[index].split()) * rng.uniform(0.002, 0.008)))
        texts.append(substitute_words(bases[index], count, vocabulary, rng))
        close_pairs.append((index, len(texts) - 1))
    for index in range(60, 100):
        count = round(len(bases[index].split()) * rng.uniform(0.04, 0.12))
        texts.append(substitute_words(bases[index], count, vocabulary, rng))
        far_pairs.append((index, len(texts) - 1))
    for index in range(100, 120):
        texts.append(bases[index])
    return {"texts": texts, "num_bases": len(bases), "close_pairs": close_pairs, "far_pairs": far_pairs}


def kept_text_of_each_row(shards: list[Shard], result) -> dict[str, str]:
    """source_id -> text of the kept document that stands for it."""
    kept_text = dict(zip(result.kept["source_id"], result.kept["text"]))
    dropped_to_kept = dict(zip(result.duplicates["dropped_source_id"], result.duplicates["kept_source_id"]))
    all_ids = [source_id for shard in shards for source_id in shard.docs["source_id"]]
    return {source_id: kept_text[dropped_to_kept.get(source_id, source_id)] for source_id in all_ids}


def test_planted_near_duplicates_have_high_recall_and_precision(planted_corpus):
    texts = planted_corpus["texts"]
    config = DedupConfig()
    shards = make_shards(texts, 3, config.minhash)
    result = dedup_source(shards, config)

    # Ground truth over all pairs, from token-tuple sets (no hashing involved).
    similar, dissimilar = [], []
    sets = [set(shingle_tokens(text, SHINGLE_SIZE)) for text in texts]
    for i, j in combinations(range(len(texts)), 2):
        if texts[i] == texts[j]:
            continue
        similarity = tuple_set_jaccard(sets[i], sets[j])
        if similarity >= 0.9:
            similar.append((i, j))
        elif similarity < 0.7:
            dissimilar.append((i, j))
    assert len(similar) >= 30, "the planted close variants should give many pairs above 0.9"

    representative = kept_text_of_each_row(shards, result)
    merged = lambda i, j: representative[f"doc-{i}"] == representative[f"doc-{j}"]  # noqa: E731
    recall = sum(merged(i, j) for i, j in similar) / len(similar)
    assert recall >= 0.95, f"recall on pairs with Jaccard >= 0.9 is {recall:.3f}"
    wrongly_merged = [(i, j) for i, j in dissimilar if merged(i, j)]
    assert wrongly_merged == [], f"pairs with Jaccard < 0.7 were merged: {wrongly_merged[:5]}"
    for i, j in planted_corpus["far_pairs"]:
        assert true_jaccard(texts[i], texts[j]) < config.jaccard_threshold
        assert not merged(i, j)

    # Every recorded fuzzy Jaccard is the exact one between dropped and kept text.
    text_by_source_id = {f"doc-{i}": text for i, text in enumerate(texts)}
    fuzzy = result.duplicates.filter(pl.col("reason") == "fuzzy")
    assert len(fuzzy) >= 50
    for row in fuzzy.iter_rows(named=True):
        expected = true_jaccard(text_by_source_id[row["dropped_source_id"]], text_by_source_id[row["kept_source_id"]])
        assert row["jaccard"] == pytest.approx(expected, abs=1e-12)
        assert row["jaccard"] >= config.jaccard_threshold
    exact = result.duplicates.filter(pl.col("reason") == "exact")
    assert len(exact) == 20 and exact["jaccard"].to_list() == [1.0] * 20
    assert (exact["dropped_id"] == exact["kept_id"]).all()
    assert result.stats["kept_docs"] + len(result.duplicates) == len(texts)
    assert result.duplicates.schema == pl.Schema(DUPLICATES_SCHEMA)


def test_verification_rejects_lsh_false_positives(planted_corpus):
    # A loose LSH (threshold ~0.42) proposes the far variants; exact Jaccard must reject them all.
    texts = planted_corpus["texts"]
    config = DedupConfig(bands=32, rows=4)
    assert lsh_threshold(32, 4) < 0.45
    result = dedup_source(make_shards(texts, 2, config.minhash), config)
    assert result.stats["rejected_pairs"] > 0
    assert result.stats["lsh_candidate_pairs"] == result.stats["rejected_pairs"] + result.stats["verified_pairs"]
    dropped = set(result.duplicates.filter(pl.col("reason") == "fuzzy")["dropped_source_id"])
    for i, j in planted_corpus["far_pairs"]:
        assert f"doc-{i}" not in dropped and f"doc-{j}" not in dropped
    assert result.duplicates.filter(pl.col("reason") == "fuzzy")["jaccard"].min() >= config.jaccard_threshold


def test_result_does_not_depend_on_shard_order(planted_corpus):
    config = DedupConfig()
    shards = make_shards(planted_corpus["texts"], 4, config.minhash)
    forward = dedup_source(shards, config)
    shuffled = list(shards)
    random.Random(7).shuffle(shuffled)
    backward = dedup_source(list(reversed(shards)), config)
    for other in (dedup_source(shuffled, config), backward):
        assert other.kept.equals(forward.kept)
        assert other.duplicates.equals(forward.duplicates)
        timings = {key for key in forward.stats if key.startswith("seconds_")}
        assert {k: v for k, v in other.stats.items() if k not in timings} == \
            {k: v for k, v in forward.stats.items() if k not in timings}


def test_incremental_shard_reuses_cached_signatures(planted_corpus, tmp_path, monkeypatch):
    config = DedupConfig()
    # Cached shards hold the base documents; the new shard brings all planted variants.
    texts = planted_corpus["texts"]
    split = planted_corpus["num_bases"]
    old_texts, new_texts = texts[:split], texts[split:]
    old_shards = make_shards(old_texts, 3, config.minhash)
    for shard in old_shards:
        save_signatures(shard.signatures, tmp_path / f"{shard.shard_key}.parquet")

    hashed_docs = []
    original = minhash.minhash_texts
    monkeypatch.setattr(minhash, "minhash_texts", lambda t, c: hashed_docs.append(len(t)) or original(t, c))
    new_docs = frame(new_texts, [f"doc-{i}" for i in range(split, len(texts))])
    incremental = [
        Shard(shard.shard_key, shard.docs, load_signatures(tmp_path / f"{shard.shard_key}.parquet", config.minhash))
        for shard in old_shards
    ] + [Shard("shard-100", new_docs, compute_signatures(new_docs, config.minhash))]
    assert hashed_docs == [len(new_texts)], "only the new shard's documents are hashed"
    monkeypatch.undo()

    recomputed = [
        Shard(shard.shard_key, shard.docs, compute_signatures(shard.docs, config.minhash)) for shard in incremental
    ]
    from_cache = dedup_source(incremental, config)
    from_scratch = dedup_source(recomputed, config)
    assert from_cache.kept.equals(from_scratch.kept)
    assert from_cache.duplicates.equals(from_scratch.duplicates)
    # Duplicates between the new shard and the cached ones are found (either side may be kept).
    duplicates = from_cache.duplicates
    across = (duplicates["dropped_shard"] == "shard-100") != (duplicates["kept_shard"] == "shard-100")
    assert across.sum() >= 75  # 60 close variants and 20 exact copies were planted


def test_exact_duplicates_keep_first_by_shard_key_then_row():
    config = DedupConfig(fuzzy=False)
    text = "one two three four five six seven eight"
    first = frame(["unrelated words here", text, text], ["a0", "a1", "a2"])
    second = frame([text], ["b0"])
    shards = [
        Shard("2024-02", second, compute_signatures(second, config.minhash)),
        Shard("2024-01", first, compute_signatures(first, config.minhash)),
    ]
    result = dedup_source(shards, config)
    assert result.kept["source_id"].to_list() == ["a0", "a1"]
    assert result.kept["shard_key"].to_list() == ["2024-01", "2024-01"]
    assert result.duplicates.select("dropped_shard", "dropped_source_id", "kept_source_id", "reason").rows() == [
        ("2024-01", "a2", "a1", "exact"),
        ("2024-02", "b0", "a1", "exact"),
    ]
    assert result.stats["exact_duplicates"] == 2 and result.stats["fuzzy_duplicates"] == 0


def test_fuzzy_keeps_first_seen_and_redirects_exact_copies_of_dropped_documents():
    config = DedupConfig()
    words = [f"w{i}" for i in range(200)]
    longest = " ".join(words + ["extra", "tail"])
    shorter = " ".join(words)
    docs = frame([shorter, longest, longest], ["s0", "s1", "s2"])
    result = dedup_source([Shard("k", docs, compute_signatures(docs, config.minhash))], config)
    # First seen wins even though a later copy is longer: earlier decisions never depend on later shards.
    assert result.kept["source_id"].to_list() == ["s0"]
    rows = result.duplicates.select("dropped_source_id", "kept_source_id", "reason").rows()
    # s2 is an exact copy of s1, but s1 itself was dropped: both point at the kept s0.
    assert rows == [("s1", "s0", "fuzzy"), ("s2", "s0", "fuzzy")]
    assert result.duplicates["jaccard"].to_list() == [pytest.approx(true_jaccard(shorter, longest))] * 2


def test_centre_assignment_never_drops_through_a_chain():
    # A ~ B and B ~ C pass the threshold, A ~ C does not. Connected components would drop one end
    # in favour of the other (or of B); centres keep A, drop B to A, and keep C.
    config = DedupConfig(bands=32, rows=4)  # loose LSH: every pair here is proposed
    words = [f"w{i}" for i in range(200)]
    a = list(words)
    b = list(a)
    for position in (20, 60, 100, 140):
        b[position] = f"b{position}"
    c = list(b)
    for position in (40, 80, 120, 160):
        c[position] = f"c{position}"
    texts = [" ".join(a), " ".join(b), " ".join(c)]
    assert true_jaccard(texts[0], texts[1]) >= 0.8 and true_jaccard(texts[1], texts[2]) >= 0.8
    assert true_jaccard(texts[0], texts[2]) < 0.8
    docs = frame(texts, ["a", "b", "c"])
    result = dedup_source([Shard("k", docs, compute_signatures(docs, config.minhash))], config)
    assert result.kept["source_id"].to_list() == ["a", "c"]
    assert result.duplicates.select("dropped_source_id", "kept_source_id").rows() == [("b", "a")]
    assert result.stats["rejected_pairs"] >= 1  # c was checked against the centre a and rejected
    assert result.stats["dropped_below_threshold_via_chain"] == 0


def test_short_and_tokenless_documents():
    config = DedupConfig()
    texts = ["Hello, world!", "hello world", "hello there", "!!!", "...", ""]
    docs = frame(texts, [f"d{i}" for i in range(len(texts))])
    result = dedup_source([Shard("k", docs, compute_signatures(docs, config.minhash))], config)
    # Fewer tokens than the shingle size: one shingle of all tokens, so only identical token
    # sequences match; documents without tokens are never fuzzy duplicates of each other.
    assert result.kept["source_id"].to_list() == ["d0", "d2", "d3", "d4", "d5"]
    assert result.duplicates.select("dropped_source_id", "kept_source_id", "jaccard", "reason").rows() == [
        ("d1", "d0", 1.0, "fuzzy")
    ]
    assert result.stats["docs_without_tokens"] == 3


def test_empty_inputs():
    config = DedupConfig()
    empty = frame([], [])
    result = dedup_source([Shard("k", empty, compute_signatures(empty, config.minhash))], config)
    assert len(result.kept) == 0 and "shard_key" in result.kept.columns
    assert len(result.duplicates) == 0 and result.stats["input_docs"] == 0
    result = dedup_source([], config)
    assert len(result.kept) == 0 and len(result.duplicates) == 0


def test_bad_inputs_are_rejected():
    config = DedupConfig()
    docs = frame(["a b c", "d e f"], ["x", "y"])
    signatures = compute_signatures(docs, config.minhash)
    with pytest.raises(ValueError, match="not row-aligned"):
        dedup_source([Shard("k", docs.reverse(), signatures)], config)
    with pytest.raises(ValueError, match="signatures were computed with"):
        other = compute_signatures(docs, MinHashConfig(seed=2))
        dedup_source([Shard("k", docs, other)], config)
    with pytest.raises(ValueError, match="shard keys must be unique"):
        dedup_source([Shard("k", docs, signatures), Shard("k", docs, signatures)], config)
    with pytest.raises(ValueError, match="lacks columns"):
        dedup_source([Shard("k", docs.drop("metadata"), signatures)], config)
    forged = docs.with_columns(pl.Series("id", [docs["id"][0], docs["id"][0]]))
    with pytest.raises(ValueError, match="share an id with a different text"):
        dedup_source([Shard("k", forged, compute_signatures(forged, config.minhash))], config)
    not_hex = docs.with_columns(pl.Series("id", ["not a hash", docs["id"][1]]))
    with pytest.raises(ValueError, match="not a hex sha256"):
        dedup_source([Shard("k", not_hex, compute_signatures(not_hex, config.minhash))], config)
    with pytest.raises(ValueError, match="exceeds num_perm"):
        DedupConfig(bands=20, rows=10)


def test_default_lsh_parameters_target_the_verification_threshold():
    config = DedupConfig()
    assert 0.75 <= lsh_threshold(config.bands, config.rows) <= 0.8
    assert candidate_probability(0.9, config.bands, config.rows) > 0.99
    assert candidate_probability(0.5, config.bands, config.rows) < 0.02
    assert np.isclose(candidate_probability(lsh_threshold(12, 10), 12, 10), 1 - (1 - 1 / 12) ** 12)


def test_large_cluster_is_verified_against_centres_only(planted_corpus):
    # 150 variants of one document, each with one different word substituted: every pair is a
    # near-duplicate (Jaccard about 0.87). Only centres are candidates, so verification is linear
    # in the cluster, not quadratic, and every drop is verified against its kept document.
    rng = random.Random(5)
    base = planted_corpus["texts"][0]
    words = base.split()
    variants = set()
    while len(variants) < 150:
        position = rng.randrange(len(words))
        variants.add(" ".join(words[:position] + [f"variant{len(variants)}"] + words[position + 1 :]))
    config = DedupConfig()
    docs = frame(sorted(variants), [f"v{i}" for i in range(len(variants))])
    result = dedup_source([Shard("k", docs, compute_signatures(docs, config.minhash))], config)
    assert len(result.kept) <= 3  # a variant whose pair with the first centre LSH missed becomes one
    assert result.stats["verified_pairs"] == len(variants) - len(result.kept)
    assert result.stats["lsh_candidate_pairs"] <= 3 * len(variants)
    assert result.duplicates["jaccard"].min() >= config.jaccard_threshold


# ---------------------------------------------------------------------------------------------
# The incremental, partitioned index
# ---------------------------------------------------------------------------------------------


def shard_inputs(shards: list[Shard], versions: dict[str, str] | None = None) -> list[ShardInput]:
    return [
        ShardInput(shard.source, shard.shard_key, (versions or {}).get(shard.shard_key, "v"),
                   lambda docs=shard.docs: docs, lambda sigs=shard.signatures: sigs)
        for shard in shards
    ]


def file_hashes(index: IndexDir) -> dict[str, str]:
    return {rel: hashlib.sha256(index.read_bytes(rel)).hexdigest() for rel in index.files()}


def test_new_shard_leaves_earlier_decisions_and_files_byte_identical(planted_corpus, tmp_path):
    config = DedupConfig()
    texts = planted_corpus["texts"]
    split = planted_corpus["num_bases"]
    old_shards = make_shards(texts[:split], 3, config.minhash)
    index = IndexDir.local(tmp_path / "index")
    first = update_index(index, shard_inputs(old_shards), config)
    assert [shard.seq for shard in first.new_shards] == [0, 1, 2]
    before = file_hashes(index)

    # The new shard's key sorts first, and its variants are longer or equal: it is still seen last.
    new_docs = frame(texts[split:], [f"doc-{i}" for i in range(split, len(texts))])
    new_shard = Shard("shard-000-early-name", new_docs, compute_signatures(new_docs, config.minhash))
    second = update_index(index, shard_inputs([*old_shards, new_shard]), config)
    after = file_hashes(index)
    assert {rel: after[rel] for rel in before} == before, "files of earlier shards changed"
    assert sorted(set(after) - set(before)) == [
        decision_path(3), *(f"keys/p{p:04d}/000001.{kind}" for p in range(config.index_partitions)
                            for kind in ("filter.npy", "parquet")),
        "registry/000001.json"]
    assert [(shard.seq, shard.shard_key) for shard in second.new_shards] == [(3, "shard-000-early-name")]

    decisions = index.read_parquet(decision_path(3))
    # Every planted copy and close variant in the new shard is dropped in favour of an old document.
    assert len(decisions) >= 75 and set(decisions["kept_shard"]) <= {s.shard_key for s in old_shards}
    assert decisions["jaccard"].min() >= config.jaccard_threshold
    assert second.stats["input_docs"] == len(new_docs) and second.stats["dropped_below_threshold_via_chain"] == 0
    # Same decisions as deciding everything at once with the new shard ordered last.
    renamed = Shard("shard-999", new_docs, new_shard.signatures)
    at_once = dedup_source([*old_shards, renamed], config)
    expected = at_once.duplicates.filter(pl.col("dropped_shard") == "shard-999")
    assert decisions.drop("dropped_row", "dropped_shard").equals(expected.drop("dropped_shard"))
    assert read_registry(index)[3].kept == len(new_docs) - len(decisions)

    # Nothing new: nothing changes.
    third = update_index(index, shard_inputs([*old_shards, new_shard]), config)
    assert third.new_shards == [] and file_hashes(index) == after


def test_batching_does_not_change_decisions(planted_corpus):
    config = DedupConfig()
    shards = make_shards(planted_corpus["texts"], 5, config.minhash)
    one_by_one = dedup_source(shards, config, batch_shards=1)
    all_at_once = dedup_source(shards, config, batch_shards=8)
    assert one_by_one.kept.equals(all_at_once.kept)
    assert one_by_one.duplicates.equals(all_at_once.duplicates)


def test_candidate_step_holds_one_bucket_range_at_a_time(planted_corpus, tmp_path, monkeypatch):
    config = DedupConfig(index_partitions=4)
    shards = make_shards(planted_corpus["texts"], 4, config.minhash)
    index = IndexDir.local(tmp_path / "index")
    update_index(index, shard_inputs(shards[:2]), config)
    runs = [rel for rel in index.files("keys") if rel.endswith(".parquet")]  # not their bucket filters
    for rel in runs:
        partition = int(rel.split("/")[1][1:])
        buckets = index.read_parquet(rel)["bucket"].to_numpy()
        assert set(key_partition(buckets, config.index_partitions).tolist()) <= {partition}, rel

    calls = []
    original = dedup_passes.partition_collisions

    def spy(old_runs, new_keys):
        loaded = [run(np.unique(new_keys["bucket"].to_numpy())) for run in old_runs]
        seen = {int(p) for frame in [new_keys, *loaded]
                for p in key_partition(frame["bucket"].to_numpy(), config.index_partitions)}
        calls.append((seen, len(loaded)))
        return original([lambda buckets, frame=frame: frame for frame in loaded], new_keys)

    monkeypatch.setattr(dedup_passes, "partition_collisions", spy)
    update = update_index(index, shard_inputs(shards), config, batch_shards=1)
    # Two batches (one new shard each), each four passes: one bucket range per pass, over that
    # range's runs only (one per earlier batch).
    assert len(calls) == 2 * config.index_partitions
    assert all(len(seen) == 1 for seen, _ in calls)
    assert [runs for _, runs in calls] == [1] * 4 + [2] * 4
    total_keys = sum(len(index.read_parquet(rel)) for rel in index.files("keys") if rel.endswith(".parquet"))
    assert update.stats["max_partition_keys"] < total_keys / 2


def _spawned_pool_map(fn, items, shared):
    """Each partition's pass in one of two spawned worker processes (they import `partition_pass`
    by name and read the index from disk, as Ray's workers do), finishing in any order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(fn, items, [shared] * len(items)))


def stored_shard_inputs(shards: list[Shard], folder) -> list[ShardInput]:
    """The shards written to disk, with loaders a worker process can be sent (no closures)."""
    import functools

    inputs = []
    for shard in shards:
        docs, signatures = folder / f"{shard.shard_key}.parquet", folder / f"{shard.shard_key}.signatures.parquet"
        shard.docs.write_parquet(docs)
        save_signatures(shard.signatures, signatures)
        inputs.append(ShardInput(shard.source, shard.shard_key, "v", functools.partial(pl.read_parquet, docs),
                                 functools.partial(load_signatures, str(signatures)), documents=len(shard.docs)))
    return inputs


@pytest.mark.slow  # the index built serially and fanned out over processes
def test_keys_and_partition_passes_fanned_out_give_the_same_index_and_decisions(planted_corpus, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setattr(dedup, "CENTRE_UNIT_DOCS", 8)  # many small centre units, each whole components
    config = DedupConfig(index_partitions=4)
    shards = make_shards(planted_corpus["texts"], 4, config.minhash)
    inputs = stored_shard_inputs(shards, tmp_path)
    serial, fanned = IndexDir.local(tmp_path / "serial"), IndexDir.local(tmp_path / "fanned")
    mapped = []

    def unit(item):  # a bucket range, a new shard's sequence number, or a centre unit's shards
        return item if isinstance(item, int) else item[0] if isinstance(item[0], int) else sorted(item.shards)

    def recording_map(fn, items, shared):
        mapped.append((fn.__name__, [unit(item) for item in items]))
        return _spawned_pool_map(fn, items, shared)

    # Two shards, then two more in batches of one: later passes read the committed runs.
    for index, parallel_map in ((serial, dedup.in_process_map), (fanned, recording_map)):
        first = update_index(index, inputs[:2], config, parallel_map=parallel_map)
        written = file_hashes(index)
        later = update_index(index, inputs, config, batch_shards=1, parallel_map=parallel_map)
        assert later.stats["index_row_groups_read"] > 0 and first.stats["colliding_keys"] > 0
        # Each update names every file it wrote, hashed from the bytes written, units' runs included.
        stored = file_hashes(index)
        for update, files in ((first, written), (later, {rel: stored[rel] for rel in set(stored) - set(written)})):
            assert {rel: sha for rel, (_, sha) in update.files_written.items()} == files
    # Per batch: one unit per new shard (by its sequence number), one per bucket range, centre units
    # of whole collision components (several, as the units are shrunk), one run write per range.
    ranges = [0, 1, 2, 3]
    assert [(name, units if name != "assign_centres" else None) for name, units in mapped] == [
        ("shard_keys_pass", [0, 1]), ("partition_pass", ranges), ("assign_centres", None),
        ("partition_commit_pass", ranges),
        ("shard_keys_pass", [2]), ("partition_pass", ranges), ("assign_centres", None),
        ("partition_commit_pass", ranges),
        ("shard_keys_pass", [3]), ("partition_pass", ranges), ("assign_centres", None),
        ("partition_commit_pass", ranges)]
    centre_calls = [units for name, units in mapped if name == "assign_centres"]
    assert all(len(units) >= 3 for units in centre_calls), centre_calls
    assert any(2 in shards and min(shards) < 2 for shards in centre_calls[1])  # reads an earlier shard's rows
    hashes = file_hashes(fanned)
    assert hashes == file_hashes(serial)  # decisions, key runs, registry: byte for byte
    assert not fanned.files("pending")  # the spilled keys go once their batch is committed
    duplicates = pl.concat(fanned.read_parquet(rel) for rel in fanned.files("decisions"))
    assert len(duplicates) >= 75
    # A batch below the threshold is not worth a worker: its units run in the index's process.
    mapped.clear()
    update_index(IndexDir.local(tmp_path / "small"), inputs, config, parallel_map=recording_map,
                 worth_spreading=lambda nbytes: nbytes > 10**9)
    assert mapped == []


def test_spilled_keys_of_an_uncommitted_batch_are_removed(planted_corpus, tmp_path):
    config = DedupConfig(index_partitions=4)
    shards = make_shards(planted_corpus["texts"], 3, config.minhash)
    index = IndexDir.local(tmp_path / "index")
    update_index(index, shard_inputs(shards[:2]), config)
    index.write_bytes("pending/p0002/000002.parquet", b"a killed batch's keys")
    redo = update_index(index, shard_inputs(shards), config)
    assert [s.seq for s in redo.new_shards] == [2] and not index.files("pending")


def test_a_small_new_shard_reads_only_the_row_groups_it_needs(planted_corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(dedup_passes, "RUN_ROW_GROUP_KEYS", 16)
    config = DedupConfig()
    texts = planted_corpus["texts"]
    old_shards = make_shards(texts[:150], 3, config.minhash)
    index = IndexDir.local(tmp_path / "index")
    update_index(index, shard_inputs(old_shards), config)
    # Two new documents: a close variant of base 0 and an exact copy of base 119, both in the index.
    new_docs = frame([texts[planted_corpus["num_bases"]], texts[-1]], ["new-0", "new-1"])
    new_shard = Shard("shard-new", new_docs, compute_signatures(new_docs, config.minhash))
    update = update_index(index, shard_inputs([*old_shards, new_shard]), config)
    # At most one row group per new key (2 documents x 13 keys), out of about a hundred.
    assert update.stats["index_row_groups_read"] <= 2 * (config.bands + 1)
    assert update.stats["index_row_groups"] > 3 * update.stats["index_row_groups_read"]
    decisions = index.read_parquet(decision_path(3))
    assert decisions["reason"].to_list() == ["fuzzy", "exact"]
    at_once = dedup_source([*old_shards, Shard("shard-zzz", new_docs, new_shard.signatures)], config)
    expected = at_once.duplicates.filter(pl.col("dropped_shard") == "shard-zzz")
    assert decisions.drop("dropped_row", "dropped_shard").equals(expected.drop("dropped_shard"))


def test_a_new_shard_that_collides_with_nothing_reads_next_to_no_row_group(planted_corpus, tmp_path, monkeypatch):
    # Bucket hashes are uniform, so new keys fall in the min/max range of most row groups; the run's
    # bucket filters leave out the groups none of them is in. Without filters (an index written
    # before them), or with more new buckets a group than they are worth, the same update reads
    # by the statistics alone and decides the same.
    monkeypatch.setattr(dedup_passes, "RUN_ROW_GROUP_KEYS", 16)
    config = DedupConfig(index_partitions=4)
    texts = planted_corpus["texts"]
    assert planted_corpus["num_bases"] >= 160  # bases 150..159 have no variant and are not indexed
    old_shards = make_shards(texts[:150], 3, config.minhash)
    new_docs = frame(texts[150:160], [f"fresh-{i}" for i in range(10)])
    shards = [*old_shards, Shard("shard-new", new_docs, compute_signatures(new_docs, config.minhash))]
    updates, indexes = {}, {}
    for name in ("filtered", "no filter files", "too many keys a group"):
        index = indexes[name] = IndexDir.local(tmp_path / name.replace(" ", "-"))
        update_index(index, shard_inputs(old_shards), config)
        filters = index.files("keys")
        assert sum(rel.endswith(".filter.npy") for rel in filters) == 4 == len(filters) // 2
        if name == "no filter files":
            for rel in filters:
                if rel.endswith(".filter.npy"):
                    index.remove(rel)
        with monkeypatch.context() as patch:
            if name == "too many keys a group":
                patch.setattr(dedup_passes, "FILTER_KEYS_PER_GROUP", 0.01)
            updates[name] = update_index(index, shard_inputs(shards), config)
    with_filters = updates["filtered"].stats
    for name in ("no filter files", "too many keys a group"):
        without = updates[name].stats
        assert with_filters["index_row_groups"] == without["index_row_groups"] > 100
        assert without["index_row_groups_read"] > 50
        assert with_filters["index_row_groups_read"] <= 0.1 * without["index_row_groups_read"]
        assert with_filters["index_filter_bytes"] > 0 == without["index_filter_bytes"]
        assert with_filters["colliding_keys"] == without["colliding_keys"]
        assert without["exact_duplicates"] + without["fuzzy_duplicates"] == 0
        assert all(indexes["filtered"].read_bytes(rel) == indexes[name].read_bytes(rel)
                   for rel in indexes["filtered"].files("keys") if "/000001." in rel)
    assert with_filters["exact_duplicates"] + with_filters["fuzzy_duplicates"] == 0


def test_cross_source_group_keeps_the_first_seen_copy():
    config = DedupConfig()
    shared = "The same licence text appears in two sources with a few words more here and there " * 6
    web = frame([shared, "only in web " * 20], ["w0", "w1"]).with_columns(pl.lit("web").alias("source"))
    books = frame([shared, "only in books " * 20], ["b0", "b1"]).with_columns(pl.lit("books").alias("source"))
    shards = [
        Shard("2024-02", web, compute_signatures(web, config.minhash), "web"),
        Shard("2024-01", books, compute_signatures(books, config.minhash), "books"),
    ]
    result = dedup_source(shards, config)
    assert result.duplicates.select("dropped_source", "dropped_source_id", "kept_source", "kept_source_id",
                                     "reason").rows() == [("web", "w0", "books", "b0", "exact")]
    assert sorted(result.kept["source_id"]) == ["b0", "b1", "w1"]
    # The same shard key in two sources is two shards.
    same_key = [Shard("k", web, shards[0].signatures, "web"), Shard("k", books, shards[1].signatures, "books")]
    assert len(dedup_source(same_key, config).duplicates) == 1


def test_index_starts_over_when_its_inputs_change_and_drops_uncommitted_batches(planted_corpus, tmp_path):
    config = DedupConfig()
    shards = make_shards(planted_corpus["texts"], 3, config.minhash)
    index = IndexDir.local(tmp_path / "index")
    update_index(index, shard_inputs(shards[:2]), config)
    committed = file_hashes(index)
    # A run killed before its registry entry left a batch's files: they do not count and are redone.
    index.write_bytes(decision_path(2), b"partial")
    index.write_bytes("keys/p0003/000001.parquet", b"partial")
    redo = update_index(index, shard_inputs(shards), config)
    assert redo.reset_reason is None and [s.seq for s in redo.new_shards] == [2]
    assert index.read_parquet(decision_path(2)).schema == pl.Schema(DECISION_SCHEMA)
    assert {rel: h for rel, h in file_hashes(index).items() if rel in committed} == committed

    changed = update_index(index, shard_inputs(shards, versions={shards[0].shard_key: "v2"}), config)
    assert "changed" in changed.reset_reason and len(changed.new_shards) == 3
    other_config = DedupConfig(jaccard_threshold=0.9)
    assert "config" in update_index(index, shard_inputs(shards), other_config).reset_reason
    gone = update_index(index, shard_inputs(shards[1:]), other_config)
    assert "no longer an input" in gone.reset_reason and [s.seq for s in gone.new_shards] == [0, 1]


def test_band_buckets_propose_exactly_the_pairs_datasketch_lsh_proposes(planted_corpus):
    from datasketch import LeanMinHash, MinHashLSH

    config = DedupConfig(bands=32, rows=4)  # loose, so there are many pairs to compare
    docs = frame(planted_corpus["texts"], [str(i) for i in range(len(planted_corpus["texts"]))])
    hashvalues = compute_signatures(docs, config.minhash).hashvalues
    buckets = minhash.band_hashes(hashvalues, config.bands, config.rows)
    ours = set()
    for band in range(config.bands):
        by_bucket: dict[int, list[int]] = {}
        for row, bucket in enumerate(buckets[:, band].tolist()):
            by_bucket.setdefault(bucket, []).append(row)
        ours.update(pair for rows in by_bucket.values() for pair in combinations(rows, 2))
    lsh = MinHashLSH(num_perm=config.minhash.num_perm, params=(config.bands, config.rows))
    sketches = [LeanMinHash(seed=config.minhash.seed, hashvalues=row, scheme="affine32") for row in hashvalues]
    for row, sketch in enumerate(sketches):
        lsh.insert(row, sketch, check_duplication=False)
    theirs = {(min(row, other), max(row, other)) for row, sketch in enumerate(sketches)
              for other in lsh.query(sketch) if other != row}
    assert len(theirs) > 100 and ours == theirs


def test_dedup_groups_from_the_sources_yaml(tmp_path):
    from marin_assets.curation.config import parse_curation_config
    from marin_assets.curation.refine import dedup_config_from, dedup_group_members, dedup_group_of

    def sources(*entries):
        return parse_curation_config({"sources": [{"uri": str(tmp_path / "*.txt"), "format": "text", **entry}
                                                  for entry in entries]}, tmp_path)

    config = sources({"name": "web", "dedup": {"group": "corpus", "jaccard_threshold": 0.85}},
                     {"name": "books", "dedup": {"group": "corpus", "jaccard_threshold": 0.85}},
                     {"name": "code"})
    web, books, code = config.sources
    assert [dedup_group_of(source) for source in config.sources] == ["corpus", "corpus", "code"]
    assert dedup_group_members(books, config) == [web, books]
    assert dedup_group_members(code, config) == [code]
    assert dedup_config_from(web).jaccard_threshold == 0.85  # `group` is not a DedupConfig field

    mixed = sources({"name": "web", "dedup": {"group": "corpus"}},
                    {"name": "books", "dedup": {"group": "corpus", "bands": 16, "rows": 8}})
    with pytest.raises(ValueError, match="differ in their dedup settings"):
        dedup_group_members(mixed.sources[0], mixed)
    # Naming a source's default group joins it; naming a source that is in another group is an error.
    joined = sources({"name": "web", "dedup": {"group": "books"}}, {"name": "books"})
    assert dedup_group_members(joined.sources[0], joined) == list(joined.sources)
    clash = sources({"name": "web", "dedup": {"group": "books"}}, {"name": "books", "dedup": {"group": "other"}})
    with pytest.raises(ValueError, match="has the name of source 'books'"):
        dedup_group_members(clash.sources[0], clash)
    with pytest.raises(ValueError, match="must be a non-empty string"):
        dedup_group_of(sources({"name": "web", "dedup": {"group": ""}}).sources[0])


def test_colliding_documents_of_earlier_shards_are_read_by_row_group(planted_corpus, tmp_path):
    """A new shard's collisions read the few row groups of earlier shards that hold them, and decide
    as reading the shards whole does."""
    config = DedupConfig()
    texts = planted_corpus["texts"]
    split = planted_corpus["num_bases"]
    old_shards = make_shards(texts[:split], 3, config.minhash)
    groups_read = []

    def by_row_group(shard: Shard) -> ShardInput:
        path = tmp_path / f"{shard.shard_key}.parquet"
        shard.docs.write_parquet(path, row_group_size=8)

        def load_rows(rows):
            import pyarrow.parquet as pq

            real = pq.ParquetFile.read_row_groups
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(pq.ParquetFile, "read_row_groups",
                              lambda self, groups, **kw: groups_read.append(len(groups)) or real(self, groups, **kw))
                return dedup.read_parquet_rows(str(path), rows)

        return ShardInput(shard.source, shard.shard_key, "v", lambda: shard.docs, lambda: shard.signatures,
                          load_rows=load_rows)

    new_docs = frame(texts[split:split + 40], [f"doc-{i}" for i in range(split, split + 40)])
    new_shard = Shard("shard-new", new_docs, compute_signatures(new_docs, config.minhash))
    decided = {}
    for name, inputs in (("whole", shard_inputs), ("rows", lambda shards: [by_row_group(s) for s in shards])):
        index = IndexDir.local(tmp_path / name)
        update_index(index, inputs(old_shards), config)
        update_index(index, inputs([*old_shards, new_shard]), config)
        decided[name] = index.read_parquet(decision_path(3))
    assert len(decided["rows"]) >= 20 and decided["rows"].equals(decided["whole"])
    old_groups = sum(-(-len(s.docs) // 8) for s in old_shards)
    assert 0 < sum(groups_read) < old_groups / 2

    # Rows come back in the order asked, from any row groups; a row past the end is an error.
    path = tmp_path / f"{old_shards[0].shard_key}.parquet"
    wanted = [17, 3, 16, 0]
    assert dedup.read_parquet_rows(str(path), wanted).equals(
        old_shards[0].docs.select("id", "text", "source_id")[wanted])
    with pytest.raises(IndexError):
        dedup.read_parquet_rows(str(path), [len(old_shards[0].docs)])
