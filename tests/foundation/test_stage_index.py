"""A stage's listing with its index of manifests (`marin_resources.storage.stage_index`) answers what the
per-partition lookups answer, on local disk and object stores: after commits the index has not seen,
with a stale or damaged index, for damaged and half-rebuilt artifacts, and while commits land."""

import gzip
import importlib.util
import json
import threading
import time
from pathlib import Path

import dagster as dg
import pytest

from marin_assets.catalog import Catalog
from marin_assets.planning import Planner, parse_key
from marin_resources.storage import stage_index
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.stage_index import index_path, list_stage
from marin_resources.storage.store import ArtifactStore, producer_info, writing

KEY, VERSION = "raw/letters", "v1"


@pytest.fixture(params=["local", "s3", "gcs"])
def store(request, tmp_path):
    if request.param == "local":
        return ArtifactStore(str(tmp_path / "store"))
    prefix, options = request.getfixturevalue(f"{request.param}_prefix")
    return ArtifactStore(prefix, options)


@pytest.fixture(autouse=True)
def small_rewrite_threshold(monkeypatch):
    monkeypatch.setattr(stage_index, "REWRITE_AFTER", 3)


def identity(partition: str) -> dict:
    return {"shard": partition}


def commit(store: ArtifactStore, partition: str, text: bytes, *, run_id: str = "r", finish: bool = True):
    with writing(store, KEY, VERSION, partition, fingerprint=fingerprint(identity(partition)), run_id=run_id) as w:
        with w.open("data.txt") as fh:
            fh.write(text)
        if finish:
            return w.commit(config=identity(partition), upstream=[], producer=producer_info(run_id))
    return None


def direct(store: ArtifactStore, partition: str) -> tuple:
    """What the per-partition lookups say of one partition: (data version, damage, kept data version)."""
    fp = fingerprint(identity(partition))
    found = store.find(KEY, VERSION, partition, fingerprint=fp)
    kept = store.find_previous(KEY, VERSION, partition, fingerprint=fp)
    return (found and found.data_version, store.check_files(found) if found else None,
            kept and kept.data_version)


def listed(listing, partition: str) -> tuple:
    fp = fingerprint(identity(partition))
    found = listing.find(partition, fp)
    kept = listing.find_previous(partition, fp)
    return (found and found.data_version, listing.check_files(found) if found else None,
            kept and kept.data_version)


def assert_agrees(store: ArtifactStore, partitions) -> stage_index.StageListing:
    listing = list_stage(store, KEY, VERSION)
    assert {p: listed(listing, p) for p in partitions} == {p: direct(store, p) for p in partitions}
    listing.finish()
    return listing


def test_the_index_is_written_then_read_and_commits_after_it_are_seen(store):
    parts = [f"s{i}" for i in range(5)]
    for p in parts:
        commit(store, p, f"first {p}".encode())
    first = assert_agrees(store, parts)
    assert first.tail_reads == 5 and first.index_written and store.fs.exists(index_path(store, KEY, VERSION))
    again = assert_agrees(store, parts)
    assert again.tail_reads == 0 and not again.index_written  # every manifest from the index

    # After the index: a new partition, and an indexed one rebuilt with other bytes (same identity, same path).
    commit(store, "s9", b"new")
    rebuilt = commit(store, "s0", b"rebuilt, and longer")
    later = assert_agrees(store, [*parts, "s9"])
    assert later.tail_reads == 2
    assert later.find("s0", fingerprint(identity("s0"))).data_version == rebuilt.data_version


