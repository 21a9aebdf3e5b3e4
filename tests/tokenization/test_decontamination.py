"""Decontamination (issue #32 item 5): `eval_ngrams` and `decontaminated/<source>`.

Planted contamination (whole and partial copies of validation documents and of eval-set items inside
training shards) is all found; clean text loses nothing; a shared 12-gram is not a 13-gram match;
validation documents are never dropped; `mode: mark` keeps the shard as it is; a new eval set makes
the index and every decontaminated shard stale; two fresh builds give the same data versions; a
missing or damaged eval set is refused in one line, before anything is committed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marin_assets.catalog import Catalog
from marin_assets.planning import Planner
from marin_assets.tokenization.cache import iter_split_documents
from marin_assets.tokenization.cache_config import CacheConfig, with_validation_minimum
from marin_assets.tokenization.decontamination import (
    CONTAMINATED,
    EvalSetError,
    SplitNgramsJob,
    decontaminate,
    eval_set,
    eval_set_texts,
    merged_index,
    split_ngrams,
    validation_threshold_of,
)
from marin_assets.tokenization.decontamination_assets import build_decontamination_assets, eval_ngrams_identity
from marin_assets.tokenization.ngrams import NgramHasher, build_index, normalized_words, overlap
from marin_assets.tokenization.registry import (
    DecontaminationPolicy,
    DecontaminationSettings,
    MixtureEntry,
    TokenizationRegistry,
    TokenizedEntry,
    TokenizerEntry,
    load_registry,
)
from marin_assets.tokenization.tokenizer import TokenizerConfig
from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import VERSION_METADATA_KEY
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.keys import asset_key
from marin_resources.splits import corpus_threshold, is_validation_document
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore

SOURCE = "letters"
N = 13
CACHE = CacheConfig(validation_fraction=0.2)
FRACTION = CACHE.validation_fraction


def _vocabulary(rng: random.Random, size: int = 20_000) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return sorted({"".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(size)})


def _clean_documents(count: int, seed: int = 0) -> list[str]:
    """Prose-like documents of words drawn from a 20,000-word vocabulary: two of them share a
    13-gram with negligible probability, so any match is a planted one."""
    rng = random.Random(seed)
    words = _vocabulary(rng)
    docs = []
    for _ in range(count):
        sentences = []
        for _ in range(rng.randint(8, 40)):
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 20)))
            sentences.append(sentence.capitalize() + rng.choice([".", "!", "?", ";"]))
        docs.append(" ".join(sentences))
    return docs


def _doc_id(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def _table(texts: list[str]) -> pa.Table:
    return pa.table({"id": [_doc_id(t) for t in texts], "text": texts, "source": ["t"] * len(texts),
                     "source_id": [str(i) for i in range(len(texts))], "metadata": ["{}"] * len(texts)})


def _disguised(text: str) -> str:
    """The same words as another casing, punctuation and line breaking would give them."""
    return "\n".join(w.upper() + ("," if i % 5 == 0 else "") for i, w in enumerate(text.split()))


# ---- pure -------------------------------------------------------------------------------------------


def test_normalization_ignores_case_punctuation_and_line_breaks():
    assert normalized_words("Hello, World!\n  It's-here_now.") == ["hello", "world", "itsherenow"]
    hasher = NgramHasher(3)
    assert np.array_equal(hasher.of("The cat, sat ON the mat!"), hasher.of("the CAT sat\non the mat"))
    assert hasher.of("too short").size == 0


def test_ngrams_never_cross_a_document_boundary():
    hasher = NgramHasher(3)
    grams, doc_of = hasher.batch(["a b c", "d e", "f g h i"])
    assert doc_of.tolist() == [0, 2, 2]
    assert np.array_equal(grams, np.concatenate([hasher.of("a b c"), hasher.of("f g h i")]))


def test_the_split_is_the_token_caches_own():
    ids = [_doc_id(t) for t in _clean_documents(200, seed=3)]
    cfg = CacheConfig(validation_fraction=0.001, validation_min_documents=10)
    raised = with_validation_minimum(cfg, ids)
    assert corpus_threshold(cfg.validation_fraction, cfg.validation_min_documents, ids) \
        == raised.validation_fraction > cfg.validation_fraction
    assert sum(is_validation_document(i, raised.validation_fraction) for i in ids) == 10


def test_an_index_built_in_units_is_the_index_built_at_once(tmp_path):
    """eval_ngrams/<source> hashes chunks of corpus files as separate units (maybe on other workers):
    merged, they give the same sorted array as hashing the whole validation split in one pass."""
    cfg = CacheConfig(validation_fraction=0.3)
    files = []
    for i in range(5):
        path = tmp_path / f"shard-{i}.parquet"
        pq.write_table(_table(_clean_documents(40, seed=10 + i)), path)
        files.append(str(path))
    at_once = build_index(NgramHasher(13), (text for _, text in iter_split_documents(files, cfg, "validation")))
    job = SplitNgramsJob(cfg, cfg.validation_fraction, 13)
    units = [split_ngrams(chunk, job) for chunk in (files[:1], files[1:4], files[4:], [])]
    merged = merged_index(unit.hashes for unit in units)
    assert at_once.size > 1000 and merged.dtype == np.uint64
    assert np.array_equal(merged, at_once)
    assert sum(u.documents for u in units) == sum(1 for _ in iter_split_documents(files, cfg, "validation"))
    assert sum(u.corpus_documents for u in units) == 200
    assert units[-1].documents == 0 and units[-1].hashes.size == 0


@pytest.fixture(scope="module")
def planted():
    """A shard's documents: clean ones, validation documents, and training documents with planted
    copies of validation documents and of eval-set items; the index over the validation split and
    the eval set."""
    clean = _clean_documents(400)
    validation = [t for t in clean if is_validation_document(_doc_id(t), FRACTION)]
    training = [t for t in clean if not is_validation_document(_doc_id(t), FRACTION)]
    items = [" ".join(t.split()[5:25]) for t in _clean_documents(20, seed=7)]  # eval-set items, 20 words each
    filler = _clean_documents(60, seed=11)
    rng = random.Random(1)
    contaminated = []
    for i, source in enumerate(validation[:20]):
        words = source.split()
        if i % 3 == 0:  # a whole copy, disguised
            text = _disguised(source)
        elif i % 3 == 1:  # a partial copy: 13 consecutive words inside other text
            start = rng.randrange(0, len(words) - N)
            text = filler[i] + " " + " ".join(words[start:start + N]) + " " + filler[i + 20]
        else:  # half of it, at the end of a long training document
            text = filler[i] + " " + " ".join(words[len(words) // 2:])
        contaminated.append(text)
    for i, item in enumerate(items):  # a task item inside a training document
        contaminated.append(filler[40 + i] + " " + item + " " + filler[i])
    contaminated = [t for t in contaminated if not is_validation_document(_doc_id(t), FRACTION)]
    hasher = NgramHasher(N)
    index = build_index(hasher, validation + items)
    return {"training": training, "validation": validation, "contaminated": contaminated, "items": items,
            "index": index, "hasher": hasher}


def test_planted_contamination_is_all_found_and_clean_text_is_kept(planted):
    texts = planted["training"] + planted["validation"] + planted["contaminated"]
    result = decontaminate(_table(texts), planted["index"], planted["hasher"], FRACTION, DecontaminationPolicy(),
                           CACHE)
    dropped = set(result.contaminated_rows.column("id").to_pylist())
    planted_ids = {_doc_id(t) for t in planted["contaminated"]}
    assert len(planted_ids) >= 30
    assert dropped == planted_ids  # recall 1.0, and no clean training document dropped
    assert set(result.contaminated_rows.column("reason").to_pylist()) == {CONTAMINATED}
    kept = set(result.kept.column("id").to_pylist())
    assert kept == {_doc_id(t) for t in planted["training"] + planted["validation"]}
    assert result.validation_documents == len(planted["validation"]) > 0  # never dropped, though all match
    assert result.kept.schema == _table(texts).schema


def test_a_shared_12_gram_is_not_a_13_gram_match(planted):
    source = planted["validation"][0].split()
    filler = _clean_documents(2, seed=99)
    shares_12 = filler[0] + " " + " ".join(source[:12]) + " " + filler[1]
    shares_13 = filler[0] + " " + " ".join(source[:13]) + " " + filler[1]
    found = overlap(planted["hasher"], planted["index"], [shares_12, shares_13]).matching
    assert found.tolist() == [0, 1]


def test_the_threshold_counts_distinct_eval_ngrams(planted):
    words = planted["validation"][1].split()
    text = "x y " + " ".join(words[:N + 1])  # two eval 13-grams, the first one twice
    text = text + " z " + " ".join(words[:N])
    assert overlap(planted["hasher"], planted["index"], [text]).matching.tolist() == [2]
    table = _table([text])
    if is_validation_document(_doc_id(text), FRACTION):
        pytest.skip("the text landed in validation")
    keep = decontaminate(table, planted["index"], planted["hasher"], FRACTION,
                         DecontaminationPolicy(min_matching_ngrams=3), CACHE)
    drop = decontaminate(table, planted["index"], planted["hasher"], FRACTION,
                         DecontaminationPolicy(min_matching_ngrams=2), CACHE)
    assert (keep.kept.num_rows, drop.kept.num_rows) == (1, 0)


def test_mark_keeps_every_document_and_lists_the_contaminated(planted):
    texts = planted["training"][:50] + planted["contaminated"]
    table = _table(texts)
    result = decontaminate(table, planted["index"], planted["hasher"], FRACTION,
                           DecontaminationPolicy(mode="mark"), CACHE)
    assert result.kept.equals(table)
    assert set(result.contaminated_rows.column("id").to_pylist()) == {_doc_id(t) for t in planted["contaminated"]}


def test_a_missing_or_damaged_eval_set_is_refused_in_one_line(tmp_path):
    with pytest.raises(EvalSetError, match="cannot read"):
        eval_set("qa", str(tmp_path / "absent.jsonl"))
    bad = tmp_path / "bad.jsonl"
    for content, message in ((b'{"text": "a"}\n{"text": \n', "line 2: not JSON"),
                             (b'{"question": "a"}\n', "line 1: expected an object with a string `text`"),
                             (b"\xff\xfe", "not UTF-8"), (b"\n\n", "holds no text")):
        bad.write_bytes(content)
        with pytest.raises(EvalSetError, match=message) as info:
            eval_set("qa", str(bad))
        assert "\n" not in str(info.value)
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "one"}\n{"text": "two"}\n')
    declared = eval_set("qa", str(good))
    assert eval_set_texts(declared) == ["one", "two"]
    good.write_text('{"text": "three"}\n')
    with pytest.raises(EvalSetError, match="changed since"):
        eval_set_texts(declared)


def test_the_registry_declares_eval_sets_and_policies(tmp_path):
    path = tmp_path / "registry.yaml"
    path.write_text("tokenizers: {t: {train_on: [a]}}\n"
                    "tokenized: {a: {tokenizer: t, decontamination: {mode: mark, min_matching_ngrams: 2}}}\n"
                    "decontamination: {ngram: 8, eval_texts: {qa: sets/qa.jsonl}}\n")
    registry = load_registry(path)
    assert registry.tokenized["a"].decontamination == DecontaminationPolicy("mark", 2)
    assert registry.decontamination == DecontaminationSettings(8, {"qa": str(tmp_path / "sets/qa.jsonl")})
    assert registry.decontamination.validation_splits
    path.write_text("tokenizers: {t: {train_on: [a]}}\ntokenized: {a: {tokenizer: t}}\n"
                    "decontamination: {validation_splits: false}\n")
    assert not load_registry(path).decontamination.validation_splits
    assert "decontamination" not in registry.tokenized["a"].cache.identity()
    path.write_text("tokenizers: {t: {train_on: [a]}}\ntokenized: {a: {tokenizer: t, decontamination: {mode: x}}}\n")
    with pytest.raises(Exception, match="decontamination"):
        load_registry(path)


# ---- assets -----------------------------------------------------------------------------------------

TOKENIZER = TokenizerEntry("letters_bpe", TokenizerConfig(vocab_size=300), train_on=(SOURCE,))
DROP = DecontaminationPolicy()
MIXTURE = MixtureEntry(SOURCE, TOKENIZER.name, {SOURCE: 1.0})
DEDUP_FP = fingerprint({})


def corpus_specs(sources: list[str]) -> dict[str, ArtifactSpec]:
    """The `deduplicated/<source>` specs the curation stage would declare, for assets built without it."""
    return {source: ArtifactSpec.fixed(f"deduplicated/{source}", "v1", {}) for source in sources}


class Store:
    """A store holding `deduplicated/letters` (shards of Parquet), and the decontamination assets over it."""

    def __init__(self, root: Path, shards: dict[str, list[str]], eval_texts: dict[str, str] | None = None,
                 policy: DecontaminationPolicy = DROP, cache: CacheConfig = CACHE, validation_splits: bool = True):
        self.cache, self.validation_splits = cache, validation_splits
        self.settings = MarinSettings.from_env({"MARIN_PREFIX": str(root)})
        self.store = ArtifactStore(self.settings.prefix)
        self.instance = dg.DagsterInstance.ephemeral()
        self.shards: list[str] = []
        self.add_shards(shards)
        self.configure(eval_texts or {}, policy)

    def add_shards(self, shards: dict[str, list[str]]) -> None:
        """`deduplicated/letters` committed again with these shards' files beside those it holds."""
        writer = self.store.begin(f"deduplicated/{SOURCE}", "v1", None, fingerprint=DEDUP_FP,
                                  run_id=f"dedup-{len(self.shards)}", resume=bool(self.shards))
        data = self.store.local_path(self.store.artifact_uri(f"deduplicated/{SOURCE}", "v1", None,
                                                             fingerprint=DEDUP_FP)) / "data"
        data.mkdir(parents=True, exist_ok=True)
        for shard, texts in shards.items():
            pq.write_table(_table(texts), data / f"{shard}.parquet")
        writer.commit(config={}, upstream=[], producer={})
        self.shards = sorted({*self.shards, *shards})
        self.instance.add_dynamic_partitions(f"{SOURCE}_shards", sorted(shards))

    def configure(self, eval_texts: dict[str, str], policy: DecontaminationPolicy = DROP):
        entry = TokenizedEntry(SOURCE, TOKENIZER.name, self.cache, decontamination=policy)
        self.registry = TokenizationRegistry({TOKENIZER.name: TOKENIZER}, {SOURCE: entry}, {SOURCE: MIXTURE},
                                             decontamination=DecontaminationSettings(N, eval_texts,
                                                                                     self.validation_splits))
        self.catalog = Catalog()
        dedup = dg.AssetSpec(key=asset_key(f"deduplicated/{SOURCE}"),
                             metadata={VERSION_METADATA_KEY: "v1"}).with_io_manager_key("artifact_io_manager")
        assets, checks = build_decontamination_assets(self.registry, self.catalog, corpus_specs([SOURCE]),
                                                      lambda: self.store)
        self.assets = [dedup, *assets, *checks]

    def run(self, key: str, partition: str | None = None, ok: bool = True) -> dg.ExecuteInProcessResult:
        result = dg.materialize(self.assets, instance=self.instance, partition_key=partition,
                                resources=build_resources(self.settings), raise_on_error=False,
                                selection=dg.AssetSelection.assets(asset_key(key)))
        assert result.success is ok
        return result

    def build(self) -> list[dg.ExecuteInProcessResult]:
        return [self.run(f"eval_ngrams/{SOURCE}"), *(self.run(f"decontaminated/{SOURCE}", s) for s in self.shards)]

    def planner(self) -> Planner:
        defs = dg.Definitions(assets=self.assets, resources=build_resources(self.settings))
        return Planner(defs, self.catalog, self.store, self.instance)

    def versions(self) -> dict:
        from marin_resources.storage.migrate import manifests

        return {(m.asset_key, m.partition): m.data_version for m in manifests(self.store)}


