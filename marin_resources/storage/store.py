"""The artifact store: `{prefix}/{asset key}/{code_version}-{fingerprint[:8]}/{partition}/` on local disk, S3
or GCS (fsspec).

The identity config is in the path, so a config change builds beside the old artifact and nothing is
overwritten. Which of the configs side by side is the current one is recorded by a small ref per
(asset key, code version, partition), `{prefix}/{asset key}/.refs/{code_version}/{partition or _}`,
rewritten whenever a build commits or reuses an artifact (like a branch pointing at a commit).

Commit protocol, the same on local disk and on object stores:

1. `begin()` takes a lease (`.lock`, see `leases.py`: conditional writes, renewed by a heartbeat
   while the writer works), then clears any leftovers of an earlier
   attempt that never committed (unless the writer resumes, as training does).
2. The producer writes its files.
3. `commit()` hashes every file, confirms the lease is still its own, and writes `.artifact.json`
   last, as one atomic operation (rename on local disk, a single PUT on object stores).

An artifact without a manifest does not exist, so a process killed at any point
leaves nothing that looks complete. Before an artifact is rebuilt in place, `begin()` keeps the
committed one, files and manifest, in `.previous/` inside its directory (hard links on local disk,
server-side copies on object stores), then removes its manifest: until the new one commits, the old
one stays readable and verifiable there (`find_previous`, `read_last_committed`), and a rebuild
killed at any point leaves it so. The commit removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import getpass
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from marin_resources.storage.identity import canonical_json, validate_partition_key
from marin_resources.storage.leases import (
    HEARTBEAT_S,
    TIMEOUT_S,
    ArtifactLockedError,  # noqa: F401 - re-exported: writers catch it from the store
    Lease,
    acquire,
    lease_objects_for,
)
from marin_resources.storage.object_stores import StoreUnavailableError, sdk_attempts
from marin_resources.storage.retry import STORAGE_RETRY, attempts_around, with_retries
from marin_resources.storage.secrets import scrub

MANIFEST_NAME = ".artifact.json"
LOCK_NAME = ".lock"
# A reference to another artifact of the same store, relative to its prefix: `store://raw/x/v1/shard`.
# Manifests and configs written inside artifacts use it, so a store copied to another prefix
# (another bucket, another disk) still points at itself; readers resolve it against their prefix.
STORE_SCHEME = "store://"
REFS_DIR = ".refs"
# Inside an artifact's directory: the committed artifact a rebuild replaces, kept until the new one commits.
PREVIOUS_DIR = ".previous"
# Ref file name of an unpartitioned artifact: partition keys start with a letter or digit, so no clash.
UNPARTITIONED_REF = "_"
FINGERPRINT_CHARS = 8
_VERSION_DIR = re.compile(rf"^(?P<code_version>.+)-(?P<fingerprint>[A-Za-z0-9]{{1,{FINGERPRINT_CHARS}}})$")
_HASH_CHUNK = 4 * 1024 * 1024


def local_store_problem(root: Path) -> str | None:
    """Why a local store at ``root`` can hold nothing, seen from the path alone: it, or the nearest of
    its parents that exists, is not a directory (a file named as the store)."""
    for path in (root, *root.parents):
        try:
            if path.exists():
                return None if path.is_dir() else f"{path} is a file, not a directory"
        except OSError as exc:
            return f"{path} cannot be examined ({type(exc).__name__}: {exc.strerror or exc})"
    return None


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class FileEntry:
    path: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class UpstreamRef:
    asset_key: str
    partition: str | None
    data_version: str
    uri: str


@dataclass
class Manifest:
    asset_key: str
    partition: str | None
    code_version: str
    fingerprint: str
    config: Any
    data_version: str
    files: list[FileEntry]
    upstream: list[UpstreamRef]
    producer: dict[str, Any]
    started_at: str
    finished_at: str
    metrics: dict[str, Any] = field(default_factory=dict)
    uri: str = ""  # where it was read from; not stored

    def to_json(self) -> str:
        body = dataclasses.asdict(self)
        body.pop("uri")
        return json.dumps(scrub(body), indent=2, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str, uri: str = "") -> Manifest:
        return cls.from_dict(json.loads(text), uri)

    @classmethod
    def from_dict(cls, stored: dict[str, Any], uri: str = "") -> Manifest:
        """A manifest from its stored JSON, parsed (``stored`` itself is left as it is)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"uri", "files", "upstream"}
        return cls(**{k: v for k, v in stored.items() if k in known}, uri=uri,
                   files=[FileEntry(**f) for f in stored.get("files", [])],
                   upstream=[UpstreamRef(**u) for u in stored.get("upstream", [])])

    def upstream_versions(self) -> dict[tuple[str, str | None], str]:
        return {(u.asset_key, u.partition): u.data_version for u in self.upstream}

    def file_version(self, rel: str) -> str | None:
        """The version of one of its files, as a reader of that file alone records it (`sha256=<hex>`):
        a shard's run that reads its own file of a whole-corpus artifact is not stale when the
        artifact gains other files. None where it has no such file."""
        return self._file_versions.get(rel)

    def holds_version(self, version: str) -> bool:
        """Whether a reader that recorded ``version`` of this artifact read it as it is: its data
        version, or the version of one of its files (`file_version`)."""
        return version == self.data_version or self.file_of_version(version) is not None

    def file_of_version(self, version: str) -> str | None:
        """The file a `file_version` names; None where it names none of this artifact's files."""
        return self._files_by_version.get(version)

    @functools.cached_property
    def _file_versions(self) -> dict[str, str]:
        # Looked up once per shard of a corpus of tens of thousands; a read manifest's files do not change.
        return {f.path: f"sha256={f.sha256}" for f in self.files}

    @functools.cached_property
    def _files_by_version(self) -> dict[str, str]:
        return {version: path for path, version in self._file_versions.items()}


