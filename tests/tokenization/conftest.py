"""Small real corpus for tokenization tests: prose from the Python standard library's own sources,
plus hand-written documents that stress exact round-tripping (CRLF, tabs, Unicode, special-token text)."""

from __future__ import annotations

import hashlib
import os
import sysconfig

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("WANDB_MODE", "offline")

TRICKY_DOCUMENTS = [
    "Windows line endings\r\nsecond line\r\n\r\n",
    "\tleading tab and  double  spaces   \n   indented trailing spaces   ",
    " starts with a space",
    "Unicode: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🦙🚀, combining e\u0301",
    "Text that spells special tokens: <|bos|> <|eos|> <|pad|><|eos|>",
    "control chars \x00 \x07 \x1b[31m and a form feed \x0c and NBSP\u00a0here",
    "x",
    "\n",
]


def _stdlib_documents(max_files: int = 40, lines_per_doc: int = 40) -> list[str]:
    lib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(lib) if n.endswith(".py"))[:max_files]
    docs = []
    for name in names:
        with open(os.path.join(lib, name), encoding="utf-8", errors="replace", newline="") as f:
            lines = f.read().splitlines(keepends=True)
        for i in range(0, len(lines), lines_per_doc):
            docs.append("".join(lines[i : i + lines_per_doc]))
    return docs


def doc_id(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _write_docs(path: str, texts: list, ids: list | None = None) -> str:
    """Write documents in the curated-corpus schema (id, text, source, source_id, metadata)."""
    if ids is None:
        ids = [doc_id(t) if t is not None else None for t in texts]
    table = pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "text": pa.array(texts, pa.string()),
            "source": ["test"] * len(texts),
            "source_id": [str(i) for i in range(len(texts))],
            "metadata": ["{}"] * len(texts),
        }
    )
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="session")
def write_docs():
    """write_docs(path, texts, ids=None) -> path: a Parquet file in the curated-corpus schema."""
    return _write_docs


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    docs = _stdlib_documents()
    # Dedupe while keeping order: ids are content hashes, as in the curated corpus.
    seen: set[str] = set()
    unique = [d for d in docs + TRICKY_DOCUMENTS if not (d in seen or seen.add(d))]
    assert len(unique) > 300
    return unique


@pytest.fixture(scope="session")
def tokenizer_dir(corpus, tmp_path_factory) -> str:
    from marin_assets.tokenization.tokenizer import TokenizerConfig, train_bpe_tokenizer

    out = str(tmp_path_factory.mktemp("tok") / "tokenizer")
    train_bpe_tokenizer(corpus, TokenizerConfig(vocab_size=512), out)
    return out
