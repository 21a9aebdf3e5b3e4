"""Artifact store: locations, manifests, atomic commit, leases, verification."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from marin_resources.storage.identity import (
    InvalidPartitionKeyError,
    changed_fields,
    fingerprint,
    validate_partition_key,
)
from marin_resources.storage.store import (
    MANIFEST_NAME,
    PREVIOUS_DIR,
    ArtifactLockedError,
    ArtifactStore,
    UpstreamRef,
    content_data_version,
    git_sha,
    producer_info,
    writing,
)

FP = fingerprint({})


def commit_text(store, key, version, partition, text, config=None, upstream=()):
    with writing(store, key, version, partition, fingerprint=fingerprint(config or {}), run_id="run-test") as w:
        with w.open("data/part-0.txt") as fh:
            fh.write(text.encode())
        return w.commit(config=config or {}, upstream=list(upstream),
                        producer=producer_info("run-test"), metrics={"chars": len(text)})


def test_location_is_readable_and_versioned(tmp_path):
    store = ArtifactStore(str(tmp_path))
    assert store.artifact_uri("tokenized/shakespeare", "v1", None, fingerprint=FP) == \
        f"{tmp_path}/tokenized/shakespeare/v1-{FP[:8]}"
    assert store.artifact_uri("raw/letters", "v2", "shard-0001", fingerprint=FP) == \
        f"{tmp_path}/raw/letters/v2-{FP[:8]}/shard-0001"
    commit_text(store, "raw/letters", "v1", "s1", "old")
    commit_text(store, "raw/letters", "v2", "s1", "new")
    assert store.find("raw/letters", "v1", "s1").metrics == {"chars": 3}
    assert store.find("raw/letters", "v2", "s1").metrics == {"chars": 3}
    assert store.code_versions("raw/letters") == ["v1", "v2"]


def test_manifest_fields(tmp_path):
    store = ArtifactStore(str(tmp_path))
    up = UpstreamRef("raw/letters", "s1", "abc", "file:///x")
    m = commit_text(store, "documents/letters", "v1", "s1", "hello", config={"a": 1}, upstream=[up])
    raw = json.loads((tmp_path / f"documents/letters/v1-{fingerprint({'a': 1})[:8]}/s1" / MANIFEST_NAME).read_text())
    for field in ("asset_key", "partition", "code_version", "fingerprint", "config", "data_version", "files",
                  "upstream", "producer", "started_at", "finished_at", "metrics"):
        assert field in raw, field
    assert raw["asset_key"] == "documents/letters" and raw["partition"] == "s1"
    assert raw["fingerprint"] == fingerprint({"a": 1})
    assert raw["files"] == [{"path": "data/part-0.txt", "bytes": 5,
                             "sha256": "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"}]
    assert raw["upstream"] == [{"asset_key": "raw/letters", "partition": "s1", "data_version": "abc",
                                "uri": "file:///x"}]
    assert {"run_id", "git_sha", "packages", "host", "python"} <= set(raw["producer"])
    assert raw["data_version"] == m.data_version


def test_data_version_is_a_content_hash(tmp_path):
    a = commit_text(ArtifactStore(str(tmp_path / "a")), "x", "v1", None, "same bytes")
    b = commit_text(ArtifactStore(str(tmp_path / "b")), "x", "v1", None, "same bytes")
    c = commit_text(ArtifactStore(str(tmp_path / "c")), "x", "v1", None, "other bytes")
    assert a.data_version == b.data_version != c.data_version
    assert a.data_version == content_data_version(a.files)


@pytest.mark.parametrize("bad", ["..", "../x", "a/b", "/etc", "a\\b", "x\x00y", "tab\there", "", ".hidden", "-x"])
def test_partition_keys_that_escape_are_rejected(tmp_path, bad):
    with pytest.raises(InvalidPartitionKeyError):
        validate_partition_key(bad)
    with pytest.raises(InvalidPartitionKeyError):
        ArtifactStore(str(tmp_path)).artifact_uri("raw/x", "v1", bad, fingerprint=FP)


def test_fingerprint_is_canonical_and_diff_names_fields():
    assert fingerprint({"b": 1, "a": [1, 2]}) == fingerprint({"a": [1, 2], "b": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert changed_fields({"opt": {"lr": 1, "wd": 0}, "x": 1}, {"opt": {"lr": 2, "wd": 0}, "y": 1}) == [
        "opt.lr", "x", "y"]


def test_uncommitted_artifact_does_not_exist_and_is_cleared(tmp_path):
    store = ArtifactStore(str(tmp_path))
    w = store.begin("raw/x", "v1", "p", fingerprint=FP, run_id="r1")
    with w.open("half.bin") as fh:
        fh.write(b"partial")
    w.release()
    assert store.find("raw/x", "v1", "p") is None
    m = commit_text(store, "raw/x", "v1", "p", "whole")
    assert [f.path for f in m.files] == ["data/part-0.txt"]  # leftovers of the failed attempt are gone


def test_rebuild_removes_the_manifest_before_touching_files(tmp_path):
    store = ArtifactStore(str(tmp_path))
    commit_text(store, "raw/x", "v1", "p", "first")
    w = store.begin("raw/x", "v1", "p", fingerprint=FP, run_id="r2")
    assert store.find("raw/x", "v1", "p") is None
    w.release()


def test_a_rebuild_keeps_the_committed_artifact_readable_until_the_new_one_commits(tmp_path):
    store = ArtifactStore(str(tmp_path))
    first = commit_text(store, "raw/x", "v1", "p", "first")
    w = store.begin("raw/x", "v1", "p", fingerprint=FP, run_id="r2")
    with w.open("data/part-0.txt") as fh:
        fh.write(b"second, half written")
    w.release()  # stopped before its commit
    assert store.find("raw/x", "v1", "p") is None
    kept = store.find_previous("raw/x", "v1", "p")
    assert kept is not None and kept.uri == f"{first.uri}/{PREVIOUS_DIR}"
    assert kept.data_version == first.data_version and store.verify(kept) == []
    assert store.read_last_committed(first.uri).data_version == first.data_version
    # A second attempt keeps the same committed artifact, not the first attempt's leftovers.
    w = store.begin("raw/x", "v1", "p", fingerprint=FP, run_id="r3")
    w.release()
    assert store.verify(store.find_previous("raw/x", "v1", "p")) == []
    second = commit_text(store, "raw/x", "v1", "p", "second")
    assert store.find("raw/x", "v1", "p").data_version == second.data_version
    assert store.find_previous("raw/x", "v1", "p") is None and not (tmp_path / kept.uri).exists()
    assert store.verify(second) == []  # nothing of the kept artifact is counted as the new one's


@pytest.mark.parametrize("writes_by_rename", [False, True])
def test_a_resumed_rebuild_keeps_the_committed_files_whatever_it_rewrites(tmp_path, writes_by_rename):
    store = ArtifactStore(str(tmp_path))
    first = commit_text(store, "cache/x", "v1", None, "committed rows")
    home = tmp_path / f"cache/x/v1-{FP[:8]}"
    w = store.begin("cache/x", "v1", None, fingerprint=FP, run_id="r2", resume=True,
                    writes_by_rename=writes_by_rename)
    kept = home / PREVIOUS_DIR / "data/part-0.txt"
    # Hard links where the builder only renames over its files; a copy where it may rewrite one in place.
    assert (kept.stat().st_ino == (home / "data/part-0.txt").stat().st_ino) is writes_by_rename
    if writes_by_rename:
        staged = home / "data/part-0.txt.partial"
        staged.write_bytes(b"committed rows and more")
        staged.replace(home / "data/part-0.txt")
    else:
        with w.open("data/part-0.txt", "ab") as fh:
            fh.write(b" and more")
    w.release()
    kept_manifest = store.find_previous("cache/x", "v1", None)
    assert kept_manifest.data_version == first.data_version and store.verify(kept_manifest) == []
    assert (home / "data/part-0.txt").read_bytes() == b"committed rows and more"  # the resume point stays


def test_a_killed_rebuild_leaves_the_committed_artifact_readable_and_verified(tmp_path):
    store = ArtifactStore(str(tmp_path))
    first = commit_text(store, "raw/big", "v1", "p", "committed")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert store.find("raw/big", "v1", "p") is None
    kept = store.find_previous("raw/big", "v1", "p")
    assert kept.data_version == first.data_version and store.verify(kept) == []
    assert [f.path for f in kept.files] == ["data/part-0.txt"]
    second = commit_text(store, "raw/big", "v1", "p", "rebuilt")  # the dead writer's lease is stale
    assert [f.path for f in second.files] == ["data/part-0.txt"] and store.find_previous("raw/big", "v1", "p") is None


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from marin_resources.storage.identity import fingerprint
    from marin_resources.storage.store import ArtifactStore, producer_info
    store = ArtifactStore(sys.argv[1])
    w = store.begin("raw/big", "v1", "p", fingerprint=fingerprint({}), run_id="victim")
    for i in range(10_000):
        with w.open(f"part-{i:05d}.bin") as fh:
            fh.write(b"x" * 4096)
        if i == 20:
            print("writing", flush=True)
        time.sleep(0.001)
    w.commit(config={}, upstream=[], producer=producer_info("victim"))
""")


