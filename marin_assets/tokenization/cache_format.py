"""What a token cache root holds on disk: Levanter's arrays and ledgers, and the manifest beside them.

Writing uses tensorstore directly, in the layout of Levanter's `TreeStore` and `CacheLedger`, so
appending a shard does not import Levanter (and JAX); `TreeCache.load` and Levanter's trainer read
the cache unchanged, which the Levanter tests check. The metadata its loader expects is derived once
per cache, as Levanter derives it, with transformers alone (`preprocessor_metadata`). The manifest
(`marin_tokenize_manifest.json`) is the record of which ledger shards are committed; see
docs/tokenization.md. Kept apart from the encoding and the assembly, which both write this format.
"""

from __future__ import annotations

import hashlib
import json
import os

import fsspec
import numpy as np

from marin_assets.tokenization.cache_config import MESSAGES_COLUMN, CacheConfig
from marin_assets.tokenization.shard_files import ShardFileWriter, ShardLayout
from marin_assets.tokenization.tokenizer import local_tokenizer_dir

SPLITS = ("train", "validation")
INPUT_IDS = "input_ids"
MANIFEST_NAME = "marin_tokenize_manifest.json"
# Bump when the meaning of rows changes, so old caches are rebuilt rather than appended to.
CACHE_FORMAT_VERSION = 1
TOKEN_DTYPE = np.int32


# ---------------------------------------------------------------------------------------------
# Manifest: which shards are committed (the source of truth on resume)


def read_json(uri: str) -> dict | None:
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return json.load(f)


def write_json(uri: str, obj: dict) -> None:
    fs, path = fsspec.core.url_to_fs(uri)
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with fs.open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    fs.mv(tmp, path)


def manifest_identity(tokenizer_sha: str, bos: int, eos: int, cfg: CacheConfig) -> dict:
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "tokenizer_json_sha256": tokenizer_sha,
        "bos_token_id": bos,
        "eos_token_id": eos,
        **cfg.row_identity(),
    }


# ---------------------------------------------------------------------------------------------
# Levanter's on-disk format, written with tensorstore alone

# A split directory as Levanter 1.2's TreeStore lays it out (levanter.store.tree_store and
# jagged_array): per field a JaggedArrayStore, `<field>/offsets` (int64: [0] = rows, [i] = end of
# row i in `data`) and `<field>/data`, each a zarr3 array of shape [2**54] stored in shard files of
# SHARD_CHUNK elements made of ROW_CHUNK-element blosc chunks; next to them `shard_ledger.json`.
# Written here without importing Levanter (and with it JAX and Ray: ~4 s of CPU in every process
# that appends a shard); Levanter's TreeCache and trainer read it unchanged, which
# tests/tokenization/test_tokenization_levanter.py checks on fresh and appended caches.
ROW_CHUNK = 256 * 1024
SHARD_CHUNK = ROW_CHUNK * 512
LEDGER_NAME = "shard_ledger.json"
_ARRAY_LENGTH = 2**54


def _zarr3_array(url: str, dtype: str, fresh: bool):
    """Open (``fresh``: replace) one of a JaggedArrayStore's arrays, created as Levanter creates it."""
    import tensorstore as ts

    from marin_resources.storage.object_stores import tensorstore_kvstore

    kvstore = tensorstore_kvstore(url)
    if kvstore["driver"] == "file":
        os.makedirs(os.path.dirname(kvstore["path"]), exist_ok=True)
    spec = {"driver": "zarr3", "kvstore": kvstore, "metadata": {
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [SHARD_CHUNK]}},
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [ROW_CHUNK], "codecs": [{"name": "blosc", "configuration": {"clevel": 5}}]}}]}}
    mode = {"create": True, "delete_existing": True} if fresh else {"create": True, "open": True}
    return ts.open(spec, dtype=dtype, shape=[_ARRAY_LENGTH], **mode).result()


def read_zarr3_array(url: str):
    import tensorstore as ts

    from marin_resources.storage.object_stores import tensorstore_kvstore

    return ts.open({"driver": "zarr3", "kvstore": tensorstore_kvstore(url)}, open=True).result()


