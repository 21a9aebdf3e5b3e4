"""The artifact store: `{prefix}/{asset key}/{code_version}/{partition}/` on any fsspec filesystem.

Commit protocol, the same on local disk and on object stores:

1. `begin()` takes a lease (`.lock`), then clears any leftovers of an earlier
   attempt that never committed (unless the writer resumes, as training does).
2. The producer writes its files.
3. `commit()` hashes every file and writes `.artifact.json` last, as one atomic
   operation (rename on local disk, a single PUT on object stores).

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
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from marin_resources.identity import canonical_json, validate_partition_key
from marin_resources.object_stores import sdk_attempts
from marin_resources.retry import STORAGE_RETRY, attempts_around, with_retries
from marin_resources.secrets import scrub

MANIFEST_NAME = ".artifact.json"
LOCK_NAME = ".lock"
_HASH_CHUNK = 4 * 1024 * 1024


class ArtifactLockedError(RuntimeError):
    """Another live writer holds the lease on this artifact."""


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


class ArtifactStore:
    """Artifacts under one fsspec prefix (a local path, `gs://bucket/x`, `s3://bucket/x`)."""

    def __init__(self, prefix: str, storage_options: dict[str, Any] | None = None, lock_ttl_s: float = 6 * 3600):
        self.prefix = prefix.rstrip("/") if "://" in prefix else str(Path(prefix).expanduser().resolve())
        self.fs, root = url_to_fs(self.prefix, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.is_local = isinstance(self.fs, fsspec.implementations.local.LocalFileSystem)
        self.lock_ttl_s = lock_ttl_s
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
        return Manifest.from_json(text, uri=uri)

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
        base = self._path(uri)
        try:
            found = self.fs.find(base, withdirs=False)
        except FileNotFoundError:
            return []
        rels = []
        for p in found:
            if self.is_local and os.path.islink(p):
                continue  # links (e.g. wandb's latest-run pointers) are not content and may dangle
            rel = p[len(base):].lstrip("/")
            if rel and rel not in (MANIFEST_NAME, LOCK_NAME) and not rel.startswith(MANIFEST_NAME + "."):
                rels.append(rel)
        return sorted(rels)

    def hash_file(self, uri: str, rel: str) -> FileEntry:
        h = hashlib.sha256()
        size = 0
        with self.fs.open(f"{self._path(uri)}/{rel}", "rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
                size += len(chunk)
        return FileEntry(path=rel, bytes=size, sha256=h.hexdigest())

    def verify(self, manifest: Manifest) -> list[str]:
        """Files whose bytes no longer match the manifest (changed, missing, or added)."""
        problems = []
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
        self._acquire_lock(path, run_id)
        try:
            # A rebuilt artifact must stop looking complete before its files change.
            if self.fs.exists(f"{path}/{MANIFEST_NAME}"):
                self.fs.rm_file(f"{path}/{MANIFEST_NAME}")
            if not resume:
                for rel in self.list_files(uri):
                    self.fs.rm_file(f"{path}/{rel}")
            self.fs.makedirs(path, exist_ok=True)
        except BaseException:
            self._release_lock(path, run_id)
            raise
        return ArtifactWriter(self, asset_key, code_version, partition, uri, run_id)

    def _lock_body(self, run_id: str) -> dict[str, Any]:
        return {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(), "created": time.time(),
                "token": uuid.uuid4().hex}

    def _lock_is_stale(self, body: dict[str, Any]) -> bool:
        if time.time() - float(body.get("created", 0)) > self.lock_ttl_s:
            return True
        if body.get("host") == socket.gethostname():
            try:
                os.kill(int(body["pid"]), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, KeyError, ValueError):
                return False
        return False

    def _acquire_lock(self, path: str, run_id: str) -> None:
        lock = f"{path}/{LOCK_NAME}"
        body = self._lock_body(run_id)
        payload = json.dumps(body).encode()
        self.fs.makedirs(path, exist_ok=True)
        for _ in range(2):
            if self.is_local:
                try:
                    fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    holder = self._read_lock(lock)
                else:
                    with os.fdopen(fd, "wb") as fh:
                        fh.write(payload)
                    return
            else:
                holder = self._read_lock(lock)
                if holder is None:
                    # Object stores have no O_EXCL through fsspec: write, then read back to see who won.
                    self.fs.pipe_file(lock, payload)
                    time.sleep(0.05)
                    holder = self._read_lock(lock)
                    if holder and holder.get("token") == body["token"]:
                        return
            if holder is None:
                continue
            if holder.get("run_id") == run_id and holder.get("pid") == os.getpid():
                return
            if self._lock_is_stale(holder):
                self.fs.rm_file(lock)
                continue
            raise ArtifactLockedError(
                f"{self.prefix}{path[len(self.root):]} is being written by run {holder.get('run_id')} "
                f"(host {holder.get('host')}, pid {holder.get('pid')}); retry when it finishes")
        raise ArtifactLockedError(f"could not take the lease on {path}")

    def _read_lock(self, lock: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(lock))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _release_lock(self, path: str, run_id: str) -> None:
        lock = f"{path}/{LOCK_NAME}"
        holder = self._read_lock(lock)
        if holder and holder.get("run_id") == run_id:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(lock)

    def retract(self, manifest: Manifest) -> str:
        """Withdraw a committed artifact so that it is built again. Its manifest is kept beside the
        files as ``.artifact.json.retracted-<UTC time>``, the record of what was withdrawn (file
        listings skip it); returns that URI."""
        stamp = utc_now().replace(":", "").replace("-", "")
        path = f"{self._path(manifest.uri)}/{MANIFEST_NAME}"
        self.retrying(lambda: self.fs.mv(path, f"{path}.retracted-{stamp}"))
        return f"{manifest.uri}/{MANIFEST_NAME}.retracted-{stamp}"

    def write_manifest(self, manifest: Manifest) -> None:
        path = f"{self._path(manifest.uri)}/{MANIFEST_NAME}"
        data = manifest.to_json().encode("utf-8")
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
                 uri: str, run_id: str):
        self.store, self.asset_key, self.code_version, self.partition = store, asset_key, code_version, partition
        self.uri, self.run_id = uri, run_id
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
               metrics: dict[str, Any] | None = None) -> Manifest:
        if self._staging is not None:
            # Regular files only, as list_files counts them: tools leave links behind (W&B's
            # latest-run and log links), some dangling once their target is gone.
            local = [p for p in sorted(self._staging.rglob("*")) if p.is_file() and not p.is_symlink()]
            remote = [f"{self.store._path(self.uri)}/{p.relative_to(self._staging).as_posix()}" for p in local]
            self.store.retrying(lambda: self.store.fs.put([str(p) for p in local], remote))
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        files = [self.store.hash_file(self.uri, rel) for rel in self.store.list_files(self.uri)]
        manifest = Manifest(
            asset_key=self.asset_key, partition=self.partition, code_version=self.code_version,
            fingerprint=fingerprint, config=json.loads(canonical_json(config)),
            data_version=content_data_version(files), files=files, upstream=list(upstream), producer=producer,
            started_at=self.started_at, finished_at=utc_now(), metrics=dict(metrics or {}), uri=self.uri)
        self.store.write_manifest(manifest)
        self.committed = True
        self.release()
        return manifest

    def release(self) -> None:
        """Give up the lease. Uncommitted files stay; without a manifest they do not count."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        self.store._release_lock(self.store._path(self.uri), self.run_id)


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
