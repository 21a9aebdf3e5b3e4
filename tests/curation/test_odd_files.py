"""Files that are not plain, still files (issue #30): discovery and the raw copy never wait on them,
never fail a shard for them, and what the copy records is the hash of the bytes it stored."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import socket
import tarfile
import threading
import time
from pathlib import Path

import pytest

from marin_assets.curation.copying import CopiedFile, copy_listed_file
from marin_assets.curation.discovery import discover_shards, list_source_files
from marin_assets.curation.listed_files import CHANGED_DURING_READ, NOT_A_REGULAR_FILE, refusal_parts
from marin_assets.curation.readers import read_shard

from .conftest import NORMAL_TEXT, make_source, write_odd_archives

LINE = json.dumps({"text": NORMAL_TEXT}) + "\n"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MARIN_CACHE_DIR", str(tmp_path / "cache"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.timeout(60)  # today's failure is a hang: opening the FIFO waits for a writer forever
def test_fifos_sockets_and_dangling_links_are_listed_as_refused_and_never_opened(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    (d / "good.jsonl").write_text(LINE * 3)
    os.mkfifo(d / "fifo.jsonl")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(d / "sock.jsonl"))
    (d / "broken.jsonl").symlink_to(d / "nowhere")
    (d / "gone.jsonl").symlink_to("/nonexistent/x.jsonl")  # outside the root too: broken is what helps
    (d / "loop.jsonl").symlink_to(d / "loop.jsonl")
    (d / "to_fifo.jsonl").symlink_to(d / "fifo.jsonl")
    src = make_source(tmp_path, uri="src", format="jsonl")

    refs = {r.relpath: r for r in list_source_files(src)}
    reasons = {rel: refusal_parts(r.refused)[0] for rel, r in refs.items() if r.refused}
    assert reasons == {"fifo.jsonl": "not_a_regular_file", "sock.jsonl": "not_a_regular_file",
                       "to_fifo.jsonl": "not_a_regular_file", "broken.jsonl": "broken_link",
                       "gone.jsonl": "broken_link", "loop.jsonl": "broken_link"}
    assert refusal_parts(refs["fifo.jsonl"].refused)[1] == "a FIFO; never opened"
    assert refs["good.jsonl"].refused is None and refs["good.jsonl"].etag == f"sha256:{_sha256((LINE * 3).encode())}"

    (shard,) = discover_shards(src)
    result = read_shard(src, shard)
    assert result.documents.height == 3 and result.n_records == 3 + 6 and result.n_refused_files == 6
    assert sorted(result.quarantine["reason"].to_list()) == ["broken_link"] * 3 + ["not_a_regular_file"] * 3


def test_odd_entries_beyond_the_issue(tmp_path, monkeypatch):
    """A directory named like a data file is descended, not read; a zero-byte file is an ordinary (empty)
    record; a file the process may not open is refused as `unreadable` (as root, permission bits do not
    stop a read, so the refusal is simulated); a file removed between the listing and its hash leaves the
    listing."""
    d = tmp_path / "src"
    (d / "dir.jsonl").mkdir(parents=True)
    (d / "dir.jsonl" / "inner.jsonl").write_text(LINE)
    (d / "empty.jsonl").write_bytes(b"")
    (d / "locked.jsonl").write_text(LINE)
    (d / "vanishing.jsonl").write_text(LINE)
    real_open = os.open

    def guarded_open(path, flags, *args, **kwargs):
        if os.fsdecode(path).endswith("locked.jsonl"):
            raise PermissionError(13, "Permission denied", os.fsdecode(path))
        if os.fsdecode(path).endswith("vanishing.jsonl"):
            os.unlink(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)
    src = make_source(tmp_path, uri="src", format="jsonl")
    refs = {r.relpath: r for r in list_source_files(src)}
    assert set(refs) == {"dir.jsonl/inner.jsonl", "empty.jsonl", "locked.jsonl"}
    assert refs["locked.jsonl"].refused == "unreadable: PermissionError: Permission denied"
    assert refs["empty.jsonl"].refused is None and refs["empty.jsonl"].size == 0


def test_odd_archive_members_are_refused_one_by_one_and_the_good_ones_read(tmp_path):
    """Issue 50 (4): a member named ``../../x`` or ``/etc/x``, a symlink, FIFO or device member, a hard
    link to nothing: the listing never ended (an absolute name) or the shard failed on each run. Each is
    refused with its reason; the good members, and a hard link to one of them, are read."""
    good = LINE.encode()
    refused = write_odd_archives(tmp_path / "src", good, good)
    (tmp_path / "data.jsonl").write_bytes(good)
    with tarfile.open(tmp_path / "src" / "hard.tar", "w") as tar:
        tar.add(tmp_path / "data.jsonl", arcname="data.jsonl")
        info = tarfile.TarInfo("again.jsonl")
        info.type, info.linkname = tarfile.LNKTYPE, "data.jsonl"
        tar.addfile(info)
    with tarfile.open(tmp_path / "src" / "shadow.tar", "w") as tar:  # "/etc/x" first, then "etc/x"
        for name, text in (("/etc/x.jsonl", "the absolute member"), ("etc/x.jsonl", "the relative member")):
            data = (json.dumps({"text": text}) + "\n").encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    refused["shadow.tar//etc/x.jsonl"] = "outside_root"
    src = make_source(tmp_path, uri="src", format="jsonl")
    refs = {r.relpath: r for r in list_source_files(src)}
    assert {rel: refusal_parts(r.refused)[0] for rel, r in refs.items() if r.refused} == refused
    assert refusal_parts(refs["members.tar.gz/link.jsonl"].refused)[1] == \
        "a symbolic link to '/etc/passwd' in the archive; never read"
    assert sorted(rel for rel, r in refs.items() if not r.refused) == \
        ["hard.tar/again.jsonl", "hard.tar/data.jsonl", "members.tar.gz/good.jsonl", "members.zip/good.jsonl",
         "shadow.tar/etc/x.jsonl"]

    (shard,) = discover_shards(src)
    result = read_shard(src, shard)  # tar members come from one pass over each tarball, matched by exact name
    assert result.documents.height == 5 and result.n_refused_files == len(refused)
    assert "the relative member" in result.documents["text"].to_list()
    assert "the absolute member" not in result.documents["text"].to_list()
    assert sorted(result.quarantine["reason"].to_list()) == sorted(refused.values())
    for rel in ("hard.tar/again.jsonl", "hard.tar/data.jsonl"):
        copied = copy_listed_file(refs[rel], src, lambda: contextlib.nullcontext(io.BytesIO()))
        assert copied.sha256 == _sha256(good)


@pytest.mark.parametrize("uri", ["src", "src/**/*.jsonl"])
def test_a_directory_that_cannot_be_listed_is_refused_not_dropped(tmp_path, monkeypatch, uri):
    """Issue 50 (5): the files in a directory the process may not list (mode 000) were silently absent:
    no row, no warning. The directory is one ``unreadable`` row naming why; its siblings are read. As
    root, permission bits do not stop a listing, so the refusal is also simulated where it happens."""
    d = tmp_path / "src"
    (d / "locked" / "deeper").mkdir(parents=True)
    (d / "open").mkdir()
    (d / "open" / "a.jsonl").write_text(LINE)
    (d / "locked" / "b.jsonl").write_text(LINE)
    (d / "locked" / "deeper" / "c.jsonl").write_text(LINE)
    real_scandir = os.scandir

    def guarded_scandir(path="."):
        if os.fsdecode(path) == str(d / "locked"):
            raise PermissionError(13, "Permission denied", os.fsdecode(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", guarded_scandir)
    (d / "locked").chmod(0)
    try:
        src = make_source(tmp_path, uri=uri, format="jsonl")
        refs = {r.relpath: r for r in list_source_files(src)}
        assert refs.keys() == {"locked", "open/a.jsonl"}
        assert refs["locked"].refused == ("unreadable: a directory that cannot be listed (PermissionError: Permission "
                                          "denied); none of its files is read")
        (shard,) = discover_shards(src)
        result = read_shard(src, shard)
    finally:
        (d / "locked").chmod(0o755)
    assert (result.documents.height, result.n_refused_files) == (1, 1)
    assert result.quarantine["reason"].to_list() == ["unreadable"]


class _Sink(io.BytesIO):
    """The copy's destination; it keeps what the last read wrote."""

    def __init__(self, stored: dict, on_write=None):
        super().__init__()
        self.stored, self.on_write = stored, on_write

    def write(self, data) -> int:
        if self.on_write is not None:
            self.on_write()
        return super().write(data)

    def close(self) -> None:
        self.stored["bytes"] = self.getvalue()
        super().close()