@pytest.fixture(scope="module")
def shards(planted) -> dict[str, list[str]]:
    """Two shards: the validation documents and half the clean training ones in the first, the rest
    and every planted copy but the eval-set items in the second."""
    training, validation = planted["training"], planted["validation"]
    copies = [t for t in planted["contaminated"] if not any(item in t for item in planted["items"])]
    return {"a-first": validation + training[:150], "b-second": training[150:] + copies}


def test_the_assets_drop_planted_copies_into_the_dropped_table_and_warn(tmp_path, planted, shards):
    built = Store(tmp_path / "store", shards)
    results = built.build()
    first = built.store.find(f"decontaminated/{SOURCE}", "v1", "a-first")
    second = built.store.find(f"decontaminated/{SOURCE}", "v1", "b-second")
    copies = len(shards["b-second"]) - (len(planted["training"]) - 150)
    assert first.metrics["contaminated"] == 0 and second.metrics["contaminated"] == second.metrics["dropped"] == copies
    assert second.metrics["validation_documents"] == 0 < first.metrics["validation_documents"]
    dropped = pq.read_table(built.store.local_path(second.uri) / "dropped/b-second.parquet")
    assert dropped.num_rows == copies and set(dropped.column("reason").to_pylist()) == {CONTAMINATED}
    kept = pq.read_table(built.store.local_path(second.uri) / "data/b-second.parquet")
    assert kept.num_rows == len(planted["training"]) - 150
    assert not set(kept.column("id").to_pylist()) & set(dropped.column("id").to_pylist())
    # One check per shard's run, in shard order: it warns where a shard held contaminated documents.
    verdicts = [(c.passed, c.severity) for r in results[1:] for c in r.get_asset_check_evaluations()]
    assert verdicts == [(True, dg.AssetCheckSeverity.WARN), (False, dg.AssetCheckSeverity.WARN)]
    ngrams = built.store.find(f"eval_ngrams/{SOURCE}", "v1", None)
    assert ngrams.metrics["eval_documents"] == {SOURCE: len(planted["validation"])}
    assert ngrams.metrics["thresholds"] == {SOURCE: FRACTION}


