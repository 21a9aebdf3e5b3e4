"""Tokenize curated documents into a Levanter cache root (`<root>/train`, `<root>/validation`): the
entry points, and what a finished cache's manifest says.

A build encodes each shard on its own (`encoding.py`: HF `tokenizers`, one unit of work per shard,
in the build's process or spread over workers by the `parallel_map` a caller passes), then
assembly (`assembly.py`) moves the encoded rows into the cache in ledger order, one shard file per
unit, keeping the shards an earlier build committed. The cache is written in Levanter's own layout
without importing Levanter (`cache_format.py`); the settings and totals are in `cache_config.py`.

Each split is a TreeCache whose single field is `input_ids` (int32), one row per document:
`[BOS] + ids(text) + [EOS]`. A document goes to validation when
`int(sha256(id)[:8], 16) / 2**32 < validation_fraction`.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from marin_assets.tokenization.assembly import assemble_shards, require_distinct_keys, reuse_plan
from marin_assets.tokenization.cache_config import CacheConfig, CacheStats, stats_from_manifest, with_validation_minimum
from marin_assets.tokenization.cache_format import (
    INPUT_IDS,
    LEDGER_NAME,
    MANIFEST_NAME,
    SPLITS,
    manifest_identity,
    preprocessor_metadata,
    read_json,
    read_zarr3_array,
    special_token_ids,
)
from marin_assets.tokenization.encoding import (
    ENCODED_DIR,
    DocumentShard,
    EncodeJob,
    encode_shards,
    iter_clean_batches,
    iterator_shard,
    parquet_ids,
    parquet_shard,
)
from marin_assets.tokenization.tokenizer import local_tokenizer_dir, tokenizer_json_sha256
from marin_resources.parallel_map import ParallelMap, in_process_map
from marin_resources.progress import ProgressMeter
from marin_resources.splits import is_validation_document


def build_levanter_cache(doc_files: Sequence[str], tokenizer_dir: str, out_root: str, cfg: CacheConfig,
                         fingerprints: Mapping[str, str] | None = None,
                         parallel_map: ParallelMap = in_process_map, keys: Mapping[str, str] | None = None,
                         progress: ProgressMeter | None = None) -> CacheStats:
    """Tokenize Parquet document files into the Levanter cache root `out_root`.

    On a fresh build `doc_files` order is the row order. With `cfg.incremental`, ledger shards already
    in `out_root` whose files are unchanged stay where they are (see `reuse_plan`) and only the other
    files are encoded, appended in `doc_files` order. `fingerprints` maps a file to a content
    fingerprint (the sha256 its producer recorded); files without one are fingerprinted by size and
    mtime/ETag. `parallel_map` runs the shards' encoding (`encode_parquet_shard`, one call per file
    to encode): one after another here by default, or spread over workers (a Ray cluster); the
    cache's bytes do not depend on it. `keys` names files in the ledger (default: their URIs); the
    assets give store-relative names, so a cache's bytes do not depend on the store's prefix.
    `progress` counts the documents and text bytes encoded.
    """
    if isinstance(doc_files, str):
        raise TypeError("doc_files must be a list of Parquet paths/URIs, not a single string")
    fingerprints, keys = fingerprints or {}, keys or {}
    cfg = with_validation_minimum(cfg, parquet_ids(doc_files, cfg) if cfg.validation_min_documents else ())
    shards = [parquet_shard(os.fspath(u), cfg, fingerprints.get(os.fspath(u)), keys.get(os.fspath(u)))
              for u in doc_files]
    return _build(shards, tokenizer_dir, out_root, cfg, parallel_map, progress)


def build_levanter_cache_from_documents(
    documents: Iterable[tuple[str, str]],
    tokenizer_dir: str,
    out_root: str,
    cfg: CacheConfig,
    source_name: str = "documents",
) -> CacheStats:
    """Like `build_levanter_cache` for an in-memory iterator of (id, text); always a full rebuild."""
    if cfg.validation_min_documents is not None:
        documents = list(documents)
        cfg = with_validation_minimum(cfg, (doc_id for doc_id, _ in documents))
    return _build([iterator_shard(documents, source_name, cfg)], tokenizer_dir, out_root, cfg)


def _build(shards: Sequence[DocumentShard], tokenizer_dir: str, out_root: str, cfg: CacheConfig,
           parallel_map: ParallelMap = in_process_map, progress: ProgressMeter | None = None) -> CacheStats:
    require_distinct_keys([s.key for s in shards])
    if cfg.chat is not None:
        raise ValueError("a chat cache is assembled from shards encoded on their own (encode_shard_rows, then "
                         "assemble_levanter_cache), as tokenized/<source> builds it")
    out_root = out_root.rstrip("/")
    with local_tokenizer_dir(tokenizer_dir) as local_tok, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="levanter-metadata") as background:
        tok_sha = tokenizer_json_sha256(local_tok)
        old = read_json(f"{out_root}/{MANIFEST_NAME}") if cfg.incremental else None
        # Levanter's metadata for a new cache imports transformers (a second): it is worked out while
        # the shards are encoded with the BOS/EOS ids the tokenizer's own files give, and the two must
        # agree before anything is written.
        levanter = background.submit(preprocessor_metadata, tokenizer_dir, local_tok, old)
        bos_eos = special_token_ids(local_tok) or levanter.result()[1:3]
        identity = manifest_identity(tok_sha, *bos_eos, cfg)

        reuse, todo = reuse_plan(old, identity, shards)
        if old is not None and not todo and reuse == len(old["shards"]) and old.get("finished"):
            return stats_from_manifest(out_root, old, reused=reuse)

        job = EncodeJob(tokenizer_dir, *bos_eos, cfg, identity, f"{out_root}/{ENCODED_DIR}")
        # Encoding first, every shard as its own unit: the cache is not touched until all are encoded,
        # so a shard that fails leaves the previous cache as it was, and never a hole in a new one.
        started = time.monotonic()
        encoded = encode_shards(todo, job, parallel_map, progress)
        encode_seconds = time.monotonic() - started
        metadata, bos, eos, files_sha = levanter.result()
    if (bos, eos) != tuple(bos_eos):
        raise ValueError(f"tokenizer at {tokenizer_dir}: its files give BOS/EOS ids {tuple(bos_eos)}, transformers "
                         f"{(bos, eos)}")
    stats = assemble_shards(out_root, identity, metadata, files_sha, old, reuse, encoded, cfg.flush_tokens,
                            parallel_map)
    return replace(stats, encode_seconds=round(encode_seconds, 3))


# ---------------------------------------------------------------------------------------------
# A finished cache, as its manifest gives it


def read_cache_stats(cache_root: str) -> CacheStats:
    """Stats of a finished cache root built by `build_levanter_cache`."""
    manifest = read_json(f"{cache_root.rstrip('/')}/{MANIFEST_NAME}")
    if manifest is None or not manifest.get("finished"):
        raise FileNotFoundError(f"no finished tokenized cache at {cache_root}")
    return stats_from_manifest(cache_root, manifest, reused=len(manifest["shards"]))


def cache_shard_order(cache_root: str) -> list[str]:
    """Keys (document file URIs) of the ledger shards of a finished cache root, in row order."""
    manifest = read_json(f"{cache_root.rstrip('/')}/{MANIFEST_NAME}")
    if manifest is None or not manifest.get("finished"):
        raise FileNotFoundError(f"no finished tokenized cache at {cache_root}")
    return [s["key"] for s in manifest["shards"]]


# ---------------------------------------------------------------------------------------------
# Verification


@dataclass(frozen=True)
class RoundtripFailure:
    doc_id: str
    split: str
    row: int
    reason: str


def iter_parquet_texts(doc_files: Sequence[str], cfg: CacheConfig | None = None) -> Iterator[str]:
    """Texts of the documents a cache would hold, in cache order (e.g. to train a tokenizer)."""
    cfg = cfg or CacheConfig()
    for uri in doc_files:
        for batch in iter_clean_batches(parquet_shard(os.fspath(uri), cfg), cfg):
            yield from batch.texts


def cache_config_of(cache_root: str) -> tuple[CacheConfig, dict]:
    """How a finished cache split and read its documents, and its recorded identity."""
    manifest = read_json(f"{cache_root.rstrip('/')}/{MANIFEST_NAME}")
    if manifest is None or not manifest.get("finished"):
        raise FileNotFoundError(f"no finished tokenized cache at {cache_root}")
    ident = manifest["identity"]
    cfg = CacheConfig(validation_fraction=ident["validation_fraction"], id_column=ident["id_column"],
                      text_column=ident["text_column"])
    return cfg, ident


def iter_split_documents(doc_files: Sequence[str], cfg: CacheConfig, split: str) -> Iterator[tuple[str, str]]:
    """(id, text) of the documents a cache puts in ``split``, in cache order: e.g. the held-out
    documents a downstream task may be built from without touching what the model trained on."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for doc_id, text, held_out in iter_documents_with_split(doc_files, cfg):
        if held_out == (split == "validation"):
            yield doc_id, text


