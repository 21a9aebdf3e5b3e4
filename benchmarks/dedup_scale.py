"""Incremental, partitioned dedup (``update_index``) against the old in-memory datasketch LSH.

Usage:
    python -m benchmarks.dedup_scale [--sizes 25000 100000 400000] [--shard-docs 25000]

Three parts, each measured in a fresh child process (peak RSS is the child's ``VmHWM``; the
peak right before the timed step is printed too, so the growth is visible; ours first runs one
untimed 50-document update and both read one signature file first, since the first read pays about
3 s of one-time lazy imports):

1. Quality on a real corpus: the Debian copyright files (``/usr/share/doc/*/copyright``, one
   document per file, in 4 shards by sorted path). The truth is brute force: every pair's exact
   Jaccard of the shingle sets, then the same first-seen centre assignment (a document is dropped
   when it has Jaccard >= threshold with an earlier kept document). Precision and recall of our
   dropped set against it, and the count of drops below the threshold to their kept document.
2. Scale: a seeded corpus of documents of 10-40 sentences drawn from the unique sentences of the
   system's licence and copyright texts, in shards of ``--shard-docs`` documents; 3% of documents
   are planted near-duplicates of an earlier document (1% of its words substituted, Jaccard about
   0.9). Signatures are computed once and cached on disk with the documents, as ``filtered/``
   caches them. Per size:
   * ours: ``update_index`` from the cached shards into an empty index (keys, the partitioned
     candidate step, verification, centre assignment and writing the index), seconds and peak RSS,
     with planted-duplicate recall and unplanted documents dropped;
   * datasketch: the old candidate step alone, ``MinHashLSH`` over every signature (as
     ``LeanMinHash``) and one query per document, seconds and peak RSS. It does no verification,
     which favours it.
3. Incremental: at the largest size, the index of all shards but the last, then the last shard
   added (seconds, peak RSS), against indexing that one shard alone; best of ``--repeats`` each.
   ``--new-shard-docs N`` adds only the last shard's first N documents: a shard small next to
   the index, where the bucket filters are fetched.
   The added shard also runs against a copy of the index without its bucket filters (read by the
   row groups' min/max statistics alone, as before the filters): row groups read, seconds, and
   whether it dropped the same documents.

The last line is JSON.
"""

from __future__ import annotations

import benchmarks.one_core  # noqa: F401 -- first: one thread per pool, before numpy is imported

# isort: split

import argparse  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import polars as pl  # noqa: E402

from marin_assets.curation.dedup import decision_path, update_index  # noqa: E402
from marin_assets.curation.dedup_index import DedupConfig, IndexDir, ShardInput  # noqa: E402
from marin_assets.curation.minhash import (  # noqa: E402
    compute_signatures,
    exact_jaccard,
    load_signatures,
    save_signatures,
    shingle_sets,
)

CONFIG = DedupConfig()
PLANTED_FRACTION = 0.03
SUBSTITUTED_FRACTION = 0.01


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: unlike ru_maxrss, it does not carry the parent's peak over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def frame(texts: list[str], source_ids: list[str], source: str) -> pl.DataFrame:
    return pl.DataFrame({
        "id": [hashlib.sha256(text.encode()).hexdigest() for text in texts],
        "text": texts, "source": source, "source_id": source_ids, "metadata": "{}",
    }, schema={"id": pl.Utf8, "text": pl.Utf8, "source": pl.Utf8, "source_id": pl.Utf8, "metadata": pl.Utf8})


def write_shard(folder: Path, key: str, docs: pl.DataFrame) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    docs.write_parquet(folder / f"{key}.docs.parquet")
    save_signatures(compute_signatures(docs, CONFIG.minhash), folder / f"{key}.signatures.parquet")


def shard_inputs(folder: Path, keys: list[str]) -> list[ShardInput]:
    return [ShardInput("bench", key, "v", lambda key=key: pl.read_parquet(folder / f"{key}.docs.parquet"),
                       lambda key=key: load_signatures(folder / f"{key}.signatures.parquet", CONFIG.minhash))
            for key in keys]