def test_eval_set_items_are_found_and_a_new_eval_set_makes_the_index_and_every_shard_stale(
        tmp_path, planted, shards):
    with_items = {**shards, "b-second": shards["b-second"] + [t for t in planted["contaminated"]
                                                              if any(item in t for item in planted["items"])]}
    built = Store(tmp_path / "store", with_items)
    built.build()
    before = built.store.find(f"decontaminated/{SOURCE}", "v1", "b-second").metrics["contaminated"]
    states = {(s.asset_key, s.partition): s.state for s in built.planner().status()}
    assert set(states.values()) == {"fresh"}

    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"text": item}) + "\n" for item in planted["items"]))
    built.configure({"qa": str(qa)})
    assert fingerprint(eval_ngrams_identity(built.registry, SOURCE, [eval_set("qa", str(qa))])) != \
        fingerprint(eval_ngrams_identity(built.registry, SOURCE, []))
    states = {(s.asset_key, s.partition): s.state for s in built.planner().status()}
    assert states[(f"eval_ngrams/{SOURCE}", None)] == "missing"  # a new identity
    assert {states[(f"decontaminated/{SOURCE}", s)] for s in built.shards} == {"stale"}
    built.build()
    after = built.store.find(f"decontaminated/{SOURCE}", "v1", "b-second")
    items_planted = sum(1 for t in planted["contaminated"] if any(item in t for item in planted["items"]))
    assert after.metrics["contaminated"] == before + items_planted
    assert built.store.find(f"eval_ngrams/{SOURCE}", "v1", None).metrics["eval_documents"]["eval_set/qa"] == \
        len(planted["items"])
    assert {s.state for s in built.planner().status()} == {"fresh"}


