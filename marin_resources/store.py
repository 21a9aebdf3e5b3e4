"""The artifact store: `{prefix}/{asset key}/{code_version}/{partition}/` on local disk, S3 or GCS (fsspec).

Commit protocol, the same on local disk and on object stores:

1. `begin()` takes a lease (`.lock`, see `leases.py`: conditional writes, renewed by a heartbeat
   while the writer works), then clears any leftovers of an earlier
   attempt that never committed (unless the writer resumes, as training does).
2. The producer writes its files.
3. `commit()` hashes every file, confirms the lease is still its own, and writes `.artifact.json`
   last, as one atomic operation (rename on local disk, a single PUT on object stores).

An artifact without a manifest does not exist, so a process killed at any point
leaves nothing that looks complete. Before an artifact is rebuilt in place, its
manifest is deleted first for the same reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import hashlib
import json
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from marin_resources.identity import canonical_json, validate_partition_key
from marin_resources.leases import HEARTBEAT_S, TIMEOUT_S, ArtifactLockedError, Lease, acquire, lease_objects_for
from marin_resources.object_stores import sdk_attempts
from marin_resources.retry import STORAGE_RETRY, attempts_around, with_retries
from marin_resources.secrets import scrub

MANIFEST_NAME = ".artifact.json"
LOCK_NAME = ".lock"
# A reference to another artifact of the same store, relative to its prefix: `store://raw/x/v1/shard`.
# Manifests and configs written inside artifacts use it, so a store copied to another prefix
# (another bucket, another disk) still points at itself; readers resolve it against their prefix.
STORE_SCHEME = "store://"
_HASH_CHUNK = 4 * 1024 * 1024


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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
    def from_json(cls, text: str, uri: str = "") -> "Manifest":
        raw = json.loads(text)
        raw["files"] = [FileEntry(**f) for f in raw.get("files", [])]
        raw["upstream"] = [UpstreamRef(**u) for u in raw.get("upstream", [])]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known}, uri=uri)

    def upstream_versions(self) -> dict[tuple[str, str | None], str]:
        return {(u.asset_key, u.partition): u.data_version for u in self.upstream}


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


def _map_strings(value: Any, fn) -> Any:
    """`fn` applied to every string in JSON-like data (dicts, lists, strings)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