def _listed(tmp_path: Path, content: bytes):
    (tmp_path / "src").mkdir(exist_ok=True)
    path = tmp_path / "src" / "grows.jsonl"
    path.write_bytes(content)
    src = make_source(tmp_path, uri="src/*.jsonl", format="jsonl")
    (ref,) = list_source_files(src)
    return src, ref, path


def test_a_file_that_grows_during_its_copy_is_read_again_and_recorded_as_stored(tmp_path):
    src, ref, path = _listed(tmp_path, LINE.encode() * 50)
    path.write_bytes(path.read_bytes() + LINE.encode())  # grown since it was listed
    stored, appended = {}, []

    def append_once() -> None:  # during the first read only: the second read sees a still file
        if not appended:
            appended.append(1)
            with open(path, "ab") as fh:
                fh.write(LINE.encode())

    copied = copy_listed_file(ref, src, lambda: contextlib.closing(_Sink(stored, append_once)))
    assert isinstance(copied, CopiedFile)
    assert stored["bytes"] == path.read_bytes() and copied.bytes == len(stored["bytes"]) == ref.size + 2 * len(LINE)
    assert copied.sha256 == _sha256(stored["bytes"]) and copied.etag == f"sha256:{copied.sha256}" != ref.etag


def test_a_file_that_never_holds_still_is_changed_during_read(tmp_path):
    src, ref, path = _listed(tmp_path, LINE.encode() * 50)

    def append() -> None:
        with open(path, "ab") as fh:
            fh.write(b"x")

    copied = copy_listed_file(ref, src, lambda: contextlib.closing(_Sink({}, append)))
    assert refusal_parts(copied)[0] == CHANGED_DURING_READ and "changed during each of 3 reads" in copied