class JaggedArrayWriter:
    """One field's offsets and data arrays (JaggedArrayStore's layout): opened or created, their row
    and token counts, trimmed; assembly writes them through `offsets` and `data`.

    Tensorstore creates the arrays and reads them; the writes go through `ShardFileWriter`, which
    rewrites a shard file holding one inner chunk in memory, where tensorstore would hold the whole
    file (up to 512 MB of tokens for the tail shard of a large cache)."""

    def __init__(self, field_url: str, fresh: bool):
        offsets = _zarr3_array(f"{field_url}/offsets", "int64", fresh)
        data = _zarr3_array(f"{field_url}/data", np.dtype(TOKEN_DTYPE).name, fresh)
        self.rows = int(offsets[0].read().result())
        self.size = int(offsets[self.rows].read().result()) if self.rows else 0
        self._offsets_at = lambda row: int(offsets[row].read().result())
        self.offsets = ShardFileWriter(f"{field_url}/offsets", ShardLayout.of(offsets.spec().to_json()["metadata"]))
        self.data = ShardFileWriter(f"{field_url}/data", ShardLayout.of(data.spec().to_json()["metadata"]))
        for files in (self.offsets, self.data):
            files.remove_staged()  # a killed run's half-written shard file

    def trim_to(self, rows: int) -> None:
        """Drop the rows after the first ``rows`` (zero-filled, as Levanter's trim leaves them)."""
        if rows >= self.rows:
            return
        size = self._offsets_at(rows) if rows else 0
        self.offsets.write(0, np.array([rows], dtype=np.int64))
        self.data.zero(size, self.size)
        self.offsets.zero(rows + 1, self.rows + 1)
        self.rows, self.size = rows, size


def write_ledger(split_dir: str, shards: list[dict], split: str, metadata: dict, finished: bool) -> None:
    """Levanter's CacheLedger of one split as its JSON encoding spells it, for these ledger shards;
    `is_finished` is what TreeCache.load asks."""
    rows = {entry["key"]: entry[f"{split}_documents"] for entry in shards}
    write_json(f"{split_dir}/{LEDGER_NAME}", {
        "total_num_rows": sum(rows.values()), "shard_rows": rows, "is_finished": finished,
        "finished_shards": list(rows), "field_counts": {}, "metadata": {"preprocessor_metadata": metadata}})


def tokenizer_ledger_name(local_dir: str) -> str:
    """How a ledger names its tokenizer: by its files' hash, never by where they are, so a cache's
    bytes are the same on every prefix and a relocated cache still names its tokenizer truly. A
    trainer gives the tokenizer it loads the same name (:func:`name_tokenizer_as_ledgers_do`)."""
    return f"sha256:{_tokenizer_files_sha256(local_dir)}"


def name_tokenizer_as_ledgers_do(data_config) -> None:
    """Levanter compares a cache ledger's metadata with its loaded tokenizer's, where ``tokenizer`` is
    the loaded tokenizer's ``name_or_path``: the URI it was read from. Named by its files' hash, as
    ledgers name it, it matches a cache built under any prefix."""
    with local_tokenizer_dir(data_config.tokenizer) as local:
        data_config.the_tokenizer.name_or_path = tokenizer_ledger_name(local)


