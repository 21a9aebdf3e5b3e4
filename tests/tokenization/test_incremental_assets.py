"""Append-only token caches and pinned tokenizers, through the Dagster assets and the store.

The upstream `deduplicated/<source>` artifact is committed directly, following dedup's rule: a
committed data file keeps its bytes, and a new shard only adds a file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest

from marin_assets.catalog import Catalog
from marin_assets.planning import Planner, parse_key
from marin_assets.tokenization.assets import (
    TOKENIZED_VERSION,
    TokenizedEntry,
    TokenizerEntry,
    build_tokenized_asset,
    build_tokenizer_asset,
)
from marin_assets.tokenization.cache_config import CacheConfig
from marin_assets.tokenization.decontamination_assets import build_decontamination_assets
from marin_assets.tokenization.registry import DecontaminationPolicy, MixtureEntry, TokenizationRegistry
from marin_assets.tokenization.tokenizer import TokenizerConfig
from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import VERIFY_TAG, VERSION_METADATA_KEY
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.keys import asset_key
from marin_resources.splits import is_validation_document
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore, UpstreamRef

SOURCE = "letters"
DEDUP_VERSION = "v1"
PARTITIONS = f"{SOURCE}_shards"
EXEMPLAR = {"input_ids": np.zeros((0,), dtype=np.int32)}
TOKENIZER = TokenizerEntry("letters_bpe", TokenizerConfig(vocab_size=400), train_on=(SOURCE,))
# Marked, not dropped: these tests count the documents a cache holds (stdlib sources share 13-grams
# between files: license headers, idioms), and decontamination has tests of its own.
TOKENIZED = TokenizedEntry(SOURCE, TOKENIZER.name, CacheConfig(validation_fraction=0.2, batch_rows=64),
                           decontamination=DecontaminationPolicy(mode="mark"))
# The files an append may rewrite: Levanter keeps the row count in offsets[0] and packs the first
# 128 Mi tokens of a split into one zarr shard file, so both live in c/0 for a cache this small.
APPEND_REWRITES = {f"{split}/{name}" for split in ("train", "validation")
                   for name in ("shard_ledger.json", "input_ids/offsets/c/0",
                                "input_ids/data/c/0")} \
    | {"marin_tokenize_manifest.json"}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): _sha(p) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


DEDUP_FP = fingerprint({})


class Pipeline:
    """A store holding `deduplicated/letters`, and the tokenizer and tokenized assets over it."""

    def __init__(self, tmp_path: Path, corpus: list[str], write_docs):
        self.tmp, self.corpus, self.write_docs = tmp_path, corpus, write_docs
        self.settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store")})
        self.store = ArtifactStore(self.settings.prefix)
        self.instance = dg.DagsterInstance.ephemeral()
        self.dedup_uri = self.store.artifact_uri(f"deduplicated/{SOURCE}", DEDUP_VERSION, None, fingerprint=DEDUP_FP)

    def commit_corpus(self, shards: dict[str, list[str]]) -> None:
        """Commit deduplicated/letters with these new shard files; files already there stay as they are."""
        writer = self.store.begin(f"deduplicated/{SOURCE}", DEDUP_VERSION, None, fingerprint=DEDUP_FP, run_id="dedup",
                                  resume=True)
        data = self.store.local_path(self.dedup_uri) / "data"
        data.mkdir(parents=True, exist_ok=True)
        for key, texts in shards.items():
            self.write_docs(str(data / f"{key}.parquet"), texts)
        writer.commit(config={}, upstream=[], producer={})

    def assets(self, tokenizer: TokenizerEntry = TOKENIZER, catalog: Catalog | None = None):
        dedup = dg.AssetSpec(key=asset_key(f"deduplicated/{SOURCE}"), metadata={
            VERSION_METADATA_KEY: DEDUP_VERSION}).with_io_manager_key("artifact_io_manager")
        catalog = Catalog() if catalog is None else catalog
        corpora = {SOURCE: ArtifactSpec.fixed(f"deduplicated/{SOURCE}", DEDUP_VERSION, {})}
        token_shards, tokenized, *checks = build_tokenized_asset(TOKENIZED, catalog, corpora[SOURCE])
        decontamination, decontamination_checks = build_decontamination_assets(
            TokenizationRegistry({TOKENIZER.name: TOKENIZER}, {SOURCE: TOKENIZED},
                                 {SOURCE: MixtureEntry(SOURCE, TOKENIZER.name, {SOURCE: 1.0})}), catalog, corpora,
            lambda: self.store)
        return [dedup, build_tokenizer_asset(tokenizer, catalog, lambda: self.store, corpora), *decontamination,
                token_shards, tokenized, *checks, *decontamination_checks]

    def shards(self) -> list[str]:
        """The corpus's shards, each a partition of token_shards/letters (as discovery adds them)."""
        shards = sorted(p.stem for p in (self.store.local_path(self.dedup_uri) / "data").glob("*.parquet"))
        known = set(self.instance.get_dynamic_partitions(PARTITIONS))
        self.instance.add_dynamic_partitions(PARTITIONS, [s for s in shards if s not in known])
        return shards

    def run(self, key: str, partition: str | None = None, tokenizer: TokenizerEntry = TOKENIZER,
            ok: bool = True, tags: dict[str, str] | None = None) -> dg.ExecuteInProcessResult:
        result = dg.materialize(self.assets(tokenizer), instance=self.instance, partition_key=partition,
                                resources=build_resources(self.settings), raise_on_error=False, tags=tags,
                                selection=dg.AssetSelection.assets(asset_key(key)))
        assert result.success is ok
        return result

    def encode(self, shard: str) -> None:
        """A new or changed shard's steps before the cache: the eval index (reused, or rebuilt at the same
        data version where the corpus's validation split is unchanged), the shard's decontamination and
        its encoding."""
        self.run(f"eval_ngrams/{SOURCE}")
        self.shards()
        self.run(f"decontaminated/{SOURCE}", shard)
        self.run(f"token_shards/{SOURCE}", shard)

    def materialize(self, tokenizer: TokenizerEntry = TOKENIZER) -> list[dg.ExecuteInProcessResult]:
        """The tokenizer and the eval index, each shard's partitions of decontaminated/letters and
        token_shards/letters (their own runs), then the cache."""
        shards = self.shards()
        return [self.run(f"tokenizer/{tokenizer.name}", tokenizer=tokenizer), self.run(f"eval_ngrams/{SOURCE}"),
                *(self.run(f"decontaminated/{SOURCE}", shard, tokenizer) for shard in shards),
                *(self.run(f"token_shards/{SOURCE}", shard, tokenizer) for shard in shards),
                self.run(f"tokenized/{SOURCE}", tokenizer=tokenizer)]

    def planner(self) -> Planner:
        catalog = Catalog()
        defs = dg.Definitions(assets=self.assets(catalog=catalog), resources=build_resources(self.settings))
        return Planner(defs, catalog, self.store, self.instance)

    def cache_root(self) -> Path:
        return self.store.local_path(self.store.find(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None).uri)