@pytest.mark.timeout(60)
def test_a_listed_file_replaced_by_a_fifo_before_its_copy_is_refused_without_waiting(tmp_path):
    """Removed since it was listed, a file fails its shard (FileNotFoundError, as before: the next
    listing no longer has it); a FIFO in its place is refused, not waited on."""
    src, ref, path = _listed(tmp_path, LINE.encode())
    path.unlink()
    with pytest.raises(FileNotFoundError):
        copy_listed_file(ref, src, lambda: contextlib.closing(_Sink({})))
    os.mkfifo(path)
    fifo = copy_listed_file(ref, src, lambda: contextlib.closing(_Sink({})))
    assert refusal_parts(fifo)[0] == NOT_A_REGULAR_FILE


def test_raw_stores_what_it_hashes_while_an_appender_runs(tmp_path, curation_planner):
    """Issue #30: a file growing during the build got the listing's hash of a shorter file, and
    `--verify` passed. Whatever the appender's timing, each copied file's recorded etag is the sha256 of
    the stored copy (or the file is quarantined as changed_during_read), and a verifying lineage walk
    checks exactly that."""
    from marin_assets.planning import parse_key
    from marin_resources.storage.lineage import build_lineage, listing_problems

    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "log.jsonl"
    path.write_text(LINE * 2000)  # about 1.6 MB, so a read takes a while
    plan = curation_planner(f"sources:\n  - name: growing\n    uri: {tmp_path}/in/*.jsonl\n")
    plan.discover()
    stop = threading.Event()

    def appender() -> None:
        with open(path, "ab") as fh:
            while not stop.is_set():
                fh.write(LINE.encode())
                fh.flush()
                time.sleep(0.002)

    thread = threading.Thread(target=appender)
    thread.start()
    try:
        steps = plan.materialize(parse_key("raw/growing"), "log.jsonl", log=lambda m: None)
    finally:
        stop.set()
        thread.join()
    assert all(s.success for s in steps), [s.error for s in steps]
    artifacts = plan.store
    manifest = artifacts.find("raw/growing", "v1", "log.jsonl")
    with artifacts.open(f"{manifest.uri}/listing.json") as fh:
        (item,) = json.load(fh)
    stored = {entry.path: entry for entry in manifest.files}
    if item.get("refused"):
        assert item["refused"].startswith("changed_during_read: ") and "files/log.jsonl" not in stored
    else:
        copy = stored["files/log.jsonl"]
        assert item["etag"] == f"sha256:{copy.sha256}" and item["bytes"] == copy.bytes > len(LINE) * 2000
    assert not build_lineage(artifacts, manifest, verify=True).problems

    # A listing whose etag is not its copy's hash, as one written before this fix could be, fails verify.
    writer = artifacts.begin("raw/forged", "v1", "x", fingerprint="f" * 64, run_id="test")
    with writer.open("files/a.jsonl") as fh:
        fh.write(LINE.encode() * 2)
    writer.write_json("listing.json", [{"relpath": "a.jsonl", "uri": "file:///a.jsonl", "bytes": 2 * len(LINE),
                                        "etag": f"sha256:{_sha256(LINE.encode())}"}])
    forged = writer.commit(config={}, upstream=[], producer={})
    (problem,) = listing_problems(artifacts, forged)
    assert problem.endswith(f"files/a.jsonl: stored copy sha256 {_sha256(LINE.encode() * 2)[:12]} != listed "
                            f"sha256:{_sha256(LINE.encode())[:12]}")


def test_a_store_object_is_copied_as_stored_and_recorded_by_the_hash_of_the_copy(tmp_path):
    """The fsspec path (an object store, here fsspec's memory store): the state around each read is
    the object's size and checksum or modification time, and a whole file hashed at listing is
    recorded by the hash of what was copied, also when it was replaced since the listing."""
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/odd-files-test/a.jsonl", LINE.encode())
    try:
        src = make_source(tmp_path, uri="memory://odd-files-test/*.jsonl", format="jsonl")
        (ref,) = list_source_files(src)
        assert ref.etag == f"sha256:{_sha256(LINE.encode())}"
        fs.pipe("/odd-files-test/a.jsonl", LINE.encode() * 2)  # replaced since it was listed
        stored = {}
        copied = copy_listed_file(ref, src, lambda: contextlib.closing(_Sink(stored)))
        assert stored["bytes"] == LINE.encode() * 2
        assert (copied.bytes, copied.etag) == (2 * len(LINE), f"sha256:{_sha256(LINE.encode() * 2)}")
    finally:
        fs.rm("/odd-files-test", recursive=True)
