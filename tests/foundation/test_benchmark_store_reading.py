"""The benchmarks read stores the way the assets write them: a layout change that would break a
benchmark fails here rather than in a benchmark run (benchmarks/incremental.py listed
`<stage>/<source>/v1/` long after artifacts had moved to `v1-<fingerprint>/`)."""

import importlib.util
import sys
from pathlib import Path

from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore, producer_info, writing

# benchmarks/ is a folder of scripts, not an installed package: load the script by its path.
_SPEC = importlib.util.spec_from_file_location(
    "benchmark_incremental", Path(__file__).resolve().parents[2] / "benchmarks" / "incremental.py")
incremental = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = incremental  # its dataclasses look their module up while they are built
_SPEC.loader.exec_module(incremental)


def test_incremental_snapshot_lists_every_committed_partition(tmp_path):
    store = ArtifactStore(str(tmp_path))
    versions = {}
    for shard in ("a.txt", "b.txt"):
        with writing(store, f"filtered/{incremental.SOURCE}", "v1", shard, fingerprint=fingerprint({"shard": shard}),
                     run_id="r1") as writer:
            with writer.open("documents.parquet") as fh:
                fh.write(shard.encode())
            versions[shard] = writer.commit(config={}, upstream=[], producer=producer_info("r1")).data_version
    # An uncommitted partition is not listed.
    store.begin(f"filtered/{incremental.SOURCE}", "v1", "c.txt", fingerprint=fingerprint({}), run_id="r2")
    snapshot = incremental.snapshot(str(tmp_path), "filtered")
    assert {shard: version for shard, (version, _) in snapshot.items()} == versions
