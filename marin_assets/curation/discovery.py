"""Discovery: a source's files listed through its URI scheme and grouped into shards, the unit of
work (one Dagster partition each), with big JSONL and Parquet files cut into byte ranges.

Discovery (:func:`discover_shards`) is deterministic and incremental: see
:func:`group_into_shards` for why adding a file never changes which files
an existing shard holds, beyond the single shard the new file lands in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from marin_assets.curation.config import DEFAULT_BYTES_PER_SHARD, SourceConfig
from marin_assets.curation.formats import record_layout
from marin_assets.curation.listed_files import FileRef
from marin_assets.curation.schemes.registry import scheme_of
from marin_resources.storage.identity import validate_partition_key

# A shard may grow to this many times bytes_per_shard before a file is forced to start the next one.
MAX_SHARD_FACTOR = 2
_KEY_MAX_READABLE = 80


def list_source_files(source: SourceConfig, excluded: tuple[str, ...] = ()) -> list[FileRef]:
    """Every file (or archive member, or virtual file) of a source, sorted by relpath; none under an
    ``excluded`` prefix (the store's: a store inside the data folder is not data)."""
    return sorted(scheme_of(source.uri).list_files(source, excluded), key=lambda r: r.relpath)


def _open_raw(uri: str) -> contextlib.AbstractContextManager[BinaryIO]:
    """A listed file's bytes as stored, through its scheme."""
    return scheme_of(uri).open(uri, None, decompress=False)


@dataclass(frozen=True)
class Shard:
    source: str
    key: str  # path-safe, stable, unique within the source
    files: tuple[FileRef, ...]

    @functools.cached_property
    def fingerprint(self) -> str:
        """Changes when any member file's uri, size, mtime, checksum or refusal changes. Computed once
        a shard: a listing's 75,000 shards each asked several times took seconds."""
        # A whole file's entry leaves out its (absent) range, so whole-file shards keep their fingerprints.
        # FileRef's fields are flat (byte_range a tuple of ints), so its field values are its astuple.
        payload = json.dumps([_field_values(f)[:-1] if f.byte_range is None else _field_values(f)
                              for f in self.files], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


_FILE_REF_FIELDS = tuple(f.name for f in dataclasses.fields(FileRef))


def _field_values(ref: FileRef) -> tuple:
    return tuple(getattr(ref, name) for name in _FILE_REF_FIELDS)


def _unit_hash(text: str) -> float:
    """Stable uniform value in [0, 1) derived from ``text``."""
    # surrogateescape: a file name that is not valid UTF-8 arrives with lone surrogates.
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()[:8], "big") / 2**64


_PLAIN_RELPATH = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=/-]*$")
_KEY_DIGEST_CHARS = 8
_HASHED_KEY_END = re.compile(rf"-[0-9a-f]{{{_KEY_DIGEST_CHARS}}}$")


def shard_key(relpath: str) -> str:
    """Readable, path-safe and unique key for the shard starting at ``relpath``.

    Ordinary paths map one-to-one by writing ``/`` as ``+`` (``httpx/LICENSE.md`` ->
    ``httpx+LICENSE.md``), so keys and storage paths carry no hashes. Any other path (spaces,
    ``+``, ``..`` as in ``report..final.txt``, non-ASCII, over 80 characters, or one that itself
    ends like a hashed key) is sanitised to letters, digits and single dots and gets a short hash
    of the exact path appended: sanitising may map two paths to the same text, the hash keeps
    them apart, and no ordinary key ends in ``-<8 hex digits>``. Every key passes
    :func:`validate_partition_key`, so no file name can make the store refuse its shard.
    """
    if _PLAIN_RELPATH.match(relpath) and "//" not in relpath and ".." not in relpath \
            and len(relpath) <= _KEY_MAX_READABLE and not _HASHED_KEY_END.search(relpath):
        return validate_partition_key(relpath.rstrip("/").replace("/", "+"))
    readable = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "_", relpath))
    readable = (readable.strip("._-") or "file")[:_KEY_MAX_READABLE]
    digest = hashlib.sha256(relpath.encode("utf-8", "surrogateescape")).hexdigest()[:_KEY_DIGEST_CHARS]
    return validate_partition_key(f"{readable}-{digest}")


