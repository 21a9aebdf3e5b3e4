"""Caches and mixtures as Levanter reads them. All Levanter-importing tests live here (one ~8 s import)."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np
import pytest

from marin_assets.tokenization.cache import (
    build_levanter_cache,
    build_levanter_cache_from_documents,
    decode_roundtrip_check,
    read_cache_stats,
)
from marin_assets.tokenization.cache_config import CacheConfig
from marin_assets.tokenization.cache_format import name_tokenizer_as_ledgers_do
from marin_assets.tokenization.mixture import MixtureComponent, MixtureSpec, render_levanter_data_config
from marin_resources.splits import is_validation_document

FRACTION = 0.1
EXEMPLAR = {"input_ids": np.zeros((0,), dtype=np.int32)}


def _doc_id(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _rows(split_dir: str) -> list[np.ndarray]:
    from levanter.store.cache import TreeCache

    cache = TreeCache.load(split_dir, EXEMPLAR)
    return [np.asarray(r["input_ids"]) for r in cache.get_batch_sync(list(range(len(cache))))] if len(cache) else []


@pytest.fixture(scope="module")
def shards(corpus, write_docs, tmp_path_factory) -> list[str]:
    """Three Parquet shards; the second also holds rows that must be skipped (null/empty text, null id)."""
    d = tmp_path_factory.mktemp("docs")
    n = len(corpus)
    parts = [corpus[: n // 3], corpus[n // 3 : 2 * n // 3], corpus[2 * n // 3 :]]
    paths = []
    for k, part in enumerate(parts):
        texts, ids = list(part), [_doc_id(t) for t in part]
        if k == 1:
            texts += [None, "", "orphan text"]
            ids += [_doc_id("null"), _doc_id(""), None]
        paths.append(write_docs(str(d / f"part-{k}.parquet"), texts, ids))
    return paths


@pytest.fixture(scope="module")
def cfg() -> CacheConfig:
    # Small batches and flushes so that the multi-batch and multi-flush paths run on a small corpus.
    return CacheConfig(validation_fraction=FRACTION, batch_rows=64, flush_tokens=20_000)


@pytest.fixture(scope="module")
def built(shards, tokenizer_dir, cfg, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cache") / "root")
    return root, build_levanter_cache(shards, tokenizer_dir, root, cfg)


def test_levanter_loads_the_tokenizer(tokenizer_dir):
    from levanter.compat.hf_checkpoints import load_tokenizer
    from levanter.data.text import BatchTokenizer

    tok = load_tokenizer(tokenizer_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (0, 1, 2, 512)
    processor = BatchTokenizer(tok)
    assert list(processor.output_exemplar) == ["input_ids"]
    # Levanter's own tokenization of the same text matches ours: BOS + ids + EOS.
    row = processor([{"text": "hello world"}])[0]["input_ids"]
    assert row[0] == tok.bos_token_id and row[-1] == tok.eos_token_id


@pytest.mark.parametrize("adds_bos_itself", [True, False])
def test_cache_metadata_is_levanters_own(tokenizer_dir, tmp_path, adds_bos_itself):
    """What a first cache build writes as the ledger's metadata, without importing Levanter, is
    what Levanter's loader computes for the same tokenizer (but the tokenizer's name: by hash)."""
    import shutil

    from levanter.data.text import BatchTokenizer
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from marin_assets.tokenization.cache_format import levanter_preprocessor_metadata, tokenizer_ledger_name

    local = str(tmp_path / "tokenizer")
    shutil.copytree(tokenizer_dir, local)
    if not adds_bos_itself:  # ours puts BOS first itself; without that, Levanter's loader adds it
        tok = Tokenizer.from_file(f"{local}/tokenizer.json")
        tok.post_processor = None
        tok.save(f"{local}/tokenizer.json")
    ours, bos_id, eos_id = levanter_preprocessor_metadata(local, local)
    hf_tok = AutoTokenizer.from_pretrained(local)
    levanters = BatchTokenizer(hf_tok, enforce_bos=True, enforce_eos=True).metadata
    assert levanters["append_bos"] is not adds_bos_itself and levanters["append_eos"] is True
    assert ours == levanters | {"tokenizer": tokenizer_ledger_name(local)}
    assert list(ours) == list(levanters)  # the ledger's JSON keeps Levanter's order
    assert (bos_id, eos_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id)


def test_cache_rows_are_bos_text_eos_in_document_order(built, corpus, tokenizer_dir):
    from tokenizers import Tokenizer

    root, stats = built
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    rows = {split: _rows(f"{root}/{split}") for split in ("train", "validation")}
    expected = {"train": [], "validation": []}
    for text in corpus:
        expected["validation" if is_validation_document(_doc_id(text), FRACTION) else "train"].append(text)

    assert len(rows["train"]) + len(rows["validation"]) == len(corpus) == stats.documents
    assert stats.skipped_documents == 3
    for split in ("train", "validation"):
        assert len(rows[split]) == len(expected[split]) > 0
        for ids, text in zip(rows[split], expected[split]):
            assert ids.dtype == np.int32
            assert ids[0] == 0 and ids[-1] == 1
            assert not np.isin(ids[1:-1], [0, 1, 2]).any()  # special-token text was encoded as text
            assert tok.decode(ids[1:-1].tolist(), skip_special_tokens=False) == text

    tokens = {s: sum(r.size for r in rows[s]) for s in rows}
    assert (stats.train.documents, stats.train.tokens) == (len(rows["train"]), tokens["train"])
    assert (stats.validation.documents, stats.validation.tokens) == (len(rows["validation"]), tokens["validation"])
    assert stats.text_tokens == stats.tokens - 2 * stats.documents
    assert stats.text_bytes == sum(len(t.encode("utf-8")) for t in corpus)
    assert stats.bytes_per_token == pytest.approx(stats.text_bytes / stats.text_tokens)
    assert (stats.shards, stats.shards_encoded, stats.shards_reused) == (3, 3, 0)
    assert read_cache_stats(root).to_dict() | {"shards_reused": 0, "shards_encoded": 3,
                                               "documents_encoded": stats.documents, "tokens_encoded": stats.tokens,
                                               "encode_seconds": stats.encode_seconds,
                                               "assembly_seconds": stats.assembly_seconds} == stats.to_dict()
    assert stats.encode_seconds > 0 and stats.assembly_seconds > 0


def test_ledger_is_finished_and_names_each_shard(built, shards):
    from levanter.store.cache import CacheLedger

    root, stats = built
    for split, split_stats in (("train", stats.train), ("validation", stats.validation)):
        ledger = CacheLedger.load(f"{root}/{split}")
        assert ledger.is_finished
        assert ledger.total_num_rows == split_stats.documents
        assert ledger.finished_shards == shards
        assert sum(ledger.shard_rows.values()) == split_stats.documents
        assert ledger.metadata.preprocessor_metadata["append_eos"] is True


def test_decode_roundtrip_check_passes_and_can_fail(built, shards, tokenizer_dir, write_docs, corpus, tmp_path):
    import shutil

    import tensorstore as ts

    root, _ = built
    assert decode_roundtrip_check(root, tokenizer_dir, shards, sample_n=50) == []
    # Any subset, in any order: each file is checked against its own ledger rows only.
    assert decode_roundtrip_check(root, tokenizer_dir, [shards[2], shards[0]], sample_n=50) == []
    # A file that is not a ledger shard.
    stranger = write_docs(str(tmp_path / "stranger.parquet"), corpus[:3])
    failures = decode_roundtrip_check(root, tokenizer_dir, [stranger], sample_n=10)
    assert [f.reason for f in failures] == [f"{stranger} is not a ledger shard of {root}"]
    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    # Rows whose tokens were overwritten decode to other text.
    data = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{copy}/train/input_ids/data"}}).result()
    data[5:400].write(7).result()
    failures = decode_roundtrip_check(copy, tokenizer_dir, shards, sample_n=1000)
    assert failures and {f.split for f in failures} == {"train"}
    assert all(f.reason.startswith(("decoded text differs", "row does not start")) for f in failures)
    # An array holding fewer rows than the manifest says.
    offsets = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                      "path": f"{copy}/validation/input_ids/offsets"}}).result()
    offsets[0].write(1).result()
    failures = decode_roundtrip_check(copy, tokenizer_dir, shards[:1], sample_n=10)
    assert any(f.split == "validation" and f.row == -1 and "the arrays hold 1" in f.reason for f in failures)


def test_validation_split_is_deterministic_across_builds(built, shards, tokenizer_dir, cfg, tmp_path):
    root, stats = built
    other = build_levanter_cache(shards, tokenizer_dir, str(tmp_path / "again"), cfg)
    assert other.validation == stats.validation and other.train == stats.train
    for a, b in zip(_rows(f"{root}/validation"), _rows(str(tmp_path / "again" / "validation"))):
        assert np.array_equal(a, b)


def test_incremental_append_trim_and_change(shards, tokenizer_dir, cfg, built, write_docs, corpus, tmp_path):
    full_root, full = built
    root = str(tmp_path / "inc")
    first = build_levanter_cache(shards[:2], tokenizer_dir, root, cfg)
    assert (first.shards_encoded, first.shards_reused) == (2, 0)

    grown = build_levanter_cache(shards, tokenizer_dir, root, cfg)
    assert (grown.shards_encoded, grown.shards_reused) == (1, 2)
    assert grown.train == full.train and grown.validation == full.validation
    for split in ("train", "validation"):
        for a, b in zip(_rows(f"{root}/{split}"), _rows(f"{full_root}/{split}"), strict=True):
            assert np.array_equal(a, b)

    same = build_levanter_cache(shards, tokenizer_dir, root, cfg)
    assert (same.shards_encoded, same.shards_reused) == (0, 3)

    trimmed = build_levanter_cache(shards[:1], tokenizer_dir, root, cfg)
    assert (trimmed.shards_encoded, trimmed.shards_reused, trimmed.shards) == (0, 1, 1)
    assert len(_rows(f"{root}/train")) == trimmed.train.documents

    # A changed upstream file is re-encoded, and everything after it too.
    changed = str(tmp_path / "changed.parquet")
    write_docs(changed, corpus[:5])
    mixed = build_levanter_cache([shards[0], changed], tokenizer_dir, root, cfg)
    assert (mixed.shards_encoded, mixed.shards_reused) == (1, 1)
    write_docs(changed, corpus[:7])
    os.utime(changed, (1, 1))  # different content and mtime
    again = build_levanter_cache([shards[0], changed], tokenizer_dir, root, cfg)
    assert (again.shards_encoded, again.shards_reused) == (1, 1)
    assert again.documents == mixed.documents + 2
    assert decode_roundtrip_check(root, tokenizer_dir, [shards[0], changed], sample_n=1000) == []

    # A different split fraction changes which rows exist: full rebuild.
    rebuilt = build_levanter_cache(shards[:1], tokenizer_dir, root, CacheConfig(validation_fraction=0.5))
    assert (rebuilt.shards_encoded, rebuilt.shards_reused) == (1, 0)


def _same_rows(root: str, other: str) -> None:
    for split in ("train", "validation"):
        for a, b in zip(_rows(f"{root}/{split}"), _rows(f"{other}/{split}"), strict=True):
            assert np.array_equal(a, b)


def _file_hashes(root: str) -> dict[str, str]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _process_pool_map(fn, items, shared):
    """Shards encoded by two worker processes (spawned: they import the module by name, as Ray's
    workers do), finishing in whatever order they finish."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(fn, items, [shared] * len(items)))


