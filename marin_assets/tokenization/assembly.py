"""Assembling a Levanter cache from encoded shards: which committed shards it keeps, the validation
threshold it is split at, and the units of work that move the shards' rows into its arrays.

Incremental builds: the ledger of a Levanter cache records rows per named shard, and the jagged
arrays can be appended to and trimmed at a row boundary, but rows cannot be removed from the middle.
So each upstream Parquet file is a ledger shard, kept in the order it was first committed: a rebuild
keeps the longest run of committed ledger shards (in ledger order) whose files are still wanted and
unchanged (`reuse_plan`), trims anything after it, and appends the remaining files, encoded once. A
new file is therefore always appended, wherever its name sorts. A manifest next to the splits
(`marin_tokenize_manifest.json`) is the record of which shards are committed; see docs/tokenization.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import fsspec
import numpy as np

from marin_assets.tokenization import chat_template
from marin_assets.tokenization.cache_config import CacheConfig, CacheStats, stats_from_manifest
from marin_assets.tokenization.cache_format import (
    INPUT_IDS,
    MANIFEST_NAME,
    SHARD_CHUNK,
    SPLITS,
    TOKEN_DTYPE,
    JaggedArrayWriter,
    manifest_identity,
    preprocessor_metadata,
    read_json,
    write_json,
    write_ledger,
)
from marin_assets.tokenization.encoding import (
    ENCODED_DIR,
    ENCODING,
    FIELD_ROWS,
    ID_HASHES,
    ROW_FILES,
    ROWS,
    ROWS_AT,
    DocumentShard,
    cache_fields,
    read_rows,
)
from marin_assets.tokenization.shard_files import ShardFileWriter, ShardLayout
from marin_assets.tokenization.tokenizer import local_tokenizer_dir, tokenizer_json_sha256
from marin_resources.parallel_map import ParallelMap, in_process_map
from marin_resources.splits import ID_HASH_DTYPE, fraction_holds_enough, raised_threshold

# ---------------------------------------------------------------------------------------------
# Split thresholds: where a validation minimum moves the split


def validation_threshold(cfg: CacheConfig, encoded: Sequence[dict]) -> float:
    """The fraction a cache of these encoded shards (every shard of it, each split by
    ``cfg.validation_fraction``) is split at: ``with_validation_minimum`` over the corpus, from the
    shards' counts, and only where the fraction holds out too few, from their id hashes."""
    documents, held_out = _split_counts(encoded)

    def id_hashes() -> np.ndarray:
        _require_rows(encoded, "a raised validation threshold reads every shard's id hashes")
        return np.concatenate([np.empty(0, ID_HASH_DTYPE)]
                              + [read_rows(e[ROWS], ID_HASHES, ID_HASH_DTYPE) for e in encoded])

    return raised_threshold(cfg.validation_fraction, cfg.validation_min_documents, documents, held_out, id_hashes)


def split_by_fraction_alone(cfg: CacheConfig, encoded: Sequence[dict]) -> bool:
    """Whether a cache of these shards is split at ``cfg.validation_fraction`` itself, as their counts
    show (no validation minimum, or the fraction holds out enough): its assembly then reads no
    shard's id hashes, and keeps the shards its ledger holds without their rows."""
    return fraction_holds_enough(cfg.validation_min_documents, *_split_counts(encoded))


def _split_counts(encoded: Sequence[dict]) -> tuple[int, int]:
    """(documents, validation documents) of these shards, each split by the cache's own fraction."""
    return (sum(e["train_documents"] + e["validation_documents"] for e in encoded),
            sum(e["validation_documents"] for e in encoded))


def _require_rows(entries: Sequence[dict], why: str) -> None:
    """Refuse entries given without row files (ledger entries of shards a cache holds) where ``why``
    needs their rows: the cache would otherwise be assembled with a hole."""
    held = [e["key"] for e in entries if ROWS not in e]
    if held:
        raise ValueError(f"{len(held)} shard(s) were given as held by the cache, without their row files "
                         f"({', '.join(held[:5])}), but {why}; give their encoded rows")


