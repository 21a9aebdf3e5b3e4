"""Paths and fsspec URLs: a local path (relative to the sources file), ``file://``, ``gs://``,
``s3://`` or any other fsspec protocol, optionally a glob, optionally chained into an archive
(``tar://texts/*.txt::file:///x.tar.gz``). A matched archive is read as its members.

A local file is identified by its sha256 (cached by its stat), a store object by the checksum the
store keeps (or, without one, the sha256 of its bytes, cached by modification time). Local files
that must not be read are listed as refused: a link out of the source root, a link to nothing, a
FIFO, socket or device, a file that cannot be opened.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from fsspec.implementations.local import LocalFileSystem

from marin_assets.curation.content_hashes import (
    MTIME_KEYS,
    ContentHashCache,
    NotARegularFileError,
    content_checksum,
    file_kind,
    info_str,
    open_regular,
    stat_stamp,
)
from marin_assets.curation.listed_files import (
    BROKEN_LINK,
    NOT_A_REGULAR_FILE,
    OUTSIDE_ROOT,
    UNREADABLE_FILE,
    FileRef,
    refusal,
)
from marin_assets.curation.schemes.base import (
    GLOB_CHARS,
    FileState,
    ListedSource,
    ReadThroughFsspec,
    absolute_uri,
    file_sha256,
    is_pinned_file,
)
from marin_assets.curation.schemes.fsspec_listing import (
    archive_members,
    archive_protocol,
    glob_files,
    glob_root,
    listed_file,
    relative,
)
from marin_assets.curation.schemes.hf import HF_SCHEME, use_hf_endpoint
from marin_assets.curation.schemes.urls import archive_link, member_url, opened_filesystem, url_filesystem, url_protocol

FILES_SCHEME = "files"  # not a URI prefix: the scheme of plain paths and of every fsspec protocol


def local_path(uri: str) -> str | None:
    """The path of a ``file://`` URI, None for any other URI."""
    return uri[len("file://"):] if uri.startswith("file://") else None


def _expand_archive(archive_uri: str, archive_relpath: str) -> list[FileRef]:
    """The members of the archive at ``archive_uri``, each a file; an odd one (see `archive_members`)
    refused with its reason."""
    protocol = archive_protocol(archive_uri)
    with opened_filesystem(member_url(protocol, "", archive_uri)) as (afs, _):
        members = archive_members(afs)
        infos = {m: afs.info(m) for m, refused in members.items() if refused is None}
    refs = []
    for m, refused in members.items():
        # An absolute name (refused) keeps its "/": "a.tar//etc/x" is not the member "etc/x".
        uri, relpath = member_url(protocol, m, archive_uri), f"{archive_relpath}/{m}"
        refs.append(listed_file(uri, relpath, infos[m]) if refused is None
                    else FileRef(uri=uri, relpath=relpath, refused=refused))
    return refs


def _outside_root(path: str, real_root: str, real_dirs: dict[str, str] | None = None) -> str | None:
    """Why ``path`` may not be read: it (or a directory link on its way) resolves outside ``real_root``
    (the source root, resolved). A link to nothing is left to `_local_refusal`: it says `broken_link`,
    the more useful cause. ``real_dirs`` keeps each directory resolved (a listing's 75,000 files
    share a few): a file that is no link resolves to its resolved directory and its name."""
    link = os.path.islink(path)
    if link and not os.path.exists(path):
        return None
    if link or real_dirs is None:
        real = os.path.realpath(path)
    else:
        folder, name = os.path.split(path)
        if folder not in real_dirs:
            real_dirs[folder] = os.path.realpath(folder)
        real = os.path.join(real_dirs[folder], name)
    if real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep):
        return None
    return refusal(OUTSIDE_ROOT, f"symlink resolves outside the source root {real_root} (to {real}); "
                                 "set follow_symlinks: true on the source to read it")