def version_dir(code_version: str, fingerprint: str) -> str:
    """The path segment of one identity: ``{code_version}-{fingerprint[:8]}``."""
    short = fingerprint[:FINGERPRINT_CHARS]
    if not short.isalnum():
        raise ValueError(f"fingerprint {fingerprint!r} must start with {FINGERPRINT_CHARS} letters or digits")
    return f"{code_version}-{short}"


def parse_version_dir(name: str) -> tuple[str, str] | None:
    """``(code_version, fingerprint prefix)`` of an identity directory name, None for anything else
    (an artifact directory of the old ``{code_version}`` layout, say)."""
    match = _VERSION_DIR.match(name)
    return (match["code_version"], match["fingerprint"]) if match else None


def content_data_version(files: list[FileEntry]) -> str:
    """Content hash over the artifact's files: names and bytes, independent of order and location."""
    h = hashlib.sha256()
    for entry in sorted(files, key=lambda e: e.path):
        h.update(f"{entry.path}\0{entry.sha256}\n".encode())
    return h.hexdigest()


def _data_version_problems(manifest: Manifest) -> list[str]:
    """A recorded data version must be the content hash of the listed files; anything else (a
    forged or hand-edited version) would let a consumer adopt bytes it never saw."""
    listed = content_data_version(manifest.files)
    if manifest.data_version == listed:
        return []
    return [f"{manifest.uri}/{MANIFEST_NAME}: data_version {manifest.data_version[:12]} is not the content hash "
            f"{listed[:12]} of its listed files"]


def size_problems(manifest: Manifest, sizes: dict[str, int]) -> list[str]:
    """`ArtifactStore.check_files` given the artifact's files and their sizes (a listing's, or stats')."""
    problems = _data_version_problems(manifest)
    for entry in manifest.files:
        size = sizes.get(entry.path)
        if size is None:
            problems.append(f"{manifest.uri}/{entry.path}: missing")
        elif size != entry.bytes:
            problems.append(f"{manifest.uri}/{entry.path}: {size} bytes, recorded {entry.bytes}")
    return problems


def _map_strings(value: Any, fn) -> Any:
    """`fn` applied to every string in JSON-like data (dicts, lists, strings)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


@dataclass(frozen=True)
class FileStat:
    """A file as one listing shows it: size, and modification time in epoch seconds (None where the
    store reports none)."""

    bytes: int
    modified_at: float | None


def modified_at(info: dict[str, Any]) -> float | None:
    """A file's modification time in epoch seconds from fsspec's info (local, GCS or S3 spelling)."""
    for key in ("mtime", "LastModified", "updated"):
        value = info.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


@dataclass(frozen=True)
class CommittedFiles:
    """A committed artifact's file entries and when its manifest was written, by the store's clock.

    A file whose size matches its entry and whose mtime is older than the manifest has not been
    written since it was hashed, so a resumed build's commit reuses its entry instead of reading
    it again: an append costs what it writes, not the artifact's size."""

    entries: dict[str, FileEntry]
    committed_at: float

    def untouched(self, stats: dict[str, FileStat]) -> dict[str, FileEntry]:
        return {rel: entry for rel, stat in stats.items() if (entry := self.entries.get(rel)) is not None
                and stat.bytes == entry.bytes and stat.modified_at is not None
                and stat.modified_at < self.committed_at}