@pytest.mark.slow  # two token cache builds, one fanned out
def test_fanned_out_encoding_gives_the_serial_builds_bytes(built, shards, tokenizer_dir, cfg, tmp_path):
    serial_root, serial = built
    root = str(tmp_path / "fanned")
    fanned = build_levanter_cache(shards, tokenizer_dir, root, cfg, parallel_map=_process_pool_map)
    timings = ("cache_root", "encode_seconds", "assembly_seconds")
    assert {k: v for k, v in fanned.to_dict().items() if k not in timings} == \
        {k: v for k, v in serial.to_dict().items() if k not in timings}
    hashes = _file_hashes(root)
    assert hashes == _file_hashes(serial_root)  # every array shard file, ledger and manifest
    assert not any(path.startswith(".encoded") for path in hashes)  # the per-shard rows are gone

    # An append spread over workers equals the serial append too.
    grown = str(tmp_path / "grown")
    build_levanter_cache(shards[:1], tokenizer_dir, grown, cfg)
    build_levanter_cache(shards, tokenizer_dir, grown, cfg, parallel_map=_process_pool_map)
    serial_grown = str(tmp_path / "serial_grown")
    build_levanter_cache(shards[:1], tokenizer_dir, serial_grown, cfg)
    build_levanter_cache(shards, tokenizer_dir, serial_grown, cfg)
    assert _file_hashes(grown) == _file_hashes(serial_grown)


