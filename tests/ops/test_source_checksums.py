"""Raw sources on object stores are identified by the checksum the store keeps (S3 ETag, GCS
md5Hash / crc32c), not by their modification time; a filesystem that keeps none has its bytes
hashed. Runs against moto and the GCS emulator."""

import uuid

import fsspec
import pytest

from marin_assets.curation.config import parse_curation_config
from marin_assets.curation.content_hashes import ContentHashCache
from marin_assets.curation.discovery import discover_shards, list_source_files

LETTER = b"Dear reader, the tide came in early today and the harbour filled with boats.\n"


def source(uri: str):
    return parse_curation_config({"sources": [{"name": "remote", "uri": uri, "format": "text",
                                               "files_per_shard": 1}]}, "/").sources[0]


@pytest.fixture
def s3(s3_server, monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(name, value)
    fs = fsspec.filesystem("s3", skip_instance_cache=True, client_kwargs={"endpoint_url": s3_server})
    bucket = f"src-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    return fs, bucket


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    fs = fsspec.filesystem("gs", skip_instance_cache=True, token="anon", endpoint_url=gcs_server)
    bucket = f"src-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    return fs, bucket


def fingerprints(fs, uri):
    fs.invalidate_cache()
    return {s.key: s.fingerprint for s in discover_shards(source(uri))}


@pytest.mark.parametrize("store, scheme, checksum", [("s3", "s3", "ETag:"), ("gcs", "gs", ("md5Hash:", "crc32c:"))])
def test_object_store_files_are_identified_by_the_stores_checksum(request, store, scheme, checksum, monkeypatch,
                                                                 tmp_path):
    monkeypatch.setenv("MARIN_CACHE_DIR", str(tmp_path / "cache"))
    fs, bucket = request.getfixturevalue(store)
    fs.pipe({f"{bucket}/d/one.txt": LETTER, f"{bucket}/d/two.txt": LETTER.upper()})
    uri = f"{scheme}://{bucket}/d/*.txt"
    hashed = []
    monkeypatch.setattr(ContentHashCache, "sha256_of_remote", lambda *a: hashed.append(a) or "x")
    refs = list_source_files(source(uri))
    assert all(r.etag.startswith(checksum) and r.mtime is None for r in refs), refs
    before = fingerprints(fs, uri)

    fs.pipe(f"{bucket}/d/one.txt", LETTER)  # the same bytes uploaded again: a new mtime, the same file
    assert fingerprints(fs, uri) == before
    fs.pipe(f"{bucket}/d/two.txt", LETTER.upper().replace(b"TIDE", b"TIME"))  # same size, other bytes
    after = fingerprints(fs, uri)
    assert [k for k in before if before[k] != after[k]] == ["two.txt"]
    assert hashed == []  # the store's checksum sufficed: no byte was read


def test_a_filesystem_without_checksums_has_its_bytes_hashed(monkeypatch, tmp_path):
    monkeypatch.setenv("MARIN_CACHE_DIR", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    root = f"/checksums-{uuid.uuid4().hex[:8]}"
    fs.pipe({f"{root}/one.txt": LETTER, f"{root}/two.txt": LETTER.upper()})
    uri = f"memory://{root}/*.txt"
    refs = list_source_files(source(uri))
    assert all(r.etag.startswith("sha256:") for r in refs)
    before = fingerprints(fs, uri)
    fs.pipe(f"{root}/two.txt", LETTER.upper().replace(b"TIDE", b"TIME"))
    after = fingerprints(fs, uri)
    assert [k for k in before if before[k] != after[k]] == ["two.txt"]


def test_prefetched_hashes_are_still_checked_against_each_files_stat(tmp_path):
    """A listing reads its files' cached hashes in a few queries (`prefetch`), not one per file; a file
    rewritten after that is hashed again, as one looked up alone would be."""
    from marin_assets.curation.content_hashes import ContentHashCache, sha256_file

    files = [tmp_path / f"f{i}.txt" for i in range(3)]
    for i, f in enumerate(files):
        f.write_text(f"file {i}")
    with ContentHashCache(tmp_path / "cache.sqlite") as hashes:
        first = [hashes.sha256(str(f)) for f in files]
    files[1].write_text("rewritten, and longer")
    with ContentHashCache(tmp_path / "cache.sqlite") as hashes:
        hashes.prefetch([str(f) for f in files] + [str(tmp_path / "never-hashed.txt")])
        assert hashes.db.execute("SELECT count(*) FROM hashes").fetchone()[0] == 3
        again = [hashes.sha256(str(f)) for f in files]
    assert again[0] == first[0] and again[2] == first[2]
    assert again[1] == sha256_file(files[1]) != first[1]
