"""What every URI scheme of a source does: the operations discovery, copying and reading ask of it."""

from __future__ import annotations

import contextlib
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from marin_assets.curation.listed_files import FileRef
from marin_assets.curation.schemes.urls import archive_link, member_url, open_url, url_protocol
from marin_resources.typed_config import ConfigError

GLOB_CHARS = re.compile(r"[*?\[]")


class SourceUriError(ConfigError):
    """A source URI its scheme refuses (bad syntax, a bad pin file) or whose scheme is unknown: one line."""


class ListedSource(Protocol):
    """The fields of a source (`config.SourceConfig`) that a scheme reads."""

    @property
    def name(self) -> str: ...
    @property
    def uri(self) -> str: ...
    @property
    def sha256(self) -> str | None: ...
    @property
    def expand_archives(self) -> bool: ...
    @property
    def follow_symlinks(self) -> bool: ...


@dataclass(frozen=True)
class FileState:
    """What says a listed file is unchanged, taken before and after each read of its copy."""

    size: int | None
    # A local file's (mtime_ns, ctime_ns, inode); None for a store object.
    stat: tuple[int, int, int] | None = None
    # A store object's content checksum, or its modification time where the store keeps none.
    store_tag: str | None = None


class UriScheme(Protocol):
    """One URI scheme. ``name`` is the prefix before ``://`` (the files scheme takes plain paths and
    every fsspec protocol)."""

    name: str

    def declared_uri(self, uri: str, base_dir: Path, where: str) -> str:
        """``uri`` as a sources file at ``base_dir`` declares it, made absolute and checked at load."""
        ...

    def identity_uri(self, uri: str) -> str:
        """What of a declared ``uri`` names the data, as the source's identity records it: never where
        this checkout or a file of it happens to sit."""
        ...

    def is_pinned(self, source: ListedSource) -> bool:
        """Whether nothing the source reads can vary: what a quality classifier may train on."""
        ...

    def pinned_sha256(self, source: ListedSource) -> str | None:
        """The sha256 of a pinned source's bytes now, to compare with its ``sha256``; None where the
        scheme checks the pin itself."""
        ...

    def list_files(self, source: ListedSource, excluded: tuple[str, ...] = ()) -> list[FileRef]:
        """Every file (or archive member, or virtual file) of a source, in any order; none under
        ``excluded`` (store prefixes, local paths or URLs: a store is never its own data)."""
        ...

    def resolve_url(self, uri: str, expected_sha256: str | None) -> str:
        """The fsspec URL that reads a listed file's URI (a virtual file's URI itself)."""
        ...

    def open(self, uri: str, expected_sha256: str | None, decompress: bool) -> contextlib.AbstractContextManager[
            BinaryIO]:
        """A listed file opened for reading, decompressed by its name unless ``decompress`` is false."""
        ...

    def open_stored(self, uri: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A listed file exactly as stored (archives opened, compression kept), for copying it."""
        ...

    def splits_by_byte_range(self, uri: str) -> bool:
        """Whether a big file may be read as byte ranges (a random-access file, not a member or a
        virtual file)."""
        ...

    def file_state(self, uri: str) -> FileState | None:
        """The state of a listed file before and after a read, None for what cannot change under a
        reader (a pinned or installed file, a file at a commit, an archive member)."""
        ...


def absolute_uri(uri: str, base_dir: Path) -> str:
    """A relative local path made absolute against ``base_dir`` (a sources file's directory); in a URL
    into an archive, its archive's. A path is never split at ``::`` (see `urls`)."""
    link = archive_link(uri)
    if link is not None:
        return member_url(link.protocol, link.member, absolute_uri(link.archive, base_dir))
    if url_protocol(uri) is not None:
        return uri
    path = Path(uri).expanduser()
    return str(path if path.is_absolute() else base_dir / path)


class ReadThroughFsspec:
    """``open`` and ``open_stored`` of a scheme whose files fsspec reads at its ``resolve_url(uri)``."""

    def identity_uri(self, uri: str) -> str:
        return uri  # the location is the data's name (a user's folder, a bucket, a repository)

    def open(self, uri: str, expected_sha256: str | None, decompress: bool) -> contextlib.AbstractContextManager[
            BinaryIO]:
        return open_url(self.resolve_url(uri, expected_sha256), decompress)

    def open_stored(self, uri: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return self.open(uri, None, decompress=False)


def is_pinned_file(source: ListedSource) -> bool:
    """One file (no glob) with its sha256: nothing else can vary."""
    return source.sha256 is not None and not GLOB_CHARS.search(source.uri)


def file_sha256(url: str) -> str:
    """The sha256 of the bytes at an fsspec URL, as stored."""
    with open_url(url, decompress=False) as fh:
        return hashlib.sha256(fh.read()).hexdigest()