def test_two_fresh_builds_give_the_same_bytes_whatever_the_tokenizers_bookkeeping(shards, tokenizer_dir, cfg,
                                                                                   tmp_path):
    """The tokenizer artifact's own manifest (build times) and lease are not the tokenizer: two
    builds of the same cache from it are byte for byte the same (they once differed in the
    manifest's tokenizer hash)."""
    import shutil

    tokenizer = str(tmp_path / "tokenizer")
    shutil.copytree(tokenizer_dir, tokenizer)
    hashes = []
    for build, stamp in enumerate(("2026-12-05T04:00:00", "2026-12-05T05:00:00")):
        with open(f"{tokenizer}/.artifact.json", "w") as f:
            json.dump({"finished_at": stamp}, f)
        build_levanter_cache(shards, tokenizer, str(tmp_path / f"cache-{build}"), cfg)
        hashes.append(_file_hashes(str(tmp_path / f"cache-{build}")))
    assert hashes[0] == hashes[1]


def _small_shard_files(full_root: str, monkeypatch) -> dict[str, list[np.ndarray]]:
    """Shrink Levanter's zarr shard files to 4,096 values (1,024 per chunk), on our writer's side and
    on Levanter's reader's, which checks an array's chunk grid against its own constants; returns
    the rows of the cache at `full_root`, read before, at full size."""
    import levanter.store.jagged_array as jagged

    import marin_assets.tokenization.assembly as assembly
    import marin_assets.tokenization.cache_format as cache_format

    expected = {split: _rows(f"{full_root}/{split}") for split in ("train", "validation")}
    for module, row, shard in ((cache_format, "ROW_CHUNK", "SHARD_CHUNK"),
                               (jagged, "DEFAULT_CHUNK_SIZE", "DEFAULT_WRITE_CHUNK_SIZE")):
        monkeypatch.setattr(module, row, 1024)
        monkeypatch.setattr(module, shard, 4096)
    monkeypatch.setattr(assembly, "SHARD_CHUNK", 4096)  # assembly's own binding: whether it spreads its units
    return expected


@pytest.mark.slow  # a token cache over many shard files
def test_assembly_over_many_shard_files_spreads_one_unit_per_file(shards, tokenizer_dir, cfg, built, monkeypatch,
                                                                  tmp_path):
    """With shard files of 4,096 values, the cache spans dozens of them: each is its own unit of
    assembly, written by whichever worker takes it, and the arrays come out as one writer's would."""
    full_root, _ = built
    expected = _small_shard_files(full_root, monkeypatch)
    mapped = []

    def recording_pool_map(fn, items, shared):
        mapped.append((fn.__name__, len(items)))
        return _process_pool_map(fn, items, shared)

    fanned, serial = str(tmp_path / "fanned"), str(tmp_path / "serial")
    build_levanter_cache(shards[:1], tokenizer_dir, fanned, cfg, parallel_map=recording_pool_map)
    build_levanter_cache(shards, tokenizer_dir, fanned, cfg, parallel_map=recording_pool_map)
    # The first build's one shard is encoded in a pool of its own; the append's two likewise; every
    # build's shard files are assembled by the pool, one unit each.
    assert [name for name, _ in mapped] == ["encode_parquet_shard", "assemble_file"] * 2 and mapped[-1][1] > 10
    build_levanter_cache(shards[:1], tokenizer_dir, serial, cfg)
    build_levanter_cache(shards, tokenizer_dir, serial, cfg)
    hashes = _file_hashes(fanned)
    assert hashes == _file_hashes(serial)
    assert sum(path.startswith("train/input_ids/data/c/") for path in hashes) > 10
    for split, rows in expected.items():  # Levanter reads the same rows as from the one-file layout
        for a, b in zip(_rows(f"{fanned}/{split}"), rows, strict=True):
            assert np.array_equal(a, b)


