"""Copying a listed file into raw/: the bytes exactly as stored, hashed as they are written, and read
again when the file changed during the read."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from marin_assets.curation.config import SourceConfig
from marin_assets.curation.content_hashes import NotARegularFileError
from marin_assets.curation.discovery import byte_range_chunks
from marin_assets.curation.formats import record_layout
from marin_assets.curation.listed_files import CHANGED_DURING_READ, NOT_A_REGULAR_FILE, FileRef, refusal
from marin_assets.curation.schemes.registry import scheme_of

# Reads of a listed file before one during which it did not change is given up on (changed_during_read).
READ_TRIES = 3


@dataclass(frozen=True)
class CopiedFile:
    """What one read of a listed file stored: the sha256 and length of exactly the bytes written, and
    the file's checksum as the copy leaves it recorded (for a whole local file, that sha256)."""

    sha256: str
    bytes: int
    etag: str | None


def _file_chunks(ref: FileRef, source: SourceConfig, limit: int | None) -> Iterator[bytes]:
    """The file exactly as stored at the source (archives opened, compression kept), at most ``limit``
    bytes of it (its size when the read began: a file appended to faster than it is read still ends);
    a range of a split file is its records as a file of the same format."""
    if ref.byte_range is not None:
        yield from byte_range_chunks(ref.uri, record_layout(source.format, ref.relpath), *ref.byte_range)
        return
    with scheme_of(ref.uri).open_stored(ref.uri) as fh:
        left = limit
        while (left is None or left > 0) and (chunk := fh.read(1 << 20 if left is None else min(left, 1 << 20))):
            left = None if left is None else left - len(chunk)
            yield chunk


def copy_listed_file(ref: FileRef, source: SourceConfig,
                     open_copy: Callable[[], contextlib.AbstractContextManager[BinaryIO]],
                     tries: int = READ_TRIES) -> CopiedFile | str:
    """Copy one listed file through ``open_copy`` (opened afresh for each read), hashing the bytes as
    they are written, so the hash recorded is the hash of the copy. A read counts only if the file
    was the same before and after it (its scheme's ``file_state``) and, for a whole file, as long as
    the bytes read: a file that grows or is rewritten meanwhile is read again, up to ``tries`` times.
    Returns the copy, or the refusal (``changed_during_read``, ``not_a_regular_file``) of a file
    that never held still or turned into a FIFO since it was listed; then whatever ``open_copy``
    holds is partial and the caller removes it. A file removed since it was listed raises
    ``FileNotFoundError``: its shard fails, and the next listing no longer has it."""
    scheme = scheme_of(ref.uri)
    before = None
    for _ in range(tries):
        digest, size = hashlib.sha256(), 0
        try:
            before = scheme.file_state(ref.uri) if before is None else before
            limit = before.size if before is not None and isinstance(before.size, int) else None
            with open_copy() as out:
                for chunk in _file_chunks(ref, source, limit):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            after = scheme.file_state(ref.uri)
        except NotARegularFileError as exc:
            return refusal(NOT_A_REGULAR_FILE, f"{exc}, since it was listed; never read")
        if after == before and (after is None or ref.byte_range is not None or after.size == size):
            etag = ref.etag  # a range, a weak tag or what cannot change: as listed
            if ref.byte_range is None and (ref.etag is None or ref.etag.startswith("sha256:")):
                etag = f"sha256:{digest.hexdigest()}"
            elif ref.byte_range is None and after is not None and ref.mtime is None and after.stat is None:
                etag = after.store_tag  # the store's checksum of the object that was read
            return CopiedFile(sha256=digest.hexdigest(), bytes=size, etag=etag)
        before = after
    return refusal(CHANGED_DURING_READ, f"changed during each of {tries} reads (last read {size} bytes; "
                                        f"{ref.size} when listed)")
