"""One large shard's `token_shards` encoding: in one piece, against row ranges on one-core workers.

Usage:
    python -m benchmarks.shard_ranges [--megabytes 128] [--ranges 2 4] [--repeats 2] [--workdir DIR]

What a cluster of one-core workers gets from encoding one shard in row ranges
(`encode_shard_rows(row_ranges=...)`, one `encode_row_range` task each, then this process
concatenates the ranges' row files). Set-up, not timed: one Parquet shard of about --megabytes of
text (real paragraphs, `benchmarks.scale_corpus`, written as `decontaminated/` writes its shards) and
a BPE tokenizer of 8,192 tokens trained on its first 8 MB. Every process encodes on one core (one
thread per pool, one Rust thread for `tokenizers`):

  one piece   `encode_shard_rows` in a child process;
  R ranges    the same call with R ranges of equal rows; each range in its own child process, as many
              at once as this machine has cores (a stand-in for one-core pods or Ray workers; a
              child's start, about 1 s, is in the figure, as a fresh Ray worker's would be).

Reported for each: wall seconds (best of --repeats), the speedup over one piece, the seconds after
the last range ended (concatenation and clean-up) with the row files' MB per second through it,
and whether every row file equals the one-piece file byte for byte. The last line is JSON.
"""

from __future__ import annotations

import benchmarks.one_core  # noqa: F401 -- first: one thread per pool, before numpy is imported

# isort: split

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from multiprocessing import get_context  # noqa: E402
from pathlib import Path  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from benchmarks.scale_corpus import CorpusWriter  # noqa: E402
from marin_assets.tokenization.cache_config import CacheConfig  # noqa: E402
from marin_assets.tokenization.decontamination import parquet_bytes  # noqa: E402
from marin_assets.tokenization.encoding import ShardSpec, encode_shard_rows, parquet_rows  # noqa: E402
from marin_assets.tokenization.tokenizer import TokenizerConfig, train_bpe_tokenizer  # noqa: E402

# One Rust thread per process: each worker is one core, as a one-core pod is.
ONE_THREAD = {"RAYON_NUM_THREADS": "1", "RAYON_RS_NUM_CPUS": "1"}
CFG = CacheConfig(validation_fraction=0.01)


def build_inputs(workdir: Path, megabytes: int) -> tuple[str, str]:
    """The shard (Parquet, as `decontaminated/` writes it) and the tokenizer, made once per workdir."""
    shard, tokenizer = workdir / f"shard-{megabytes}mb.parquet", workdir / "tokenizer"
    if not shard.exists():
        writer = CorpusWriter(workdir / "jsonl", shard_bytes=megabytes * 1_000_000)
        lines = writer.write_shard().read_text(encoding="utf-8").splitlines()
        docs = [json.loads(line) for line in lines]
        table = pa.table({"id": [d["id"] for d in docs], "text": [d["text"] for d in docs]})
        shard.write_bytes(parquet_bytes(table))
        shutil.rmtree(workdir / "jsonl")
    if not tokenizer.exists():
        texts = pq.read_table(shard, columns=["text"]).column("text").to_pylist()
        sample, size = [], 0
        for text in texts:
            if size > 8_000_000:
                break
            sample.append(text)
            size += len(text)
        train_bpe_tokenizer(sample, TokenizerConfig(vocab_size=8192), str(tokenizer))
    return str(shard), str(tokenizer)


def one_piece(shard: str, tokenizer: str, out: str) -> float:
    started = time.perf_counter()
    encode_shard_rows(ShardSpec("store://bench", "fp", shard), tokenizer, out, CFG)
    return time.perf_counter() - started


def file_hashes(root: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(root).iterdir())}


def measure(shard: str, tokenizer: str, ranges: int, work: Path, pool: ProcessPoolExecutor) -> dict:
    out = work / f"ranges-{ranges}"
    shutil.rmtree(out, ignore_errors=True)
    mapped = {}

    def equal_rows(weights):
        bounds = [len(weights) * k // ranges for k in range(ranges + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def on_workers(fn, items, shared):
        results = list(pool.map(fn, items, [shared] * len(items)))
        mapped["ended"] = time.perf_counter()
        return results

    started = time.perf_counter()
    encode_shard_rows(ShardSpec("store://bench", "fp", shard), tokenizer, str(out / "rows"), CFG,
                      split_rows=equal_rows, parts_uri=str(out / "parts"),
                      parallel_map=on_workers)
    ended = time.perf_counter()
    row_bytes = sum(p.stat().st_size for p in (out / "rows").iterdir())
    return {"seconds": ended - started, "after_ranges_s": ended - mapped["ended"], "row_mb": row_bytes / 1e6,
            "hashes": file_hashes(str(out / "rows"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=128)
    parser.add_argument("--ranges", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="keep the shard and tokenizer here (default: a temp dir)")
    args = parser.parse_args()
    os.environ.update(ONE_THREAD)  # children inherit it; this process encodes nothing itself
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shard-ranges-"))
    workdir.mkdir(parents=True, exist_ok=True)
    shard, tokenizer = build_inputs(workdir, args.megabytes)
    rows, text_bytes = parquet_rows(shard)
    print(f"shard: {rows:,} documents, {text_bytes / 1e6:.1f} MB uncompressed, {os.path.getsize(shard) / 1e6:.1f} MB "
          f"on disk; {os.cpu_count()} core(s), one thread each")
    spawn = get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as single:
        whole = [single.submit(one_piece, shard, tokenizer, str(workdir / "whole")).result()
                 for _ in range(args.repeats)]
    baseline = min(whole)
    expected = file_hashes(str(workdir / "whole"))
    results = {"one_piece_s": round(baseline, 2), "rows": rows, "text_mb": round(text_bytes / 1e6, 1), "ranges": {}}
    print(f"{'setting':<12} {'wall s':>8} {'speedup':>8} {'after ranges s':>15} {'row MB/s':>9}  same bytes")
    print(f"{'one piece':<12} {baseline:>8.2f} {1.0:>8.2f} {'':>15} {'':>9}  -")
    for ranges in args.ranges:
        runs = []
        for _ in range(args.repeats):
            # A fresh pool per run: its workers' start is paid inside the measurement.
            with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=spawn) as pool:
                runs.append(measure(shard, tokenizer, ranges, workdir, pool))
        best = min(runs, key=lambda r: r["seconds"])
        same = all(r["hashes"] == expected for r in runs)
        rate = best["row_mb"] / best["after_ranges_s"] if best["after_ranges_s"] else float("inf")
        print(f"{f'{ranges} ranges':<12} {best['seconds']:>8.2f} {baseline / best['seconds']:>8.2f} "
              f"{best['after_ranges_s']:>15.2f} {rate:>9.0f}  {'yes' if same else 'NO'}")
        results["ranges"][ranges] = {"seconds": round(best["seconds"], 2),
                                     "speedup": round(baseline / best["seconds"], 3),
                                     "after_ranges_s": round(best["after_ranges_s"], 2),
                                     "row_mb": round(best["row_mb"], 1), "same_bytes": same}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
