"""An fsspec listing turned into `FileRef`s: globs, paths relative to the source root, archives, and
the checksum or modification time each entry is identified by. Shared by the schemes that list
through fsspec (files, pypi-sdist, hf)."""

from __future__ import annotations

import stat
import tarfile
from collections.abc import Mapping
from typing import Any

from marin_assets.curation.content_hashes import MTIME_KEYS, content_checksum, file_kind, info_str
from marin_assets.curation.listed_files import BROKEN_LINK, NOT_A_REGULAR_FILE, OUTSIDE_ROOT, FileRef, refusal
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


def archive_members(afs) -> dict[str, str | None]:
    """Every member of an archive (fsspec's tar or zip filesystem of it) that is not a directory, by its
    name, with why it is not read (`FileRef.refused`), or None: a name that is absolute or climbs out
    with ``..`` (``outside_root``), a symbolic link, FIFO or device (``not_a_regular_file``), a hard
    link to no regular member before it (``broken_link``). Read from the archive's own index, not
    fsspec's walk, which never ends on an absolute name."""
    from fsspec.implementations.tar import TarFileSystem

    return _tar_members(afs.tar) if isinstance(afs, TarFileSystem) else _zip_members(afs.zip)


def _unsafe_name(name: str) -> str | None:
    if name.startswith("/") or ".." in name.split("/"):
        return refusal(OUTSIDE_ROOT, f"member name {name!r} leads out of the archive; never read")
    return None


_TAR_KINDS = {tarfile.SYMTYPE: "a symbolic link", tarfile.FIFOTYPE: "a FIFO", tarfile.CHRTYPE: "a character device",
              tarfile.BLKTYPE: "a block device"}


def _tar_members(tar: tarfile.TarFile) -> dict[str, str | None]:
    members: dict[str, str | None] = {}
    regular: set[str] = set()  # a hard link names a regular member before it
    for info in tar.getmembers():
        name = info.name.rstrip("/")
        if info.isdir():
            continue
        refused = _unsafe_name(name)
        if refused is None and info.islnk() and info.linkname.rstrip("/") not in regular:
            refused = refusal(BROKEN_LINK, f"hard link to {info.linkname!r}, not a regular file before it in the "
                                           "archive; never read")
        elif refused is None and not info.isreg() and not info.islnk():
            kind = _TAR_KINDS.get(info.type, f"a member of tar type {info.type!r}")
            target = f" to {info.linkname!r}" if info.issym() else ""
            refused = refusal(NOT_A_REGULAR_FILE, f"{kind}{target} in the archive; never read")
        members[name] = refused  # a name repeated: the last is the one read
        if refused is None:
            regular.add(name)
        else:
            regular.discard(name)
    return members


def _zip_members(zf) -> dict[str, str | None]:
    members: dict[str, str | None] = {}
    for info in zf.infolist():
        name = info.filename.rstrip("/")
        if info.is_dir():
            continue
        mode = info.external_attr >> 16  # the Unix mode, for an archive made on Unix
        odd = info.create_system == 3 and stat.S_IFMT(mode) and not stat.S_ISREG(mode)
        kind = "a symbolic link" if odd and stat.S_ISLNK(mode) else file_kind(mode) if odd else None
        members[name] = _unsafe_name(name) or (
            None if kind is None else refusal(NOT_A_REGULAR_FILE, f"{kind} in the archive; never read"))
    return members