def iter_documents_with_split(doc_files: Sequence[str], cfg: CacheConfig) -> Iterator[tuple[str, str, bool]]:
    """(id, text, whether it is a validation document) of every document a cache of these files holds,
    in cache order."""
    for uri in doc_files:
        for batch in iter_clean_batches(parquet_shard(os.fspath(uri), cfg), cfg):
            for doc_id, text in zip(batch.ids, batch.texts):
                yield doc_id, text, is_validation_document(doc_id, cfg.validation_fraction)


def decode_roundtrip_check(
    cache_root: str, tokenizer_dir: str, doc_files: Sequence[str], sample_n: int = 100, seed: int = 0,
    keys: Mapping[str, str] | None = None,
) -> list[RoundtripFailure]:
    """Check ledger shards of a finished cache against their document files, reading rows back.

    `doc_files` are the files of some of the cache's ledger shards, in any order: each shard's rows
    are located from the manifest's per-shard counts, so only these files are read (checking the
    shards a build appended costs those shards, not the corpus). Per file: its documents per split
    match the ledger's count. For a random sample of their documents: the row starts with BOS, ends
    with EOS, and decode(row[1:-1]) == text. For the whole cache: each split's row count, in the
    arrays and in Levanter's ledger, matches the manifest. `keys` gives the files' ledger keys as
    the build was given them. Returns the failures (empty: all good).
    """
    from tokenizers import Tokenizer

    cache_root = cache_root.rstrip("/")
    cfg, ident = cache_config_of(cache_root)
    manifest = read_json(f"{cache_root}/{MANIFEST_NAME}")
    failures: list[RoundtripFailure] = []
    first_row: dict[str, dict[str, int]] = {split: {} for split in SPLITS}  # shard key -> its first row
    expected: dict[str, dict[str, int]] = {split: {} for split in SPLITS}  # shard key -> its rows
    arrays = {}
    for split in SPLITS:
        row = 0
        for entry in manifest["shards"]:
            first_row[split][entry["key"]], expected[split][entry["key"]] = row, entry[f"{split}_documents"]
            row += entry[f"{split}_documents"]
        arrays[split] = (read_zarr3_array(f"{cache_root}/{split}/{INPUT_IDS}/offsets"),
                         read_zarr3_array(f"{cache_root}/{split}/{INPUT_IDS}/data"))
        stored = int(arrays[split][0][0].read().result())
        ledger = read_json(f"{cache_root}/{split}/{LEDGER_NAME}") or {}
        if stored != row or ledger.get("total_num_rows") != row or not ledger.get("is_finished"):
            failures.append(RoundtripFailure("", split, -1, f"the manifest gives {row} rows, the arrays hold {stored}, "
                                             f"Levanter's ledger says {ledger.get('total_num_rows')} "
                                             f"(finished: {ledger.get('is_finished')})"))

    rng = random.Random(seed)
    sample: list[tuple[str, int, str, str]] = []  # (split, row, id, text): reservoir sample
    seen = 0
    for uri in doc_files:
        key = (keys or {}).get(os.fspath(uri), os.fspath(uri))
        if key not in first_row["train"]:
            failures.append(RoundtripFailure("", "", -1, f"{key} is not a ledger shard of {cache_root}"))
            continue
        rows = {split: 0 for split in SPLITS}
        for batch in iter_clean_batches(parquet_shard(os.fspath(uri), cfg), cfg):
            for doc_id, text in zip(batch.ids, batch.texts):
                split = "validation" if is_validation_document(doc_id, cfg.validation_fraction) else "train"
                item = (split, first_row[split][key] + rows[split], doc_id, text)
                rows[split] += 1
                seen += 1
                if len(sample) < sample_n:
                    sample.append(item)
                elif (j := rng.randrange(seen)) < sample_n:
                    sample[j] = item
        for split in SPLITS:
            if rows[split] != expected[split][key]:
                failures.append(RoundtripFailure("", split, -1, f"{key}: {rows[split]} documents, the ledger holds "
                                                 f"{expected[split][key]} rows"))

    with local_tokenizer_dir(tokenizer_dir) as local_tok:
        tok = Tokenizer.from_file(os.path.join(local_tok, "tokenizer.json"))
    bos, eos = ident["bos_token_id"], ident["eos_token_id"]
    for split, row, doc_id, text in sorted(sample):
        offsets, data = arrays[split]
        if row >= int(offsets[0].read().result()):
            continue  # counted above
        bounds = offsets[row:row + 2].read().result()
        ids = data[int(bounds[0]) if row else 0:int(bounds[1])].read().result()
        if ids.size < 2 or ids[0] != bos or ids[-1] != eos:
            failures.append(RoundtripFailure(doc_id, split, row, "row does not start with BOS and end with EOS"))
            continue
        decoded = tok.decode(ids[1:-1].tolist(), skip_special_tokens=False)
        if decoded != text:
            failures.append(
                RoundtripFailure(doc_id, split, row, f"decoded text differs ({len(decoded)} vs {len(text)} chars)")
            )
    return failures