def levanter_preprocessor_metadata(tokenizer_dir: str, local_dir: str) -> tuple[dict, int, int]:
    """Metadata Levanter's loader will expect, plus BOS/EOS ids; checks the cache exemplar fits.

    The metadata is `levanter.data.text.BatchTokenizer(tokenizer, enforce_bos=True,
    enforce_eos=True).metadata`, worked out here from the same transformers tokenizer in the same
    way, without importing Levanter: its import (JAX, Ray, datasets) took 3-4 s of a first cache
    build's last step, which runs alone. `test_cache_metadata_is_levanters_own` holds the two equal
    for the pinned Levanter."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(local_dir)
    bos, eos = hf_tok.bos_token_id, hf_tok.eos_token_id
    if bos is None or eos is None:
        raise ValueError(f"tokenizer at {tokenizer_dir} must define both bos_token and eos_token")
    exemplar = hf_tok("hi there", return_attention_mask=False, verbose=False)  # BatchTokenizer.output_exemplar
    fields = sorted(exemplar)
    if fields != [INPUT_IDS]:
        raise ValueError(
            f"Levanter expects cache fields {fields} for tokenizer {tokenizer_dir}; this cache stores only "
            f"{INPUT_IDS!r}. Set tokenizer.model_input_names to ['input_ids', 'attention_mask'] (adopt_tokenizer does)."
        )
    # BatchTokenizer appends BOS or EOS where the tokenizer's own encoding of "hi there" lacks them
    # (it encodes it again with the attention mask; the ids are the same).
    ids = exemplar[INPUT_IDS]
    metadata = {
        # Levanter puts the path the tokenizer was loaded from here; ledgers name it by its files' hash.
        "tokenizer": tokenizer_ledger_name(local_dir),
        "vocab_size": len(hf_tok),
        "return_attention_mask": False,
        "padding": False,
        "max_length": hf_tok.model_max_length,
        "append_bos": ids[0] != bos,
        "append_eos": ids[-1] != eos,
    }
    return metadata, int(bos), int(eos)


def special_token_ids(local_dir: str) -> tuple[int, int] | None:
    """(BOS, EOS) ids as the tokenizer's own files give them, without importing transformers:
    `tokenizer_config.json` names the tokens and `tokenizer.json` numbers them. None where they do
    not say (transformers then decides)."""
    from tokenizers import Tokenizer

    try:
        with open(os.path.join(local_dir, "tokenizer_config.json")) as f:
            config = json.load(f)
        tokenizer = Tokenizer.from_file(os.path.join(local_dir, "tokenizer.json"))
    except Exception:  # noqa: BLE001 - a file it cannot read: transformers decides
        return None
    ids = []
    for name in ("bos_token", "eos_token"):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token_id is None:
            return None
        ids.append(token_id)
    return ids[0], ids[1]


def _tokenizer_files_sha256(local_dir: str) -> str:
    """One hash of every file of a tokenizer directory (names and bytes). Dot files are the store's
    bookkeeping (the artifact's manifest, with its build times, and its lease), not the tokenizer:
    hashing them made two builds of the same cache differ."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(local_dir)):
        path = os.path.join(local_dir, name)
        if os.path.isfile(path) and not name.startswith("."):
            digest.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def preprocessor_metadata(tokenizer_dir: str, local_dir: str, previous: dict | None,
                          cfg: CacheConfig | None = None) -> tuple[dict, int, int, str]:
    """(Levanter metadata, BOS, EOS, tokenizer files' hash). A cache whose manifest recorded them
    for the same tokenizer files (and chat template) reuses them: Levanter (and transformers) are
    imported only to start a cache, not to append a shard to it. One that named its tokenizer by
    path (before ledgers named it by hash) gets the new name. A chat cache's (``cfg.chat``, its
    template resolved) is its `ChatProcessor`'s."""
    files_sha = _tokenizer_files_sha256(local_dir)
    template = cfg.chat.template if cfg is not None and cfg.chat is not None else None
    if previous is not None and previous.get("tokenizer_files_sha256") == files_sha \
            and (previous.get("levanter_metadata") or {}).get("tokenizer") == f"sha256:{files_sha}" \
            and previous["levanter_metadata"].get("chat_template") == template:
        identity = previous["identity"]
        return previous["levanter_metadata"], identity["bos_token_id"], identity["eos_token_id"], files_sha
    if template is not None:
        return (*chat_preprocessor_metadata(tokenizer_dir, local_dir, cfg), files_sha)
    return (*levanter_preprocessor_metadata(tokenizer_dir, local_dir), files_sha)


def chat_preprocessor_metadata(tokenizer_dir: str, local_dir: str, cfg: CacheConfig) -> tuple[dict, int, int]:
    """`levanter.data.text.ChatProcessor(tokenizer, chat_template, messages_field).metadata` for a chat
    cache (its template resolved), worked out without importing Levanter, plus BOS/EOS ids;
    `test_chat_cache_metadata_is_levanters_own` holds the two equal."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(local_dir)
    bos, eos = hf_tok.bos_token_id, hf_tok.eos_token_id
    if bos is None or eos is None:
        raise ValueError(f"tokenizer at {tokenizer_dir} must define both bos_token and eos_token")
    return ({"tokenizer": tokenizer_ledger_name(local_dir), "vocab_size": len(hf_tok),
             "chat_template": cfg.chat.template, "messages_field": MESSAGES_COLUMN}, int(bos), int(eos))
