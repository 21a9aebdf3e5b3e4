"""What `tokenized/<source>` reads before a one-shard append: every shard's `token_shards` manifest
(the path before) or the new shard's only (the shards the cache holds taken from its own record).

Usage:
    python benchmarks/shard_lookup.py [--shards 500 5000] [--latency-ms 0] [--workdir DIR]

For each size N, a synthetic store on local disk: `deduplicated/<source>` listing N+1 shard files,
its eval index, N+1 committed `decontaminated/<source>` and `token_shards/<source>` partitions
(manifests as the assets write them, with small data and row files), a tokenizer, and the committed
cache of the first N shards (its artifact manifest, with the N shards' partitions as inputs and
their deduplicated files in `decontaminated_from`, and its ledger `marin_tokenize_manifest.json`).
Then the two steps the append runs before its assembly, as the asset runs them:

  old: `encoded_shards` with no previous cache (every shard's two manifests read, 32 shards at a
       time) and the input check (`refuse_damaged_inputs`) over every input: each manifest read
       again, its files listed;
  new: the committed cache's manifest read, `encoded_shards` with it (`carried_shards`: its ledger,
       `marin_tokenize_manifest.json`, read once through fsspec, not counted below) and the input
       check over what is read: the corpus, the tokenizer, the eval index and the new shard.

Both must give the same inputs (the lineage the manifest records) and entries. Reported: the
token_shards manifests read, the store calls (manifest reads and listings), wall and CPU seconds.
`--latency-ms` adds that much sleep to every manifest read and listing, a stand-in for an object
store's request latency (not a measurement of one). The last line is JSON.
"""

from __future__ import annotations

import os
import sys

# Scripts in benchmarks/ (e.g. tokenize.py) would shadow stdlib modules of the same name.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

from marin_assets.tokenization.assets import ROWS_DIR, encoded_shards, token_shards_identity  # noqa: E402
from marin_assets.tokenization.cache_config import CacheConfig  # noqa: E402
from marin_assets.tokenization.cache_format import MANIFEST_NAME as CACHE_MANIFEST  # noqa: E402
from marin_assets.tokenization.decontamination_assets import (  # noqa: E402
    decontaminated_identity,
    eval_ngrams_key,
    shard_file,
)
from marin_assets.tokenization.registry import (  # noqa: E402
    DECONTAMINATED_VERSION,
    EVAL_NGRAMS_VERSION,
    TOKEN_SHARDS_VERSION,
    TOKENIZED_VERSION,
    TokenizedEntry,
)
from marin_resources.artifacts import ArtifactHandle, refuse_damaged_inputs  # noqa: E402
from marin_resources.storage.identity import fingerprint  # noqa: E402
from marin_resources.storage.store import ArtifactStore, FileEntry, Manifest, content_data_version  # noqa: E402