def test_against_eval_sets_alone_a_new_shard_checks_only_itself(tmp_path, planted, shards):
    """`validation_splits: false` (for terabytes): the index holds the eval sets alone, so a new shard,
    whose validation documents would grow the split, leaves the index and every other shard fresh and
    costs its own pass. Eval-set items are still dropped; copies of validation documents are kept."""
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"text": item}) + "\n" for item in planted["items"]))
    with_items = [t for t in planted["contaminated"] if any(item in t for item in planted["items"])]
    built = Store(tmp_path / "store", {**shards, "b-second": shards["b-second"] + with_items}, {"qa": str(qa)},
                  validation_splits=False)
    built.build()
    index = built.store.find(f"eval_ngrams/{SOURCE}", "v1", None)
    assert index.config["validation_splits"] == {} and index.upstream == []
    assert set(index.metrics["eval_documents"]) == {"eval_set/qa"}
    second = built.store.find(f"decontaminated/{SOURCE}", "v1", "b-second")
    assert second.metrics["contaminated"] == len(with_items)  # the validation documents' copies are kept

    built.add_shards({"c-third": planted["validation"][:5] + planted["training"][:20]})
    states = {(s.asset_key, s.partition): s.state for s in built.planner().status()}
    assert states[(f"eval_ngrams/{SOURCE}", None)] == "fresh"
    assert states[(f"decontaminated/{SOURCE}", "c-third")] == "missing"
    assert {states[(f"decontaminated/{SOURCE}", s)] for s in ("a-first", "b-second")} == {"fresh"}
    built.run(f"decontaminated/{SOURCE}", "c-third")
    assert {s.state for s in built.planner().status()} == {"fresh"}