def test_a_shard_that_fails_to_encode_is_reported_alone(shards, tokenizer_dir, cfg, built, monkeypatch, tmp_path):
    from levanter.store.cache import TreeCache

    import marin_assets.tokenization.encoding as encoding

    full_root, _ = built
    root = str(tmp_path / "failing")
    build_levanter_cache(shards[:1], tokenizer_dir, root, cfg)
    before = _file_hashes(root)
    real_encode = encoding._Encoder.encode_texts
    bad = shards[1]
    encoded: list[str] = []

    def encode_texts(self, texts):
        if self.failing:
            raise RuntimeError("simulated bad shard")
        return real_encode(self, texts)

    real_encode_shard = encoding._encode_shard

    def encode_shard(shard, job):
        encoded.append(shard.key)
        monkeypatch.setattr(encoding._Encoder, "failing", shard.key == bad, raising=False)
        return real_encode_shard(shard, job)

    monkeypatch.setattr(encoding._Encoder, "encode_texts", encode_texts)
    monkeypatch.setattr(encoding, "_encode_shard", encode_shard)
    with pytest.raises(encoding.ShardEncodingError, match=r"1 of 2 shard\(s\).*part-1.*simulated bad shard") as err:
        build_levanter_cache(shards, tokenizer_dir, root, cfg)
    assert shards[2] not in str(err.value)
    assert encoded == shards[1:]  # the sibling after the bad shard was still encoded
    # The committed cache was not touched: it is the one-shard cache, finished, and Levanter reads it.
    assert {k: v for k, v in _file_hashes(root).items() if not k.startswith(".encoded")} == before
    assert len(TreeCache.load(f"{root}/train", EXEMPLAR)) > 0

    encoded.clear()
    monkeypatch.setattr(encoding._Encoder, "encode_texts", real_encode)
    resumed = build_levanter_cache(shards, tokenizer_dir, root, cfg)
    assert encoded == shards[1:] and (resumed.shards_reused, resumed.shards_encoded) == (1, 2)
    _same_rows(root, full_root)


def test_a_killed_assembly_leaves_the_cache_readable_and_resumes_without_encoding(shards, tokenizer_dir, cfg, built,
                                                                                  monkeypatch, tmp_path):
    from levanter.store.cache import TreeCache

    import marin_assets.tokenization.assembly as assembly
    import marin_assets.tokenization.encoding as encoding

    full_root, _ = built
    root = str(tmp_path / "crash")
    build_levanter_cache(shards[:1], tokenizer_dir, root, cfg)
    before = _rows(f"{root}/train")
    real_assemble = assembly.assemble_file
    seen = []

    def killed_after_one_unit(unit, job):
        if seen:  # one shard file is written, the next is not
            raise RuntimeError("simulated crash")
        seen.append(unit)
        return real_assemble(unit, job)

    monkeypatch.setattr(assembly, "assemble_file", killed_after_one_unit)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_levanter_cache(shards, tokenizer_dir, root, cfg)
    monkeypatch.setattr(assembly, "assemble_file", real_assemble)
    # Mid-append, Levanter still reads the one-shard cache, row for row.
    cache = TreeCache.load(f"{root}/train", EXEMPLAR)
    assert len(cache) == len(before)
    for a, b in zip(_rows(f"{root}/train"), before, strict=True):
        assert np.array_equal(a, b)

    encodes = {"n": 0}
    real_encode = encoding._Encoder.encode_texts

    def counting_encode(self, texts):
        encodes["n"] += 1
        return real_encode(self, texts)

    monkeypatch.setattr(encoding._Encoder, "encode_texts", counting_encode)
    resumed = build_levanter_cache(shards, tokenizer_dir, root, cfg)
    assert encodes["n"] == 0  # every shard's rows were already encoded: assembly only moves them
    assert (resumed.shards_reused, resumed.shards_encoded) == (1, 2)
    _same_rows(root, full_root)
    assert not os.path.exists(f"{root}/.encoded")
    assert _file_hashes(root).keys() == _file_hashes(full_root).keys()


def test_a_rerun_with_fewer_shards_zeroes_what_a_killed_assembly_left(shards, tokenizer_dir, cfg, monkeypatch,
                                                                       tmp_path):
    import marin_assets.tokenization.assembly as assembly

    root = str(tmp_path / "shrunk")
    build_levanter_cache(shards[:1], tokenizer_dir, root, cfg)
    real_assemble = assembly.assemble_file
    written = []

    def killed_after_every_unit(unit, job):
        written.append(real_assemble(unit, job))
        if len(written) == len(job.units("train")) + len(job.units("validation")):
            raise RuntimeError("simulated crash")  # every value written, the row counts not yet
        return written[-1]

    monkeypatch.setattr(assembly, "assemble_file", killed_after_every_unit)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_levanter_cache(shards, tokenizer_dir, root, cfg)
    monkeypatch.setattr(assembly, "assemble_file", real_assemble)
    build_levanter_cache(shards[:2], tokenizer_dir, root, cfg)  # the third shard is no longer wanted
    clean = str(tmp_path / "clean")
    build_levanter_cache(shards[:1], tokenizer_dir, clean, cfg)
    build_levanter_cache(shards[:2], tokenizer_dir, clean, cfg)
    assert _file_hashes(root) == _file_hashes(clean)  # nothing of the third shard is left in the arrays