def _metadata(results: list[dg.ExecuteInProcessResult], key: str, partition: str | None = None) -> dict:
    event = next(e for result in results for e in result.get_asset_materialization_events()
                 if e.asset_key == asset_key(key) and e.partition == partition)
    return {k: v.value for k, v in event.materialization.metadata.items()}


def _rows(split_dir: Path) -> list[np.ndarray]:
    from levanter.store.cache import TreeCache

    cache = TreeCache.load(str(split_dir), EXEMPLAR)
    return [np.asarray(r["input_ids"]) for r in cache.get_batch_sync(list(range(len(cache))))] if len(cache) else []


@pytest.fixture
def pipeline(tmp_path, corpus, write_docs) -> Pipeline:
    p = Pipeline(tmp_path, corpus, write_docs)
    third = len(corpus) // 3
    # The shard added later ("b-new") sorts first by name: append order is not name order.
    p.commit_corpus({"m-first": corpus[:third], "p-second": corpus[third:2 * third]})
    return p


@pytest.mark.slow  # token cache builds
def test_new_shard_is_encoded_once_and_appended(pipeline, corpus, monkeypatch):
    first = pipeline.materialize()
    assert _metadata(first, f"tokenized/{SOURCE}")["shards_encoded"] == 2
    root = pipeline.cache_root()
    before_files = _snapshot(root)
    before_rows = {split: _rows(root / split) for split in ("train", "validation")}
    tokenizer_before = pipeline.store.find(f"tokenizer/{TOKENIZER.name}", TOKENIZER.version, None)

    third = len(corpus) // 3
    new_docs = corpus[2 * third:]
    pipeline.commit_corpus({"b-new": new_docs})

    hashed: list[str] = []
    real_hash = ArtifactStore.hash_file

    def counting_hash(self, uri, rel):
        if uri.rsplit("/", 1)[0].endswith(f"tokenized/{SOURCE}") and \
                uri.rsplit("/", 1)[1].startswith(f"{TOKENIZED_VERSION}-"):
            hashed.append(rel)
        return real_hash(self, uri, rel)

    monkeypatch.setattr(ArtifactStore, "hash_file", counting_hash)
    second = pipeline.materialize()
    monkeypatch.setattr(ArtifactStore, "hash_file", real_hash)

    # The tokenizer is pinned: reused, not retrained, though its corpus grew.
    tok_meta = _metadata(second, f"tokenizer/{TOKENIZER.name}")
    assert tok_meta["marin/reused"] is True
    tokenizer_after = pipeline.store.find(f"tokenizer/{TOKENIZER.name}", TOKENIZER.version, None)
    assert (tokenizer_after.data_version, tokenizer_after.finished_at) == \
        (tokenizer_before.data_version, tokenizer_before.finished_at)

    # Exactly the new shard's documents were encoded, in its own partition's run; the others were reused.
    assert {shard: _metadata(second, f"token_shards/{SOURCE}", shard)["marin/reused"]
            for shard in ("b-new", "m-first", "p-second")} == {"b-new": False, "m-first": True, "p-second": True}
    assert _metadata(second, f"token_shards/{SOURCE}", "b-new")["documents"] == len(new_docs)
    # The cache appended the new shard's rows as one ledger shard.
    meta = _metadata(second, f"tokenized/{SOURCE}")
    assert (meta["shards_encoded"], meta["shards_reused"], meta["shards"]) == (1, 2, 3)
    assert meta["documents_encoded"] == len(new_docs)
    assert meta["documents"] == len(corpus)

    from levanter.store.cache import CacheLedger

    ledger = CacheLedger.load(str(root / "train"))
    assert [Path(k).name for k in ledger.finished_shards] == ["m-first.parquet", "p-second.parquet", "b-new.parquet"]

    # Levanter opens the grown cache unchanged; old rows are the same, the new shard's rows follow.
    after_rows = {split: _rows(root / split) for split in ("train", "validation")}
    assert sum(len(r) for r in after_rows.values()) == len(corpus)
    for split in ("train", "validation"):
        old = before_rows[split]
        assert all(np.array_equal(a, b) for a, b in zip(old, after_rows[split][:len(old)], strict=True))

    # Only the files Levanter's layout forces to change were written; everything else kept its bytes.
    after_files = _snapshot(root)
    changed = {rel for rel, sha in before_files.items() if after_files.get(rel) != sha}
    assert set(before_files) <= set(after_files)
    assert changed <= APPEND_REWRITES, changed - APPEND_REWRITES
    assert {"train/input_ids/data/zarr.json", "train/input_ids/offsets/zarr.json"} <= set(before_files) - changed

    # The commit hashed only files the append wrote; the reused entries are right.
    manifest = pipeline.store.find(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None)
    assert set(hashed) <= APPEND_REWRITES | (set(after_files) - set(before_files))
    assert len(hashed) < len(after_files)
    assert pipeline.store.verify(manifest) == []
    # The shard files the append wrote were hashed as they were written, not read back at commit.
    assert meta["marin/files_vouched"] >= 2
    assert meta["marin/files_rehash_skipped"] + meta["marin/files_vouched"] == len(after_files) - len(hashed)

    # The decode round-trip check reads rows in ledger (append) order.
    checks = second[-1].get_asset_check_evaluations()
    assert checks and all(c.passed for c in checks)