def group_into_shards(source_name: str, files: list[FileRef], files_per_shard: int | None = None,
                      bytes_per_shard: int | None = DEFAULT_BYTES_PER_SHARD) -> list[Shard]:
    """Group sorted files into shards with content-defined boundaries.

    A file *starts* a new shard when a stable hash of its relative path falls below
    ``size / bytes_per_shard`` (or ``1 / files_per_shard``), so boundaries depend only on each
    file itself, never on its position or on how many files exist, and shards hold about
    ``bytes_per_shard`` bytes on average. Adding a file therefore either joins the shard that
    precedes it in sorted order or splits that one shard; every other shard keeps exactly its
    files and its key (the first file's path).

    By bytes, a shard is also cut where the next file would take it past ``MAX_SHARD_FACTOR``
    times the target, so no partition's input is unbounded by chance (a file bigger than the
    target stands alone). Such a cut depends on
    the files since the last content-defined boundary only, so an insertion still changes only
    the shards between its two neighbouring boundaries.
    """
    if files_per_shard is None and bytes_per_shard is None:
        raise ValueError("group_into_shards needs files_per_shard or bytes_per_shard")
    shards: list[list[FileRef]] = []
    shard_bytes = 0
    after_range = False
    for ref in files:
        size = ref.size or 0
        if ref.byte_range is not None or after_range:  # a range of a split file is a shard of its own
            starts = True
        elif files_per_shard is not None:
            starts = _unit_hash(ref.relpath) < 1.0 / files_per_shard
        else:
            starts = (_unit_hash(ref.relpath) < size / bytes_per_shard
                      or (shard_bytes > 0 and shard_bytes + size > MAX_SHARD_FACTOR * bytes_per_shard))
        if not shards or starts:
            shards.append([ref])
            shard_bytes = size
        else:
            shards[-1].append(ref)
            shard_bytes += size
        after_range = ref.byte_range is not None
    return [Shard(source=source_name, key=shard_key(group[0].shard_path), files=tuple(group)) for group in shards]


def split_large_files(source: SourceConfig, files: list[FileRef]) -> list[FileRef]:
    """Each JSONL or Parquet file over twice ``bytes_per_shard`` becomes byte ranges of about that size.

    A range holds the records that *start* inside it: the lines of uncompressed JSONL
    (:func:`line_range_chunks`; ranges at fixed offsets, so listing needs no scan and a file that
    grows keeps its earlier ranges' keys), or the row groups of Parquet (ranges cut at row-group
    starts read from the footer). Together the ranges read every record exactly once. A changed
    file changes every range's fingerprint (they share its checksum) and all are read again.
    """
    from fsspec.utils import infer_compression

    target = source.bytes_per_shard
    if target is None:
        return files
    split = []
    for ref in files:
        fmt = record_layout(source.format, ref.relpath)
        if not (ref.refused is None and ref.size and ref.size > MAX_SHARD_FACTOR * target
                and scheme_of(ref.uri).splits_by_byte_range(ref.uri) and infer_compression(ref.relpath) is None
                and fmt in ("jsonl", "parquet")):
            split.append(ref)
            continue
        if fmt == "jsonl":
            cuts = list(range(0, ref.size, target))
        else:
            cuts = []
            for offset in _row_group_starts(ref.uri):
                if not cuts or offset - cuts[-1] >= target:
                    cuts.append(offset)
            cuts[0] = 0  # the leading magic bytes belong to the first range
        bounds = [*cuts, ref.size]
        split.extend(dataclasses.replace(ref, byte_range=(a, b)) for a, b in zip(bounds, bounds[1:]))
    return split


def _row_group_starts(uri: str) -> list[int]:
    """Byte offset of each row group's first column chunk, from the Parquet footer."""
    import pyarrow.parquet as pq

    with _open_raw(uri) as f:
        meta = pq.ParquetFile(f).metadata
        starts = []
        for i in range(meta.num_row_groups):
            col = meta.row_group(i).column(0)
            starts.append(col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset)
        return starts


def byte_range_chunks(uri: str, fmt: str, start: int, end: int) -> Iterator[bytes]:
    """A stand-alone file of the records that start in bytes ``[start, end)`` (see split_large_files), in
    pieces: a JSONL range streams (`line_range_chunks`), a Parquet range is its row groups rewritten."""
    if fmt == "jsonl":
        yield from line_range_chunks(uri, start, end)
        return
    import pyarrow.parquet as pq

    starts = _row_group_starts(uri)
    wanted = [i for i, offset in enumerate(starts) if start <= offset < end]
    with _open_raw(uri) as f:
        table = pq.ParquetFile(f).read_row_groups(wanted)
    out = io.BytesIO()
    pq.write_table(table, out)
    yield out.getvalue()


def line_range_chunks(uri: str, start: int, end: int, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a file that start in bytes ``[start, end)``, each whole (the last may run past end), in
    pieces of at most ``chunk_bytes``: a line of any length costs one piece of memory, in the range it
    starts in and in each range it runs through (read to its end, a piece at a time, and skipped)."""
    with _open_raw(uri) as f:
        pos = start
        if start > 0:
            # The rest of the line that started before ``start`` belongs to the range before.
            pos = start - 1
            f.seek(pos)
            while True:
                chunk = f.read(chunk_bytes)
                if not chunk:
                    return
                newline = chunk.find(b"\n")
                if newline >= 0:
                    pos += newline + 1
                    f.seek(pos)
                    break
                pos += len(chunk)
        if pos >= end:
            return
        # From a line start: everything up to the first newline at end - 1 or later, after which the
        # next line starts at ``end`` or later.
        while True:
            chunk = f.read(chunk_bytes)
            if not chunk:
                return
            newline = chunk.find(b"\n", max(0, end - 1 - pos))
            if newline >= 0:
                yield chunk[:newline + 1]
                return
            yield chunk
            pos += len(chunk)


def discover_shards(source: SourceConfig, excluded: tuple[str, ...] = ()) -> list[Shard]:
    """List a source's files deterministically (none under ``excluded``) and group them into shards."""
    files = split_large_files(source, list_source_files(source, excluded))
    return group_into_shards(source.name, files, source.files_per_shard, source.bytes_per_shard)
