"""Opening listed files for reading: any URI through its scheme, and the members of a tarball read in
one pass instead of one decompression each."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Mapping
from typing import BinaryIO

from marin_assets.curation.schemes.registry import scheme_of
from marin_assets.curation.schemes.urls import archive_link, open_url, url_name


def prefetch_tar_members(uris: list[str], expected_sha256: str | None = None) -> dict[str, bytes]:
    """Raw bytes of every tar-member URI in ``uris``, reading each archive once.

    A compressed tarball has no index: opening members one by one re-inflates
    the archive from the start each time, so a shard of N members would cost
    N full decompressions. Streaming the archive once costs one.
    """
    import tarfile

    wanted: dict[str, dict[str, str]] = {}  # archive url -> member -> original uri
    for uri in uris:
        link = archive_link(scheme_of(uri).resolve_url(uri, expected_sha256))
        if link is not None and link.protocol == "tar":
            wanted.setdefault(link.archive, {})[link.member] = uri
    found: dict[str, bytes] = {}
    for target, members in wanted.items():
        with open_url(target, decompress=False) as raw, tarfile.open(fileobj=raw, mode="r|*") as tar:
            for info in tar:
                name = info.name.rstrip("/")  # as the archive's index names it: "/etc/x" is not "etc/x"
                if name in members and info.isfile():
                    extracted = tar.extractfile(info)
                    if extracted is not None:
                        found[members[name]] = extracted.read()
                        del members[name]
                        if not members:
                            break
    return found


@contextlib.contextmanager
def open_binary(
    uri: str,
    expected_sha256: str | None = None,
    prefetched: Mapping[str, bytes] | None = None,
    decompress: bool = True,
) -> Iterator[BinaryIO]:
    """Open a FileRef URI for reading, decompressing .gz/.bz2/.zst/... by name.

    ``prefetched`` holds raw bytes from :func:`prefetch_tar_members`; with
    ``decompress=False`` the stored bytes come back as they are (for copying a
    file verbatim).
    """
    from fsspec.compression import compr
    from fsspec.utils import infer_compression

    if prefetched is not None and uri in prefetched:
        buffer: BinaryIO = io.BytesIO(prefetched[uri])
        codec = infer_compression(url_name(uri)) if decompress else None
        if codec is not None:
            buffer = compr[codec](buffer, mode="rb")
        try:
            yield buffer
        finally:
            buffer.close()
        return
    with scheme_of(uri).open(uri, expected_sha256, decompress) as f:
        yield f