def test_bad_inputs_give_clear_errors(tokenizer_dir, write_docs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    no_text = str(tmp_path / "no_text.parquet")
    pq.write_table(pa.table({"id": ["a"], "body": ["x"]}), no_text)
    with pytest.raises(ValueError, match="missing column"):
        build_levanter_cache([no_text], tokenizer_dir, str(tmp_path / "c1"), CacheConfig())
    with pytest.raises(FileNotFoundError):
        build_levanter_cache([str(tmp_path / "absent.parquet")], tokenizer_dir, str(tmp_path / "c2"), CacheConfig())
    with pytest.raises(ValueError, match="empty"):
        build_levanter_cache([], tokenizer_dir, str(tmp_path / "c3"), CacheConfig())
    ok = write_docs(str(tmp_path / "ok.parquet"), ["some text"])
    with pytest.raises(ValueError, match="duplicate"):
        build_levanter_cache([ok, ok], tokenizer_dir, str(tmp_path / "c4"), CacheConfig())


def test_build_from_in_memory_documents(corpus, tokenizer_dir, tmp_path):
    docs = [(_doc_id(t), t) for t in corpus[:40]]
    stats = build_levanter_cache_from_documents(iter(docs), tokenizer_dir, str(tmp_path / "mem"),
                                                CacheConfig(validation_fraction=0.0))
    assert (stats.documents, stats.validation.documents) == (40, 0)
    assert len(_rows(str(tmp_path / "mem" / "validation"))) == 0
    assert len(_rows(str(tmp_path / "mem" / "train"))) == 40


@pytest.fixture(scope="module")
def appended(shards, tokenizer_dir, cfg, tmp_path_factory):
    """The same documents as `built`, the last shard appended to a cache of the first two."""
    root = str(tmp_path_factory.mktemp("appended") / "root")
    build_levanter_cache(shards[:2], tokenizer_dir, root, cfg)
    stats = build_levanter_cache(shards, tokenizer_dir, root, cfg)
    assert (stats.shards_encoded, stats.shards_reused) == (1, 2)
    return root, stats


@pytest.mark.parametrize("cache", ["built", "appended"])
def test_levanter_trains_from_the_rendered_mixture(cache, request, tokenizer_dir, caplog):
    import draccus
    import haliax as hax
    import jax
    from levanter.data.text import LMMixtureDatasetConfig
    from levanter.main.train_lm import TrainLmConfig
    from levanter.schedule import BatchSchedule

    root, stats = request.getfixturevalue(cache)
    spec = MixtureSpec(
        name="test-mix",
        components={
            "stdlib": MixtureComponent(root, 1.0),
            "heldout": MixtureComponent(root, 0.0, tags=("eval",)),
        },
        tokenizer_dir=tokenizer_dir,
        seq_len=64,
        shuffle=False,
    )
    data = render_levanter_data_config(spec)
    # The rendered dict is what TrainLmConfig.data decodes to, via draccus like a YAML config.
    assert isinstance(draccus.decode(TrainLmConfig, {"data": data}).data, LMMixtureDatasetConfig)
    config = draccus.decode(LMMixtureDatasetConfig, data)
    name_tokenizer_as_ledgers_do(config)  # as train_main does

    Pos = hax.Axis("position", spec.seq_len)
    with caplog.at_level(logging.INFO):
        train = config.train_set(Pos, BatchSchedule(4), key=jax.random.PRNGKey(0)).as_sync_dataset()
        first = train[0]
        validation = config.validation_sets(Pos)
    assert not [r for r in caplog.records
                if "Metadata mismatch" in r.getMessage() or "Building cache" in r.getMessage()]

    # Training sequences are seq_len-aligned windows of the concatenated train rows (the mixture
    # only permutes their order within a block).
    flat = np.concatenate(_rows(f"{root}/train"))
    windows = flat[: len(flat) // spec.seq_len * spec.seq_len].reshape(-1, spec.seq_len)
    assert len(windows) == stats.train.tokens // spec.seq_len > 0
    assert (windows == np.asarray(first.tokens.array)).all(axis=1).any()
    # Both components are evaluated on the validation split, including the weight-0 one.
    assert sorted(validation) == ["heldout", "stdlib"]
    n_val = len(validation["heldout"].as_sync_dataset())
    assert n_val == stats.validation.tokens // spec.seq_len > 0


def test_fsspec_uris_for_documents_and_tokenizer(corpus, tokenizer_dir, write_docs, tmp_path):
    import fsspec

    from marin_assets.tokenization.tokenizer import adopt_tokenizer

    fs = fsspec.filesystem("memory")
    local = write_docs(str(tmp_path / "d.parquet"), corpus[:30])
    fs.put_file(local, "/tok-test/docs/d.parquet")
    remote_tok = "memory://tok-test/tokenizer"
    art = adopt_tokenizer(tokenizer_dir, remote_tok)  # written through a local temp dir, then uploaded
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/tok-test/tokenizer", detail=False)) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"
    ]
    docs = ["memory://tok-test/docs/d.parquet"]
    stats = build_levanter_cache(docs, remote_tok, str(tmp_path / "c"), CacheConfig(validation_fraction=0.2))
    assert stats.documents == 30 and art.vocab_size == 512
    assert decode_roundtrip_check(str(tmp_path / "c"), remote_tok, docs, sample_n=30) == []


def test_append_rewrites_only_the_tail_of_levanters_zarr_shards(shards, tokenizer_dir, cfg, built, monkeypatch,
                                                                 tmp_path):
    """Levanter stores 128 Mi tokens per zarr shard file (`data/c/<k>`). With that size scaled down
    (the same code path writes and reads), an append leaves every data shard file before the old
    tail byte-identical: what a cache larger than 128 Mi tokens gets at full size."""
    full_root, _ = built
    expected = _small_shard_files(full_root, monkeypatch)
    root = tmp_path / "small-shards"

    def files() -> dict[str, str]:
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in root.rglob("*") if p.is_file()}

    build_levanter_cache(shards[:2], tokenizer_dir, str(root), cfg)
    before = files()
    grown = build_levanter_cache(shards, tokenizer_dir, str(root), cfg)
    assert (grown.shards_encoded, grown.shards_reused) == (1, 2)
    after = files()

    data = sorted((p for p in before if p.startswith("train/input_ids/data/c/")),
                  key=lambda p: int(p.rsplit("/", 1)[1]))
    assert len(data) > 3
    changed = {p for p in before if after[p] != before[p]}
    assert changed & set(data) <= {data[-1]}
    assert len([p for p in after if p.startswith("train/input_ids/data/c/")]) > len(data)
    for split in ("train", "validation"):
        for a, b in zip(_rows(str(root / split)), expected[split], strict=True):
            assert np.array_equal(a, b)


