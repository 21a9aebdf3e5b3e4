"""The store through the CLI (issue 17): damaged artifacts are never reused (defects 2 and 5),
`--rebuild` takes the lease before it withdraws anything, and `lineage` refuses a path as a
partition cleanly.

A small curated source is built once by the CLI; each test damages a private copy of the store
(a deleted file, a flipped byte, a forged data version) and runs the CLI on it in a fresh process,
as a user's shell would. The Dagster-level tests drive `materialize_artifact` directly, the path
that runs launched from the UI or a sensor take.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import ArtifactHandleIOManager, Built, MarinStore, marin_asset, materialize_artifact
from marin_resources.keys import asset_key
from marin_resources.storage.store import MANIFEST_NAME, ArtifactStore
from tests.foundation.test_dagster_artifacts import make_defs

FORGED = "0" * 64
LINES = ["The ferry left the harbour before dawn with a cargo of salt, rope and letters for the island.",
         "An old keeper trimmed the lamp each evening and wrote the weather into a narrow ledger.",
         "Children on the quay counted the gulls and argued about which boat would come home first."]

WORDS, JOINED = asset_key("test/words"), asset_key("test/joined")


def marin(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marin_assets.cli", *argv], env=env, capture_output=True, text=True,
                          check=False, timeout=300)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("damage-base")
    (tmp / "text").mkdir()
    for name in ("north", "south"):
        (tmp / "text" / f"{name}.txt").write_text("\n\n".join(f"{name.title()}: {line}" for line in LINES * 3))
    sources = tmp / "sources.yaml"
    sources.write_text(f"sources:\n  - name: harbour\n    uri: {tmp / 'text'}/*.txt\n    format: text\n"
                       "    files_per_shard: 1\n")
    env = {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(tmp / "store"),
           "DAGSTER_HOME": str(tmp / "home"), "MARIN_ENV": "local"}
    proc = marin(env, "materialize", "documents/harbour")
    assert proc.returncode == 0, proc.stderr
    return tmp, env


@pytest.fixture
def copy(base, tmp_path):
    """A private copy of the built store and instance; manifests record absolute URIs, so they are rewritten."""
    src, env = base
    for name in ("store", "home"):
        shutil.copytree(src / name, tmp_path / name)
    for manifest in (tmp_path / "store").rglob(MANIFEST_NAME):
        manifest.write_text(manifest.read_text().replace(str(src / "store"), str(tmp_path / "store")))
    return tmp_path / "store", {**env, "MARIN_PREFIX": str(tmp_path / "store"), "DAGSTER_HOME": str(tmp_path / "home")}


def one(root: Path, key: str, partition: str | None = None) -> Path:
    """The artifact directory of `key[partition]` at v1 (each test builds one config of it)."""
    (found,) = (root / key).glob("v1-*" + (f"/{partition}" if partition else ""))
    return found


def raw_south(store: Path) -> Path:
    return one(store, "raw/harbour", "south.txt") / "files/south.txt"


def flip_byte(path: Path) -> bytes:
    original = path.read_bytes()
    data = bytearray(original)
    data[3] ^= 0x20  # "South" -> "SoUth": same size, other bytes
    path.write_bytes(bytes(data))
    return original


def documents_text(store: Path) -> str:
    documents = pl.read_parquet(one(store, "documents/harbour", "south.txt") / "documents.parquet")
    return "\n".join(documents["text"].to_list())


@pytest.mark.slow  # the module's `marin` build, then rebuilds
def test_deleted_file_is_reported_and_rebuilt(copy):
    store, env = copy
    original = raw_south(store).read_bytes()
    raw_south(store).unlink()

    status = marin(env, "status", "raw/harbour")
    assert status.returncode == 0, status.stderr
    assert "damaged  raw/harbour[south.txt]" in status.stdout and f"{raw_south(store)}: missing" in status.stdout

    proc = marin(env, "materialize", "documents/harbour", "--partition", "south.txt")
    assert proc.returncode == 0, proc.stderr
    assert f"raw/harbour: damaged: {raw_south(store)}: missing" in proc.stdout
    assert "ok: 1 run(s)" in proc.stdout
    assert raw_south(store).read_bytes() == original
    artifacts = ArtifactStore(str(store))
    assert artifacts.verify(artifacts.find("raw/harbour", "v1", "south.txt")) == []


@pytest.mark.slow  # the module's `marin` build, then rebuilds
def test_flipped_byte_is_found_by_verify_and_never_carried_downstream(copy):
    store, env = copy
    original = flip_byte(raw_south(store))
    # Same size: the cheap check cannot see it, the full one does.
    assert "fresh    raw/harbour[south.txt]" in marin(env, "status", "raw/harbour").stdout
    verified = marin(env, "status", "raw/harbour", "--verify")
    assert "damaged  raw/harbour[south.txt]" in verified.stdout and f"{raw_south(store)}: sha256" in verified.stdout

    proc = marin(env, "materialize", "documents/harbour", "--partition", "south.txt", "--verify")
    assert proc.returncode == 0, proc.stderr
    assert f"raw/harbour: damaged: {raw_south(store)}: sha256" in proc.stdout
    assert raw_south(store).read_bytes() == original  # rebuilt from the source

    # --rebuild of the documents reads the raw copy again, so it re-hashes it first.
    flip_byte(raw_south(store))
    rebuilt = marin(env, "materialize", "documents/harbour", "--partition", "south.txt", "--rebuild")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert raw_south(store).read_bytes() == original
    text = documents_text(store)
    assert "South:" in text and "SoUth" not in text


@pytest.mark.slow  # the module's `marin` build, then rebuilds
def test_forged_data_version_is_rebuilt_not_adopted(copy):
    store, env = copy
    manifest_path = one(store, "raw/harbour", "south.txt") / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    real = manifest["data_version"]
    manifest["data_version"] = FORGED
    manifest_path.write_text(json.dumps(manifest))

    proc = marin(env, "materialize", "documents/harbour", "--partition", "south.txt", "--rebuild")
    assert proc.returncode == 0, proc.stderr
    assert "is not the content hash" in proc.stdout
    artifacts = ArtifactStore(str(store))
    assert artifacts.find("raw/harbour", "v1", "south.txt").data_version == real
    docs = artifacts.find("documents/harbour", "v1", "south.txt")
    assert docs.upstream_versions()[("raw/harbour", "south.txt")] == real


@pytest.mark.slow  # the module's `marin` build
def test_rebuild_of_a_partition_another_writer_holds_withdraws_nothing(copy):
    store, env = copy
    partition_dir = one(store, "documents/harbour", "south.txt")
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (partition_dir / ".lock").write_text(json.dumps({
            "run_id": "other-run", "host": socket.gethostname(), "pid": writer.pid, "created": time.time(),
            "renewed": time.time(), "token": "t"}))
        proc = marin(env, "materialize", "documents/harbour", "--partition", "south.txt", "--rebuild")
    finally:
        writer.kill()
        writer.wait()
    assert proc.returncode == 1
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("marin: ") and "being written by run other-run" in errors[0], \
        proc.stderr
    assert (partition_dir / MANIFEST_NAME).is_file()
    assert not list(partition_dir.glob(f"{MANIFEST_NAME}.retracted-*"))


def shard_documents(artifact: Path) -> dict[str, int]:
    """Rows of each shard's data file in a `deduplicated/<source>` artifact."""
    return {path.stem: pl.read_parquet(path).height for path in sorted((artifact / "data").glob("*.parquet"))}


