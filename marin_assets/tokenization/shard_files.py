"""Write ranges of a 1-D zarr3 array stored in `sharding_indexed` shard files, holding one inner
chunk at a time rather than a whole shard file.

Levanter's jagged arrays keep up to 512 inner chunks (128 Mi tokens, up to 512 MB) in one shard
file. Writing part of a shard through tensorstore reads the whole existing file and builds the new
one in memory, so a cache writer's memory grew with the tail shard file until it was full (about
+400 MB for one full data shard; the tokenized step peaked at 1.4 GB on an 800 MB corpus). Here a
write encodes only the inner chunks it changes and streams the new shard file: the unchanged
chunks' encoded bytes are copied from the old file in bounded pieces, the changed ones appended,
then the index. The file is written beside the old one and moved over it, so a reader (or a run
killed mid-write) sees the old file or the new one, never a mix, as with tensorstore's own writes.

The files are byte-compatible with tensorstore's: inner chunks are encoded by tensorstore itself
(an in-memory array with the same codecs), and the shard index is zarr3's default one (per inner
chunk little-endian uint64 offset and size, 2**64 - 1 for an absent chunk, then the crc32c of the
index). An inner chunk that is all fill value (0) is left out, as tensorstore leaves it out.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

import fsspec
import google_crc32c
import numpy as np

_ABSENT = np.uint64(2**64 - 1)
_CRC_BYTES = 4
# Encoded bytes of unchanged chunks are copied in pieces of at most this size.
_COPY_PIECE_BYTES = 32 << 20
# A shard file being written is staged as `c/<shard>.<random>.partial`, then moved over `c/<shard>`.
_STAGED_SUFFIX = ".partial"


@dataclass(frozen=True)
class ShardLayout:
    """The part of a zarr3 array's metadata this writer needs: shard and inner chunk lengths and
    the inner chunks' codecs (as in zarr.json's `sharding_indexed` configuration)."""

    shard_length: int
    chunk_length: int
    dtype: str
    inner_codecs: tuple[dict, ...]

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_length // self.chunk_length

    @property
    def index_bytes(self) -> int:
        return self.chunks_per_shard * 16 + _CRC_BYTES

    @classmethod
    def of(cls, metadata: dict) -> ShardLayout:
        """The layout of a zarr3 array from its metadata (`zarr.json`), which must be a 1-D array of
        `sharding_indexed` shards with the default index (at the end, crc32c) and key encoding."""
        (codec,) = metadata["codecs"]
        config = codec["configuration"]
        index_codecs = [c["name"] for c in config.get("index_codecs", [{"name": "bytes"}, {"name": "crc32c"}])]
        if (codec["name"] != "sharding_indexed" or config.get("index_location", "end") != "end"
                or index_codecs != ["bytes", "crc32c"]
                or metadata.get("chunk_key_encoding", {"name": "default"}).get("name") != "default"):
            raise ValueError(f"not a layout this writer handles: {metadata}")
        (shard_length,) = metadata["chunk_grid"]["configuration"]["chunk_shape"]
        (chunk_length,) = config["chunk_shape"]
        if shard_length % chunk_length:
            raise ValueError(f"shard length {shard_length} is not a multiple of the chunk length {chunk_length}")
        return cls(shard_length, chunk_length, metadata["data_type"], tuple(config["codecs"]))


class ChunkCodec:
    """Encodes and decodes inner chunks with tensorstore's own codecs, through an in-memory array."""

    def __init__(self, layout: ShardLayout):
        self.layout = layout

    def _memory_array(self, chunks: int):
        import tensorstore as ts

        # A context of its own: memory stores opened in one context share their keys.
        return ts.open({"driver": "zarr3", "kvstore": {"driver": "memory"}, "metadata": {
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [self.layout.chunk_length]}},
            "codecs": list(self.layout.inner_codecs), "data_type": self.layout.dtype, "fill_value": 0}},
            shape=[chunks * self.layout.chunk_length], create=True,
            context=ts.Context()).result()

    def encode(self, chunks: list[np.ndarray]) -> list[bytes | None]:
        """Each chunk (of chunk_length values) as stored; None for one that is all zeros."""
        if not chunks:
            return []
        array = self._memory_array(len(chunks))
        n = self.layout.chunk_length
        writes = [array[i * n:(i + 1) * n].write(chunk) for i, chunk in enumerate(chunks)]
        for write in writes:
            write.result()
        kvstore = array.kvstore
        reads = [kvstore.read(f"c/{i}") for i in range(len(chunks))]
        return [bytes(r.value) if r.state == "value" else None for r in (read.result() for read in reads)]

    def decode(self, encoded: bytes | None) -> np.ndarray:
        if encoded is None:
            return np.zeros(self.layout.chunk_length, dtype=self.layout.dtype)
        array = self._memory_array(1)
        array.kvstore.write("c/0", encoded).result()
        return array[0:self.layout.chunk_length].read().result()