@pytest.mark.slow  # two tokenizer trainings and the caches built on them
def test_pinned_tokenizer_status_and_explicit_retrain(pipeline, corpus):
    pipeline.materialize()
    tok_key = parse_key(f"tokenizer/{TOKENIZER.name}")
    cache_key = parse_key(f"tokenized/{SOURCE}")
    fresh = pipeline.planner().state(tok_key, None)
    assert fresh.state == "fresh" and "pinned to deduplicated/letters@" in fresh.cause and "(unchanged)" in fresh.cause

    pipeline.commit_corpus({"z-new": corpus[-20:]})
    grown = pipeline.store.find(f"deduplicated/{SOURCE}", DEDUP_VERSION, None)
    planner = pipeline.planner()
    pinned = planner.state(tok_key, None)
    assert pinned.state == "fresh", pinned
    assert f"now {grown.data_version[:12]}" in pinned.cause and "retrain" in pinned.cause
    assert planner.state(cache_key, None).state == "stale"  # the cache does follow its corpus

    pipeline.materialize()
    assert pipeline.planner().state(cache_key, None).state == "fresh"
    trained = pipeline.store.find(f"tokenizer/{TOKENIZER.name}", TOKENIZER.version, None)
    assert trained.config["corpora"][SOURCE] != grown.data_version
    assert trained.upstream == []

    # Retraining is an explicit new version: it trains on today's corpus and pins that.
    retrained = TokenizerEntry(TOKENIZER.name, TOKENIZER.config, TOKENIZER.train_on, version="v3")
    pipeline.run(f"tokenizer/{TOKENIZER.name}", tokenizer=retrained)
    v3 = pipeline.store.find(f"tokenizer/{TOKENIZER.name}", "v3", None)
    assert v3.config["corpora"] == {SOURCE: grown.data_version}
    assert v3.metrics["pinned_corpus"][SOURCE]["data_version"] == grown.data_version


