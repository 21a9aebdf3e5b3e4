"""Writer leases on an artifact directory: one `.lock` object per artifact, taken and renewed with
conditional writes, kept alive by a heartbeat.

- Taking: create only if absent (`O_EXCL` under a lock file on local disk, `If-None-Match: *` on
  S3, `ifGenerationMatch=0` on GCS).
- Renewing every `heartbeat_s`: replace only if the lease is still the one this writer wrote
  (its content hash, S3 ETag or GCS generation: `If-Match` / `ifGenerationMatch`).
- A lease not renewed within `timeout_s` is stale on any host; on the writer's own host a dead
  pid makes it stale at once. A stale lease is taken over by a conditional replace, so of two
  writers racing for it one wins.
- Releasing deletes the lease only if it is still this writer's, so a writer whose lease was
  taken over never removes the new holder's.

Every conditional operation first reads and compares the tag, then asks the store to enforce it.
The read is what the GCS emulator used in tests honours (it ignores preconditions); real GCS and
S3 (and moto) enforce the precondition itself, which is what makes a race safe.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsspec.asyn import sync

HEARTBEAT_S = 30.0
TIMEOUT_S = 90.0


class ArtifactLockedError(RuntimeError):
    """Another live writer holds the lease on this artifact, or this writer lost its lease."""


def _precondition_failed(exc: BaseException) -> bool:
    """True when a store refused a conditional request (S3 412/409, GCS 412), however the
    filesystem library wrapped the answer."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, FileExistsError):
            return True
        if getattr(seen, "code", None) == 412:  # gcsfs HttpError
            return True
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def _not_found(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, FileNotFoundError) or getattr(seen, "code", None) == 404:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class LeaseObjects:
    """Conditional operations on one small object. `tag` identifies a version of it."""

    def read(self, path: str) -> tuple[bytes, str] | None:
        raise NotImplementedError

    def create(self, path: str, data: bytes) -> str | None:
        """Write if absent; the new tag, or None if it exists."""
        raise NotImplementedError

    def replace(self, path: str, data: bytes, tag: str) -> str | None:
        """Write if the current version has `tag`; the new tag, or None."""
        current = self.read(path)
        if current is None or current[1] != tag:
            return None
        return self._replace(path, data, tag)

    def delete(self, path: str, tag: str) -> bool:
        """Delete if the current version has `tag`."""
        current = self.read(path)
        if current is None or current[1] != tag:
            return False
        return self._delete(path, tag)

    def _replace(self, path: str, data: bytes, tag: str) -> str | None:
        raise NotImplementedError

    def _delete(self, path: str, tag: str) -> bool:
        raise NotImplementedError


@contextlib.contextmanager
def exclusive_file_lock(path: str | os.PathLike):
    """Holds `flock(LOCK_EX)` on the file at `path` (created if missing) across processes on this host
    or a shared POSIX mount; released when the block ends or the process dies."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class LocalLeaseObjects(LeaseObjects):
    """Local disk (or a shared POSIX mount): every change happens under `flock` on `<lease>.guard`,
    and content is replaced atomically, so the tag (content hash) comparison and the write are one
    step."""

    def _guard(self, path: str):
        return exclusive_file_lock(f"{path}.guard")

    def read(self, path: str) -> tuple[bytes, str] | None:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def _write(self, path: str, data: bytes) -> str:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
        return hashlib.sha256(data).hexdigest()

    def create(self, path: str, data: bytes) -> str | None:
        with self._guard(path):
            if os.path.exists(path):
                return None
            return self._write(path, data)

    def replace(self, path: str, data: bytes, tag: str) -> str | None:
        with self._guard(path):
            return super().replace(path, data, tag)

    def delete(self, path: str, tag: str) -> bool:
        with self._guard(path):
            return super().delete(path, tag)

    def _replace(self, path: str, data: bytes, tag: str) -> str | None:
        return self._write(path, data)

    def _delete(self, path: str, tag: str) -> bool:
        os.unlink(path)
        return True


class _ObjectStoreLeaseObjects(LeaseObjects):
    """Requests through the store's own filesystem client, so endpoint and credentials are the store's."""

    def __init__(self, fs: Any):
        self.fs = fs

    def _conditional(self, path: str, call: Callable[[], Any], *, absent_ok: bool = False) -> Any | None:
        """`call()`'s answer, or None when the store refused its precondition (or, with
        `absent_ok`, found no object)."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - classified below
            if _precondition_failed(exc) or (absent_ok and _not_found(exc)):
                return None
            raise
        finally:
            self.fs.invalidate_cache(path)


