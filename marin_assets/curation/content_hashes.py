"""What identifies a file's content: the sha256 of a local file (cached by its stat), the checksum a
store keeps in its listing, and a local file opened without ever waiting on a FIFO."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from marin_assets.curation.local_cache import cache_dir

MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "date_time", "modified")
# Checksums of the content that stores keep, strongest first: S3's additional checksums and ETag
# (an MD5, or an MD5 of part MD5s for multipart uploads), GCS's md5Hash and crc32c (composite objects
# have only crc32c; GCS's `etag` changes with metadata, so it is not one), a zip member's CRC-32,
# git's blob sha (github://, git://), an LFS pointer's oid.
_CONTENT_CHECKSUM_KEYS = ("ChecksumSHA256", "ChecksumSHA1", "ChecksumCRC64NVME", "ChecksumCRC32C", "ChecksumCRC32",
                          "md5Hash", "crc32c", "ETag", "CRC", "sha", "blob_id", "lfs")
_QUOTE = '"'  # S3 quotes its ETags
_PREFETCH_CHUNK = 900  # SQLite's default limit on a statement's variables is 999 in older builds


def info_str(info: Mapping[str, Any], keys: tuple[str, ...]) -> str | None:
    """The first of ``keys`` that a listing entry holds, as text."""
    for key in keys:
        value = info.get(key)
        if value not in (None, ""):
            return str(value)
    return None


def content_checksum(info: Mapping[str, Any]) -> str | None:
    """`<key>:<value>` of the strongest content checksum in a listing entry, or None."""
    for key in _CONTENT_CHECKSUM_KEYS:
        value = info.get(key)
        if value not in (None, ""):
            return f"{key}:{str(value).strip(_QUOTE)}"
    return None


class NotARegularFileError(OSError):
    """A FIFO, socket or device where a file was expected."""


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return f"not a regular file (mode {oct(mode)})"


def open_regular(path: str | Path) -> BinaryIO:
    """A local regular file opened for reading, never a wait: with O_NONBLOCK opening a FIFO returns at
    once instead of waiting for a writer, and anything but a regular file (a FIFO, socket or device
    put in the file's place since it was listed) is refused before a byte is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFileError(f"{os.fsdecode(path)} is {file_kind(mode)}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def stat_stamp(path: str) -> tuple[int, int, int, int]:
    """(size, mtime_ns, ctime_ns, inode): what changes when a local file is rewritten."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


class ContentHashCache:
    """sha256 of local files, kept in SQLite under :func:`cache_dir` and keyed by path and
    (size, mtime_ns, ctime_ns, inode): an unchanged file costs one ``stat``, and a rewrite that
    keeps size and mtime still changes ctime (which no user call can set back), so it is re-hashed."""

    def __init__(self, path: Path | None = None):
        import sqlite3

        path = path or cache_dir() / "content-sha256.sqlite"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, timeout=60)
        self.db.execute("CREATE TABLE IF NOT EXISTS hashes (path BLOB PRIMARY KEY, size INTEGER, "
                        "mtime_ns INTEGER, ctime_ns INTEGER, inode INTEGER, sha256 TEXT)")
        self._prefetched: dict[bytes, tuple | None] = {}  # path -> its row as `prefetch` read it

    def prefetch(self, paths) -> None:
        """Read the rows of ``paths`` (local paths) in a few queries: `sha256` then looks them up in
        memory, checked against the file's stat as ever (a listing's 75,000 files cost 75,000
        queries otherwise)."""
        keys = [os.fsencode(p) for p in paths]
        for i in range(0, len(keys), _PREFETCH_CHUNK):
            chunk = keys[i:i + _PREFETCH_CHUNK]
            rows = self.db.execute("SELECT path, size, mtime_ns, ctime_ns, inode, sha256 FROM hashes WHERE path IN "
                                   f"({','.join('?' * len(chunk))})", chunk).fetchall()
            self._prefetched.update({row[0]: row[1:] for row in rows})
            self._prefetched.update({key: None for key in chunk if key not in self._prefetched})

    def __enter__(self) -> ContentHashCache:
        return self

    def __exit__(self, *exc) -> None:
        self.db.commit()
        self.db.close()

    def sha256_of_remote(self, fs, path: str, uri: str, size: int | None, mtime: str | None) -> str:
        """sha256 of a file on a filesystem that keeps no checksum, keyed by its URI, size and
        modification time (there is no ctime or inode to add): unchanged, it is read once."""
        key = b"remote:" + uri.encode("utf-8", "surrogateescape")
        stamp = (-1 if size is None else int(size), str(mtime or ""))
        row = self.db.execute("SELECT size, mtime_ns, sha256 FROM hashes WHERE path = ?", (key,)).fetchone()
        if row is not None and mtime is not None and (row[0], row[1]) == stamp:
            return row[2]
        digest = hashlib.sha256()
        with fs.open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
        if mtime is not None:  # without a modification time a cached hash could never be trusted
            self.db.execute("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, NULL, NULL, ?)", (key, *stamp,
                                                                                            digest.hexdigest()))
        return digest.hexdigest()

    def sha256_of_listed(self, fs, path: str, uri: str, info: Mapping[str, Any]) -> str:
        """`sha256_of_remote` of a file as its listing entry (``info``) gives its size and modification time."""
        return self.sha256_of_remote(fs, path, uri, info.get("size"), info_str(info, MTIME_KEYS))

    def sha256(self, path: str) -> str:
        stamp, key = stat_stamp(path), os.fsencode(path)  # bytes: a file name need not be UTF-8
        if key in self._prefetched:
            row = self._prefetched.pop(key)
        else:
            row = self.db.execute("SELECT size, mtime_ns, ctime_ns, inode, sha256 FROM hashes WHERE path = ?",
                                  (key,)).fetchone()
        if row is not None and tuple(row[:4]) == stamp:
            return row[4]
        digest = sha256_file(path)
        if stat_stamp(path) == stamp:  # not rewritten while we read it
            self.db.execute("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?, ?)", (key, *stamp, digest))
        return digest