def test_changed_committed_shard_reencodes_from_it(pipeline, corpus):
    """Dedup's rule broken (a committed file rewritten with other bytes): that shard and every shard
    committed after it are encoded again; the ones before it are kept."""
    pipeline.materialize()
    path = pipeline.store.local_path(pipeline.dedup_uri) / "data" / "p-second.parquet"
    texts = pq.read_table(path).column("text").to_pylist()[:-3]
    os.remove(path)
    pipeline.commit_corpus({"p-second": texts})
    results = pipeline.materialize()
    assert _metadata(results, f"token_shards/{SOURCE}", "p-second")["marin/reused"] is False
    meta = _metadata(results, f"tokenized/{SOURCE}")
    assert (meta["shards_encoded"], meta["shards_reused"]) == (1, 1)
    assert meta["documents_encoded"] == len(texts)


def test_two_prefixes_give_the_same_bytes_and_a_moved_cache_loads_with_the_tokenizer_found_there(
        tmp_path, corpus, write_docs, caplog):
    """Issue #30: the ledger named the tokenizer (and its shards) by absolute URI, so the cache was
    the one artifact whose data version depended on the prefix, and a moved cache named files that
    were not there. Built on two prefixes, every artifact has one data version; the store copied to
    a third prefix loads in Levanter, as training and eval load it, with the tokenizer found there and
    no metadata mismatch."""
    import logging
    import shutil

    import draccus
    import haliax as hax
    import jax
    from levanter.data.text import LMMixtureDatasetConfig
    from levanter.schedule import BatchSchedule

    from marin_assets.tokenization.mixture import MixtureComponent, MixtureSpec, render_levanter_data_config

    third = len(corpus) // 3
    built = []
    for name in ("a", "b"):
        pipeline = Pipeline(tmp_path / name, corpus, write_docs)
        pipeline.commit_corpus({"m-first": corpus[:third], "p-second": corpus[third:2 * third]})
        pipeline.materialize()
        built.append({(m.asset_key, m.partition): m.data_version for m in _manifests(pipeline.store)})
    # The corpus, tokenizer, eval index, two decontaminated and two token shards, and the cache.
    assert len(built[0]) == 8 and built[0] == built[1]

    shutil.copytree(tmp_path / "a" / "store", tmp_path / "moved" / "store", symlinks=True)
    shutil.rmtree(tmp_path / "a")  # nothing may still point into the old prefix
    moved = ArtifactStore(str(tmp_path / "moved" / "store"))
    cache = moved.find(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None)
    tokenizer = moved.find(f"tokenizer/{TOKENIZER.name}", TOKENIZER.version, None)
    assert str(tmp_path / "a") not in (moved.local_path(cache.uri) / "train" / "shard_ledger.json").read_text()
    spec = MixtureSpec(name="moved", components={SOURCE: MixtureComponent(cache.uri, 1.0)},
                       tokenizer_dir=tokenizer.uri, seq_len=32, shuffle=False)
    config = draccus.decode(LMMixtureDatasetConfig, render_levanter_data_config(spec))
    # (after the builds: issue #30's check)
    from marin_assets.tokenization.cache_format import name_tokenizer_as_ledgers_do

    name_tokenizer_as_ledgers_do(config)  # as train_main and eval_main do
    with caplog.at_level(logging.INFO):
        train = config.train_set(hax.Axis("position", 32), BatchSchedule(2), key=jax.random.PRNGKey(0))
        first = train.as_sync_dataset()[0]
    assert not [r for r in caplog.records
                if "Metadata mismatch" in r.getMessage() or "Building cache" in r.getMessage()]
    assert first.tokens.array.shape == (32,) and int(first.tokens.array.max()) < len(config.the_tokenizer)


def _manifests(store: ArtifactStore) -> list:
    from marin_resources.storage.migrate import manifests

    return manifests(store)