class S3LeaseObjects(_ObjectStoreLeaseObjects):
    """S3: `If-None-Match: *` to create, `If-Match: <ETag>` to renew and delete."""

    def read(self, path: str) -> tuple[bytes, str] | None:
        bucket, key, _ = self.fs.split_path(path)

        async def get() -> tuple[bytes, str]:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            async with response["Body"] as body:
                return await body.read(), response["ETag"]

        try:
            return sync(self.fs.loop, get)
        except Exception as exc:  # noqa: BLE001 - classified below
            if _not_found(exc):
                return None
            raise

    def _call(self, method: str, **kwargs: Any) -> Any:
        return sync(self.fs.loop, self.fs._call_s3, method, **kwargs)

    def create(self, path: str, data: bytes) -> str | None:
        bucket, key, _ = self.fs.split_path(path)
        out = self._conditional(path, lambda: self._call("put_object", Bucket=bucket, Key=key, Body=data,
                                                           IfNoneMatch="*"))
        return None if out is None else out["ETag"]

    def _replace(self, path: str, data: bytes, tag: str) -> str | None:
        bucket, key, _ = self.fs.split_path(path)
        out = self._conditional(path, lambda: self._call("put_object", Bucket=bucket, Key=key, Body=data,
                                                           IfMatch=tag))
        return None if out is None else out["ETag"]

    def _delete(self, path: str, tag: str) -> bool:
        bucket, key, _ = self.fs.split_path(path)
        return self._conditional(path, lambda: self._call("delete_object", Bucket=bucket, Key=key,
                                                          IfMatch=tag)) is not None


class GCSLeaseObjects(_ObjectStoreLeaseObjects):
    """GCS: `ifGenerationMatch=0` to create, the generation to renew and delete. The Python GCS
    emulator ignores these preconditions, so there only the read-and-compare step protects; see
    docs/identity.md."""

    def read(self, path: str) -> tuple[bytes, str] | None:
        for _ in range(5):
            try:
                before = self.fs.info(path, refresh=True)["generation"]
                data = self.fs.cat_file(path)
                after = self.fs.info(path, refresh=True)["generation"]
            except FileNotFoundError:
                return None
            finally:
                self.fs.invalidate_cache(path)
            if before == after:  # nobody replaced it between the two looks
                return data, str(after)
        raise ArtifactLockedError(f"gs://{path}: the lease kept changing while it was read")

    def _upload(self, path: str, data: bytes, generation: str) -> str | None:
        from urllib.parse import quote

        bucket, key, _ = self.fs.split_path(path)
        out = self._conditional(path, lambda: self.fs.call(
            "POST", f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o", uploadType="media", name=key,
            ifGenerationMatch=generation, data=data, headers={"Content-Type": "application/octet-stream"},
            json_out=True))
        return None if out is None else str(out["generation"])

    def create(self, path: str, data: bytes) -> str | None:
        if self.read(path) is not None:  # what the emulator needs; real GCS refuses by precondition
            return None
        return self._upload(path, data, "0")

    def _replace(self, path: str, data: bytes, tag: str) -> str | None:
        return self._upload(path, data, tag)

    def _delete(self, path: str, tag: str) -> bool:
        bucket, key, _ = self.fs.split_path(path)
        return self._conditional(path, lambda: self.fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=tag),
                                 absent_ok=True) is not None


