"""ShardFileWriter against tensorstore itself: the same writes to two arrays of one small layout
(shards of 4 inner chunks of 8 values) give the same values and the same shard files, byte for byte."""

import os

import numpy as np
import pytest
import tensorstore as ts

from marin_assets.tokenization.shard_files import ShardFileWriter, ShardLayout

CHUNK, SHARD = 8, 32
BLOSC = {"name": "blosc", "configuration": {"clevel": 5, "cname": "lz4", "shuffle": "shuffle", "typesize": 4,
                                            "blocksize": 0}}


def open_array(path: str):
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}, "metadata": {
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [SHARD]}},
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [CHUNK], "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, BLOSC]}}]}},
        dtype="int32", shape=[2**20], create=True, delete_existing=True).result()


def shard_files(path: str) -> dict[str, bytes]:
    folder = os.path.join(path, "c")
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


@pytest.fixture
def pair(tmp_path):
    reference = open_array(str(tmp_path / "reference"))
    ours = open_array(str(tmp_path / "ours"))
    writer = ShardFileWriter(str(tmp_path / "ours"), ShardLayout.of(ours.spec().to_json()["metadata"]))
    return reference, writer, ours, tmp_path


def test_layout_is_read_from_the_array_metadata(pair):
    _, writer, _, _ = pair
    assert (writer.layout.shard_length, writer.layout.chunk_length, writer.layout.chunks_per_shard) == (SHARD, CHUNK, 4)
    assert writer.layout.dtype == "int32"


WRITES = [
    (0, np.arange(1, 6)),                # part of the first chunk
    (5, np.arange(100, 120)),            # finishes it, two whole chunks, part of the fourth
    (25, np.arange(200, 250)),           # across the shard boundary into shard 1
    (0, np.array([7])),                  # a header rewrite at position 0, as the offsets array gets
    (80, np.zeros(8, dtype=np.int32)),   # an all-zero chunk is left out of its shard file
    (75, np.arange(300, 309)),           # after a gap (absent chunks) in shard 2
    (40, np.zeros(30, dtype=np.int32)),  # zeroing, as a trim does
    (32, np.zeros(32, dtype=np.int32)),  # shard 1 all zeros: its file goes, as tensorstore deletes it
    (160, np.zeros(8, dtype=np.int32)),  # zeros in a shard with no file: none is made
]


def test_same_values_and_same_bytes_as_tensorstore(pair):
    reference, writer, ours, tmp_path = pair
    for start, values in WRITES:
        reference[start:start + values.size].write(values.astype(np.int32)).result()
        writer.write(start, values)
        expected = reference[0:128].read().result()
        np.testing.assert_array_equal(open_array_for_read(tmp_path / "ours")[0:128].read().result(), expected)
        assert shard_files(str(tmp_path / "ours")) == shard_files(str(tmp_path / "reference"))


def test_each_shard_file_is_named_with_the_size_and_hash_of_its_bytes_as_written(pair):
    """`written` after every write: each existing file's size and sha256, a deleted one as None."""
    import hashlib

    _, writer, _, tmp_path = pair
    for start, values in WRITES:
        writer.write(start, values)
        for name, data in shard_files(str(tmp_path / "ours")).items():
            assert writer.written[writer.shard_path(int(name))] == (len(data), hashlib.sha256(data).hexdigest())
    assert writer.written[writer.shard_path(1)] is None  # shard 1 went all zeros: its file was deleted
    assert not (tmp_path / "ours" / "c" / "1").exists()


def open_array_for_read(path):
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}, open=True).result()


@pytest.mark.parametrize("start, stop", [(3, 5), (4, 70), (8, 32), (0, 128), (70, 70), (100, 200)])
def test_zeroing_a_range_gives_tensorstores_bytes(pair, start, stop):
    """zero() (a trim) gives the values and files tensorstore gives for a write of zeros: partial
    chunks kept around the range, whole chunks dropped, an emptied shard's file deleted."""
    reference, writer, ours, tmp_path = pair
    for at, values in WRITES[:3] + [(75, np.arange(300, 309))]:
        reference[at:at + values.size].write(values.astype(np.int32)).result()
        writer.write(at, values)
    reference[start:stop].write(np.zeros(stop - start, dtype=np.int32)).result()
    writer.zero(start, stop)
    assert np.array_equal(ours[0:256].read().result(), reference[0:256].read().result())
    assert shard_files(str(tmp_path / "ours")) == shard_files(str(tmp_path / "reference"))


def test_no_partial_file_is_left_behind(pair):
    _, writer, _, tmp_path = pair
    writer.write(0, np.arange(70))
    assert sorted(os.listdir(tmp_path / "ours" / "c")) == ["0", "1", "2"]


def test_a_damaged_shard_index_is_refused_not_overwritten(pair):
    _, writer, _, tmp_path = pair
    writer.write(0, np.arange(10))
    path = tmp_path / "ours" / "c" / "0"
    damaged = bytearray(path.read_bytes())
    damaged[-10] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="crc32c"):
        writer.write(10, np.arange(5))
    assert path.read_bytes() == bytes(damaged)


def test_other_layouts_are_refused():
    metadata = {"chunk_grid": {"configuration": {"chunk_shape": [32]}}, "data_type": "int32",
                "codecs": [{"name": "sharding_indexed", "configuration": {
                    "chunk_shape": [8], "codecs": [], "index_location": "start"}}]}
    with pytest.raises(ValueError, match="not a layout"):
        ShardLayout.of(metadata)


def test_a_killed_writers_staged_file_is_removed_and_the_shard_kept(pair):
    _, writer, _, tmp_path = pair
    writer.write(0, np.arange(40))
    before = shard_files(str(tmp_path / "ours"))
    (tmp_path / "ours" / "c" / "0.deadbeef.partial").write_bytes(b"half a shard")
    assert writer.remove_staged() == 1
    assert shard_files(str(tmp_path / "ours")) == before
    np.testing.assert_array_equal(open_array_for_read(tmp_path / "ours")[0:40].read().result(), np.arange(40))