def test_a_shard_that_fails_to_encode_fails_alone_and_the_cache_is_never_assembled_with_a_hole(pipeline, corpus):
    """A shard that cannot be encoded fails its own partition's run; its siblings commit, and the cache
    refuses in one line naming it, leaving the committed cache as it was. Fixed, the rerun encodes
    that shard alone."""
    import pyarrow as pa

    pipeline.materialize()
    root = pipeline.cache_root()
    before = _snapshot(root)
    bad = pipeline.store.local_path(pipeline.dedup_uri) / "data" / "k-broken.parquet"
    pq.write_table(pa.table({"id": ["x"], "body": ["no text column"]}), bad)
    pipeline.commit_corpus({"z-fine": corpus[-10:]})
    shards = pipeline.shards()
    failed = pipeline.run(f"decontaminated/{SOURCE}", "k-broken", ok=False)
    assert "missing column(s) ['text']" in str(failed.get_step_failure_events()[0].event_specific_data.error)
    pipeline.run(f"decontaminated/{SOURCE}", "z-fine")
    fine = pipeline.run(f"token_shards/{SOURCE}", "z-fine")
    assert _metadata([fine], f"token_shards/{SOURCE}", "z-fine")["documents"] == 10
    refused = pipeline.run(f"tokenized/{SOURCE}", ok=False)
    error = refused.get_step_failure_events()[0].event_specific_data.error.message
    assert f"of the {len(shards)} shards of deduplicated/{SOURCE}, 1 not encoded (k-broken)" in error, error
    assert _snapshot(root) == before  # the committed cache is untouched

    os.remove(bad)
    pipeline.commit_corpus({"k-broken": corpus[:5]})  # the shard replaced by readable documents
    results = pipeline.materialize()
    assert [shard for shard in pipeline.shards()
            if not _metadata(results, f"token_shards/{SOURCE}", shard)["marin/reused"]] == ["k-broken"]
    assert _metadata(results, f"tokenized/{SOURCE}")["shards"] == 4


def test_the_planner_encodes_each_shard_in_its_own_step_before_the_cache(pipeline, corpus):
    """`marin materialize tokenized/<source>` plans one step per shard, its decontamination and its
    encoding in one run, then the cache; a new shard makes its own partitions missing and the cache
    stale. The eval index follows the corpus (its validation split grew), so every shard is checked
    again, but a shard whose documents are unchanged is not encoded again."""
    pipeline.shards()
    planner = pipeline.planner()
    cache_key, shards_key = parse_key(f"tokenized/{SOURCE}"), parse_key(f"token_shards/{SOURCE}")
    checked_key = parse_key(f"decontaminated/{SOURCE}")
    steps = planner.steps_of([(cache_key, None)])
    encode = [i for i, step in enumerate(steps) if shards_key in step.keys]
    assert all(steps[i].keys == [checked_key, shards_key] for i in encode)  # no extra run per shard
    assert sorted(steps[i].partition for i in encode) == ["m-first", "p-second"]
    (assemble,) = [i for i, step in enumerate(steps) if cache_key in step.keys]
    assert set(encode) <= steps[assemble].after

    results = planner.materialize(cache_key, None, log=lambda line: None)
    assert all(r.success for r in results)
    encoded = {s: pipeline.store.find(f"token_shards/{SOURCE}", "v1", s).uri for s in ("m-first", "p-second")}
    pipeline.commit_corpus({"b-new": corpus[-10:]})
    pipeline.shards()
    states = {(s.asset_key, s.partition): s.state for s in pipeline.planner().status([shards_key, cache_key])}
    assert states[(f"token_shards/{SOURCE}", "b-new")] == "missing"
    assert states[(f"tokenized/{SOURCE}", None)] == "stale"
    results = pipeline.planner().materialize(cache_key, None, log=lambda line: None)
    assert all(r.success for r in results)
    assert {s: pipeline.store.find(f"token_shards/{SOURCE}", "v1", s).uri for s in ("m-first", "p-second")} \
        == encoded
    assert pipeline.store.find(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None).metrics["shards_encoded"] == 1