class ShardFileWriter:
    """Writes value ranges of one zarr3 array (`url`: its directory, holding zarr.json) shard file by
    shard file."""

    def __init__(self, url: str, layout: ShardLayout):
        self.fs, self.root = fsspec.core.url_to_fs(url.rstrip("/"))
        self.layout = layout
        self.codec = ChunkCodec(layout)
        self.written: dict[str, tuple[int, str] | None] = {}
        """Shard files this writer wrote (filesystem path: size and sha256 of the bytes written, hashed
        as they were written) or deleted (None); the latest write of each counts."""

    def shard_path(self, shard: int) -> str:
        return f"{self.root}/c/{shard}"

    def remove_staged(self) -> int:
        """Delete staged files a killed writer left beside the shard files (they are never read, but
        an artifact's commit would list them); how many there were. Only the array's one writer (the
        artifact's lease holder) may call this."""
        staged = self.fs.glob(f"{self.root}/c/*{_STAGED_SUFFIX}")
        for path in staged:
            self.fs.rm_file(path)
        return len(staged)

    def read_index(self, path: str) -> np.ndarray | None:
        """A shard file's index (chunks x 2: offset and size of each inner chunk); None if there is no file."""
        try:
            size = self.fs.size(path)
        except FileNotFoundError:
            return None
        if size is None or size < self.layout.index_bytes:
            raise ValueError(f"{path}: {size} bytes cannot hold a shard index of {self.layout.index_bytes}")
        raw = self.fs.cat_file(path, start=size - self.layout.index_bytes, end=size)
        body, crc = raw[:-_CRC_BYTES], raw[-_CRC_BYTES:]
        if google_crc32c.value(body).to_bytes(_CRC_BYTES, "little") != crc:
            raise ValueError(f"{path}: the shard index fails its crc32c check")
        return np.frombuffer(body, dtype="<u8").reshape(-1, 2)

    def write(self, start: int, values: np.ndarray) -> None:
        """Store `values` at positions [start, start + len(values)), leaving every other value as it is."""
        values = np.ascontiguousarray(values, dtype=self.layout.dtype)
        end = start + values.size
        shard_length = self.layout.shard_length
        for shard in range(start // shard_length, (end - 1) // shard_length + 1 if values.size else 0):
            base = shard * shard_length
            low, high = max(start, base), min(end, base + shard_length)
            self._write_in_shard(shard, low - base, values[low - start:high - start])

    def zero(self, start: int, stop: int) -> None:
        """Set positions [start, stop) to zero, the fill value: whole inner chunks are dropped from
        their shard file without being encoded, and each shard file is rewritten once (or deleted,
        when nothing but zeros is left in it)."""
        shard_length = self.layout.shard_length
        for shard in range(start // shard_length, (stop - 1) // shard_length + 1 if stop > start else 0):
            base = shard * shard_length
            self._zero_in_shard(shard, max(start, base) - base, min(stop, base + shard_length) - base)

    def _zero_in_shard(self, shard: int, low: int, high: int) -> None:
        n = self.layout.chunk_length
        path = self.shard_path(shard)
        old = self.read_index(path)
        if old is None:
            return  # no file: every value is already zero
        encoded: dict[int, bytes | None] = {}
        partial: dict[int, np.ndarray] = {}
        for chunk in range(low // n, (high - 1) // n + 1):
            if old[chunk, 0] == _ABSENT:
                continue  # already zeros
            chunk_low, chunk_high = max(low, chunk * n) - chunk * n, min(high, (chunk + 1) * n) - chunk * n
            if chunk_high - chunk_low == n:
                encoded[chunk] = None
            else:
                partial[chunk] = self.codec.decode(self._old_chunk(path, old, chunk)).copy()
                partial[chunk][chunk_low:chunk_high] = 0
        encoded.update(zip(partial, self.codec.encode(list(partial.values()))))
        if encoded:
            self._rewrite(path, old, encoded)

    def _write_in_shard(self, shard: int, offset: int, values: np.ndarray) -> None:
        n = self.layout.chunk_length
        path = self.shard_path(shard)
        old = self.read_index(path)
        first, last = offset // n, (offset + values.size - 1) // n
        chunks = []
        for chunk in range(first, last + 1):
            low, high = max(offset, chunk * n), min(offset + values.size, (chunk + 1) * n)
            piece = values[low - offset:high - offset]
            if high - low == n:
                chunks.append(piece)
                continue
            # A partly written chunk keeps the values around the new ones.
            merged = self.codec.decode(self._old_chunk(path, old, chunk)).copy()
            merged[low - chunk * n:high - chunk * n] = piece
            chunks.append(merged)
        encoded = dict(zip(range(first, last + 1), self.codec.encode(chunks)))
        self._rewrite(path, old, encoded)

    def _old_chunk(self, path: str, old: np.ndarray | None, chunk: int) -> bytes | None:
        if old is None or old[chunk, 0] == _ABSENT:
            return None
        offset, size = (int(v) for v in old[chunk])
        return self.fs.cat_file(path, start=offset, end=offset + size)

    def _rewrite(self, path: str, old: np.ndarray | None, encoded: dict[int, bytes | None]) -> None:
        """The shard file with `encoded` in place of those chunks, streamed to a new file that then
        replaces the old one. A shard left with no chunk (all zeros) has no file, as tensorstore
        leaves it."""
        kept = [chunk for chunk in range(self.layout.chunks_per_shard) if chunk not in encoded
                and old is not None and old[chunk, 0] != _ABSENT]
        if not kept and all(data is None for data in encoded.values()):
            if old is not None:
                self.fs.rm_file(path)
                self.written[path] = None
            return
        index = np.full((self.layout.chunks_per_shard, 2), _ABSENT, dtype="<u8")
        staged = f"{path}.{uuid.uuid4().hex}{_STAGED_SUFFIX}"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        position = 0
        digest = hashlib.sha256()
        try:
            with self.fs.open(staged, "wb") as out:
                for members, source_offset, size, data in self._pieces(path, old, encoded):
                    if data is None:
                        data = self.fs.cat_file(path, start=source_offset, end=source_offset + size)
                    out.write(data)
                    digest.update(data)
                    # A copied run of several chunks keeps their sizes and relative offsets.
                    for member, member_offset, member_size in members:
                        index[member] = (position + member_offset, member_size)
                    position += len(data)
                body = index.tobytes()
                tail = body + google_crc32c.value(body).to_bytes(_CRC_BYTES, "little")
                out.write(tail)
                digest.update(tail)
            self.fs.mv(staged, path)
            self.written[path] = (position + len(tail), digest.hexdigest())
        except BaseException:
            try:
                self.fs.rm_file(staged)
            except (FileNotFoundError, OSError):
                pass
            raise

    def _pieces(self, path: str, old: np.ndarray | None, encoded: dict[int, bytes | None]):
        """In chunk order: ([(chunk, offset in piece, size)], old file offset, size, bytes or None to copy).

        Unchanged chunks that lie back to back in the old file are copied as one piece of at most
        _COPY_PIECE_BYTES."""
        run: list[tuple[int, int, int]] = []
        run_start = run_end = 0
        for chunk in range(self.layout.chunks_per_shard):
            if chunk in encoded:
                data = encoded[chunk]
            elif old is not None and old[chunk, 0] != _ABSENT:
                offset, size = (int(v) for v in old[chunk])
                if run and offset == run_end and run_end + size - run_start <= _COPY_PIECE_BYTES:
                    run.append((chunk, offset - run_start, size))
                    run_end += size
                else:
                    if run:
                        yield run, run_start, run_end - run_start, None
                    run, run_start, run_end = [(chunk, 0, size)], offset, offset + size
                continue
            else:
                continue
            if run:
                yield run, run_start, run_end - run_start, None
                run = []
            if data is not None:
                yield [(chunk, 0, len(data))], 0, len(data), data
        if run:
            yield run, run_start, run_end - run_start, None
