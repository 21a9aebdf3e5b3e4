"""Memory of a JSONL file's byte-range workers when one line is huge (issue 50, finding 6).

Usage:
    python -m benchmarks.huge_line [--line-mb 300] [--max-doc-mb 16] [--range-mb 64] [--workdir DIR]

Writes a JSONL file: 1,000 small records, one record of --line-mb MB (a "text" of that many "x"),
1,000 small records. A source over it with bytes_per_shard --range-mb and max_doc_bytes --max-doc-mb
is split into byte ranges (`split_large_files`), a partition each. Each range then runs in a child
process of its own, as the raw and documents steps run it: `copy_listed_file` copies the range into
a file (raw/), and `read_shard` reads that copy (documents/). A child reports its peak RSS above what
it held after a warm-up pass over a small file (`resource.getrusage`, ru_maxrss), and what it read.
Printed: one line per range, then a JSON line with the largest peak and the records, documents,
too_large rows and bytes copied over all ranges (the huge line is one too_large row, every other
record a document, and the ranges' copies add up to the file).
"""

from __future__ import annotations

import benchmarks.one_core  # noqa: F401 -- first: one thread per pool, before numpy is imported

# isort: split

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from marin_assets.curation.config import SourceConfig, parse_curation_config  # noqa: E402
from marin_assets.curation.copying import copy_listed_file  # noqa: E402
from marin_assets.curation.discovery import Shard, discover_shards  # noqa: E402
from marin_assets.curation.listed_files import FileRef  # noqa: E402
from marin_assets.curation.readers import read_shard  # noqa: E402

MB = 1_000_000
SMALL_RECORDS = 1_000  # before the huge line, and as many after it


def write_corpus(path: Path, line_mb: int) -> None:
    """The small records, the huge one written a megabyte at a time, the small records again."""
    with open(path, "w") as fh:
        for part in ("before", "after"):
            if part == "after":
                fh.write('{"text": "')
                for _ in range(line_mb):
                    fh.write("x" * MB)
                fh.write('"}\n')
            for i in range(SMALL_RECORDS):
                fh.write(json.dumps({"text": f"record {i} {part} the huge line: a short document"}) + "\n")


def source_over(path: Path, range_mb: int, max_doc_mb: int) -> SourceConfig:
    fields = {"name": "huge", "uri": str(path), "format": "jsonl", "bytes_per_shard": range_mb * MB,
              "max_doc_bytes": max_doc_mb * MB}
    return parse_curation_config({"sources": [fields]}, path.parent).sources[0]


def run_range(source: SourceConfig, ref: FileRef, copy: Path) -> dict:
    """One range as raw and documents handle it: copied into ``copy``, then read from there."""
    def open_copy():
        return open(copy, "wb")

    copied = copy_listed_file(ref, source, open_copy)
    stored = FileRef(uri=str(copy), relpath=ref.relpath, size=copied.bytes)
    result = read_shard(source, Shard(source=source.name, key=ref.shard_path, files=(stored,)))
    return {"records": result.n_records, "documents": result.documents.height,
            "too_large": result.quarantine_counts["too_large"], "copied_bytes": copied.bytes}


def worker(corpus: Path, range_mb: int, max_doc_mb: int, index: int, workdir: Path) -> dict:
    """In a child process: a warm-up pass over a small file, then range ``index``; the peak above the warm-up."""
    small = workdir / "warm-up.jsonl"
    small.write_text("".join(json.dumps({"text": f"warm-up {i}"}) + "\n" for i in range(100)))
    warm = source_over(small, range_mb, max_doc_mb)
    run_range(warm, discover_shards(warm)[0].files[0], workdir / f"warm-up-copy-{index}")
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    source = source_over(corpus, range_mb, max_doc_mb)
    ref = discover_shards(source)[index].files[0]
    read = run_range(source, ref, workdir / f"range-{index}.jsonl")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (workdir / f"range-{index}.jsonl").unlink()
    return {"range": list(ref.byte_range or (0, 0)), "peak_mib_over_baseline": round((peak - baseline) / 1024, 1),
            **read}


def measure(workdir: Path, line_mb: int, max_doc_mb: int, range_mb: int) -> dict:
    corpus = workdir / "huge.jsonl"
    write_corpus(corpus, line_mb)
    ranges = len(discover_shards(source_over(corpus, range_mb, max_doc_mb)))
    size = corpus.stat().st_size
    rows = []
    for index in range(ranges):
        child = subprocess.run([sys.executable, "-m", "benchmarks.huge_line", "--worker", str(index),
                                "--workdir", str(workdir), "--line-mb", str(line_mb), "--max-doc-mb",
                                str(max_doc_mb), "--range-mb", str(range_mb)],
                               capture_output=True, text=True, check=True)
        rows.append(json.loads(child.stdout.splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    corpus.unlink()
    return {"line_mb": line_mb, "max_doc_mb": max_doc_mb, "range_mb": range_mb, "ranges": ranges,
            "max_peak_mib_over_baseline": max(r["peak_mib_over_baseline"] for r in rows),
            **{k: sum(r[k] for r in rows) for k in ("records", "documents", "too_large", "copied_bytes")},
            "file_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--line-mb", type=int, default=300)
    parser.add_argument("--max-doc-mb", type=int, default=16)
    parser.add_argument("--range-mb", type=int, default=64)
    parser.add_argument("--workdir", type=Path, help="where the corpus and the copies go (default: a temporary one)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.workdir / "huge.jsonl", args.range_mb, args.max_doc_mb, args.worker,
                                args.workdir)))
        return
    with tempfile.TemporaryDirectory(prefix="huge-line-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        print(json.dumps(measure(workdir, args.line_mb, args.max_doc_mb, args.range_mb)))


if __name__ == "__main__":
    main()
