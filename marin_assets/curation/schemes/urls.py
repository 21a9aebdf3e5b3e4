"""URLs read as themselves: a path or a store key is never split at ``::``.

fsspec reads ``a::b`` as a chain of URLs (``a`` read from inside ``b``), so a file named ``File::Spec.txt``
beside one named ``File`` was read as ``File``. Here the only chains are into archives,
``tar://MEMBER::ARCHIVE`` or ``zip://MEMBER::ARCHIVE`` (:func:`member_url`): the first ``::`` ends the
member (one holding ``::`` or ``%`` is percent-escaped), and the archive is any URL or path, itself read
literally (or a URL into another archive). Every other URL or path, ``::`` and all, names one file.
"""

from __future__ import annotations

import contextlib
import re
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

ARCHIVE_PROTOCOLS = ("tar", "zip")
_SCHEME_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*$")


def url_protocol(url: str) -> str | None:
    """The protocol before ``://``, None for a path (a ``://`` later in it is part of a file name)."""
    prefix, sep, _ = url.partition("://")
    return prefix if sep and _SCHEME_NAME.match(prefix) else None


@dataclass(frozen=True)
class ArchiveLink:
    """A URL into an archive: ``member`` of the archive at ``archive``, read as ``protocol``."""

    protocol: str
    member: str
    archive: str


def archive_link(url: str) -> ArchiveLink | None:
    """The archive and member a ``tar://`` or ``zip://`` URL names, None for any other URL or path."""
    protocol = url_protocol(url)
    if protocol not in ARCHIVE_PROTOCOLS:
        return None
    member, sep, archive = url[len(protocol) + 3:].partition("::")
    if not sep:
        return None
    return ArchiveLink(protocol, urllib.parse.unquote(member) if "%" in member else member, archive)


def member_url(protocol: str, member: str, archive: str) -> str:
    """The URL of ``member`` in the archive at ``archive``; unchanged from fsspec's chain unless the
    member holds ``::`` (which would end it) or ``%`` (which would be read as an escape)."""
    if "::" in member or "%" in member:
        member = member.replace("%", "%25").replace(":", "%3A")
    return f"{protocol}://{member}::{archive}"


def url_name(url: str) -> str:
    """The name that says how a URL's bytes are compressed: a member's name, or the URL itself."""
    link = archive_link(url)
    return url if link is None else link.member


def url_filesystem(url: str, **options: Any):
    """fsspec's filesystem and path for a URL or path that is not into an archive, ``::`` kept
    (``fsspec.core.url_to_fs`` without its chaining)."""
    import fsspec

    protocol = url_protocol(url) or "file"
    cls = fsspec.get_filesystem_class(protocol)
    return fsspec.filesystem(protocol, **{**cls._get_kwargs_from_urls(url), **options}), cls._strip_protocol(url)


@contextlib.contextmanager
def opened_filesystem(url: str, **options: Any) -> Iterator[tuple[Any, str]]:
    """The filesystem and path of any URL: for a URL into an archive, the archive (opened literally,
    kept open until the context ends) and the member; ``options`` go to a store's filesystem."""
    import fsspec
    from fsspec.utils import infer_compression

    link = archive_link(url)
    if link is None:
        yield url_filesystem(url, **options)
        return
    with open_url(link.archive, decompress=False) as archive:
        cls = fsspec.get_filesystem_class(link.protocol)
        compression = {"compression": infer_compression(url_name(link.archive))} if link.protocol == "tar" else {}
        yield cls(fo=archive, skip_instance_cache=True, **compression), cls._strip_protocol(link.member)


@contextlib.contextmanager
def open_url(url: str, decompress: bool) -> Iterator[BinaryIO]:
    """A URL or path opened for reading as itself, decompressed by its name (.gz, .bz2, .zst, ...) or not."""
    from fsspec.compression import compr
    from fsspec.utils import infer_compression

    codec = infer_compression(url_name(url)) if decompress else None
    with opened_filesystem(url) as (fs, path), fs.open(path, "rb") as raw:
        if codec is None:
            yield raw
            return
        with compr[codec](raw, mode="rb") as decompressed:
            yield decompressed