def test_appending_a_shard_imports_neither_levanter_nor_jax(shards, tokenizer_dir, cfg, built, tmp_path):
    """The fixed cost of one new shard: a process that appends it loads no Levanter, JAX, Ray or
    transformers (the metadata Levanter expects is in the manifest); Levanter reads the result."""
    import subprocess
    import sys

    full_root, _ = built
    root = str(tmp_path / "root")
    build_levanter_cache(shards[:2], tokenizer_dir, root, cfg)
    code = ("import json, sys\nfrom marin_assets.tokenization.cache import build_levanter_cache\n"
            "from marin_assets.tokenization.cache_config import CacheConfig\n"
            f"stats = build_levanter_cache({shards!r}, {tokenizer_dir!r}, {root!r}, {cfg!r})\n"
            "print(json.dumps([stats.shards_encoded, stats.shards_reused,\n"
            "                  sorted(m for m in ('levanter', 'jax', 'ray', 'transformers') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [1, 2, []]
    for split in ("train", "validation"):
        for a, b in zip(_rows(f"{root}/{split}"), _rows(f"{full_root}/{split}"), strict=True):
            assert np.array_equal(a, b)
    assert decode_roundtrip_check(root, tokenizer_dir, shards[2:], sample_n=100) == []


def test_bos_and_eos_from_the_tokenizers_files_match_transformers(tokenizer_dir, tmp_path):
    """The ids a build encodes with before Levanter's metadata is ready are the ones transformers reads."""
    import shutil

    from transformers import AutoTokenizer

    from marin_assets.tokenization.cache_format import special_token_ids

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert special_token_ids(tokenizer_dir) == (hf.bos_token_id, hf.eos_token_id)
    unnamed = tmp_path / "unnamed"
    shutil.copytree(tokenizer_dir, unnamed)
    (unnamed / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    assert special_token_ids(str(unnamed)) is None  # no BOS named: transformers decides


def test_a_validation_minimum_holds_out_the_lowest_hashes_and_changes_no_other_identity(shards, tokenizer_dir, cfg,
                                                                                         tmp_path):
    from dataclasses import asdict, replace

    from marin_assets.tokenization.cache import cache_config_of, iter_split_documents
    from marin_assets.tokenization.cache_config import with_validation_minimum
    from marin_assets.tokenization.encoding import parquet_ids

    # Without a minimum, a config's identity is what it was before the field existed.
    assert "validation_min_documents" not in cfg.identity() and "validation_min_documents" not in cfg.row_identity()
    assert cfg.identity() == {k: v for k, v in asdict(cfg).items() if k not in ("validation_min_documents", "chat")}
    ids = list(parquet_ids(shards, cfg))
    tiny = replace(cfg, validation_fraction=0.001, validation_min_documents=12)
    by_fraction = sum(is_validation_document(i, 0.001) for i in ids)
    assert by_fraction < 12
    raised = with_validation_minimum(tiny, reversed(ids))
    assert raised == with_validation_minimum(tiny, ids)  # the order of the corpus does not matter
    held_out = sorted(i for i in ids if is_validation_document(i, raised.validation_fraction))
    lowest = sorted(ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())[:12]
    assert held_out == sorted(lowest)
    # A fraction that holds out enough already is kept as it is; at most half the corpus is held out.
    enough = replace(cfg, validation_min_documents=2)
    assert with_validation_minimum(enough, ids) == enough
    assert with_validation_minimum(replace(tiny, validation_min_documents=10**6), ids).validation_fraction < 0.6

    stats = build_levanter_cache(shards, tokenizer_dir, str(tmp_path / "min"), tiny)
    assert stats.validation.documents == 12 and stats.train.documents == len(ids) - 12
    # Readers of the cache see the split it was built with (the threshold is in its recorded identity).
    split_cfg, identity = cache_config_of(str(tmp_path / "min"))
    assert identity["validation_min_documents"] == 12
    assert sorted(i for i, _ in iter_split_documents(shards, split_cfg, "validation")) == sorted(lowest)


def test_encoding_in_this_process_reports_each_shard(shards, tokenizer_dir, cfg, tmp_path):
    from marin_resources.progress import ProgressMeter

    lines: list[str] = []
    stats = build_levanter_cache(shards, tokenizer_dir, str(tmp_path / "root"), cfg,
                                 progress=ProgressMeter(lines.append, "encoded", every_s=0))
    assert len(lines) == len(shards)  # one line after each shard
    assert lines[-1].startswith(f"[progress] encoded: {stats.documents:,} documents, ")


def test_a_shard_encoded_in_row_ranges_gives_the_one_piece_row_files(shards, tokenizer_dir, cfg, tmp_path):
    """A huge shard's `token_shards` partition spread over workers: its rows in ranges that cut
    through row groups (one of them empty, one holding the rows to skip), run in any order, then
    concatenated: every row file and the entry are the one-piece encoding's, and the ranges' own
    files are gone."""
    import pyarrow.parquet as pq

    from marin_assets.tokenization.encoding import ROWS, ShardSpec, encode_shard_rows, parquet_rows

    table = pq.read_table(shards[1])  # ends with a null text, an empty text and a null id
    uri = str(tmp_path / "grouped.parquet")
    pq.write_table(table, uri, row_group_size=7)
    rows, text_bytes = parquet_rows(uri)
    assert rows == table.num_rows and text_bytes > 0
    spec = ShardSpec("store://grouped", "fp", uri)
    whole = encode_shard_rows(spec, tokenizer_dir, str(tmp_path / "whole"), cfg)

    ran: list[tuple[int, int]] = []

    def backwards(fn, items, shared):  # the last range first, as workers may finish them
        results = {item: fn(item, shared) for item in reversed(items)}
        ran.extend(reversed(items))
        return [results[item] for item in items]

    ranges = [(0, 10), (10, 10), (10, rows - 2), (rows - 2, rows)]
    parts = tmp_path / "parts"
    weighed: list[np.ndarray] = []
    spread = encode_shard_rows(spec, tokenizer_dir, str(tmp_path / "spread"), cfg,
                               split_rows=lambda weights: weighed.append(weights) or ranges, parts_uri=str(parts),
                               parallel_map=backwards)
    assert len(weighed[0]) == rows and weighed[0].sum() <= text_bytes  # each row weighed from the footer
    assert ran == ranges[::-1]
    assert _file_hashes(str(tmp_path / "spread")) == _file_hashes(str(tmp_path / "whole"))
    assert {k: v for k, v in spread.items() if k != ROWS} == {k: v for k, v in whole.items() if k != ROWS}
    assert spread["skipped_documents"] == 3 and not parts.exists()
    for bad in ([(0, 5), (6, rows)], [(0, 5), (5, rows - 1)]):  # a gap; rows left out
        with pytest.raises(ValueError, match=f"consecutive and cover the file's {rows} rows"):
            encode_shard_rows(spec, tokenizer_dir, str(tmp_path / "bad"), cfg, split_rows=lambda _, bad=bad: bad,
                              parts_uri=str(parts))


def test_a_cache_assembled_from_shards_encoded_on_their_own_is_the_serial_builds(shards, tokenizer_dir, cfg, built,
                                                                                  tmp_path):
    """`token_shards/<source>`'s path: each shard encoded into a folder of its own (as its own
    partition's run would, in any order), then `assemble_levanter_cache`, fresh and appended, with
    and without a validation minimum: every file equals `build_levanter_cache`'s."""
    from dataclasses import replace

    from marin_assets.tokenization.assembly import assemble_levanter_cache
    from marin_assets.tokenization.encoding import ShardSpec, encode_shard_rows

    def encoded(config: CacheConfig) -> list[dict]:
        by_shard = {uri: encode_shard_rows(ShardSpec(uri, f"fp-{k}", uri), tokenizer_dir,
                                           str(tmp_path / "rows" / str(config.validation_fraction) / str(k)), config)
                    for k, uri in reversed(list(enumerate(shards)))}
        return [by_shard[uri] for uri in shards]

    fingerprints = {uri: f"fp-{k}" for k, uri in enumerate(shards)}
    serial_root = str(tmp_path / "serial")
    build_levanter_cache(shards, tokenizer_dir, serial_root, cfg, fingerprints=fingerprints)
    rows = encoded(cfg)
    root = str(tmp_path / "assembled")
    stats = assemble_levanter_cache(rows, tokenizer_dir, root, cfg)
    assert _file_hashes(root) == _file_hashes(serial_root)
    assert stats.documents == built[1].documents and stats.shards_encoded == len(shards)
    for split in ("train", "validation"):  # Levanter reads the assembled cache's rows as the serial build's
        ours, theirs = _rows(f"{root}/{split}"), _rows(f"{built[0]}/{split}")
        assert len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(ours, theirs))

    # An append moves the new shard's rows only; the same rows again change nothing.
    grown, serial_grown = str(tmp_path / "grown"), str(tmp_path / "serial_grown")
    assemble_levanter_cache(rows[:2], tokenizer_dir, grown, cfg)
    appended = assemble_levanter_cache(rows, tokenizer_dir, grown, cfg)
    assert (appended.shards_reused, appended.shards_encoded) == (2, 1)
    build_levanter_cache(shards[:2], tokenizer_dir, serial_grown, cfg, fingerprints=fingerprints)
    build_levanter_cache(shards, tokenizer_dir, serial_grown, cfg, fingerprints=fingerprints)
    assert _file_hashes(grown) == _file_hashes(serial_grown)
    assert assemble_levanter_cache(rows, tokenizer_dir, grown, cfg).shards_encoded == 0

    # A minimum the fraction does not meet is decided over the whole corpus at assembly: the shards
    # were split by the fraction alone, and their rows are split again, not encoded again.
    tiny = replace(cfg, validation_fraction=0.001, validation_min_documents=12)
    tiny_rows = encoded(tiny)
    assert sum(e["validation_documents"] for e in tiny_rows) < 12
    minimum, serial_minimum = str(tmp_path / "minimum"), str(tmp_path / "serial_minimum")
    assert assemble_levanter_cache(tiny_rows, tokenizer_dir, minimum, tiny).validation.documents == 12
    build_levanter_cache(shards, tokenizer_dir, serial_minimum, tiny, fingerprints=fingerprints)
    assert _file_hashes(minimum) == _file_hashes(serial_minimum)
    # Growing: the threshold moves with the corpus (a rebuild, as the serial build does).
    few, serial_few = str(tmp_path / "few"), str(tmp_path / "serial_few")
    small = replace(tiny, validation_min_documents=3)
    small_rows = encoded(small)
    for cut in (2, 3):
        assemble_levanter_cache(small_rows[:cut], tokenizer_dir, few, small)
        build_levanter_cache(shards[:cut], tokenizer_dir, serial_few, small, fingerprints=fingerprints)
        assert _file_hashes(few) == _file_hashes(serial_few)

    # Rows encoded with other settings are refused, naming the shard, and the cache stays as it was.
    before = _file_hashes(root)
    with pytest.raises(ValueError, match=r"1 shard\(s\) were encoded with another tokenizer or settings .*part-0"):
        assemble_levanter_cache([tiny_rows[0], *rows[1:]], tokenizer_dir, root, cfg)
    assert _file_hashes(root) == before


def test_shards_the_cache_holds_are_appended_to_from_its_ledger_without_their_rows(shards, tokenizer_dir, cfg,
                                                                                     tmp_path):
    """An append given the shards the cache holds as its own ledger entries (`held_shards`: no row files,
    as `tokenized/<source>` gives them without looking them up) writes the same bytes as one given every
    shard's rows. Where the assembly would need their rows (a shard before them removed, a raised
    validation threshold), it refuses naming them and the cache stays as it was; a ledger that is not
    the committed one is not used."""
    import hashlib
    import shutil
    from dataclasses import replace

    from marin_assets.tokenization.assembly import assemble_levanter_cache, held_shards
    from marin_assets.tokenization.cache_format import MANIFEST_NAME
    from marin_assets.tokenization.encoding import ShardSpec, encode_shard_rows

    rows = [encode_shard_rows(ShardSpec(uri, f"fp-{k}", uri), tokenizer_dir, str(tmp_path / "rows" / str(k)), cfg)
            for k, uri in enumerate(shards)]
    full, held = str(tmp_path / "full"), str(tmp_path / "held")
    assemble_levanter_cache(rows[:2], tokenizer_dir, full, cfg)
    shutil.copytree(full, held)
    sha = hashlib.sha256(open(f"{held}/{MANIFEST_NAME}", "rb").read()).hexdigest()
    wanted = {e["key"]: e["fingerprint"] for e in rows}
    ledger = held_shards(held, wanted, cfg, sha256=sha)
    assert [e["key"] for e in ledger] == shards[:2] and all("rows" not in e for e in ledger)
    assert held_shards(held, wanted, cfg, sha256="0" * 64) == []  # not the committed ledger
    assert held_shards(held, {**wanted, shards[0]: "fp-changed"}, cfg, sha256=sha) == []  # changed first shard
    assert held_shards(held, wanted, replace(cfg, validation_fraction=0.5), sha256=sha) == []

    appended = assemble_levanter_cache([*ledger, rows[2]], tokenizer_dir, held, cfg)
    assert (appended.shards_reused, appended.shards_encoded) == (2, 1)
    assemble_levanter_cache(rows, tokenizer_dir, full, cfg)
    assert _file_hashes(held) == _file_hashes(full)

    # The first shard gone: the second's rows move, and a held entry has none.
    before = _file_hashes(held)
    with pytest.raises(ValueError, match=r"1 shard\(s\) were given as held by the cache.*part-1.*does not keep"):
        assemble_levanter_cache([ledger[1], rows[2]], tokenizer_dir, held, cfg)
    # A validation minimum the fraction does not meet reads every shard's id hashes.
    with pytest.raises(ValueError, match=r"2 shard\(s\) were given as held.*raised validation threshold"):
        assemble_levanter_cache([*ledger, rows[2]], tokenizer_dir, held,
                                replace(cfg, validation_min_documents=10**6))
    assert _file_hashes(held) == before