def test_an_eval_set_changed_after_load_is_refused_and_nothing_is_committed(tmp_path, shards):
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"text": "a question of some length"}\n')
    built = Store(tmp_path / "store", shards, {"qa": str(qa)})
    qa.write_text("damaged")
    failed = built.run(f"eval_ngrams/{SOURCE}", ok=False)
    error = failed.get_step_failure_events()[0].event_specific_data.error.message
    assert "eval set 'qa'" in error and "changed since" in error
    assert built.store.find(f"eval_ngrams/{SOURCE}", "v1", None) is None
    with pytest.raises(EvalSetError, match="line 1: not JSON"):
        built.configure({"qa": str(qa)})  # what loading the code location does: the CLI exits 2


def test_mark_mode_keeps_the_shard_file_byte_for_byte(tmp_path, shards):
    built = Store(tmp_path / "store", shards, policy=DecontaminationPolicy(mode="mark"))
    built.build()
    second = built.store.find(f"decontaminated/{SOURCE}", "v1", "b-second")
    dedup = built.store.find(f"deduplicated/{SOURCE}", "v1", None)
    assert second.metrics["contaminated"] > 0 and second.metrics["dropped"] == 0
    assert second.file_version("data/b-second.parquet") == dedup.file_version("data/b-second.parquet")
    marked = pq.read_table(built.store.local_path(second.uri) / "marked/b-second.parquet")
    assert marked.num_rows == second.metrics["contaminated"]