SOURCE, TOKENIZER = "synthetic", "synthetic_bpe"
ENTRY = TokenizedEntry(SOURCE, TOKENIZER, CacheConfig(validation_fraction=0.01))
ROW_FILES = ("train.tokens", "train.lengths", "validation.tokens", "validation.lengths", "id_hashes")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def commit(store: ArtifactStore, key: str, version: str, partition: str | None, identity: dict,
           files: dict[str, bytes], *, upstream=(), metrics=None) -> Manifest:
    """An artifact with these files, its manifest written as a build commits it."""
    fp = fingerprint(identity)
    uri = store.artifact_uri(key, version, partition, fingerprint=fp)
    entries = []
    for rel, data in sorted(files.items()):
        path = store.local_path(f"{uri}/{rel}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        entries.append(FileEntry(rel, len(data), _sha(data)))
    manifest = Manifest(key, partition, version, fp, identity, content_data_version(entries), entries,
                        [u.ref() for u in upstream], {}, "", "", dict(metrics or {}), uri=uri)
    store.write_manifest(manifest)
    store.point(manifest)
    return manifest


def synthetic_store(root: Path, shards: int) -> tuple[ArtifactStore, dict]:
    store = ArtifactStore(str(root))
    names = [f"shard-{k:06d}" for k in range(shards + 1)]  # the last one is the new shard
    corpus = ArtifactHandle.from_manifest(commit(store, f"deduplicated/{SOURCE}", "v1", None, {},
                                                 {f"data/{n}.parquet": n.encode() for n in names}))
    corpus_manifest = store.read_manifest(corpus.uri)
    tokenizer = ArtifactHandle.from_manifest(commit(store, f"tokenizer/{TOKENIZER}", "v1", None, {},
                                                    {"tokenizer.json": b"{}"}))
    encoding = {"format_version": 1, "tokenizer_json_sha256": _sha(b"{}"), "bos_token_id": 1, "eos_token_id": 2,
                **ENTRY.cache.encoding_identity()}
    identity = token_shards_identity(ENTRY)
    index = ArtifactHandle.from_manifest(commit(store, eval_ngrams_key(SOURCE), EVAL_NGRAMS_VERSION, None, {},
                                                {"ngrams.npy": b"index"}, upstream=[corpus]))
    encoded, checked, sources = [], [], {}
    for n in names:
        read = corpus_manifest.file_version(f"data/{n}.parquet")
        dec = commit(store, f"decontaminated/{SOURCE}", DECONTAMINATED_VERSION, n, decontaminated_identity(ENTRY),
                     {shard_file(n): b"kept " + n.encode(), f"dropped/{n}.parquet": b"dropped " + n.encode()},
                     upstream=[replace(corpus, partition=n, data_version=read), index])
        checked.append(dec)
        version = dec.file_version(shard_file(n))
        sources[n] = [read, version]
        shard = {"key": store.portable(f"{dec.uri}/{shard_file(n)}"), "fingerprint": version,
                 "train_documents": 44_550, "train_tokens": 47_000_000, "validation_documents": 450,
                 "validation_tokens": 470_000, "text_bytes": 134_000_000, "skipped_documents": 0,
                 "encoding": encoding}
        inputs = [replace(ArtifactHandle.from_manifest(dec), data_version=version), tokenizer]
        encoded.append(commit(store, f"token_shards/{SOURCE}", TOKEN_SHARDS_VERSION, n, identity,
                              {f"{ROWS_DIR}/{f}": n.encode() + f.encode() for f in ROW_FILES},
                              upstream=inputs, metrics={"shard": shard, "documents": 45_000}))
    # The committed cache of the first N shards: its ledger, and its manifest naming them as inputs.
    ledger = {"identity": {**encoding, "validation_fraction": ENTRY.cache.validation_fraction},
              "finished": True, "appended_from": 0,
              "shards": [{k: v for k, v in m.metrics["shard"].items() if k != "encoding"} for m in encoded[:-1]]}
    ledger_bytes = json.dumps(store.portable(ledger), indent=1, sort_keys=True).encode()
    commit(store, f"tokenized/{SOURCE}", TOKENIZED_VERSION, None, {"cache": ENTRY.cache.identity()},
           {CACHE_MANIFEST: ledger_bytes},
           upstream=[corpus, tokenizer, index, *(ArtifactHandle.from_manifest(m) for pair in
                                                zip(checked[:-1], encoded[:-1]) for m in pair)],
           metrics={"decontaminated_from": {n: sources[n] for n in names[:-1]}})
    return store, {"corpus": corpus, "tokenizer": tokenizer, "index": index}


class Calls:
    """Counts (and optionally slows) the store's manifest reads and listings."""

    def __init__(self, latency_s: float):
        self.latency_s, self.manifests, self.token_shards, self.listings = latency_s, 0, 0, 0
        self._read, self._stats = ArtifactStore.read_manifest, ArtifactStore.file_stats

    def __enter__(self) -> Calls:
        calls = self

        def read_manifest(store, uri):
            calls.manifests += 1
            calls.token_shards += f"/token_shards/{SOURCE}/" in uri
            time.sleep(calls.latency_s)
            return calls._read(store, uri)

        def file_stats(store, uri):
            calls.listings += 1
            time.sleep(calls.latency_s)
            return calls._stats(store, uri)

        ArtifactStore.read_manifest, ArtifactStore.file_stats = read_manifest, file_stats
        return self

    def __exit__(self, *exc) -> None:
        ArtifactStore.read_manifest, ArtifactStore.file_stats = self._read, self._stats


def lookup(store: ArtifactStore, inputs: dict, *, carry: bool, latency_s: float) -> dict:
    corpus, tokenizer, index = inputs["corpus"], inputs["tokenizer"], inputs["index"]
    with Calls(latency_s) as calls:
        wall, cpu = time.perf_counter(), time.process_time()
        # The asset reads the committed cache it resumes first (its ledger is read by `held_shards`).
        previous = store.find(f"tokenized/{SOURCE}", TOKENIZED_VERSION, None,
                              fingerprint=fingerprint({"cache": ENTRY.cache.identity()})) if carry else None
        found = encoded_shards(store, ENTRY, corpus, tokenizer, index, previous)
        looked_up = time.perf_counter() - wall
        carried = {h.partition for h in found.carried}
        refuse_damaged_inputs(store, [corpus, tokenizer, index,
                                      *(h for h in found.inputs if h.partition not in carried)], full=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"token_shards_manifests_read": calls.token_shards, "manifest_reads": calls.manifests,
            "listings": calls.listings, "lookup_s": round(looked_up, 3), "with_input_check_s": round(wall, 3),
            "cpu_s": round(cpu, 3), "carried": len(carried),
            "lineage": [h.ref() for h in found.inputs], "entries": found.entries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[500, 5000], help="shards the cache holds")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="sleep added to each manifest read and listing")
    parser.add_argument("--workdir", help="default: a temporary directory, removed afterwards")
    args = parser.parse_args()
    results = []
    print(f"{'shards':>7} {'path':>4} {'manifests':>9} {'reads':>6} {'lists':>6} {'lookup s':>9} {'+check s':>9} "
          f"{'cpu s':>7}")
    for shards in args.shards:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            store, inputs = synthetic_store(Path(tmp) / "store", shards)
            old = lookup(store, inputs, carry=False, latency_s=args.latency_ms / 1000)
            new = lookup(store, inputs, carry=True, latency_s=args.latency_ms / 1000)
        # The lineage the manifest records and the assembly's input are the full lookup's.
        assert new["lineage"] == old["lineage"] and new["carried"] == shards, "the paths disagree"
        # The held shards' entries are the old path's less their row files; the new shard's is the same.
        held = [{k: v for k, v in e.items() if k not in ("rows", "encoding")} for e in old["entries"][:-1]]
        assert new["entries"][:-1] == held and new["entries"][-1] == old["entries"][-1], "the entries disagree"
        for name, row in (("old", old), ("new", new)):
            print(f"{shards:>7} {name:>4} {row['token_shards_manifests_read']:>9} {row['manifest_reads']:>6} "
                  f"{row['listings']:>6} {row['lookup_s']:>9} {row['with_input_check_s']:>9} {row['cpu_s']:>7}")
            row.pop("lineage"), row.pop("entries")
        results.append({"shards": shards, "old": old, "new": new})
    print(json.dumps({"latency_ms": args.latency_ms, "results": results}))


if __name__ == "__main__":
    main()