@pytest.mark.slow  # the dedup chain, then its repair
def test_a_truncated_corpus_file_is_repaired_whole_never_emptied(tmp_path):
    """Issue 50: one file of a committed `deduplicated/<source>` truncated; the rebuild committed an empty
    artifact (0 files, the hash of nothing) whose metrics still counted every document, and status called
    it fresh. The repair must hold every shard's documents again, as its inputs account for them."""
    from tests.ops.test_lineage_cli import cli_env, write_source

    write_source(tmp_path / "text", ["north", "south"])  # text the filters keep
    env, store = cli_env(tmp_path), tmp_path / "store"
    built = marin(env, "materialize", "deduplicated/harbour")
    assert built.returncode == 0, built.stdout + built.stderr
    artifacts = ArtifactStore(str(store))
    before = artifacts.find("deduplicated/harbour", "v1", None)
    artifact = Path(artifacts.fs_path(before.uri))
    counts = shard_documents(artifact)
    assert set(counts) == {"north.txt", "south.txt"} and sum(counts.values()) == before.metrics["documents"] > 0
    south = artifact / "data" / "south.txt.parquet"
    south.write_bytes(south.read_bytes()[:100])

    repaired = marin(env, "materialize", "deduplicated/harbour")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    after = artifacts.find("deduplicated/harbour", "v1", None)
    assert artifacts.verify(after) == []
    assert shard_documents(artifact) == counts
    assert after.metrics["documents"] == before.metrics["documents"]
    assert after.data_version == before.data_version  # the same bytes as before the damage
    status = marin(env, "status", "deduplicated/harbour")
    assert "fresh    deduplicated/harbour" in status.stdout, status.stdout


def test_a_commit_without_every_shards_file_is_refused():
    """The check `deduplicated` makes before its commit: every shard its index accounts for has its data
    file; one kept from the last commit must be as that commit left it."""
    from marin_assets.curation.refine import shards_without_files

    present = {"data/a.parquet", "data/b.parquet", "duplicates/a.parquet"}
    assert shards_without_files(["a", "b"], set(), present, set()) == []
    assert shards_without_files(["a", "b", "c"], set(), present, set()) == ["c"]
    assert shards_without_files(["a", "b"], {"a", "b"}, present, {"data/b.parquet"}) == ["a"]  # a changed since