def _local_refusal(path: str) -> str | None:
    """Why a listed local path is not opened at all: a link to nothing, or not a regular file (a FIFO
    would hang the first read, a device may never end). Decided by ``stat`` alone."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.islink(path):
            raise  # removed since it was listed
        return refusal(BROKEN_LINK, f"symlink to {os.readlink(path)}, which does not exist")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return refusal(BROKEN_LINK, f"symlink to {os.readlink(path)}: {exc.strerror}")
        raise
    return None if stat.S_ISREG(mode) else refusal(NOT_A_REGULAR_FILE, f"{file_kind(mode)}; never opened")


def _directory_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


class SourceListingFileSystem(LocalFileSystem):
    """The local filesystem as a source's listing walks it. A directory it could not list is kept in
    ``unlisted`` with the error: fsspec's walk leaves it out without a word (its ``on_error`` reaches
    the top level only). An ``excluded`` directory (the store) is never entered, whatever path leads
    to it: it is known by its device and inode."""

    def __init__(self, excluded: tuple[str, ...] = (), **kwargs: Any):
        super().__init__(**kwargs)
        self.unlisted: dict[str, OSError] = {}
        self.excluded = {d for d in map(_directory_id, excluded) if d is not None}

    def ls(self, path: str, detail: bool = False, **kwargs: Any):
        try:
            entries = super().ls(path, detail=True, **kwargs)
        except FileNotFoundError:
            raise  # removed since it was seen: no longer part of the source
        except OSError as exc:
            self.unlisted[self._strip_protocol(path)] = exc
            raise
        if self.excluded:
            inodes = {ino for _, ino in self.excluded}
            entries = [e for e in entries if e["type"] != "directory" or e.get("ino") not in inodes
                       or _directory_id(e["name"]) not in self.excluded]
        return entries if detail else [e["name"] for e in entries]


def _under(url: str, prefixes: tuple[str, ...]) -> bool:
    return any(url == p or url.startswith(p.rstrip("/") + "/") for p in prefixes)


def list_files(source: ListedSource, excluded: tuple[str, ...] = ()) -> list[FileRef]:
    """Every file (or archive member) a path or fsspec URL names; a local directory that cannot be
    listed is one refused (``unreadable``) entry; nothing under an ``excluded`` prefix (a local path or
    a URL: the store, which may lie inside a source's folder) is listed."""
    uri = source.uri
    use_hf_endpoint()  # an archive on the Hub is chained into an hf:// URL
    link = archive_link(uri)
    refs = []
    with contextlib.ExitStack() as stack:
        # A long-lived process (a sensor) must see today's listing, through the credentials and
        # endpoint its environment names now: a fresh instance, not fsspec's cached one (an archive's
        # filesystem is made afresh each time).
        fs, path = stack.enter_context(opened_filesystem(uri, **({} if link else {"skip_instance_cache": True})))
        local = isinstance(fs, LocalFileSystem) and link is None
        if local:
            excluded_paths = tuple(LocalFileSystem._strip_protocol(p) for p in excluded
                                   if url_protocol(p) in (None, "file", "local"))
            walked = glob_root(path) if GLOB_CHARS.search(path) else path
            if _under(os.path.realpath(walked), tuple(map(os.path.realpath, excluded_paths))):
                return refs  # the source lies inside the store
            fs = SourceListingFileSystem(excluded_paths, skip_instance_cache=True)
        if link is not None:

            def rebuild(p: str) -> str:
                return member_url(link.protocol, p, link.archive)
        else:
            rebuild = fs.unstrip_protocol
        try:
            matches = glob_files(fs, path)
        except FileNotFoundError:
            raise FileNotFoundError(f"source {source.name!r}: {uri} does not exist") from None
        if not local and link is None:  # a store in the same bucket: its objects are listed, then left out
            protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
            stores = tuple(fs.unstrip_protocol(fs._strip_protocol(p)) for p in excluded if url_protocol(p) in protocols)
            matches = {p: info for p, info in matches.items() if not _under(rebuild(p), stores)}
        root = path.rstrip("/") if not GLOB_CHARS.search(path) and fs.isdir(path) else glob_root(path)
        for folder, exc in (fs.unlisted.items() if local else ()):  # its files would vanish without a word
            why = f"a directory that cannot be listed ({type(exc).__name__}: {exc.strerror or exc}); none of its " \
                  "files is read"
            refs.append(FileRef(uri=rebuild(folder), relpath=relative(folder, root) if folder != root else ".",
                                refused=refusal(UNREADABLE_FILE, why)))
        hashes = stack.enter_context(ContentHashCache())
        real_root = os.path.realpath(root or ".") if local else ""  # once a listing, not once a file
        real_dirs: dict[str, str] = {}
        if local:
            hashes.prefetch(matches)  # one query per thousand files, not one per file
        for p, info in matches.items():
            rel = relative(p, root)
            if local:
                try:
                    refused = None if source.follow_symlinks else _outside_root(p, real_root, real_dirs)
                    if refused is None and os.path.isdir(p):
                        continue  # a link to a directory: fsspec does not descend into it, nor do we
                    refused = refused or _local_refusal(p)
                    archive = refused is None and source.expand_archives and archive_protocol(p)
                    # Content identity: a touched file is the same file, a same-size rewrite is not.
                    etag = None if refused or archive else f"sha256:{hashes.sha256(p)}"
                except FileNotFoundError:
                    continue  # removed since it was listed: it is no longer part of the source
                except NotARegularFileError as exc:  # put in the file's place since it was listed
                    refused, etag = refusal(NOT_A_REGULAR_FILE, f"{exc}; never read"), None
                except OSError as exc:
                    refused, etag = refusal(UNREADABLE_FILE, f"{type(exc).__name__}: {exc.strerror}"), None
                if refused is not None:
                    refs.append(FileRef(uri=rebuild(p), relpath=rel, etag=f"symlink:{os.readlink(p)}"
                                        if os.path.islink(p) else None, refused=refused))
                elif archive:
                    refs.extend(_expand_archive(rebuild(p), rel))
                else:
                    refs.append(FileRef(uri=rebuild(p), relpath=rel, size=info.get("size"), etag=etag))
            elif info.get("type", "file") != "file":  # whatever a store lists that is not a file
                refs.append(FileRef(uri=rebuild(p), relpath=rel, refused=refusal(
                    NOT_A_REGULAR_FILE, f"listed as {info.get('type')!r}, not a file; never read")))
            elif source.expand_archives and link is None and archive_protocol(p):
                refs.extend(_expand_archive(rebuild(p), rel))
            elif content_checksum(info) is not None:
                refs.append(listed_file(rebuild(p), rel, info))
            else:
                # No checksum kept by the store (plain HTTP, an archive member, memory): hash the
                # bytes once, cached by URI, size and modification time.
                digest = hashes.sha256_of_listed(fs, p, rebuild(p), info)
                refs.append(FileRef(uri=rebuild(p), relpath=rel, size=info.get("size"), etag=f"sha256:{digest}"))
    return refs


@dataclass(frozen=True)
class FilesScheme(ReadThroughFsspec):
    """Local files and store objects: they may change at any time, so each read is checked."""

    name: str = FILES_SCHEME

    def declared_uri(self, uri: str, base_dir: Path, where: str) -> str:
        return absolute_uri(uri, base_dir)

    def is_pinned(self, source: ListedSource) -> bool:
        return is_pinned_file(source)

    def pinned_sha256(self, source: ListedSource) -> str | None:
        return file_sha256(self.resolve_url(source.uri, source.sha256))

    def list_files(self, source: ListedSource, excluded: tuple[str, ...] = ()) -> list[FileRef]:
        return list_files(source, excluded)

    def resolve_url(self, uri: str, expected_sha256: str | None) -> str:
        if f"{HF_SCHEME}://" in uri:  # an archive on the Hub
            use_hf_endpoint()
        return uri

    def open_stored(self, uri: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A local file by :func:`open_regular`, so a FIFO put in its place since listing is refused,
        not waited on."""
        path = local_path(uri)
        return open_regular(path) if path is not None else self.open(uri, None, decompress=False)

    def splits_by_byte_range(self, uri: str) -> bool:
        return archive_link(uri) is None and "://" in uri  # not an archive member

    def file_state(self, uri: str) -> FileState | None:
        """A local file's size, mtime, ctime and inode; a store object's size and checksum (or
        modification time); None for a member of an archive (whose reader sees one archive it opened)."""
        path = local_path(uri)
        if path is not None:
            size, *stamp = stat_stamp(path)
            return FileState(size=size, stat=tuple(stamp))
        if archive_link(uri) is not None:
            return None
        fs, path = url_filesystem(uri)
        fs.invalidate_cache(path)
        info = fs.info(path)
        return FileState(size=info.get("size"), store_tag=content_checksum(info) or info_str(info, MTIME_KEYS))


FILES = FilesScheme()
