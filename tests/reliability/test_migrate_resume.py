"""`marin migrate` killed at any point is finished by the next run (issue 50, finding 7).

Before: killed after 35 of 68 moves, the rerun moved the rest but rewrote only the inputs naming
what it moved itself, so the manifests moved before the kill kept their inputs' old locations
(`manifest missing` under `lineage --verify`) and no ref; no command repaired them.

Here a store of the old layout (a chain raw -> filtered -> deduplicated -> tokenized, two shards)
is migrated with the process ending abruptly before its n-th write to the store (a move, a
manifest, a ref, a delete; on an object store every copy and delete of a file), for every n until
a run completes; then `migrate` runs again, uninterrupted. Each time the store must end as an
uninterrupted migration leaves it: every artifact in the identity layout, current, its inputs
naming where they are now, its lineage verified byte for byte, nothing left in the old layout, and
a third run with nothing to do.
"""

import contextlib
import itertools

import pytest

from marin_resources.storage import migrate as migrate_module
from marin_resources.storage.lineage import bill_of_materials, build_lineage
from marin_resources.storage.migrate import manifests, migrate, target_uri
from marin_resources.storage.store import ArtifactStore
from tests.ops.conftest import s3_prefix, s3_server  # noqa: F401 - fixtures
from tests.reliability.test_store_versions import ref, write_old_layout


class Killed(BaseException):
    """The process ending here (SIGKILL): not an Exception, so nothing in the code under test handles it."""


@contextlib.contextmanager
def killed_before_write(monkeypatch, store: ArtifactStore, step: int):
    """Raise `Killed` instead of the ``step``-th write of the migration to ``store`` (counting from 0)."""
    calls = itertools.count()
    targets = [(migrate_module, "_move_dir"), (ArtifactStore, "write_manifest"), (ArtifactStore, "point"),
               (store.fs, "rm"), (store.fs, "rm_file")]
    if not store.is_local:  # a move is many copies and deletes there, each a point to die at
        targets += [(store.fs, "copy"), (ArtifactStore, "_write_atomic")]
    with monkeypatch.context() as patch:
        for owner, name in targets:
            original = getattr(owner, name)

            def write(*args, _original=original, **kwargs):
                if next(calls) == step:
                    raise Killed
                return _original(*args, **kwargs)

            patch.setattr(owner, name, write)
        yield


def old_layout_store(prefix: str, options: dict | None = None, shards=("a", "b")) -> tuple[ArtifactStore, str]:
    """The chain in the `{key}/{code_version}/{partition}` layout, and its chain hash."""
    store = ArtifactStore(prefix, options or {})
    raws = [write_old_layout(store, "raw/x", p, f"raw bytes {p}", {"shard": p}) for p in shards]
    kept = [write_old_layout(store, "filtered/x", r.partition, f"kept {r.partition}", {"min_words": 5}, [ref(r)])
            for r in raws]
    dedup = write_old_layout(store, "deduplicated/x", None, "unique", {"bands": 8}, [ref(k) for k in kept])
    tokens = write_old_layout(store, "tokenized/x", None, "token ids", {"vocab": 64}, [ref(dedup)])
    return store, bill_of_materials(build_lineage(store, tokens))["chain_hash"]


def assert_migrated(store: ArtifactStore, chain_hash: str, artifacts: int) -> None:
    found = manifests(store)
    assert len(found) == artifacts and all(m.uri == target_uri(store, m) for m in found), [m.uri for m in found]
    for manifest in found:
        assert store.find(manifest.asset_key, manifest.code_version, manifest.partition).uri == manifest.uri
        node = build_lineage(store, manifest, verify=True)
        assert [p for n in node.unique() for p in n.problems] == [], manifest.uri
    tokens = store.find("tokenized/x", "v1", None)
    assert bill_of_materials(build_lineage(store, tokens))["chain_hash"] == chain_hash
    for key in ("raw/x", "filtered/x", "deduplicated/x", "tokenized/x"):
        assert not store.fs.exists(store.fs_path(f"{store.prefix}/{key}/v1")), key  # no old copy left
    again = migrate(store, log=lambda _: None)
    assert (again.moved, again.rewritten, again.pointed, again.finished, again.already) == ({}, 0, 0, 0, artifacts)


def kill_at_every_write(monkeypatch, new_store, artifacts: int) -> int:
    """For n = 0, 1, ...: a fresh old-layout store of ``artifacts`` artifacts, migrate killed before its
    n-th write, migrate again; until a migration runs to its end. Returns how many kill points were tried."""
    for step in itertools.count():
        store, chain_hash = new_store(step)
        with killed_before_write(monkeypatch, store, step):
            try:
                migrate(store, log=lambda _: None)
            except Killed:
                pass
            else:
                assert_migrated(store, chain_hash, artifacts)
                return step
        resumed = migrate(store, log=lambda _: None)
        assert (resumed.problems, resumed.refused) == ([], []), (step, resumed)
        assert_migrated(store, chain_hash, artifacts)
    raise AssertionError("unreachable")


def test_a_migration_killed_before_any_write_is_finished_by_the_next_run(tmp_path, monkeypatch):
    tried = kill_at_every_write(monkeypatch, lambda step: old_layout_store(str(tmp_path / f"store-{step}")), 6)
    assert tried >= 6 + 6 + 4  # a move and a ref for each artifact, and a rewrite for each but the raw shards


@pytest.mark.slow  # a moto server and some 30 migrations through it
def test_on_an_object_store_a_migration_killed_mid_copy_or_mid_delete_is_finished(s3_prefix, monkeypatch):  # noqa: F811
    """One shard: a chain of four artifacts, each move two copies (the file, then the manifest) and two
    deletes (the manifest, then the rest), each a point to die at."""
    prefix, options = s3_prefix
    tried = kill_at_every_write(monkeypatch, lambda step: old_layout_store(f"{prefix}-{step}", options, ("a",)), 4)
    assert tried >= 4 * 4 + 4


def test_a_store_left_half_migrated_by_the_old_command_is_repaired(tmp_path):
    """What the issue found: half the artifacts moved by a killed run of the previous code, with their
    inputs naming old locations and no refs; one run of `migrate` puts it right."""
    store, chain_hash = old_layout_store(str(tmp_path / "store"))
    for manifest in manifests(store):
        if manifest.asset_key in ("raw/x", "deduplicated/x"):  # moved, and nothing else done
            migrate_module._move_dir(store, manifest.uri, target_uri(store, manifest))
    result = migrate(store, log=lambda _: None)
    assert result.problems == [] and len(result.moved) == 3 and result.already == 3
    # filtered[a], filtered[b] and deduplicated name moved inputs; tokenized names the moved deduplicated.
    assert result.rewritten == 4 and result.pointed == 6
    assert_migrated(store, chain_hash, 6)