@pytest.mark.slow  # the module's `marin` build
def test_lineage_refuses_a_path_as_partition_in_one_line(copy):
    _, env = copy
    proc = marin(env, "lineage", "raw/harbour", "--partition", "../../etc")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "marin: raw/harbour has no partition '../../etc': invalid partition key '../../etc': contains a path "
        "separator, contains '..'"]


# ---- the same guarantees on the Dagster path (UI launches, sensors), without the planner ----------

@pytest.fixture
def words_built(tmp_path):
    assets, resources = make_defs(tmp_path)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("test_shards", ["a", "b"])
        for part in ("a", "b"):
            assert dg.materialize(assets, selection=[WORDS], partition_key=part, resources=resources,
                                  instance=instance).success
        yield assets, resources, instance


def reused(result, key):
    materializations = result.asset_materializations_for_node(asset_key(key).to_python_identifier())
    return materializations[0].metadata["marin/reused"].value


def test_damaged_target_is_rebuilt_by_materialize_artifact(tmp_path, words_built):
    assets, resources, instance = words_built
    (one(tmp_path, "test/words", "a") / "words.txt").unlink()
    again = dg.materialize(assets, selection=[WORDS], partition_key="a", resources=resources, instance=instance)
    assert again.success and reused(again, "test/words") is False
    assert (one(tmp_path, "test/words", "a") / "words.txt").read_text() == "hello a"


def test_forged_input_is_refused(tmp_path, words_built):
    assets, resources, instance = words_built
    manifest_path = one(tmp_path, "test/words", "b") / MANIFEST_NAME
    manifest_path.write_text(manifest_path.read_text().replace(
        json.loads(manifest_path.read_text())["data_version"], FORGED))
    result = dg.materialize(assets, selection=[JOINED], resources=resources, instance=instance,
                            raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    message = failure.step_failure_data.error.message
    assert "refusing damaged input test/words" in message and "is not the content hash" in message
    assert "marin materialize test/words --partition b" in message
    assert ArtifactStore(str(tmp_path)).find("test/joined", "v1", None) is None


def incremental_defs(prefix):
    """Like the token cache: a builder that resumes and skips what its own ledger says is done."""
    spec = ArtifactSpec.fixed("test/incremental", "v1", {})

    @marin_asset(spec)
    def incremental(context: dg.AssetExecutionContext, store: MarinStore):
        def build(w):
            if not store.get().fs.exists(store.get().fs_path(w.path("ledger.json"))):
                with w.open("data/chunk-0") as fh:
                    fh.write(b"rows")
                w.write_json("ledger.json", {"done": ["chunk-0"]})
            return Built()
        return materialize_artifact(context, store, spec, upstream=[], build=build, resume=True)

    store = MarinStore(prefix=str(prefix))
    return incremental, {"store": store, "artifact_io_manager": ArtifactHandleIOManager(store=store)}


def test_damaged_artifact_of_a_resuming_builder_is_built_from_scratch(tmp_path):
    incremental, resources = incremental_defs(tmp_path)
    with dg.instance_for_test() as instance:
        assert dg.materialize([incremental], resources=resources, instance=instance).success
        (one(tmp_path, "test/incremental") / "data/chunk-0").unlink()
        again = dg.materialize([incremental], resources=resources, instance=instance)
    assert again.success and reused(again, "test/incremental") is False
    assert (one(tmp_path, "test/incremental") / "data/chunk-0").read_bytes() == b"rows"
    artifacts = ArtifactStore(str(tmp_path))
    assert artifacts.verify(artifacts.find("test/incremental", "v1", None)) == []


def test_rebuild_of_a_damaged_resuming_artifact_starts_from_scratch(tmp_path):
    from marin_assets.catalog import Catalog
    from marin_assets.planning import Planner

    incremental, resources = incremental_defs(tmp_path)
    defs = dg.Definitions(assets=[incremental], resources=resources)
    with dg.instance_for_test() as instance:
        planner = Planner(defs, Catalog(), ArtifactStore(str(tmp_path)), instance)
        assert all(s.success for s in planner.materialize(asset_key("test/incremental"), None, log=lambda m: None))
        (one(tmp_path, "test/incremental") / "data/chunk-0").unlink()
        said = []
        planner.retract(asset_key("test/incremental"), None, log=said.append)
        assert any("missing; its files are cleared, it is built from scratch" in line for line in said), said
        assert all(s.success for s in planner.materialize(asset_key("test/incremental"), None,
                                                          log=said.append, verify=True))
    assert (one(tmp_path, "test/incremental") / "data/chunk-0").read_bytes() == b"rows"