def test_two_fresh_builds_give_the_same_data_versions(tmp_path, shards):
    versions = []
    for name in ("one", "two"):
        built = Store(tmp_path / name, shards)
        built.build()
        versions.append(built.versions())
    assert len(versions[0]) == 4 and versions[0] == versions[1]  # corpus, index, two shards


def test_a_validation_minimum_is_applied_to_the_whole_corpus(tmp_path):
    docs = _clean_documents(40, seed=5)
    files = []
    for i in range(2):
        path = tmp_path / f"{i}.parquet"
        pq.write_table(_table(docs[i::2]), path)
        files.append(str(path))
    cfg = CacheConfig(validation_fraction=0.001, validation_min_documents=6)
    threshold = validation_threshold_of(files, cfg)
    assert threshold == with_validation_minimum(cfg, [_doc_id(t) for f in files
                                                      for t in pq.read_table(f).column("text").to_pylist()
                                                      ]).validation_fraction
    assert sum(is_validation_document(_doc_id(t), threshold) for t in docs) == 6


def test_the_index_reads_every_id_again_only_for_a_split_short_of_its_minimum(tmp_path, shards, monkeypatch):
    """The units count the corpus as they hash its split. A fraction that holds out the cache's
    minimum is taken as it is, with no pass over every id in the step's own process (at 10 TB, billions
    of ids in one process); one that falls short is raised over the whole corpus, as the cache's is."""
    from marin_assets.tokenization import decontamination_assets

    passes = []
    monkeypatch.setattr(decontamination_assets, "validation_threshold_of",
                        lambda files, cfg: passes.append(len(files)) or validation_threshold_of(files, cfg))
    enough_cache = CacheConfig(validation_fraction=0.2, validation_min_documents=10)
    enough = Store(tmp_path / "enough", shards, cache=enough_cache)
    enough.run(f"eval_ngrams/{SOURCE}")
    index = enough.store.find(f"eval_ngrams/{SOURCE}", "v1", None)
    assert passes == [] and index.metrics["thresholds"] == {SOURCE: 0.2}
    assert index.metrics["eval_documents"][SOURCE] >= 10

    short_cache = CacheConfig(validation_fraction=0.001, validation_min_documents=6)
    short = Store(tmp_path / "short", shards, cache=short_cache)
    short.run(f"eval_ngrams/{SOURCE}")
    index = short.store.find(f"eval_ngrams/{SOURCE}", "v1", None)
    corpus = short.store.find(f"deduplicated/{SOURCE}", "v1", None)
    files = [str(short.store.local_path(corpus.uri) / "data" / f"{shard}.parquet") for shard in sorted(shards)]
    assert passes == [2]
    assert index.metrics["thresholds"] == {SOURCE: validation_threshold_of(files, short_cache)}
    assert index.metrics["thresholds"][SOURCE] > short_cache.validation_fraction
    assert index.metrics["eval_documents"][SOURCE] == 6