def chat_rows_check(cache_root: str, seq_len: int, sample_n: int = 100, seed: int | str = 0) -> list[RoundtripFailure]:
    """A finished chat cache's rows, as Levanter's chat dataset reads them: per split, `input_ids` and
    `assistant_masks` hold the manifest's row count (as Levanter's ledger does) with the same row
    lengths, none over ``seq_len``; in a sample of rows the mask is 0 or 1 and marks some tokens.
    (A conversation's row is not its text's encoding, so it is not decoded back to it.)"""
    cache_root = cache_root.rstrip("/")
    manifest = read_json(f"{cache_root}/{MANIFEST_NAME}")
    if manifest is None or not manifest.get("finished"):
        raise FileNotFoundError(f"no finished tokenized cache at {cache_root}")
    failures: list[RoundtripFailure] = []
    rng = random.Random(seed)
    for split in SPLITS:
        rows = sum(entry[f"{split}_documents"] for entry in manifest["shards"])
        ledger = read_json(f"{cache_root}/{split}/{LEDGER_NAME}") or {}
        ids, masks = ((read_zarr3_array(f"{cache_root}/{split}/{field}/offsets"),
                       read_zarr3_array(f"{cache_root}/{split}/{field}/data"))
                      for field in (INPUT_IDS, "assistant_masks"))
        offsets = ids[0][:rows + 1].read().result()
        if int(offsets[0]) != rows or ledger.get("total_num_rows") != rows or not ledger.get("is_finished") \
                or not np.array_equal(masks[0][:rows + 1].read().result(), offsets):
            failures.append(RoundtripFailure("", split, -1, f"the manifest gives {rows} rows; input_ids and "
                                             "assistant_masks or Levanter's ledger disagree"))
            continue
        ends = offsets.copy()
        ends[0] = 0
        lengths = np.diff(ends)
        for row in np.flatnonzero(lengths > seq_len)[:5]:
            failures.append(RoundtripFailure("", split, int(row), f"{int(lengths[row])} tokens > seq_len {seq_len}"))
        for row in sorted(rng.sample(range(rows), min(sample_n, rows))):
            mask = masks[1][int(ends[row]):int(ends[row + 1])].read().result()
            if not mask.any() or not np.isin(mask, (0, 1)).all():
                failures.append(RoundtripFailure("", split, row, "the assistant mask marks no tokens, or is not 0/1"))
    return failures


def appended_shard_keys(cache_root: str) -> list[str]:
    """Keys of the ledger shards the cache's last build encoded (every shard of a fresh build)."""
    manifest = read_json(f"{cache_root.rstrip('/')}/{MANIFEST_NAME}")
    if manifest is None or not manifest.get("finished"):
        raise FileNotFoundError(f"no finished tokenized cache at {cache_root}")
    return [s["key"] for s in manifest["shards"][manifest.get("appended_from", 0):]]
