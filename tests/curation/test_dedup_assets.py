"""dedup_index/<group> and deduplicated/<source> through the `marin` CLI: a new shard appends files,
earlier data files keep their bytes, and a dedup group spans sources."""

import json
import os
import subprocess
import sys

import polars as pl
import pytest

from marin_resources.storage.store import ArtifactStore
from tests.curation.test_dedup import docstring_documents


@pytest.fixture
def env(tmp_path):
    # Real, mutually dissimilar prose (Python stdlib docstrings); the last one is in both sources.
    texts = iter(docstring_documents()[:4])
    for source, files in {"web": ["a.txt", "b.txt"], "books": ["c.txt"]}.items():
        (tmp_path / source).mkdir()
        for name in files:
            (tmp_path / source / name).write_text(next(texts))
    shared = next(texts)
    (tmp_path / "books" / "shared.txt").write_text(shared)
    (tmp_path / "web" / "z-shared.txt").write_text(shared)
    sources = tmp_path / "sources.yaml"
    sources.write_text("sources:\n" + "".join(
        f"  - name: {name}\n    uri: {tmp_path / name}/*.txt\n    format: text\n    files_per_shard: 1\n"
        "    dedup:\n      group: corpus\n"
        for name in ("web", "books")))
    return {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(tmp_path / "store"),
            "DAGSTER_HOME": str(tmp_path / "home"), "MARIN_ENV": "local"}


def materialize(env, key):
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", key, "--json"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout)


def manifest(tmp_path, key):
    (path,) = (tmp_path / "store" / key).glob("v1-*/.artifact.json")
    return {entry["path"]: entry["sha256"] for entry in json.loads(path.read_text())["files"]}


@pytest.mark.slow  # `marin materialize` builds of two sources, twice (about 2 min on 2 loaded cores)
def test_new_shard_appends_and_old_data_files_keep_their_bytes(env, tmp_path):
    # One new shard per index batch (a runtime setting): five batches, the same decisions as one.
    materialize({**env, "MARIN_DEDUP_BATCH_SHARDS": "1"}, "deduplicated/web")
    assert len(list((tmp_path / "store").glob("dedup_index/corpus/v1-*/registry/*.json"))) == 5
    # Its files' entries were hashed by the units that wrote them; they match the stored bytes.
    artifacts = ArtifactStore(str(tmp_path / "store"))
    written = artifacts.read_manifest(next((tmp_path / "store").glob("deduplicated/web/v1-*")).as_posix())
    assert len(written.files) == 6 and artifacts.verify(written) == []
    index = artifacts.read_manifest(next((tmp_path / "store").glob("dedup_index/corpus/v1-*")).as_posix())
    assert artifacts.verify(index) == []
    materialize(env, "deduplicated/books")
    web, books = manifest(tmp_path, "deduplicated/web"), manifest(tmp_path, "deduplicated/books")
    assert sorted(web) == ["data/a.txt.parquet", "data/b.txt.parquet", "data/z-shared.txt.parquet",
                           "duplicates/a.txt.parquet", "duplicates/b.txt.parquet", "duplicates/z-shared.txt.parquet"]
    store = tmp_path / "store"
    # Group order is (shard key, source): books' shared.txt comes before web's z-shared.txt and is kept.
    dropped = pl.read_parquet(next(store.glob("deduplicated/web/v1-*")) / "duplicates/z-shared.txt.parquet")
    assert dropped.select("dropped_source", "kept_source", "kept_shard", "reason").rows() == [
        ("web", "books", "shared.txt", "exact")]
    assert pl.read_parquet(next(store.glob("deduplicated/web/v1-*")) / "data/z-shared.txt.parquet").height == 0
    assert pl.read_parquet(next(store.glob("deduplicated/books/v1-*")) / "data/shared.txt.parquet").height == 1

    # A new web shard whose name sorts first and which copies books' kept document: it is seen last.
    (tmp_path / "web" / "0-new.txt").write_text((tmp_path / "books" / "shared.txt").read_text())
    steps = materialize(env, "deduplicated/web")["steps"]
    assert [step["partition"] for step in steps if step["ran"]] == ["0-new.txt", None]
    # One run: the new shard's partition, then the global dedup steps that read it, nothing else to build.
    assert len({step["run_id"] for step in steps if step["ran"]}) == 1
    after = manifest(tmp_path, "deduplicated/web")
    assert {path: after[path] for path in web} == web, "an earlier data or duplicates file changed"
    assert sorted(set(after) - set(web)) == ["data/0-new.txt.parquet", "duplicates/0-new.txt.parquet"]
    web_dir = next(store.glob("deduplicated/web/v1-*"))
    assert pl.read_parquet(web_dir / "duplicates/0-new.txt.parquet")["kept_shard"].to_list() == [
        "shared.txt"]
    materialize(env, "deduplicated/books")
    assert manifest(tmp_path, "deduplicated/books") == books