def test_a_stale_or_unreadable_index_costs_reads_never_a_wrong_answer(store):
    parts = ["a", "b", "c"]
    for p in parts:
        commit(store, p, p.encode())
    assert_agrees(store, parts)
    path = index_path(store, KEY, VERSION)
    old_index = store.fs.cat_file(path)
    commit(store, "a", b"a, rebuilt")
    commit(store, "d", b"d")
    assert_agrees(store, [*parts, "d"])  # rewrites nothing (2 reads, under the threshold): still the old index
    store._write_atomic(path, old_index)  # and again, as a slow writer's copy of an older index would land
    assert assert_agrees(store, [*parts, "d"]).tail_reads == 2

    # An index whose entries claim other bytes under the current stamps is the one case a cache cannot
    # catch; one that is garbage, of another format, or truncated is ignored.
    for garbage in (b"not gzip", gzip.compress(b"{not json"), gzip.compress(json.dumps({"format": 99}).encode()),
                    old_index[:len(old_index) // 2]):
        store._write_atomic(path, garbage)
        assert assert_agrees(store, [*parts, "d"]).tail_reads == 4


def test_damaged_and_half_rebuilt_artifacts_are_seen_through_a_fresh_index(store):
    parts = ["a", "b", "c", "d"]
    for p in parts:
        commit(store, p, p.encode() * 10)
    assert_agrees(store, parts)
    fp = {p: fingerprint(identity(p)) for p in parts}
    base = {p: store.fs_path(store.artifact_uri(KEY, VERSION, p, fingerprint=fp[p])) for p in parts}
    store.fs.rm_file(f"{base['a']}/data.txt")  # a file gone
    store.fs.pipe_file(f"{base['b']}/data.txt", b"shorter")  # a file of another size
    commit(store, "c", b"half", run_id="stopped", finish=False)  # a rebuild stopped before its commit
    listing = assert_agrees(store, parts)
    assert listing.tail_reads == 0  # the index was current: the listing alone found all three
    assert listing.check_files(listing.find("a", fp["a"]))[0].endswith("data.txt: missing")
    assert "7 bytes, recorded 10" in listing.check_files(listing.find("b", fp["b"]))[0]
    assert listing.find("c", fp["c"]) is None and listing.find_previous("c", fp["c"]).data_version
    store.fs.rm(base["d"], recursive=True)  # an artifact gone altogether (gc, a hand)
    assert list_stage(store, KEY, VERSION).find("d", fp["d"]) is None


def test_a_listing_sees_every_commit_that_finished_before_it(store):
    """A writer commits and rebuilds partitions while listings are made: each listing holds, for every
    partition, the last commit that finished before the listing began, or a later one."""
    parts = [f"p{i}" for i in range(4)]
    finished: list[tuple[float, str, str]] = []  # (when, partition, data version)
    stop = threading.Event()

    def writer():
        n = 0
        while not stop.is_set() and n < 40:
            p = parts[n % len(parts)]
            manifest = commit(store, p, f"{p} round {n}".encode() * (1 + n % 3), run_id=f"w{n}")
            finished.append((time.monotonic(), p, manifest.data_version))
            n += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        checked = 0
        while thread.is_alive() or checked < 3:
            began = time.monotonic()
            before = list(finished)
            listing = list_stage(store, KEY, VERSION)
            for p in parts:
                done = [v for _, q, v in before if q == p]
                if not done:
                    continue
                found = listing.find(p, fingerprint(identity(p)))
                # Committed before the listing began: found, as that commit or a later one (a commit can be
                # visible before the writer hears back), or being rebuilt with it kept readable.
                if found is None:
                    assert listing.find_previous(p, fingerprint(identity(p))) is not None, (p, began)
                else:
                    assert found.data_version not in done[:-1], (p, began)
            checked += 1
    finally:
        stop.set()
        thread.join()
    assert_agrees(store, parts)


def test_status_reads_the_stage_listing_and_verify_reads_every_artifact(tmp_path):
    # test_artifact_spec's graph: test/lines, one file a shard, "hello <shard>" (tests/ is no package)
    spec = importlib.util.spec_from_file_location("artifact_spec_graph",
                                                  Path(__file__).with_name("test_artifact_spec.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    SHARDS, graph = module.SHARDS, module.graph  # noqa: N806 - the module's constant
    catalog = Catalog()
    defs = graph(tmp_path / "store", catalog)
    store = ArtifactStore(str(tmp_path / "store"))
    key = parse_key("test/lines")
    lines = [a for a in defs.assets if a.key == key]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(SHARDS.name, ["a", "b", "c", "d"])
        for shard in ("a", "b", "c"):
            assert dg.materialize(lines, partition_key=shard, resources=defs.resources, instance=instance).success
        planner = Planner(defs, catalog, store, instance)

        def states(**kwargs):
            return {s.partition: s.state for s in planner.status([key], **kwargs)}

        assert states() == {"a": "fresh", "b": "fresh", "c": "fresh", "d": "missing"}
        assert store.fs.exists(index_path(store, "test/lines", "v1"))  # 3 manifests read: the threshold
        assert dg.materialize(lines, partition_key="d", resources=defs.resources, instance=instance).success
        assert states()["d"] == "fresh"  # committed after the index was written
        uri = {p: store.find("test/lines", "v1", p).uri for p in "ab"}
        (store.local_path(uri["a"]) / "lines.txt").write_bytes(b"hello A")  # same size, other bytes
        (store.local_path(uri["b"]) / "lines.txt").unlink()
        cheap, full = states(), states(verify=True)
        # The cheap check sees the missing file through the index; only a re-hash sees changed bytes of the
        # same size, with the index as current as it gets (--verify reads no index).
        assert cheap == {"a": "fresh", "b": "damaged", "c": "fresh", "d": "fresh"}
        assert full == {"a": "damaged", "b": "damaged", "c": "fresh", "d": "fresh"}
        assert planner._listings is None  # a snapshot for one status only


def test_an_asset_never_built_lists_nothing(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    listing = list_stage(store, KEY, VERSION)
    assert listing.find("x", fingerprint(identity("x"))) is None and listing.code_versions == []
    assert not store.fs.exists(index_path(store, KEY, VERSION))