def _is_bookkeeping(rel: str) -> bool:
    """The manifest, kept (retracted) manifests and the lease are not artifact content."""
    return rel in (MANIFEST_NAME, LOCK_NAME) or rel.startswith((MANIFEST_NAME + ".", LOCK_NAME + "."))


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
        """``fn()`` retried on transient errors, within the storage retry policy (see marin_resources.retry)."""
        return with_retries(fn, attempts=self.retry_attempts)

    # ---- locations -------------------------------------------------------------------------
    def artifact_uri(self, asset_key: str, code_version: str, partition: str | None) -> str:
        segments = [p for p in asset_key.split("/") if p] + [code_version]
        if partition is not None:
            segments.append(partition)
        for segment in segments:
            validate_partition_key(segment)  # key path, version and partition obey the same rules
        return "/".join([self.prefix, *segments])

    def _path(self, uri: str) -> str:
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

    def local_path(self, uri: str) -> Path:
        if not self.is_local:
            raise ValueError(f"{uri} is not on local disk")
        return Path(self._path(uri))

    # ---- reading ---------------------------------------------------------------------------
    def read_manifest(self, uri: str) -> Manifest | None:
        path = f"{self._path(uri)}/{MANIFEST_NAME}"
        try:
            text = self.retrying(lambda: self.fs.cat_file(path).decode("utf-8"))
        except FileNotFoundError:
            return None
        manifest = Manifest.from_json(text, uri=uri)
        manifest.upstream = [dataclasses.replace(u, uri=self.resolve(u.uri)) for u in manifest.upstream]
        manifest.metrics = self.resolve(manifest.metrics)
        return manifest

    def find(self, asset_key: str, code_version: str, partition: str | None) -> Manifest | None:
        return self.read_manifest(self.artifact_uri(asset_key, code_version, partition))

    def code_versions(self, asset_key: str) -> list[str]:
        """Code versions that have at least a directory for this asset (newest last by mtime order is not
        guaranteed on object stores, so callers sort or compare by name)."""
        base = self._path(f"{self.prefix}/{asset_key}")
        try:
            entries = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    def open(self, uri: str, mode: str = "rb"):
        return self.fs.open(self._path(uri), mode)

    def list_files(self, uri: str) -> list[str]:
        """Relative paths of every file under an artifact directory, manifest and lease excluded."""
        return sorted(self.file_sizes(uri))

    def file_sizes(self, uri: str) -> dict[str, int]:
        """`{relative path: bytes}` of every file under an artifact directory, from one listing."""
        base = self._path(uri)
        try:
            found = self.fs.find(base, withdirs=False, detail=True)
        except FileNotFoundError:
            return {}
        sizes = {}
        for p, info in found.items():
            if self.is_local and os.path.islink(p):
                continue  # links (e.g. wandb's latest-run pointers) are not content and may dangle
            rel = p[len(base):].lstrip("/")
            if rel and not _is_bookkeeping(rel):
                sizes[rel] = int(info.get("size") or 0)
        return sizes

    def hash_file(self, uri: str, rel: str) -> FileEntry:
        h = hashlib.sha256()
        size = 0
        with self.fs.open(f"{self._path(uri)}/{rel}", "rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
                size += len(chunk)
        return FileEntry(path=rel, bytes=size, sha256=h.hexdigest())

    def check_files(self, manifest: Manifest) -> list[str]:
        """The cheap check run before an artifact is reused: its data version is the content hash of
        its listed files, and every listed file exists with its recorded size. One listing, no
        reading; `verify` is the full check."""
        problems = _data_version_problems(manifest)
        sizes = self.file_sizes(manifest.uri)
        for entry in manifest.files:
            size = sizes.get(entry.path)
            if size is None:
                problems.append(f"{manifest.uri}/{entry.path}: missing")
            elif size != entry.bytes:
                problems.append(f"{manifest.uri}/{entry.path}: {size} bytes, recorded {entry.bytes}")
        return problems

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
                problems.append(f"{manifest.uri}/{entry.path}: sha256 {actual.sha256[:12]} != recorded {entry.sha256[:12]}")
        for extra in sorted(present - {e.path for e in manifest.files}):
            problems.append(f"{manifest.uri}/{extra}: not in manifest")
        return problems

    # ---- writing ---------------------------------------------------------------------------
    def begin(self, asset_key: str, code_version: str, partition: str | None, *, run_id: str,
              resume: bool = False) -> "ArtifactWriter":
        uri = self.artifact_uri(asset_key, code_version, partition)
        path = self._path(uri)
        self.fs.makedirs(path, exist_ok=True)
        lease = self._lease(path, run_id)
        try:
            # A rebuilt artifact must stop looking complete before its files change.
            if self.fs.exists(f"{path}/{MANIFEST_NAME}"):
                self.fs.rm_file(f"{path}/{MANIFEST_NAME}")
            if not resume:
                for rel in self.list_files(uri):
                    self.fs.rm_file(f"{path}/{rel}")
            self.fs.makedirs(path, exist_ok=True)
        except BaseException:
            lease.release()
            raise
        return ArtifactWriter(self, asset_key, code_version, partition, uri, run_id, lease)

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
        directory = self._path(manifest.uri)
        path = f"{directory}/{MANIFEST_NAME}"
        lease = self._lease(directory, run_id)
        try:
            self.retrying(lambda: self.fs.mv(path, f"{path}.retracted-{stamp}"))
            if clear:
                for rel in self.list_files(manifest.uri):
                    self.fs.rm_file(f"{directory}/{rel}")
        finally:
            lease.release()
        return f"{manifest.uri}/{MANIFEST_NAME}.retracted-{stamp}"

    def write_manifest(self, manifest: Manifest) -> None:
        path = f"{self._path(manifest.uri)}/{MANIFEST_NAME}"
        # On disk, references to other artifacts are store-relative; in memory they are URIs.
        stored = dataclasses.replace(manifest, metrics=self.portable(manifest.metrics),
                                     upstream=[dataclasses.replace(u, uri=self.portable(u.uri))
                                               for u in manifest.upstream])
        data = stored.to_json().encode("utf-8")
        if self.is_local:
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
                 uri: str, run_id: str, lease: Lease):
        self.store, self.asset_key, self.code_version, self.partition = store, asset_key, code_version, partition
        self.uri, self.run_id, self.lease = uri, run_id, lease
        self.started_at = utc_now()
        self._staging: Path | None = None
        self.committed = False

    def path(self, rel: str) -> str:
        """Full URI of a file inside the artifact."""
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ValueError(f"artifact file path must be relative and stay inside the artifact: {rel!r}")
        return f"{self.uri}/{rel}"

    def open(self, rel: str, mode: str = "wb"):
        fs_path = self.store._path(self.path(rel))
        self.store.fs.makedirs(fs_path.rsplit("/", 1)[0], exist_ok=True)
        return self.store.fs.open(fs_path, mode)

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

    def commit(self, *, fingerprint: str, config: Any, upstream: list[UpstreamRef], producer: dict[str, Any],
               metrics: dict[str, Any] | None = None, known_files: dict[str, FileEntry] | None = None) -> Manifest:
        """`known_files`: entries the producer vouches for (files it left untouched since they were
        last hashed, e.g. an append-only cache's old files); those are not hashed again."""
        if self._staging is not None:
            # Regular files only, as list_files counts them: tools leave links behind (W&B's
            # latest-run and log links), some dangling once their target is gone.
            local = [p for p in sorted(self._staging.rglob("*")) if p.is_file() and not p.is_symlink()]
            remote = [f"{self.store._path(self.uri)}/{p.relative_to(self._staging).as_posix()}" for p in local]
            self.store.retrying(lambda: self.store.fs.put([str(p) for p in local], remote))
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        known = known_files or {}
        files = [known.get(rel) or self.store.hash_file(self.uri, rel) for rel in self.store.list_files(self.uri)]
        manifest = Manifest(
            asset_key=self.asset_key, partition=self.partition, code_version=self.code_version,
            fingerprint=fingerprint, config=json.loads(canonical_json(config)),
            data_version=content_data_version(files), files=files, upstream=list(upstream), producer=producer,
            started_at=self.started_at, finished_at=utc_now(), metrics=dict(metrics or {}), uri=self.uri)
        self.lease.confirm(self.uri)  # a writer whose lease was taken over must not publish
        self.store.write_manifest(manifest)
        self.committed = True
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
    except Exception:  # no passwd entry in some containers
        return str(os.getuid())


def git_sha() -> str | None:
    """Commit of the code that runs, read without spawning git (cheap, works in images without git)."""
    root = Path(__file__).resolve().parent.parent
    head = root / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref_path = root / ".git" / ref[5:]
            if ref_path.exists():
                return ref_path.read_text().strip()
            packed = root / ".git" / "packed-refs"
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref[5:]):
                    return line.split()[0]
            return None
        return ref
    except OSError:
        return os.environ.get("MARIN_GIT_SHA")


@contextlib.contextmanager
def writing(store: ArtifactStore, asset_key: str, code_version: str, partition: str | None, *, run_id: str,
            resume: bool = False) -> Iterator[ArtifactWriter]:
    """Begin an artifact and always release its lease; commit is the caller's last step."""
    writer = store.begin(asset_key, code_version, partition, run_id=run_id, resume=resume)
    try:
        yield writer
    finally:
        if not writer.committed:
            writer.release()