def _resplit(entry: dict, fraction: float, rows_uri: str) -> dict:
    """An encoded shard's rows split again at ``fraction`` (a raised validation minimum) into row files
    under ``rows_uri``: the same rows, in document order within each split; no encoding."""
    was = entry[ENCODING]["validation_fraction"]
    hashes = read_rows(entry[ROWS], ID_HASHES, ID_HASH_DTYPE).astype(np.float64) / 2**32
    kinds = [FIELD_ROWS[field] for field in (FIELD_ROWS if "chat" in entry[ENCODING] else ["input_ids"])]
    rows = {}  # (split, row file) -> its rows as they are, in document order
    for split in SPLITS:
        lengths = read_rows(entry[ROWS], f"{split}.lengths", ROW_FILES["lengths"])
        for kind in kinds:
            values = read_rows(entry[ROWS], f"{split}.{kind}", ROW_FILES[kind])
            rows[split, kind] = np.split(values, np.cumsum(lengths)[:-1]) if lengths.size else []
    # Document d is row `position[d]` of the split it was in.
    was_validation = hashes < was
    position = np.empty(hashes.size, dtype=np.int64)
    for mask in (~was_validation, was_validation):
        position[mask] = np.arange(int(mask.sum()))
    fs, path = fsspec.core.url_to_fs(rows_uri)
    fs.makedirs(path, exist_ok=True)
    out = {**entry, ROWS: rows_uri, ENCODING: {**entry[ENCODING], "validation_fraction": fraction}}
    now_validation = hashes < fraction
    for split, mask in (("train", ~now_validation), ("validation", now_validation)):
        for kind in kinds:
            moved = [rows["validation" if was_validation[d] else "train", kind][position[d]]
                     for d in np.flatnonzero(mask)]
            values = np.concatenate([np.empty(0, ROW_FILES[kind])] + moved)
            with fs.open(f"{path}/{split}.{kind}", "wb") as fh:
                fh.write(values.tobytes())
        with fs.open(f"{path}/{split}.lengths", "wb") as fh:
            fh.write(np.array([r.size for r in moved], dtype=ROW_FILES["lengths"]).tobytes())
        out[f"{split}_documents"], out[f"{split}_tokens"] = len(moved), int(values.size)
    with fs.open(f"{path}/{ID_HASHES}", "wb") as fh:
        fh.write(read_rows(entry[ROWS], ID_HASHES, ID_HASH_DTYPE).tobytes())
    return out


# ---------------------------------------------------------------------------------------------
# Assembly: the encoded rows moved into the cache, one shard file per unit of work
#
# The new rows of a split take positions [tokens before, tokens after) of its `data` array and
# [rows before + 1, rows after + 1) of its `offsets` array (offsets[1 + row] is where a row ends).
# Every shard file of an array those ranges touch is one unit: it is written by one worker, from the
# row files of the shards that fall in it, so the units are independent and can run anywhere the
# store is reachable. The row count (offsets[0]) and the ledgers are written after every unit, so
# until then a reader sees the cache as it was. While units run, the manifest records how far they
# write (`assembling`), so that a rerun with fewer shards zeroes what a killed one left beyond.

_ASSEMBLING = "assembling"


@dataclass(frozen=True)
class FileUnit:
    """Positions [start, stop) of one array of one split, all in one of its shard files."""

    split: str
    array: str  # "data" (tokens) or "offsets" (row ends)
    start: int
    stop: int
    field: str = INPUT_IDS  # a chat cache's `assistant_masks` are rows of their own, beside `input_ids`