def test_a_shard_reads_and_checks_its_own_file_of_the_corpus_only(pipeline, corpus):
    """A decontaminated partition checks the one corpus file it reads, not the whole artifact: a damaged
    file refuses its own partition, and its sibling's run does not see it."""
    pipeline.shards()
    pipeline.run(f"eval_ngrams/{SOURCE}")
    pipeline.commit_corpus({"b-new": corpus[-10:]})
    pipeline.shards()
    data = pipeline.store.local_path(pipeline.dedup_uri) / "data"
    with open(data / "b-new.parquet", "ab") as fh:
        fh.write(b"damage")
    failed = pipeline.run(f"decontaminated/{SOURCE}", "b-new", ok=False)
    error = failed.get_step_failure_events()[0].event_specific_data.error.message
    assert f"refusing damaged input deduplicated/{SOURCE}" in error and "b-new.parquet" in error, error
    pipeline.run(f"decontaminated/{SOURCE}", "m-first")
    manifest = pipeline.store.find(f"decontaminated/{SOURCE}", "v1", "m-first")
    corpus_manifest = pipeline.store.read_manifest(pipeline.dedup_uri)
    assert manifest.upstream_versions()[(f"deduplicated/{SOURCE}", "m-first")] == \
        corpus_manifest.file_version("data/m-first.parquet")
    assert corpus_manifest.holds_version(corpus_manifest.file_version("data/m-first.parquet"))
    assert not corpus_manifest.holds_version("sha256=" + "0" * 64)


def _training_only(texts: list[str]) -> list[str]:
    """The texts that are training documents (ids are their sha256): a shard of these leaves the
    corpus's validation split, and so the eval index, as it was."""
    return [t for t in texts if not is_validation_document(hashlib.sha256(t.encode()).hexdigest(),
                                                           TOKENIZED.cache.validation_fraction)]


def _counting_manifest_reads(monkeypatch, prefix: str) -> list[str]:
    """URIs of the manifests read under `prefix` (a store path) from now on: a counting store."""
    reads: list[str] = []
    real = ArtifactStore.read_manifest

    def counting(self, uri):
        if uri.startswith(prefix):
            reads.append(uri)
        return real(self, uri)

    monkeypatch.setattr(ArtifactStore, "read_manifest", counting)
    return reads


def _lineage(store: ArtifactStore, manifest) -> list[tuple]:
    return [(u.asset_key, u.partition, u.data_version, store.portable(u.uri)) for u in manifest.upstream]


def test_a_one_shard_append_reads_the_new_shards_manifest_only_and_builds_what_reading_every_one_builds(
        tmp_path, corpus, write_docs, monkeypatch):
    """Issue #28: a new shard's append looked up and checked the token_shards manifest of every shard
    of the corpus (74,500 at 10 TB). The shards the cache holds from the same file with the same
    tokenizer are taken from its own record: the append reads the new shard's manifest, once to find
    it and once to check it, whatever the corpus. The cache's bytes, its manifest's data version,
    metrics and lineage are those of a build that reads every manifest (the path before), on a second
    store; with nothing new, neither path reads one. (The new shard holds training documents only, so
    the eval index is unchanged and the shards held stay checked against it.)"""
    from marin_assets.tokenization import assets as tokenization_assets

    sixth = len(corpus) // 6
    first = {f"s-{k}": corpus[k * sixth:(k + 1) * sixth] for k in range(5)}
    built = {}
    for name, fast in (("full", False), ("fast", True)):
        pipeline = Pipeline(tmp_path / name, corpus, write_docs)
        pipeline.commit_corpus(first)
        pipeline.materialize()
        pipeline.commit_corpus({"a-new": _training_only(corpus[5 * sixth:])})
        pipeline.encode("a-new")
        with monkeypatch.context() as patched:
            if not fast:  # the path before: no shard carried, every one looked up and checked
                patched.setattr(tokenization_assets, "carried_shards", lambda *args, **kwargs: {})
            reads = _counting_manifest_reads(patched, f"{pipeline.store.prefix}/token_shards/")
            meta = _metadata([pipeline.run(f"tokenized/{SOURCE}")], f"tokenized/{SOURCE}")
            appended = list(reads)
            reads.clear()
            assert _metadata([pipeline.run(f"tokenized/{SOURCE}")], f"tokenized/{SOURCE}")["marin/reused"] is True
        manifest = pipeline.store.find(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None)
        built[name] = {"reads": appended, "reads_when_fresh": reads, "meta": meta, "manifest": manifest,
                       "files": _snapshot(pipeline.cache_root()), "lineage": _lineage(pipeline.store, manifest),
                       "store": pipeline.store}

    fast, full = built["fast"], built["full"]
    assert len(full["reads"]) == 2 * 6 and full["meta"]["marin/shard_manifests_read"] == 6
    assert [uri.rsplit("/", 1)[1] for uri in fast["reads"]] == ["a-new", "a-new"]  # the lookup, the input check
    # Each shard's decontaminated and token_shards partitions.
    assert fast["meta"]["marin/shard_manifests_read"] == 1 and fast["meta"]["marin/inputs_carried"] == 2 * 5
    assert "marin/inputs_carried" not in full["meta"]
    assert fast["reads_when_fresh"] == [] and len(full["reads_when_fresh"]) == 6
    assert (fast["meta"]["shards_encoded"], fast["meta"]["shards_reused"]) == (1, 5)

    assert fast["files"] == full["files"]
    assert fast["manifest"].data_version == full["manifest"].data_version
    assert fast["lineage"] == full["lineage"] and len(fast["lineage"]) == 3 + 2 * 6
    timing = {"assembly_seconds", "assembly_mb_per_s"}
    assert {k: v for k, v in fast["manifest"].metrics.items() if k not in timing} == \
        {k: v for k, v in full["manifest"].metrics.items() if k not in timing}
    assert fast["store"].verify(fast["manifest"]) == []