def test_a_sources_index_holds_its_own_split_and_its_mixture_partners_only(tmp_path, shards):
    """A source is checked against its own validation split and those of the sources it shares a
    mixture with; a source in another mixture is not built to decontaminate it."""
    built = Store(tmp_path / "store", shards)
    other = TokenizedEntry("notes", TOKENIZER.name, CACHE)
    alone = TokenizedEntry("memo", TOKENIZER.name, CACHE)
    registry = TokenizationRegistry(
        built.registry.tokenizers, {SOURCE: built.registry.tokenized[SOURCE], "notes": other, "memo": alone},
        {"ab": MixtureEntry("ab", TOKENIZER.name, {SOURCE: 1.0, "notes": 0.0}),
         "c": MixtureEntry("c", TOKENIZER.name, {"notes": 1.0})})
    splits = {s: sorted(eval_ngrams_identity(registry, s, [])["validation_splits"]) for s in (SOURCE, "notes", "memo")}
    assert splits == {SOURCE: [SOURCE, "notes"], "notes": [SOURCE, "notes"], "memo": ["memo"]}
    assets, _ = build_decontamination_assets(registry, Catalog(), corpus_specs([SOURCE, "notes", "memo"]),
                                             lambda: None)
    (index,) = [a for a in assets if a.key == asset_key("eval_ngrams/memo")]
    assert index.dependency_keys == {asset_key("deduplicated/memo")}


def test_the_cli_refuses_a_missing_eval_set_in_one_line_with_exit_code_2(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "marin.yaml").write_text("decontamination:\n  eval_texts:\n    qa: evals/qa.jsonl\n")
    env = {**os.environ, "MARIN_PREFIX": str(tmp_path / "store"), "DAGSTER_HOME": str(tmp_path / "home"),
           "MARIN_CONFIG": str(tmp_path / "marin.yaml")}
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "status", "eval_ngrams/shakespeare"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"marin: eval set 'qa': cannot read {tmp_path / 'evals/qa.jsonl'}: No such file or directory"]
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob(".artifact.json"))