def lease_objects_for(fs: Any) -> LeaseObjects:
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & {"file", "local"}:
        return LocalLeaseObjects()
    if protocols & {"s3", "s3a"}:
        return S3LeaseObjects(fs)
    if protocols & {"gs", "gcs"}:
        return GCSLeaseObjects(fs)
    raise ValueError(f"artifact leases need local disk, s3:// or gs://, not {sorted(protocols)}: "
                     "no conditional writes to build mutual exclusion on")


@dataclass
class Lease:
    """A held lease: where it is, what it says, and the tag of the version this writer wrote."""

    objects: LeaseObjects
    path: str
    body: dict[str, Any]
    tag: str
    heartbeat_s: float
    lost: str | None = None
    _mutex: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def renew(self) -> bool:
        """Extend the lease if it is still ours; records and returns False once it is lost."""
        with self._mutex:
            if self.lost is not None:
                return False
            body = {**self.body, "renewed": time.time()}
            tag = self.objects.replace(self.path, json.dumps(body).encode(), self.tag)
            if tag is None:
                holder = read_lease(self.objects, self.path)
                self.lost = (f"its lease was taken over by run {holder[0].get('run_id')} (host {holder[0].get('host')})"
                             if holder else "its lease was removed")
                return False
            self.body, self.tag = body, tag
            return True

    def start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    if not self.renew():
                        return
                except Exception:  # noqa: BLE001 - a transient store error: the next beat tries again
                    continue

        self._thread = threading.Thread(target=beat, name=f"lease-heartbeat {self.path}", daemon=True)
        self._thread.start()

    def confirm(self, uri: str) -> None:
        """Raise unless this writer still holds the lease (checked by a renewal, so it is also extended)."""
        if not self.renew():
            raise ArtifactLockedError(f"{uri}: not committing, {self.lost}")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._mutex:
            if self.lost is None:
                self.objects.delete(self.path, self.tag)  # a lease that is no longer ours stays


def read_lease(objects: LeaseObjects, path: str) -> tuple[dict[str, Any], str] | None:
    current = objects.read(path)
    if current is None:
        return None
    data, tag = current
    try:
        body = json.loads(data)
    except json.JSONDecodeError:
        body = {}  # unreadable (never renewed): stale
    return (body if isinstance(body, dict) else {}), tag


def lease_body(run_id: str) -> dict[str, Any]:
    now = time.time()
    return {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(), "created": now, "renewed": now,
            "token": uuid.uuid4().hex}


def is_stale(body: dict[str, Any], timeout_s: float) -> bool:
    """Not renewed within the timeout (any host), or written by a process of this host that is gone."""
    if time.time() - float(body.get("renewed", body.get("created", 0))) > timeout_s:
        return True
    if body.get("host") == socket.gethostname():
        try:
            os.kill(int(body["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError):
            return False
    return False


def acquire(objects: LeaseObjects, path: str, run_id: str, *, where: str, heartbeat_s: float,
            timeout_s: float) -> Lease:
    """Take the lease at `path` (a live holder raises ArtifactLockedError) and start its heartbeat."""
    for _ in range(3):
        body = lease_body(run_id)
        data = json.dumps(body).encode()
        holder = read_lease(objects, path)
        if holder is None:
            tag = objects.create(path, data)
        elif is_stale(holder[0], timeout_s):
            tag = objects.replace(path, data, holder[1])  # of two writers taking over, one wins
        else:
            held = holder[0]
            age = time.time() - float(held.get("renewed", held.get("created", 0)))
            raise ArtifactLockedError(
                f"{where} is being written by run {held.get('run_id')} (host {held.get('host')}, "
                f"pid {held.get('pid')}, renewed {age:.0f}s ago); retry when it finishes, or after "
                f"{timeout_s:.0f}s without renewal")
        if tag is not None:
            lease = Lease(objects, path, body, tag, heartbeat_s)
            lease.start_heartbeat()
            return lease
    raise ArtifactLockedError(f"{where}: could not take the lease, other writers kept taking it first")