def test_kill_midway_leaves_nothing_that_looks_complete(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = ArtifactStore(str(tmp_path))
    assert any((tmp_path / f"raw/big/v1-{FP[:8]}/p").iterdir())  # files were written ...
    assert store.find("raw/big", "v1", "p") is None  # ... but nothing is served
    # The dead writer's lease is stale (its pid is gone), so a new writer proceeds and commits.
    m = commit_text(store, "raw/big", "v1", "p", "recovered")
    assert store.find("raw/big", "v1", "p").data_version == m.data_version


def test_live_lease_blocks_a_second_writer(tmp_path):
    store = ArtifactStore(str(tmp_path))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        path = store.fs_path(store.artifact_uri("raw/x", "v1", "p", fingerprint=FP))
        os.makedirs(path)
        with open(f"{path}/.lock", "w") as fh:
            json.dump({"run_id": "other", "host": os.uname().nodename, "pid": sleeper.pid,
                       "created": time.time(), "token": "t"}, fh)
        with pytest.raises(ArtifactLockedError, match="being written by run other"):
            store.begin("raw/x", "v1", "p", fingerprint=FP, run_id="me")
    finally:
        sleeper.kill()


def test_verify_names_a_changed_file(tmp_path):
    store = ArtifactStore(str(tmp_path))
    m = commit_text(store, "raw/x", "v1", None, "abc")
    assert store.verify(m) == []
    target = tmp_path / f"raw/x/v1-{FP[:8]}/data/part-0.txt"
    target.write_bytes(b"abd")
    problems = store.verify(store.find("raw/x", "v1", None))
    assert len(problems) == 1 and "data/part-0.txt" in problems[0]


def test_resumed_commit_hashes_only_what_the_build_wrote(tmp_path, monkeypatch):
    store = ArtifactStore(str(tmp_path))

    def build(files: dict[str, bytes], resume: bool):
        with writing(store, "cache/x", "v1", None, fingerprint="f", run_id="run-test", resume=resume) as w:
            for rel, data in files.items():
                with w.open(rel) as fh:
                    fh.write(data)
            manifest = w.commit(config={}, upstream=[], producer=producer_info("run-test"))
            return manifest, w.files_rehash_skipped

    first, _ = build({"old-0": b"a", "old-1": b"bb", "tail": b"ccc"}, resume=False)
    hashed = []
    real_hash = ArtifactStore.hash_file
    monkeypatch.setattr(ArtifactStore, "hash_file",
                        lambda self, uri, rel: hashed.append(rel) or real_hash(self, uri, rel))
    time.sleep(0.01)  # the store's clock must tell the rewrite from the last commit
    second, skipped = build({"tail": b"ddd", "new": b"e"}, resume=True)  # same size, new bytes: rehashed
    assert sorted(hashed) == ["new", "tail"] and skipped == 2
    assert {f.path: f.sha256 for f in second.files} == {**{f.path: f.sha256 for f in first.files if f.path != "tail"},
                                                        "tail": real_hash(store, second.uri, "tail").sha256,
                                                        "new": real_hash(store, second.uri, "new").sha256}
    assert store.verify(second) == []
    hashed.clear()
    _, skipped = build({}, resume=False)  # not resumed: nothing is vouched for (and the files are gone)
    assert hashed == [] and skipped == 0


def test_commit_takes_vouched_entries_of_files_whose_size_matches(tmp_path, monkeypatch):
    import hashlib

    from marin_resources.storage.store import FileEntry

    store = ArtifactStore(str(tmp_path))
    hashed = []
    real_hash = ArtifactStore.hash_file
    monkeypatch.setattr(ArtifactStore, "hash_file",
                        lambda self, uri, rel: hashed.append(rel) or real_hash(self, uri, rel))
    with writing(store, "cache/x", "v1", None, fingerprint="f", run_id="run-test") as w:
        for rel, data in {"a": b"written elsewhere", "b": b"also", "c": b"not vouched"}.items():
            with w.open(rel) as fh:
                fh.write(data)
        w.vouch([FileEntry("a", 17, hashlib.sha256(b"written elsewhere").hexdigest()),
                 FileEntry("b", 99, "0" * 64),  # a size that does not match: read and hashed again
                 FileEntry("gone", 1, "0" * 64)])  # not stored: never enters the manifest
        manifest = w.commit(config={}, upstream=[], producer=producer_info("run-test"))
    assert sorted(hashed) == ["b", "c"] and w.files_vouched == 1
    assert sorted(f.path for f in manifest.files) == ["a", "b", "c"]
    assert store.verify(manifest) == []


def test_git_sha_is_the_commit_of_this_checkout():
    # Read from the file tree, not by spawning git: a module that moves must still find the repository.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert git_sha() == head.stdout.strip()


def test_git_sha_of_a_worktree_and_of_packed_refs(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    repo, tree = tmp_path / "repo", tmp_path / "tree"
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("x")
    subprocess.run([*git, "-C", str(repo), "add", "f"], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "one"], check=True)
    subprocess.run([*git, "-C", str(repo), "worktree", "add", "-q", "-b", "side", str(tree)], check=True)
    (tree / "f").write_text("y")
    subprocess.run([*git, "-C", str(tree), "commit", "-qam", "two"], check=True)

    def rev(where):
        return subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert (tree / ".git").is_file()  # a worktree's .git names its git directory
    assert git_sha(tree) == rev(tree) != rev(repo)
    assert git_sha(repo) == rev(repo)
    subprocess.run([*git, "-C", str(repo), "pack-refs", "--all"], check=True)
    assert git_sha(tree) == rev(tree) and git_sha(repo) == rev(repo)