ADDED_PREFIX = "added-"  # the incremental part's cut-down new shard, not a shard of the corpus


def shard_keys_in(folder: Path) -> list[str]:
    return sorted(path.name[: -len(".docs.parquet")] for path in folder.glob("*.docs.parquet")
                  if not path.name.startswith(ADDED_PREFIX))


def dropped_by_index(index: IndexDir, seqs: list[int]) -> pl.DataFrame:
    return pl.concat([index.read_parquet(decision_path(seq)) for seq in seqs])


# ---------------------------------------------------------------------------------------------
# Children: one measurement each
# ---------------------------------------------------------------------------------------------


def warm_up(folder: Path, key: str) -> None:
    """One untimed update on 50 documents: the first call pays seconds of one-time lazy imports
    (pyarrow.dataset and pandas, through the Parquet reader of load_signatures)."""
    load_signatures(folder / f"{key}.signatures.parquet", CONFIG.minhash)
    docs = pl.read_parquet(folder / f"{key}.docs.parquet").head(50)
    with tempfile.TemporaryDirectory() as tmp:
        update_index(IndexDir.local(tmp), [ShardInput("warm", "up", "v", lambda: docs,
                                                      lambda: compute_signatures(docs, CONFIG.minhash))], CONFIG)


def measure_ours(folder: Path, keys: list[str], index_dir: Path, previous: list[str]) -> dict:
    index = IndexDir.local(index_dir)
    warm_up(folder, keys[0])
    baseline = peak_rss_mb()
    start = time.perf_counter()
    update = update_index(index, shard_inputs(folder, previous + keys), CONFIG)
    seconds = time.perf_counter() - start
    dropped = dropped_by_index(index, [shard.seq for shard in update.new_shards])
    planted = sum(pl.read_parquet(folder / f"{key}.docs.parquet", columns=["source_id"])["source_id"]
                  .str.starts_with("planted-").sum() for key in keys)
    planted_dropped = int(dropped["dropped_source_id"].str.starts_with("planted-").sum())
    return {"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "rss_before_mb": baseline,
            "docs": update.stats["input_docs"], "planted": int(planted), "planted_dropped": planted_dropped,
            "unplanted_dropped": len(dropped) - planted_dropped,
            "max_partition_keys": update.stats["max_partition_keys"],
            "colliding_keys": update.stats["colliding_keys"],
            "index_row_groups": update.stats["index_row_groups"],
            "index_row_groups_read": update.stats["index_row_groups_read"],
            "index_filter_bytes": update.stats["index_filter_bytes"],
            "below_threshold": update.stats["dropped_below_threshold_via_chain"]}


def measure_datasketch(folder: Path, keys: list[str]) -> dict:
    from datasketch import LeanMinHash, MinHashLSH

    load_signatures(folder / f"{keys[0]}.signatures.parquet", CONFIG.minhash)  # the same one-time imports
    baseline = peak_rss_mb()
    start = time.perf_counter()
    lsh = MinHashLSH(num_perm=CONFIG.minhash.num_perm, params=(CONFIG.bands, CONFIG.rows))
    sketches = []
    for key in keys:
        table = load_signatures(folder / f"{key}.signatures.parquet", CONFIG.minhash)
        for row in range(len(table)):
            sketches.append(LeanMinHash(seed=CONFIG.minhash.seed, hashvalues=table.hashvalues[row],
                                        scheme="affine32"))
    with lsh.insertion_session() as session:
        for number, sketch in enumerate(sketches):
            session.insert(number, sketch, check_duplication=False)
    pairs = sum(len(lsh.query(sketch)) - 1 for sketch in sketches) // 2
    return {"seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb(), "rss_before_mb": baseline,
            "docs": len(sketches), "candidate_pairs": pairs}


def child(args: argparse.Namespace) -> None:
    folder = Path(args.folder)
    keys = args.keys.split(",")
    if args.child == "ours":
        previous = args.previous.split(",") if args.previous else []
        result = measure_ours(folder, keys, Path(args.index), previous)
    else:
        result = measure_datasketch(folder, keys)
    print(json.dumps(result))


