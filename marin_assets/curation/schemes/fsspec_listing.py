"""An fsspec listing turned into `FileRef`s: globs, paths relative to the source root, archives, and
the checksum or modification time each entry is identified by. Shared by the schemes that list
through fsspec (files, pypi-sdist, hf)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from marin_assets.curation.content_hashes import MTIME_KEYS, content_checksum, info_str
from marin_assets.curation.listed_files import FileRef
from marin_assets.curation.schemes.base import GLOB_CHARS

_ARCHIVE_SUFFIXES = {
    ".tar": "tar",
    ".tar.gz": "tar",
    ".tgz": "tar",
    ".tar.bz2": "tar",
    ".tar.xz": "tar",
    ".zip": "zip",
}
# Tags that change with more than the content (a tar header's checksum covers its mtime, GCS's etag
# its metadata): used only when a listing has nothing better, together with the mtime.
_WEAK_TAG_KEYS = ("etag", "chksum")


def archive_protocol(path: str) -> str | None:
    """fsspec's protocol for reading the archive at ``path`` as its members, by its name; None if none."""
    lower = path.lower()
    for suffix, protocol in _ARCHIVE_SUFFIXES.items():
        if lower.endswith(suffix):
            return protocol
    return None


def glob_root(path: str) -> str:
    """The directory part of ``path`` before its first glob component."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if GLOB_CHARS.search(part):
            return "/".join(parts[:i])
    return "/".join(parts[:-1])


def relative(path: str, root: str) -> str:
    root = root.rstrip("/")
    if root and path.startswith(root + "/"):
        return path[len(root) + 1 :]
    return path.lstrip("/")


def listed_file(uri: str, relpath: str, info: Mapping[str, Any], etag: str | None = None) -> FileRef:
    """A file as its listing describes it. With a content checksum kept by the store, that checksum
    is its identity and the mtime is left out: a file uploaded again without a change is the same
    file. Otherwise the mtime and the given tag (an archive's hash for its members), or a weaker
    one, stand in."""
    size = info.get("size")
    checksum = None if etag else content_checksum(info)
    return FileRef(
        uri=uri,
        relpath=relpath,
        size=int(size) if size is not None else None,
        mtime=None if checksum else info_str(info, MTIME_KEYS),
        etag=etag or checksum or info_str(info, _WEAK_TAG_KEYS),
    )


def glob_files(fs, path: str) -> dict[str, Mapping[str, Any]]:
    """The entries (not directories) that ``path`` names on ``fs``: a glob's matches, a directory's
    files, or the one file."""
    if GLOB_CHARS.search(path):
        found = fs.glob(path, detail=True)
    elif fs.isdir(path):
        found = fs.find(path, detail=True)
    else:
        found = {path: fs.info(path)}
    return {p: info for p, info in found.items() if info.get("type", "file") != "directory"}
