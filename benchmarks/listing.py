"""What content identity costs when a local source is listed: cold (every file hashed) vs warm
(the sha256 cache answers after one stat per file) vs one file rewritten.

Usage:
    python benchmarks/listing.py [--files 5000] [--kib 64] [--workdir DIR]

Each listing is `discover_shards` of a fresh SourceConfig over the directory, as the CLI and the
sensors call it, with MARIN_CACHE_DIR in the work directory. The last line is JSON:
{"files": ..., "mib": ..., "cold_s": ..., "warm_s": ..., "one_rewritten_s": ..., "hashed": {...}}.
"""

from __future__ import annotations

import os
import sys

# Scripts in benchmarks/ (e.g. tokenize.py) would shadow stdlib modules of the same name.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--kib", type=int, default=64, help="size of each file")
    parser.add_argument("--workdir", help="default: a temporary directory, removed afterwards")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        os.environ["MARIN_CACHE_DIR"] = str(Path(tmp) / "cache")
        from marin_assets.curation import content_hashes
        from marin_assets.curation.config import parse_curation_config
        from marin_assets.curation.discovery import discover_shards

        data = Path(tmp) / "data"
        data.mkdir()
        for i in range(args.files):
            (data / f"f{i:06d}.txt").write_bytes(os.urandom(args.kib * 1024))
        source = parse_curation_config({"sources": [{"name": "bench", "uri": str(data)}]}, tmp).sources[0]

        hashed: dict[str, int] = {}
        real_sha256_file = content_hashes.sha256_file

        def counting(path):
            hashed[phase] = hashed.get(phase, 0) + 1
            return real_sha256_file(path)

        content_hashes.sha256_file = counting
        timings = {}
        for phase in ("cold", "warm", "one_rewritten"):
            if phase == "one_rewritten":
                target = data / "f000000.txt"
                stat = target.stat()
                target.write_bytes(os.urandom(args.kib * 1024))
                os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime
            started = time.perf_counter()
            shards = discover_shards(source)
            timings[phase] = round(time.perf_counter() - started, 3)
            # Small files are grouped into shards of about the source's bytes_per_shard: count files, not shards.
            listed = sum(len(shard.files) for shard in shards)
            if listed != args.files:
                raise SystemExit(f"{phase}: discovery listed {listed} of the {args.files} files")
            print(f"{phase:14} {timings[phase]:8.3f} s  files hashed: {hashed.get(phase, 0)}  "
                  f"({listed} files in {len(shards)} shards)")
        print(json.dumps({"files": args.files, "mib": round(args.files * args.kib / 1024, 1),
                          **{f"{k}_s": v for k, v in timings.items()}, "hashed": hashed}))


if __name__ == "__main__":
    main()