def run_child(*extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.dedup_scale", *extra], capture_output=True, text=True,
                          timeout=3600, cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode != 0:
        raise SystemExit(f"child {extra} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Part 1: quality on the Debian copyright files
# ---------------------------------------------------------------------------------------------


def brute_force_drops(texts: list[str], ids: list[str]) -> dict[int, int]:
    """dropped position -> kept position, by first-seen centre assignment over exact Jaccard of all pairs."""
    sets = shingle_sets(texts, CONFIG.minhash.shingle_size)
    centres: list[int] = []
    drops = {}
    for doc in range(len(texts)):
        for centre in centres:
            if ids[centre] == ids[doc] or exact_jaccard(sets[doc], sets[centre]) >= CONFIG.jaccard_threshold:
                drops[doc] = centre
                break
        else:
            centres.append(doc)
    return drops


def quality(folder: Path) -> dict:
    paths = sorted(glob.glob("/usr/share/doc/*/copyright"))
    texts = [Path(path).read_text(encoding="utf-8", errors="replace") for path in paths]
    shards = 4
    per_shard = -(-len(texts) // shards)
    keys = []
    for number in range(shards):
        part = range(number * per_shard, min(len(texts), (number + 1) * per_shard))
        keys.append(f"copyright-{number}")
        write_shard(folder, keys[-1], frame([texts[i] for i in part], [str(i) for i in part], "debian"))
    ids = [hashlib.sha256(text.encode()).hexdigest() for text in texts]
    # Exact exact-id drops in brute force: the exact check is part of the same rule.
    truth = brute_force_drops(texts, ids)
    index = IndexDir.local(folder / "index")
    start = time.perf_counter()
    update = update_index(index, shard_inputs(folder, keys), CONFIG)
    seconds = time.perf_counter() - start
    dropped = dropped_by_index(index, [shard.seq for shard in update.new_shards])
    ours = {int(a): int(b) for a, b in zip(dropped["dropped_source_id"], dropped["kept_source_id"])}
    hits = len(set(ours) & set(truth))
    same_kept = sum(ours[doc] == truth[doc] for doc in set(ours) & set(truth))
    return {"documents": len(texts), "truth_dropped": len(truth), "ours_dropped": len(ours),
            "precision": hits / len(ours) if ours else 1.0, "recall": hits / len(truth) if truth else 1.0,
            "same_kept_document": same_kept, "below_threshold": update.stats["dropped_below_threshold_via_chain"],
            "min_jaccard": float(dropped.filter(pl.col("reason") == "fuzzy")["jaccard"].min() or 1.0),
            "seconds": seconds}


# ---------------------------------------------------------------------------------------------
# Part 2: the scale corpus
# ---------------------------------------------------------------------------------------------


def sentence_pool() -> list[str]:
    paths = glob.glob("/usr/share/doc/*/copyright") + glob.glob("/usr/share/common-licenses/*")
    sentences = set()
    for path in paths:
        text = " ".join(Path(path).read_text(encoding="utf-8", errors="replace").split())
        # Long run-ons (file lists without full stops) would make documents that share one of them similar.
        sentences.update(s for s in re.split(r"(?<=[.!?])\s+", text) if 6 <= len(s.split()) <= 60)
    return sorted(sentences)


def build_corpus(folder: Path, total_docs: int, shard_docs: int, seed: int) -> None:
    rng = random.Random(seed)
    pool = sentence_pool()
    vocabulary = sorted({word for sentence in pool[:2000] for word in sentence.split()})
    recent: list[str] = []  # originals a planted copy may duplicate (earlier documents)
    number = 0
    for shard in range(total_docs // shard_docs):
        texts, source_ids = [], []
        for _ in range(shard_docs):
            if recent and rng.random() < PLANTED_FRACTION:
                original = rng.choice(recent)
                words = original.split()
                for position in rng.sample(range(len(words)), max(1, round(len(words) * SUBSTITUTED_FRACTION))):
                    words[position] = rng.choice(vocabulary)
                texts.append(" ".join(words))
                source_ids.append(f"planted-{number}")
            else:
                texts.append(" ".join(rng.sample(pool, rng.randint(10, 40))))
                source_ids.append(f"doc-{number}")
                recent.append(texts[-1])
                recent = recent[-5000:]
            number += 1
        write_shard(folder, f"shard-{shard:05d}", frame(texts, source_ids, "bench"))
        print(f"  wrote shard {shard} ({number} documents so far)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[25_000, 100_000, 400_000])
    parser.add_argument("--shard-docs", type=int, default=25_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the corpus here (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the incremental pair; the best counts")
    parser.add_argument("--new-shard-docs", type=int, default=None,
                        help="the incremental part's new shard: the last shard's first N documents (default: all)")
    parser.add_argument("--child", choices=["ours", "datasketch"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--keys", help=argparse.SUPPRESS)
    parser.add_argument("--previous", default="", help=argparse.SUPPRESS)
    parser.add_argument("--index", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if any(size % args.shard_docs for size in args.sizes):
        raise SystemExit("every size must be a multiple of --shard-docs")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dedup-scale-"))
    work.mkdir(parents=True, exist_ok=True)

    print("quality: Debian copyright files, ours vs brute force", flush=True)
    shutil.rmtree(work / "quality", ignore_errors=True)
    debian = quality(work / "quality")
    print("  " + json.dumps(debian), flush=True)

    corpus = work / "corpus"
    largest = max(args.sizes)
    if len(shard_keys_in(corpus)) < largest // args.shard_docs:
        print(f"building a corpus of {largest} documents", flush=True)
        shutil.rmtree(corpus, ignore_errors=True)
        build_corpus(corpus, largest, args.shard_docs, args.seed)
    all_keys = shard_keys_in(corpus)
    megabytes = {key: (corpus / f"{key}.docs.parquet").stat().st_size / 1e6 for key in all_keys}

    rows = []
    for size in sorted(args.sizes):
        keys = all_keys[: size // args.shard_docs]
        shutil.rmtree(work / "index", ignore_errors=True)
        ours = run_child("--child", "ours", "--folder", str(corpus), "--keys", ",".join(keys),
                         "--index", str(work / "index"))
        theirs = run_child("--child", "datasketch", "--folder", str(corpus), "--keys", ",".join(keys))
        rows.append({"docs": size, "shards": len(keys), "parquet_mb": round(sum(megabytes[k] for k in keys), 1),
                     "ours": ours, "datasketch": theirs})
        print(f"  {size} docs: ours {ours['seconds']:.1f} s {ours['peak_rss_mb']:.0f} MB; "
              f"datasketch {theirs['seconds']:.1f} s {theirs['peak_rss_mb']:.0f} MB", flush=True)

    # Incremental: the largest index minus its last shard, then the last shard, against that shard
    # into an empty index; best of --repeats each (the machine is shared, so single runs are noisy).
    keys = all_keys[: largest // args.shard_docs]
    base = work / "index-base"
    shutil.rmtree(base, ignore_errors=True)
    run_child("--child", "ours", "--folder", str(corpus), "--keys", ",".join(keys[:-1]), "--index", str(base))
    new_key = keys[-1]
    if args.new_shard_docs:
        new_key = f"{ADDED_PREFIX}{keys[-1]}-first-{args.new_shard_docs}"
        write_shard(corpus, new_key, pl.read_parquet(corpus / f"{keys[-1]}.docs.parquet").head(args.new_shard_docs))
    added_runs, unfiltered_runs, alone_runs = [], [], []
    for _attempt in range(args.repeats):
        for runs, keep_filters in ((added_runs, True), (unfiltered_runs, False)):
            shutil.rmtree(work / "index", ignore_errors=True)
            without_filters = None if keep_filters else shutil.ignore_patterns("*.filter.npy")
            shutil.copytree(base, work / "index", ignore=without_filters)
            runs.append(run_child("--child", "ours", "--folder", str(corpus), "--keys", new_key, "--previous",
                                  ",".join(keys[:-1]), "--index", str(work / "index")))
        shutil.rmtree(work / "index-one", ignore_errors=True)
        alone_runs.append(run_child("--child", "ours", "--folder", str(corpus), "--keys", new_key, "--index",
                                    str(work / "index-one")))
    added = min(added_runs, key=lambda run: run["seconds"])
    unfiltered = min(unfiltered_runs, key=lambda run: run["seconds"])
    same_drops = all(run[k] == added_runs[0][k] for run in added_runs + unfiltered_runs
                     for k in ("planted_dropped", "unplanted_dropped"))
    alone = min(alone_runs, key=lambda run: run["seconds"])

    print()
    print(f"{'docs':>8s} {'shards':>6s} {'MB':>7s} | {'ours s':>7s} {'ours MB':>8s} {'part keys':>10s} "
          f"{'recall':>7s} {'unpl.':>5s} | {'datasketch s':>12s} {'datasketch MB':>13s} {'pairs':>7s}")
    for row in rows:
        ours, theirs = row["ours"], row["datasketch"]
        recall = ours["planted_dropped"] / ours["planted"] if ours["planted"] else 1.0
        print(f"{row['docs']:8d} {row['shards']:6d} {row['parquet_mb']:7.1f} | {ours['seconds']:7.1f} "
              f"{ours['peak_rss_mb']:8.0f} {ours['max_partition_keys']:10d} {recall:7.3f} "
              f"{ours['unplanted_dropped']:5d} | {theirs['seconds']:12.1f} {theirs['peak_rss_mb']:13.0f} "
              f"{theirs['candidate_pairs']:7d}")
    print(f"peak RSS before the timed step (imports, warm-up): ours {rows[0]['ours']['rss_before_mb']:.0f} MB, "
          f"datasketch {rows[0]['datasketch']['rss_before_mb']:.0f} MB")
    print(f"one new shard ({added['docs']} documents) after {len(keys) - 1} (best of {args.repeats}): "
          f"{added['seconds']:.2f} s, "
          f"{added['peak_rss_mb']:.0f} MB; "
          f"that shard alone into an empty index: {alone['seconds']:.2f} s, {alone['peak_rss_mb']:.0f} MB "
          f"(ratio {added['seconds'] / alone['seconds']:.2f}); index row groups read: "
          f"{added['index_row_groups_read']} of {added['index_row_groups']}")
    print(f"the same new shard, bucket filters against the min/max statistics alone (best of {args.repeats}):")
    print(f"  {'':>12s} {'seconds':>8s} {'row groups read':>16s} {'filter MB':>9s}")
    for name, run in (("filters", added), ("statistics", unfiltered)):
        read = f"{run['index_row_groups_read']} of {run['index_row_groups']}"
        print(f"  {name:>12s} {run['seconds']:8.2f} {read:>16s} {run['index_filter_bytes'] / 1e6:9.2f}")
    print(f"  same documents dropped in every run: {same_drops}")
    summary = {
        "debian": {k: debian[k] for k in ("documents", "precision", "recall", "below_threshold", "truth_dropped")},
        "sizes": [row["docs"] for row in rows],
        "ours_seconds": [round(row["ours"]["seconds"], 2) for row in rows],
        "ours_peak_rss_mb": [round(row["ours"]["peak_rss_mb"]) for row in rows],
        "datasketch_seconds": [round(row["datasketch"]["seconds"], 2) for row in rows],
        "datasketch_peak_rss_mb": [round(row["datasketch"]["peak_rss_mb"]) for row in rows],
        "planted_recall": [round(row["ours"]["planted_dropped"] / max(row["ours"]["planted"], 1), 4) for row in rows],
        "unplanted_dropped": [row["ours"]["unplanted_dropped"] for row in rows],
        "incremental_seconds": round(added["seconds"], 2), "one_shard_alone_seconds": round(alone["seconds"], 2),
        "incremental_ratio": round(added["seconds"] / alone["seconds"], 2),
        "incremental_peak_rss_mb": round(added["peak_rss_mb"]),
        "incremental_row_groups": added["index_row_groups"],
        "incremental_row_groups_read": {"filters": added["index_row_groups_read"],
                                        "statistics": unfiltered["index_row_groups_read"]},
        "incremental_seconds_statistics_alone": round(unfiltered["seconds"], 2),
        "incremental_same_drops": same_drops,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