def _is_bookkeeping(rel: str) -> bool:
    """The manifest, kept (retracted) manifests, the lease and the artifact a rebuild replaces are not
    artifact content."""
    return rel in (MANIFEST_NAME, LOCK_NAME) or \
        rel.startswith((MANIFEST_NAME + ".", LOCK_NAME + ".", PREVIOUS_DIR + "/"))


class ArtifactStore:
    """Artifacts under one fsspec prefix (a local path, `gs://bucket/x`, `s3://bucket/x`)."""

    def __init__(self, prefix: str, storage_options: dict[str, Any] | None = None, *,
                 lease_heartbeat_s: float = HEARTBEAT_S, lease_timeout_s: float = TIMEOUT_S):
        self.prefix = prefix.rstrip("/") if "://" in prefix else str(Path(prefix).expanduser().resolve())
        self.fs, root = url_to_fs(self.prefix, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.is_local = isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)
        self.lease_heartbeat_s, self.lease_timeout_s = lease_heartbeat_s, lease_timeout_s
        self._lease_objects = lease_objects_for(self.fs)
        # Object-store SDKs retry each call themselves; their tries count against the one policy.
        self.retry_attempts = STORAGE_RETRY.attempts if self.is_local else attempts_around(sdk_attempts(self.fs))

    def retrying(self, fn):
        """``fn()`` retried on transient errors, within the storage retry policy (see marin_resources.storage.retry)."""
        return with_retries(fn, attempts=self.retry_attempts)

    # ---- locations -------------------------------------------------------------------------
    def artifact_uri(self, asset_key: str, code_version: str, partition: str | None, *, fingerprint: str) -> str:
        """Where the artifact of this identity lives: ``{key}/{code_version}-{fingerprint[:8]}/{partition}``."""
        segments = [*self._key_segments(asset_key), version_dir(code_version, fingerprint)]
        if partition is not None:
            segments.append(partition)
        for segment in segments:
            validate_partition_key(segment)  # key path, version and partition obey the same rules
        return "/".join([self.prefix, *segments])

    @staticmethod
    def _key_segments(asset_key: str) -> list[str]:
        segments = [p for p in asset_key.split("/") if p]
        for segment in segments:
            validate_partition_key(segment)
        return segments

    def ref_uri(self, asset_key: str, code_version: str, partition: str | None) -> str:
        """The ref naming the current identity of ``asset_key[partition]`` at ``code_version``."""
        name = UNPARTITIONED_REF if partition is None else validate_partition_key(partition)
        return "/".join([self.prefix, *self._key_segments(asset_key), REFS_DIR, validate_partition_key(code_version),
                         name])

    def fs_path(self, uri: str) -> str:
        """fsspec path (no protocol) for a URI under this store."""
        if not uri.startswith(self.prefix):
            raise ValueError(f"{uri} is outside the store prefix {self.prefix}")
        return self.root + uri[len(self.prefix):]

    def portable(self, value: Any) -> Any:
        """`value` (a URI, or JSON-like data holding URIs) with every URI under this store's prefix
        written as `store://<path>`; anything outside the store is kept as it is."""
        def relative(text: str) -> str:
            inside = text == self.prefix or text.startswith(self.prefix + "/")
            return STORE_SCHEME + text[len(self.prefix):].lstrip("/") if inside else text
        return _map_strings(value, relative)

    def resolve(self, value: Any) -> Any:
        """The inverse of `portable`: `store://<path>` URIs become URIs under this store's prefix."""
        return _map_strings(value, lambda text: f"{self.prefix}/{text[len(STORE_SCHEME):]}".rstrip("/")
                            if text.startswith(STORE_SCHEME) else text)

    def check_writable(self) -> None:
        """One line (`StoreUnavailableError`) if this process cannot write to its local store, made
        first if missing: a read-only directory or mount, before any run would fail deep inside its
        first step. A bucket's access is checked when the store is opened (`check_store_reachable`)."""
        if not self.is_local:
            return
        try:
            os.makedirs(self.root, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=".write-check-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise StoreUnavailableError(f"store {self.prefix}: cannot write to it "
                                        f"({type(exc).__name__}: {exc.strerror or exc})") from None

    def local_path(self, uri: str) -> Path:
        if not self.is_local:
            raise ValueError(f"{uri} is not on local disk")
        return Path(self.fs_path(uri))

    # ---- reading ---------------------------------------------------------------------------
    def read_manifest(self, uri: str) -> Manifest | None:
        path = f"{self.fs_path(uri)}/{MANIFEST_NAME}"
        try:
            text = self.retrying(lambda: self.fs.cat_file(path).decode("utf-8"))
        except FileNotFoundError:
            return None
        return self.parse_manifest(text, uri)

    def parse_manifest(self, text: str, uri: str) -> Manifest:
        """A manifest as stored at ``uri``, its store-relative references resolved against this prefix."""
        return self.manifest_from_stored(json.loads(text), uri)

    def manifest_from_stored(self, stored: dict[str, Any], uri: str) -> Manifest:
        """`parse_manifest` of the manifest's JSON already parsed (a stage index holds them so)."""
        manifest = Manifest.from_dict(stored, uri=uri)
        manifest.upstream = [dataclasses.replace(u, uri=self.resolve(u.uri)) for u in manifest.upstream]
        manifest.metrics = self.resolve(manifest.metrics)
        return manifest

    def find(self, asset_key: str, code_version: str, partition: str | None, *,
             fingerprint: str | None = None) -> Manifest | None:
        """The committed artifact of one identity, or with no fingerprint the current one (its ref)."""
        if fingerprint is None:
            fingerprint = self.current_fingerprint(asset_key, code_version, partition)
            if fingerprint is None:
                return None
        manifest = self.read_manifest(self.artifact_uri(asset_key, code_version, partition, fingerprint=fingerprint))
        if manifest is not None and manifest.fingerprint[:len(fingerprint)] != fingerprint:
            raise ValueError(f"{manifest.uri}: holds fingerprint {manifest.fingerprint[:16]}, not {fingerprint[:16]} "
                             f"(a {FINGERPRINT_CHARS}-character prefix collision); bump the code version")
        return manifest

    def current_fingerprint(self, asset_key: str, code_version: str, partition: str | None) -> str | None:
        """The fingerprint the ref of ``asset_key[partition]`` at ``code_version`` names, if any."""
        try:
            text = self.retrying(lambda: self.fs.cat_file(self.fs_path(
                self.ref_uri(asset_key, code_version, partition))).decode("utf-8"))
        except FileNotFoundError:
            return None
        return str(json.loads(text)["fingerprint"])

    def find_previous(self, asset_key: str, code_version: str, partition: str | None, *,
                      fingerprint: str | None = None) -> Manifest | None:
        """The committed artifact a rebuild of this identity (with no fingerprint, the current one)
        replaces, kept while the rebuild runs and after it was stopped; None when no rebuild is
        unfinished. Its `uri` is where its files are kept."""
        if fingerprint is None:
            fingerprint = self.current_fingerprint(asset_key, code_version, partition)
            if fingerprint is None:
                return None
        return self.read_manifest(f"{self.artifact_uri(asset_key, code_version, partition, fingerprint=fingerprint)}"
                                  f"/{PREVIOUS_DIR}")

    def read_last_committed(self, uri: str) -> Manifest | None:
        """The artifact committed at ``uri``, or where an unfinished rebuild replaces it, the one it keeps."""
        manifest = self.read_manifest(uri)
        return manifest if manifest is not None else self.read_manifest(f"{uri}/{PREVIOUS_DIR}")

    def point(self, manifest: Manifest) -> bool:
        """Make ``manifest`` the current identity of its asset partition; False if it already was.
        Reverting a config is this one small write: the old artifact is still there."""
        if self.current_fingerprint(manifest.asset_key, manifest.code_version, manifest.partition) == \
                manifest.fingerprint:
            return False
        path = self.fs_path(self.ref_uri(manifest.asset_key, manifest.code_version, manifest.partition))
        # No URI: the prefix is a runtime choice, and a moved bucket keeps its refs.
        body = json.dumps({"fingerprint": manifest.fingerprint, "pointed_at": utc_now()}, sort_keys=True).encode()
        self._write_atomic(path, body)
        return True

    def versions(self, asset_key: str) -> list[tuple[str, str]]:
        """``(code_version, fingerprint prefix)`` of every identity directory of this asset."""
        found = []
        for name in self._dirs(f"{self.prefix}/{asset_key}"):
            parsed = parse_version_dir(name)
            if parsed is not None:
                found.append(parsed)
        return sorted(found)

    def code_versions(self, asset_key: str) -> list[str]:
        """Code versions that have at least one identity directory for this asset, sorted by name
        (mtime order is not guaranteed on object stores)."""
        return sorted({code_version for code_version, _ in self.versions(asset_key)})

    def _dirs(self, uri: str) -> list[str]:
        """Names of the directories directly under ``uri``, hidden ones (refs) left out."""
        try:
            entries = self.fs.ls(self.fs_path(uri), detail=True)
        except FileNotFoundError:
            return []
        names = (e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")
        return sorted(n for n in names if not n.startswith("."))

    def open(self, uri: str, mode: str = "rb"):
        return self.fs.open(self.fs_path(uri), mode)

    def list_files(self, uri: str) -> list[str]:
        """Relative paths of every file under an artifact directory, manifest and lease excluded."""
        return sorted(self.file_sizes(uri))

    def file_sizes(self, uri: str) -> dict[str, int]:
        """`{relative path: bytes}` of every file under an artifact directory, from one listing."""
        return {rel: stat.bytes for rel, stat in self.file_stats(uri).items()}

    def file_stats(self, uri: str) -> dict[str, FileStat]:
        """`{relative path: size and mtime}` of every file under an artifact directory, manifest and
        lease excluded, from one listing."""
        base = self.fs_path(uri)
        try:
            found = self.fs.find(base, withdirs=False, detail=True)
        except FileNotFoundError:
            return {}
        stats = {}
        for p, info in found.items():
            if self.is_local and os.path.islink(p):
                continue  # links (e.g. wandb's latest-run pointers) are not content and may dangle
            rel = p[len(base):].lstrip("/")
            if rel and not _is_bookkeeping(rel):
                stats[rel] = FileStat(int(info.get("size") or 0), modified_at(info))
        return stats

    def manifest_written_at(self, uri: str) -> float | None:
        """When the artifact's manifest was written, by the store's clock (None: no manifest or no mtime)."""
        try:
            return modified_at(self.fs.info(f"{self.fs_path(uri)}/{MANIFEST_NAME}"))
        except FileNotFoundError:
            return None

    def hash_file(self, uri: str, rel: str) -> FileEntry:
        h = hashlib.sha256()
        size = 0
        with self.fs.open(f"{self.fs_path(uri)}/{rel}", "rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
                size += len(chunk)
        return FileEntry(path=rel, bytes=size, sha256=h.hexdigest())

    def check_files(self, manifest: Manifest) -> list[str]:
        """The cheap check run before an artifact is reused: its data version is the content hash of
        its listed files, and every listed file exists with its recorded size. One listing, no
        reading; `verify` is the full check."""
        return size_problems(manifest, self.file_sizes(manifest.uri))

    def check_file(self, manifest: Manifest, rel: str, *, full: bool = False) -> list[str]:
        """`check_files` of one listed file (with ``full``, `verify`'s re-hash): what a reader of that
        file alone checks, without listing an artifact of tens of thousands of files."""
        entry = next(f for f in manifest.files if f.path == rel)
        try:
            actual = self.hash_file(manifest.uri, rel) if full else \
                FileEntry(rel, self.fs.size(self.fs_path(f"{manifest.uri}/{rel}")), entry.sha256)
        except FileNotFoundError:
            return [f"{manifest.uri}/{rel}: missing"]
        if (actual.bytes, actual.sha256) != (entry.bytes, entry.sha256):
            return [f"{manifest.uri}/{rel}: {actual.bytes} bytes, sha256 {actual.sha256[:12]}; recorded "
                    f"{entry.bytes}, {entry.sha256[:12]}"]
        return []

    def verify(self, manifest: Manifest) -> list[str]:
        """Files whose bytes no longer match the manifest (changed, missing, or added), and a data
        version that is not the content hash of the listed files."""
        problems = _data_version_problems(manifest)
        present = set(self.list_files(manifest.uri))
        for entry in manifest.files:
            if entry.path not in present:
                problems.append(f"{manifest.uri}/{entry.path}: missing")
                continue
            actual = self.hash_file(manifest.uri, entry.path)
            if actual.sha256 != entry.sha256 or actual.bytes != entry.bytes:
                problems.append(f"{manifest.uri}/{entry.path}: sha256 {actual.sha256[:12]} "
                                f"!= recorded {entry.sha256[:12]}")
        for extra in sorted(present - {e.path for e in manifest.files}):
            problems.append(f"{manifest.uri}/{extra}: not in manifest")
        return problems

    # ---- writing ---------------------------------------------------------------------------
    def begin(self, asset_key: str, code_version: str, partition: str | None, *, fingerprint: str, run_id: str,
              resume: bool = False, writes_by_rename: bool = False) -> ArtifactWriter:
        """Start writing an artifact. With ``resume`` the build continues from the files there; a
        ``writes_by_rename`` builder replaces a file only by renaming a new one over it (never rewrites
        one in place), so on local disk the committed artifact it resumes is kept by hard links, not copied."""
        uri = self.artifact_uri(asset_key, code_version, partition, fingerprint=fingerprint)
        path = self.fs_path(uri)
        self.fs.makedirs(path, exist_ok=True)
        lease = self._lease(path, run_id)
        previous = None
        try:
            # What the files were when last committed: a resumed build's commit reuses the entries of
            # files it left untouched. Read before the manifest goes.
            existing = self.read_manifest(uri)
            if resume and existing is not None and (committed_at := self.manifest_written_at(uri)) is not None:
                previous = CommittedFiles({f.path: f for f in existing.files}, committed_at)
            if existing is not None:
                if existing.fingerprint != fingerprint:
                    raise ValueError(f"{uri} holds fingerprint {existing.fingerprint[:16]}, not {fingerprint[:16]} "
                                     f"(a {FINGERPRINT_CHARS}-character prefix collision); bump the code version")
                # A rebuilt artifact stops looking complete before its files change, and the committed
                # one stays readable beside it until the new one commits.
                self._keep_previous(existing, copy=resume and not writes_by_rename)
                self.fs.rm_file(f"{path}/{MANIFEST_NAME}")
            if not resume:
                for rel in self.list_files(uri):
                    self.fs.rm_file(f"{path}/{rel}")
            self.fs.makedirs(path, exist_ok=True)
        except BaseException:
            lease.release()
            raise
        return ArtifactWriter(self, asset_key, code_version, partition, fingerprint, uri, run_id, lease, previous,
                              resumed=resume)

    def _keep_previous(self, manifest: Manifest, *, copy: bool) -> None:
        """Keep a committed artifact's files and manifest in its `.previous/`, the manifest last (a kept
        artifact without one is incomplete, and the next rebuild keeps it again). On local disk a file
        is hard-linked unless ``copy`` (a builder that may rewrite it in place); on object stores it is
        copied within the store. A file already missing (a damaged artifact) is not kept."""
        path = self.fs_path(manifest.uri)
        kept = f"{path}/{PREVIOUS_DIR}"
        if self.fs.exists(kept):
            self.fs.rm(kept, recursive=True)  # a commit stopped before it removed the last one
        for entry in manifest.files:
            source, target = f"{path}/{entry.path}", f"{kept}/{entry.path}"
            try:
                if self.is_local:
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    # copy2 keeps the mtime: a resumed build's commit still knows the file as untouched.
                    shutil.copy2(source, target) if copy else os.link(source, target)
                else:
                    self.retrying(lambda s=source, t=target: self.fs.copy(s, t))
            except FileNotFoundError:
                continue
        self.write_manifest(dataclasses.replace(manifest, uri=f"{manifest.uri}/{PREVIOUS_DIR}"))

    def drop_previous(self, uri: str) -> None:
        """Remove what `begin` kept of the artifact a rebuild at ``uri`` replaced."""
        kept = f"{self.fs_path(uri)}/{PREVIOUS_DIR}"
        if self.fs.exists(kept):
            self.fs.rm(kept, recursive=True)

    def _lease(self, path: str, run_id: str) -> Lease:
        return acquire(self._lease_objects, f"{path}/{LOCK_NAME}", run_id,
                       where=f"{self.prefix}{path[len(self.root):]}", heartbeat_s=self.lease_heartbeat_s,
                       timeout_s=self.lease_timeout_s)

    def retract(self, manifest: Manifest, *, run_id: str, clear: bool = False) -> str:
        """Withdraw a committed artifact so that it is built again. Its manifest is kept beside the
        files as ``.artifact.json.retracted-<UTC time>``, the record of what was withdrawn (file
        listings skip it); returns that URI. With `clear` its files are removed too, so that a
        builder that resumes (a token cache, training) starts from scratch. The lease is taken
        first: while another writer holds it, this raises ArtifactLockedError and nothing is
        withdrawn."""
        stamp = utc_now().replace(":", "").replace("-", "")
        directory = self.fs_path(manifest.uri)
        path = f"{directory}/{MANIFEST_NAME}"
        lease = self._lease(directory, run_id)
        try:
            self.retrying(lambda: self.fs.mv(path, f"{path}.retracted-{stamp}"))
            if clear:
                for rel in self.list_files(manifest.uri):
                    self.fs.rm_file(f"{directory}/{rel}")
                self.drop_previous(manifest.uri)
        finally:
            lease.release()
        return f"{manifest.uri}/{MANIFEST_NAME}.retracted-{stamp}"

    def write_manifest(self, manifest: Manifest) -> None:
        # On disk, references to other artifacts are store-relative; in memory they are URIs.
        stored = dataclasses.replace(manifest, metrics=self.portable(manifest.metrics),
                                     upstream=[dataclasses.replace(u, uri=self.portable(u.uri))
                                               for u in manifest.upstream])
        self._write_atomic(f"{self.fs_path(manifest.uri)}/{MANIFEST_NAME}", stored.to_json().encode("utf-8"))

    def _write_atomic(self, path: str, data: bytes) -> None:
        """All or nothing: write-then-rename on local disk, one PUT on object stores."""
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        else:
            self.retrying(lambda: self.fs.pipe_file(path, data))


class ArtifactWriter:
    """Write side of one artifact. Use `path()`/`open()` for fsspec-native writers, or
    `staging_dir()` for tools that need a local directory (uploaded at commit on object stores)."""

    def __init__(self, store: ArtifactStore, asset_key: str, code_version: str, partition: str | None,
                 fingerprint: str, uri: str, run_id: str, lease: Lease, previous: CommittedFiles | None = None,
                 *, resumed: bool = False):
        self.store, self.asset_key, self.code_version, self.partition = store, asset_key, code_version, partition
        self.resumed = resumed  # the build continues from the files there (begin's `resume`), not from nothing
        self.fingerprint = fingerprint
        self.uri, self.run_id, self.lease, self.previous = uri, run_id, lease, previous
        self.files_rehash_skipped = 0
        self.files_vouched = 0
        self.started_at = utc_now()
        self._staging: Path | None = None
        self._vouched: dict[str, FileEntry] = {}
        self.committed = False

    def path(self, rel: str) -> str:
        """Full URI of a file inside the artifact."""
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ValueError(f"artifact file path must be relative and stay inside the artifact: {rel!r}")
        return f"{self.uri}/{rel}"

    def open(self, rel: str, mode: str = "wb"):
        fs_path = self.store.fs_path(self.path(rel))
        self.store.fs.makedirs(fs_path.rsplit("/", 1)[0], exist_ok=True)
        return self.store.fs.open(fs_path, mode)

    def vouch(self, entries: Iterable[FileEntry]) -> None:
        """Entries of files this build wrote, hashed from the very bytes written (by units of work,
        which may run elsewhere): the commit takes them instead of reading the files back, for each
        file whose stored size matches. A large artifact written by many workers is then not
        re-read by the one process that commits it."""
        for entry in entries:
            self._vouched[entry.path] = entry

    def remove(self, rel: str) -> None:
        """Remove a file written to the artifact (a partial copy), if it is there."""
        fs_path = self.store.fs_path(self.path(rel))
        if self.store.fs.exists(fs_path):
            self.store.fs.rm_file(fs_path)

    def write_json(self, rel: str, obj: Any) -> None:
        with self.open(rel, "wb") as fh:
            fh.write(json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def staging_dir(self) -> Path:
        """A local directory whose contents become the artifact's files at commit."""
        if self.store.is_local:
            return self.store.local_path(self.uri)
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix="marin-stage-"))
        return self._staging

    def commit(self, *, config: Any, upstream: list[UpstreamRef], producer: dict[str, Any],
               fingerprint: str | None = None, metrics: dict[str, Any] | None = None) -> Manifest:
        """Hash the files, write the manifest, then point the ref at it. `fingerprint`, if given, must
        be the one the writer began with (it names the directory). A resumed build's files left
        untouched since the last commit (see `CommittedFiles`) keep their entries and are not read again."""
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise ValueError(f"{self.uri}: committing fingerprint {fingerprint[:16]}, "
                             f"began with {self.fingerprint[:16]}")
        if self._staging is not None:
            # Regular files only, as list_files counts them: tools leave links behind (W&B's
            # latest-run and log links), some dangling once their target is gone.
            local = [p for p in sorted(self._staging.rglob("*")) if p.is_file() and not p.is_symlink()]
            remote = [f"{self.store.fs_path(self.uri)}/{p.relative_to(self._staging).as_posix()}" for p in local]
            self.store.retrying(lambda: self.store.fs.put([str(p) for p in local], remote))
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        stats = self.store.file_stats(self.uri)
        known = self.previous.untouched(stats) if self.previous is not None else {}
        self.files_rehash_skipped = len(known)
        known |= {rel: entry for rel, entry in self._vouched.items()
                  if rel in stats and stats[rel].bytes == entry.bytes and rel not in known}
        self.files_vouched = len(known) - self.files_rehash_skipped
        files = [known.get(rel) or self.store.hash_file(self.uri, rel) for rel in sorted(stats)]
        manifest = Manifest(
            asset_key=self.asset_key, partition=self.partition, code_version=self.code_version,
            fingerprint=self.fingerprint, config=json.loads(canonical_json(config)),
            data_version=content_data_version(files), files=files, upstream=list(upstream), producer=producer,
            started_at=self.started_at, finished_at=utc_now(), metrics=dict(metrics or {}), uri=self.uri)
        self.lease.confirm(self.uri)  # a writer whose lease was taken over must not publish
        self.store.write_manifest(manifest)
        self.store.point(manifest)
        self.committed = True
        self.store.drop_previous(self.uri)  # the artifact it replaced is no longer needed
        self.release()
        return manifest

    def release(self) -> None:
        """Give up the lease. Uncommitted files stay; without a manifest they do not count."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        self.lease.release()


def producer_info(run_id: str | None) -> dict[str, Any]:
    """Who made an artifact: run, code, key package versions, host and Python."""
    import platform
    from importlib import metadata

    versions = {}
    for dist in ("dagster", "levanter", "haliax", "jax", "tokenizers", "polars", "fsspec", "marin-dagster"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return {"run_id": run_id, "git_sha": git_sha(), "packages": versions, "host": socket.gethostname(),
            "user": _user(), "python": platform.python_version()}


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        return str(os.getuid())


def _git_dirs(root: Path) -> tuple[Path, Path]:
    """The checkout's git directory (its HEAD) and the common one (its branches): the same directory in
    a plain clone; in a `git worktree` (or submodule) ``.git`` is a file naming the former."""
    dot_git = root / ".git"
    git_dir = dot_git
    if dot_git.is_file():
        pointer = dot_git.read_text().strip()
        if pointer.startswith("gitdir: "):
            git_dir = (root / pointer[len("gitdir: "):]).resolve()
    common = git_dir / "commondir"
    return git_dir, (git_dir / common.read_text().strip()).resolve() if common.exists() else git_dir


CHECKOUT = Path(__file__).resolve().parents[2]  # marin_resources/storage/store.py -> the repository


def git_sha(root: Path = CHECKOUT) -> str | None:
    """Commit of the code that runs, read without spawning git (cheap, works in images without git)."""
    try:
        git_dir, common = _git_dirs(root)
        ref = (git_dir / "HEAD").read_text().strip()
        if ref.startswith("ref: "):
            ref_path = common / ref[5:]
            if ref_path.exists():
                return ref_path.read_text().strip()
            packed = common / "packed-refs"
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref[5:]):
                    return line.split()[0]
            return None
        return ref
    except OSError:
        return os.environ.get("MARIN_GIT_SHA")


@contextlib.contextmanager
def writing(store: ArtifactStore, asset_key: str, code_version: str, partition: str | None, *, fingerprint: str,
            run_id: str, resume: bool = False, writes_by_rename: bool = False) -> Iterator[ArtifactWriter]:
    """Begin an artifact and always release its lease; commit is the caller's last step."""
    writer = store.begin(asset_key, code_version, partition, fingerprint=fingerprint, run_id=run_id, resume=resume,
                         writes_by_rename=writes_by_rename)
    try:
        yield writer
    finally:
        if not writer.committed:
            writer.release()