def test_a_changed_shard_or_tokenizer_is_looked_up_and_refused_until_encoded_again(pipeline, corpus):
    """The shards carried from the cache's record are those from the same file with the same
    tokenizer: a changed shard file is looked up (and refused while its partition holds the old
    file's encoding), and a new tokenizer looks up every shard and refuses the old encodings."""
    pipeline.materialize()
    root = pipeline.cache_root()
    before = _snapshot(root)
    path = pipeline.store.local_path(pipeline.dedup_uri) / "data" / "p-second.parquet"
    was = pq.read_table(path).column("text").to_pylist()
    dropped = set(_training_only(was)[-3:])  # training documents: the eval index stays as it was
    texts = [t for t in was if t not in dropped]
    os.remove(path)
    pipeline.commit_corpus({"p-second": texts})
    error = pipeline.run(f"tokenized/{SOURCE}", ok=False).get_step_failure_events()[0].event_specific_data.error
    assert (f"of the 2 shards of deduplicated/{SOURCE}, 1 encoded from another file, eval index or tokenizer "
            "(p-second)" in error.message), error.message
    assert _snapshot(root) == before

    pipeline.encode("p-second")
    meta = _metadata([pipeline.run(f"tokenized/{SOURCE}")], f"tokenized/{SOURCE}")
    assert (meta["marin/shard_manifests_read"], meta["marin/inputs_carried"]) == (1, 2)  # m-first's carried
    assert (meta["shards_encoded"], meta["shards_reused"], meta["documents"]) == \
        (1, 1, len(corpus) // 3 + len(texts))

    retrained = TokenizerEntry(TOKENIZER.name, TOKENIZER.config, TOKENIZER.train_on, version="v3")
    pipeline.run(f"tokenizer/{TOKENIZER.name}", tokenizer=retrained)
    error = pipeline.run(f"tokenized/{SOURCE}", tokenizer=retrained, ok=False) \
        .get_step_failure_events()[0].event_specific_data.error
    assert "of the 2 shards of deduplicated/letters, 2 encoded from another file, eval index or tokenizer" \
        in error.message


def test_a_damaged_cache_is_rebuilt_from_every_shards_looked_up_rows(pipeline, corpus):
    """A damaged cache is built from scratch, from every shard's rows: none is carried, each is looked
    up and checked, and the rebuilt cache is whole. A verifying run (`marin/verify`) appends from the
    cache's record but re-hashes every input, the carried ones too."""
    pipeline.materialize()
    pipeline.commit_corpus({"b-new": _training_only(corpus[-30:])[-10:]})
    pipeline.encode("b-new")
    verified = _metadata([pipeline.run(f"tokenized/{SOURCE}", tags={VERIFY_TAG: "true"})], f"tokenized/{SOURCE}")
    assert "marin/inputs_carried" not in verified and verified["marin/shard_manifests_read"] == 1

    pipeline.commit_corpus({"c-new": _training_only(corpus[-60:-30])[-10:]})
    pipeline.encode("c-new")
    os.remove(pipeline.cache_root() / "validation" / "shard_ledger.json")
    result = pipeline.run(f"tokenized/{SOURCE}")
    meta = _metadata([result], f"tokenized/{SOURCE}")
    assert "marin/inputs_carried" not in meta and meta["marin/shard_manifests_read"] == 4
    assert (meta["shards_encoded"], meta["shards_reused"]) == (4, 0)
    assert meta["documents"] == 2 * (len(corpus) // 3) + 20
    manifest = pipeline.store.find(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None)
    assert pipeline.store.verify(manifest) == []


def _check_metadata(result: dg.ExecuteInProcessResult, name: str) -> tuple[bool, dict]:
    [evaluation] = [c for c in result.get_asset_check_evaluations() if c.check_name == name]
    return evaluation.passed, {k: v.value for k, v in evaluation.metadata.items()}


@pytest.mark.slow  # token cache builds
def test_the_round_trip_check_reads_a_sample_of_a_large_first_build_and_an_append_whole(pipeline, corpus):
    """A first build of tens of thousands of shards would be read back whole in the check's one process:
    it reads at most CHECKED_SHARDS_AT_MOST of what the build encoded; an append of one shard reads it
    and one earlier shard, as before."""
    from marin_resources.artifacts import CHECKED_SHARDS_AT_MOST

    rest = corpus[2 * (len(corpus) // 3):-10]  # what the fixture's two shards left, and the append's 10 aside
    fifth = len(rest) // 5
    pipeline.commit_corpus({f"s{i}": rest[i * fifth:(i + 1) * fifth] for i in range(5)})
    built = pipeline.materialize()[-1]
    passed, meta = _check_metadata(built, "decode_roundtrip")
    assert passed and meta["shards_encoded"] == 7 and meta["shards_checked"] == CHECKED_SHARDS_AT_MOST

    pipeline.commit_corpus({"t-new": corpus[-10:]})
    pipeline.encode("t-new")
    appended = pipeline.run(f"tokenized/{SOURCE}")
    passed, meta = _check_metadata(appended, "decode_roundtrip")
    assert passed and (meta["shards_encoded"], meta["shards_checked"]) == (1, 2)


@pytest.mark.slow  # token cache builds
def test_a_stopped_append_leaves_the_committed_cache_readable_and_its_readers_lineage_true(pipeline, corpus,
                                                                                           monkeypatch):
    """Issue #50, finding 2: a killed rebuild of the cache deleted its manifest and trimmed its arrays
    before the new one committed, so status said "never materialized" and a reader's lineage broke."""
    import marin_assets.tokenization.assembly as assembly
    from marin_resources.storage.lineage import build_lineage
    from marin_resources.storage.store import producer_info, writing

    pipeline.materialize()
    run = pipeline.run
    committed = pipeline.store.find(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None)
    before = {split: _rows(pipeline.cache_root() / split) for split in ("train", "validation")}
    # A reader of the cache, as a checkpoint records it.
    with writing(pipeline.store, "reader", "v1", None, fingerprint=fingerprint({}), run_id="reader") as w:
        w.write_json("read.json", {"cache": committed.uri})
        reader = w.commit(config={}, upstream=[UpstreamRef(committed.asset_key, None, committed.data_version,
                                                           committed.uri)], producer=producer_info("reader"))

    pipeline.commit_corpus({"b-new": corpus[2 * (len(corpus) // 3):]})
    monkeypatch.setattr(pipeline, "run",
                        lambda key, *a, **kw: None if key == f"tokenized/{SOURCE}" else run(key, *a, **kw))
    pipeline.materialize()  # every step before the cache
    monkeypatch.undo()

    def stopped(unit, job):
        raise RuntimeError("stopped mid-assembly")

    monkeypatch.setattr(assembly, "assemble_file", stopped)
    pipeline.run(f"tokenized/{SOURCE}", ok=False)
    monkeypatch.undo()

    state = pipeline.planner().state(parse_key(f"tokenized/{SOURCE}"), None)
    assert state.state == "stale" and "a rebuild has not committed" in state.cause, state
    kept = pipeline.store.find_previous(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None)
    assert kept.data_version == committed.data_version and pipeline.store.verify(kept) == []
    kept_root = pipeline.store.local_path(kept.uri)
    for split, rows in before.items():  # Levanter reads the kept cache as it was committed
        assert all(np.array_equal(a, b) for a, b in zip(_rows(kept_root / split), rows, strict=True))
    lineage = build_lineage(pipeline.store, reader, verify=True)
    cache_node = lineage.children[0]
    assert cache_node.uri == kept.uri and cache_node.problems == []  # the bytes the reader read, verified
    # What it does name is true: the cache's own inputs have moved on since (it is stale, not missing).
    problems = [p for node in lineage.unique() for p in node.problems]
    assert problems and all("recorded by tokenized/letters" in p for p in problems), problems

    # The next run finishes the append from where it stopped, and the kept cache goes.
    pipeline.run(f"tokenized/{SOURCE}")
    grown = pipeline.store.find(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None)
    assert grown.metrics["documents"] == len(corpus) and pipeline.store.verify(grown) == []
    assert pipeline.store.find_previous(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None) is None
    assert not kept_root.exists()