@dataclass(frozen=True)
class AssemblyJob:
    """What every unit of one assembly shares: the encoded shards in ledger order (each entry names
    its row files, `rows`), and where each split's arrays stood before them."""

    out_root: str
    entries: tuple[dict, ...]
    base: dict[str, tuple[int, int]]  # split -> (rows, tokens) before this assembly
    layouts: dict[str, ShardLayout]  # "<split>/<array>" -> the array's layout (every field's alike)
    piece_values: int  # values held and written at once
    fields: tuple[str, ...] = (INPUT_IDS,)

    def starts(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """Per encoded shard, its first row and first token in the split's arrays, then the ends."""
        rows, tokens = self.base[split]
        return (rows + np.cumsum([0] + [e[f"{split}_documents"] for e in self.entries], dtype=np.int64),
                tokens + np.cumsum([0] + [e[f"{split}_tokens"] for e in self.entries], dtype=np.int64))

    def ends(self, split: str) -> tuple[int, int]:
        rows, tokens = self.starts(split)
        return int(rows[-1]), int(tokens[-1])

    def units(self, split: str) -> list[FileUnit]:
        (rows, tokens), (rows_end, tokens_end) = self.base[split], self.ends(split)
        units = []
        for array, low, high in (("data", tokens, tokens_end), ("offsets", rows + 1, rows_end + 1)):
            length = self.layouts[f"{split}/{array}"].shard_length
            units += [FileUnit(split, array, max(low, k * length), min(high, (k + 1) * length), field)
                      for k in range(low // length, (high - 1) // length + 1)
                      for field in self.fields] if high > low else []
        return units


def assemble_file(unit: FileUnit, job: AssemblyJob) -> dict[str, tuple[int, str] | None]:
    """Write one unit from the row files, in pieces of at most `piece_values` values (each piece
    rewrites the shard file once); returns the shard file it wrote, with its size and sha256 hashed
    from the bytes written (`ShardFileWriter.written`)."""
    writer = ShardFileWriter(f"{job.out_root}/{unit.split}/{unit.field}/{unit.array}",
                             job.layouts[f"{unit.split}/{unit.array}"])
    pending, position = [], unit.start
    for values in _unit_values(unit, job):
        pending.append(values)
        if sum(v.size for v in pending) >= job.piece_values:
            joined = np.concatenate(pending)
            writer.write(position, joined)
            pending, position = [], position + joined.size
    if pending:
        writer.write(position, np.concatenate(pending))
    return writer.written


def _unit_values(unit: FileUnit, job: AssemblyJob) -> Iterator[np.ndarray]:
    """The values of positions [start, stop) of the unit's array, in order, a bounded piece at a time."""
    rows, tokens = job.starts(unit.split)
    row_file = FIELD_ROWS[unit.field]
    width = ROW_FILES[row_file].itemsize
    for i, entry in enumerate(job.entries):
        fs, base = fsspec.core.url_to_fs(f"{entry[ROWS]}/{unit.split}")
        if unit.array == "data":
            low, high = max(unit.start, int(tokens[i])), min(unit.stop, int(tokens[i + 1]))
            if low >= high:
                continue
            with fs.open(f"{base}.{row_file}", "rb") as fh:
                fh.seek((low - int(tokens[i])) * width)
                for first in range(low, high, job.piece_values):
                    count = min(job.piece_values, high - first)
                    data = np.frombuffer(fh.read(count * width), dtype=ROW_FILES[row_file])
                    if data.size != count:
                        raise ValueError(f"{fs.unstrip_protocol(base)}.{row_file} is shorter than its entry says")
                    yield data.astype(TOKEN_DTYPE, copy=False)
        else:
            low, high = max(unit.start, int(rows[i]) + 1), min(unit.stop, int(rows[i + 1]) + 1)
            if low >= high:
                continue
            with fs.open(f"{base}.lengths", "rb") as fh:
                lengths = np.frombuffer(fh.read(), dtype=ROW_FILES["lengths"])
            if lengths.size != entry[f"{unit.split}_documents"] or int(lengths.sum()) != entry[f"{unit.split}_tokens"]:
                raise ValueError(f"{fs.unstrip_protocol(base)}.lengths does not match its entry: {lengths.size} rows, "
                                 f"{int(lengths.sum())} tokens")
            row_ends = int(tokens[i]) + np.cumsum(lengths, dtype=np.int64)
            first_row = int(rows[i]) + 1
            yield row_ends[low - first_row:high - first_row]


# ---------------------------------------------------------------------------------------------
# Reuse plan: which committed shards an assembly keeps


def reuse_plan(manifest: dict | None, identity: dict, shards: Sequence[DocumentShard | dict]) -> tuple[int, list]:
    """(committed ledger shards to keep, shards to encode or assemble after them, in order); a shard is
    a `DocumentShard` or an encoded shard's entry.

    Kept: the longest run of committed shards, in ledger order, that are still wanted with the same
    fingerprint. Rows cannot leave the middle of a Levanter store, so a removed or changed file
    re-encodes every shard committed after it; a new file is appended whatever its position in
    `shards`, so an append-only corpus encodes each file exactly once."""
    if manifest is None or manifest.get("identity") != identity:
        return 0, list(shards)
    keep = _kept_count(manifest, dict(_key_and_fingerprint(s) for s in shards))
    kept = {e["key"] for e in manifest["shards"][:keep]}
    return keep, [s for s in shards if _key_and_fingerprint(s)[0] not in kept]


def _kept_count(manifest: dict, wanted: Mapping[str, str | None]) -> int:
    """How many of the manifest's ledger shards, from the first, are still wanted (key -> fingerprint)
    with the fingerprint they were committed with."""
    keep = 0
    for old in manifest["shards"]:
        fingerprint = wanted.get(old["key"])
        if fingerprint is None or fingerprint != old["fingerprint"]:
            break
        keep += 1
    return keep


def held_shards(cache_root: str, wanted: Mapping[str, str | None], cfg: CacheConfig, *, sha256: str) -> list[dict]:
    """The ledger entries of the cache at ``cache_root`` that an assembly of the shards ``wanted`` (key ->
    fingerprint) keeps without reading their rows: the longest run, in ledger order, still wanted with
    the same fingerprint, as `reuse_plan` keeps them. None of them where its manifest is not the committed one
    (``sha256``, as the artifact's manifest records it: a build stopped between its assembly and its
    commit) or not finished, or the cache was split at a raised threshold (a validation minimum), which
    the next assembly decides again from every shard's id hashes. One read, whatever the corpus."""
    fs, path = fsspec.core.url_to_fs(f"{cache_root.rstrip('/')}/{MANIFEST_NAME}")
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return []
    if hashlib.sha256(data).hexdigest() != sha256:
        return []
    manifest = json.loads(data)
    if not manifest.get("finished") or manifest["identity"].get("validation_fraction") != cfg.validation_fraction:
        return []
    return manifest["shards"][:_kept_count(manifest, wanted)]


def _key_and_fingerprint(shard: DocumentShard | dict) -> tuple[str, str | None]:
    return (shard["key"], shard["fingerprint"]) if isinstance(shard, dict) else (shard.key, shard.fingerprint)


# ---------------------------------------------------------------------------------------------
# Assembling a cache: the shards kept, the rest's rows written by units, then the ledgers


def require_distinct_keys(keys: list[str]) -> None:
    if not keys:
        raise ValueError("no documents to tokenize: the shard list is empty")
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate document files in the input list")


def assemble_levanter_cache(encoded: Sequence[dict], tokenizer_dir: str, out_root: str, cfg: CacheConfig,
                            parallel_map: ParallelMap = in_process_map) -> CacheStats:
    """Assemble the Levanter cache root ``out_root`` from shards encoded elsewhere (`encode_shard_rows`:
    each entry names its row files): every shard of the cache, in order, as `build_levanter_cache`
    takes its files. Only moves bytes: ledger shards already committed with the same fingerprint are
    kept (as `build_levanter_cache` keeps them) and the others' rows are appended, one unit of work
    per zarr shard file through ``parallel_map``. A validation minimum is decided here, over every
    shard (`validation_threshold`); where it raises the threshold, the shards' rows are split again
    (no encoding). The cache is byte-identical to `build_levanter_cache`'s on the same files.

    A shard the cache already holds may be given as its ledger entry, without row files (`held_shards`):
    one of the 74,500 shards of a large corpus is then not looked up again to append one. Such a
    shard must be one this assembly keeps; where it is not (a changed identity, a shard before it
    removed or changed, a raised validation threshold), this raises naming it, and nothing is written."""
    require_distinct_keys([e["key"] for e in encoded])
    out_root = out_root.rstrip("/")
    split_by_fraction = replace(cfg, validation_min_documents=None)
    split = replace(cfg, validation_fraction=validation_threshold(cfg, encoded))
    with local_tokenizer_dir(tokenizer_dir) as local_tok:
        tok_sha = tokenizer_json_sha256(local_tok)
        cfg = chat_template.resolved(cfg, local_tok)
        split_by_fraction, split = (replace(c, chat=cfg.chat) for c in (split_by_fraction, split))
        old = read_json(f"{out_root}/{MANIFEST_NAME}") if cfg.incremental else None
        metadata, bos, eos, files_sha = preprocessor_metadata(tokenizer_dir, local_tok, old, cfg)
    wanted = manifest_identity(tok_sha, bos, eos, split_by_fraction)
    # A held shard passed this check when its cache took it: it is kept only under the same identity.
    foreign = [e["key"] for e in encoded if ROWS in e and e[ENCODING] != wanted]
    if foreign:
        raise ValueError(f"{len(foreign)} shard(s) were encoded with another tokenizer or settings than this cache's "
                         f"({', '.join(foreign[:5])}); encode them again")
    identity = manifest_identity(tok_sha, bos, eos, split)
    reuse, todo = reuse_plan(old, identity, encoded)
    _require_rows(todo, "the cache does not keep them (its identity changed, or a shard before them was removed "
                        "or changed)")
    if old is not None and not todo and reuse == len(old["shards"]) and old.get("finished"):
        return stats_from_manifest(out_root, old, reused=reuse)
    if split.validation_fraction != cfg.validation_fraction:
        todo = [_resplit(e, split.validation_fraction, f"{out_root}/{ENCODED_DIR}/resplit/{i}")
                for i, e in enumerate(todo)]
    return assemble_shards(out_root, identity, metadata, files_sha, old, reuse, todo, cfg.flush_tokens, parallel_map,
                           cache_fields(cfg))


def assemble_shards(out_root: str, identity: dict, metadata: dict, files_sha: str, old: dict | None, reuse: int,
              encoded: Sequence[dict], flush_tokens: int, parallel_map: ParallelMap,
              fields: tuple[str, ...] = (INPUT_IDS,)) -> CacheStats:
    """Keep the first ``reuse`` ledger shards of the cache at ``out_root`` (its manifest ``old``) and
    append the ``encoded`` shards' rows after them, into each of ``fields`` (the same row lengths);
    the manifest and Levanter's ledgers move last."""
    manifest_uri = f"{out_root}/{MANIFEST_NAME}"
    fs, root_path = fsspec.core.url_to_fs(out_root)
    started = time.monotonic()
    if reuse == 0:
        for name in (*SPLITS, MANIFEST_NAME):
            if fs.exists(f"{root_path}/{name}"):
                fs.rm(f"{root_path}/{name}", recursive=True)
        entries: list[dict] = []
    else:
        entries = old["shards"][:reuse]
    manifest = {"identity": identity, "levanter_metadata": metadata, "tokenizer_files_sha256": files_sha,
                "finished": False, "shards": entries, "appended_from": reuse}
    arrays = {(split, field): JaggedArrayWriter(f"{out_root}/{split}/{field}", fresh=reuse == 0)
              for split in SPLITS for field in fields}
    base = {}
    for (split, field), array in arrays.items():
        array.trim_to(sum(e[f"{split}_documents"] for e in entries))  # rows of shards no longer wanted
        if base.setdefault(split, (array.rows, array.size)) != (array.rows, array.size):
            raise ValueError(f"cache {out_root}/{split}: {field} holds {array.rows} rows of {array.size} values, "
                             f"{fields[0]} {base[split]}; rebuild it")
    assembly = AssemblyJob(out_root, tuple(encoded), base,
                           {f"{split}/{name}": getattr(array, name).layout for (split, field), array in arrays.items()
                            if field == fields[0] for name in ("data", "offsets")}, flush_tokens, fields)
    ends = {split: assembly.ends(split) for split in SPLITS}
    for (split, _), array in arrays.items():
        # Values a killed assembly wrote past where this one ends (it had more shards) are zeroed.
        rows_were, tokens_were = ((old or {}).get(_ASSEMBLING) or {}).get(split, (0, 0)) if reuse else (0, 0)
        array.data.zero(ends[split][1], max(tokens_were, ends[split][1]))
        array.offsets.zero(ends[split][0] + 1, max(rows_were + 1, ends[split][0] + 1))
    # Until the row counts move, Levanter reads the cache as it was: an append leaves its ledger alone,
    # and a build that changed what is committed (fresh, or shards dropped) marks it unfinished.
    if reuse == 0 or reuse < len(old["shards"]) or not old.get("finished"):
        for split in SPLITS:
            write_ledger(f"{out_root}/{split}", entries, split, metadata, finished=False)
    manifest[_ASSEMBLING] = {split: list(ends[split]) for split in SPLITS}
    write_json(manifest_uri, manifest)

    # Assembly: every shard file the new rows touch is one unit of work, written from the row files.
    units = [unit for split in SPLITS for unit in assembly.units(split)]
    spread = parallel_map if sum(e["train_tokens"] + e["validation_tokens"] for e in encoded) >= SHARD_CHUNK \
        else in_process_map  # under one shard file of tokens, workers cost more than they save
    for files in (files for array in arrays.values() for files in (array.offsets, array.data)):
        files.written.clear()  # what the units write next replaces what was trimmed or zeroed before
    written: dict[str, tuple[int, str] | None] = {}
    for unit_written in spread(assemble_file, units, assembly):
        written |= unit_written

    for (split, field), array in arrays.items():
        # The ledger goes through fsspec, the arrays through tensorstore: a tensorstore path
        # that resolves elsewhere (as s3:// once did, to ./s3:/) must not leave a finished
        # ledger over no data.
        zarr_json = f"{root_path}/{split}/{field}/offsets/zarr.json"
        if not fs.exists(zarr_json):
            raise RuntimeError(f"cache {out_root}/{split}: Levanter wrote its rows, but "
                               f"{fs.unstrip_protocol(zarr_json)} is not in the store; tensorstore wrote them "
                               "elsewhere")
        # The row count last: from here a reader sees the new rows, whose tokens are all there.
        array.offsets.write(0, np.array([ends[split][0]], dtype=np.int64))
        written |= array.offsets.written
    manifest["shards"] = entries + [{k: v for k, v in e.items() if k not in (ROWS_AT, ROWS, ENCODING)}
                                    for e in encoded]
    del manifest[_ASSEMBLING]
    for split in SPLITS:
        write_ledger(f"{out_root}/{split}", manifest["shards"], split, metadata, finished=True)
    manifest["finished"] = True
    write_json(manifest_uri, manifest)
    if fs.exists(f"{root_path}/{ENCODED_DIR}"):
        fs.rm(f"{root_path}/{ENCODED_DIR}", recursive=True)
    return replace(stats_from_manifest(out_root, manifest, reused=reuse),
                   assembly_seconds=round(time.monotonic() - started, 3),
                   files_written=tuple((path[len(root_path) + 1:], *entry) for path, entry in sorted(written.items())
                                       if entry is not None))
