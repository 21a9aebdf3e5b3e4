"""`MARIN_RAY=cluster` against a real two-node Ray cluster, started with `ray start` on this machine:
a shard's chunks run on both nodes and commit the one-process bytes; a worker node killed mid-step
costs a retry on the surviving node, never a half-committed artifact; an unreachable RAY_ADDRESS
stops `marin materialize` in one line before anything is built."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from marin_resources.data_parallel import DataParallel
from marin_resources.environments import MarinSettings, build_resources, check_ray_reachable
from marin_resources.keys import asset_key
from marin_resources.ray_address import RayUnavailableError
from marin_resources.storage.store import ArtifactStore
from tests.ops.conftest import free_port
from tests.ops.ray_nodes import (
    DRIVER_ON_LOOPBACK,
    NO_AUTH,
    node_processes,
    ray_head,
    ray_start,
    signal_node,
    stop_node,
)

SOURCE = "spread"
SHARD = "spread.jsonl"
KEYS = ("raw/spread", "documents/spread", "filtered/spread")
SHARD_MB = 12  # with MARIN_RAY_CHUNK_MB=1, about 12 chunks: several on each node, a few seconds of work
WORDS = ("the of and to in is was for that with as on by at from his her they which this had were are not "
         "but be river valley farmer harvest morning evening market village bridge mountain forest winter "
         "summer letter captain harbour merchant journey garden kitchen window history careful gentle ancient "
         "quiet bright travelled carried listened remembered wandered gathered answered promised counted").split()


def document(rng: random.Random) -> str:
    paragraphs = [" ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))).capitalize() + "."
                           for _ in range(rng.randint(3, 6)))
                  for _ in range(rng.randint(4, 8))]
    return "\n\n".join(paragraphs)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """One shard of SHARD_MB of distinct English-like documents, the same every time."""
    root = tmp_path_factory.mktemp("spread")
    rng, size, lines = random.Random(0), 0, []
    while size < SHARD_MB * 1024 * 1024:
        lines.append(json.dumps({"id": f"doc-{len(lines)}", "text": document(rng)}) + "\n")
        size += len(lines[-1])
    (root / "data").mkdir()
    (root / "data" / SHARD).write_text("".join(lines))
    path = root / "sources.yaml"
    path.write_text(f"sources:\n  - name: {SOURCE}\n    uri: {root / 'data'}/*.jsonl\n    format: jsonl\n"
                    "    id_field: id\n    files_per_shard: 1\n")
    return path


def marin_env(sources: Path, root: Path, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MARIN_", "RAY_"))}
    return {**base, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(root / "store"),
            "DAGSTER_HOME": str(root / "home"), "MARIN_ENV": "local", **extra}


def materialize(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", f"filtered/{SOURCE}", "--json"],
                          env=env, capture_output=True, text=True, timeout=600)


def data_versions(root: Path) -> dict[str, str]:
    """Every committed artifact of the shard, each whole (its files match its manifest): key -> data version."""
    store = ArtifactStore(str(root / "store"))
    manifests = {key: store.find(key, "v1", SHARD) for key in KEYS}
    for key, manifest in manifests.items():
        assert manifest is not None, f"{key} was not committed"
        assert store.verify(manifest) == [], key
    return {key: manifest.data_version for key, manifest in manifests.items()}


def materialization_metadata(root: Path, monkeypatch) -> dict:
    monkeypatch.setenv("DAGSTER_HOME", str(root / "home"))  # the instance's SQLite paths name it
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        event = instance.get_latest_materialization_event(asset_key(f"filtered/{SOURCE}"))
    return {name: value.value for name, value in event.asset_materialization.metadata.items()}


@pytest.fixture(scope="module")
def one_process(sources, tmp_path_factory) -> dict[str, str]:
    """The data versions of the shard built in one piece, in one process (MARIN_RAY=off)."""
    root = tmp_path_factory.mktemp("one-process")
    proc = materialize(marin_env(sources, root, MARIN_RAY="off"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return data_versions(root)


@pytest.fixture(scope="module")
def head():
    """A Ray head node with one CPU on 127.0.0.1: its address (the head's GCS, as RAY_ADDRESS)."""
    with ray_head() as (address, _):
        yield address


@pytest.fixture
def worker2(head):
    """A second node with one CPU joined to the head: the process group of its services."""
    pgid = ray_start(f"--address={head}", '--resources={"worker2": 1}')
    yield pgid
    stop_node(pgid)


def cluster_env(sources: Path, root: Path, address: str) -> dict[str, str]:
    return marin_env(sources, root, MARIN_RAY="cluster", RAY_ADDRESS=address, MARIN_RAY_CHUNK_MB="1",
                     **DRIVER_ON_LOOPBACK, **NO_AUTH)


@pytest.mark.slow  # a two-node Ray cluster and two CLI builds of a 12 MB shard (about 60 s on 2 loaded cores)
def test_chunks_run_on_both_nodes_and_commit_the_one_process_bytes(sources, one_process, head, worker2,
                                                                   tmp_path, monkeypatch):
    proc = materialize(cluster_env(sources, tmp_path, head))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert data_versions(tmp_path) == one_process
    metadata = materialization_metadata(tmp_path, monkeypatch)
    assert metadata["chunks"] >= 8 and metadata["marin/ray_tasks"] == metadata["chunks"], metadata
    nodes = metadata["marin/ray_nodes"]
    assert len(nodes) == 2 and len(set(nodes)) == 2, nodes


@pytest.mark.slow  # as above, plus Ray noticing the dead node (about 15 s)
def test_a_worker_node_killed_mid_step_costs_a_retry_not_the_artifact(sources, one_process, head, worker2,
                                                                      tmp_path, monkeypatch):
    cli = subprocess.Popen([sys.executable, "-m", "marin_assets.cli", "materialize", f"filtered/{SOURCE}", "--json"],
                           env=cluster_env(sources, tmp_path, head), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 300
        while killed is None and cli.poll() is None and time.monotonic() < deadline:
            # A worker of the second node titled with the chunk function is running a chunk right now.
            running = [pid for pid, title in node_processes(worker2).items() if title == "ray::filter_chunk"]
            if running:
                assert not list((tmp_path / "store" / "filtered").glob(f"*/{SHARD}/.artifact.json"))
                signal_node(worker2, signal.SIGKILL)  # the whole node: raylet, agents and the running chunk
                killed = running
            time.sleep(0.02)
        out, err = cli.communicate(timeout=600)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert killed, f"no chunk ran on the second node while the step ran\n{err[-3000:]}"
    assert not node_processes(worker2)
    # The lost chunk ran again on the head: the step succeeded and its bytes are the one-process bytes.
    assert cli.returncode == 0, err[-3000:]
    assert "will be retried" in err, err[-3000:]  # Ray's own word that a task was lost with its node
    assert json.loads(out)["success"]
    assert data_versions(tmp_path) == one_process
    metadata = materialization_metadata(tmp_path, monkeypatch)
    assert metadata["marin/ray_tasks"] == metadata["chunks"], metadata


BUILD_SOURCE = "spreadbuild"
BUILD_SHARDS = 3  # three shards: one token_shards partition (its own run) and one dedup write task each
BUILD_SHARD_MB = 4  # three shards' dedup keys are more than one MARIN_RAY_CHUNK_MB: keys and passes spread


@pytest.fixture(scope="module")
def build_sources(tmp_path_factory) -> tuple[Path, Path]:
    """A three-shard source and a token registry for it (a small BPE trained on it): the sources
    file and the registry file."""
    root = tmp_path_factory.mktemp("spreadbuild")
    rng = random.Random(1)
    (root / "data").mkdir()
    for shard in range(BUILD_SHARDS):
        size, lines = 0, []
        while size < BUILD_SHARD_MB * 1024 * 1024:
            lines.append(json.dumps({"id": f"doc-{shard}-{len(lines)}", "text": document(rng)}) + "\n")
            size += len(lines[-1])
        (root / "data" / f"part-{shard}.jsonl").write_text("".join(lines))
    sources = root / "sources.yaml"
    sources.write_text(f"sources:\n  - name: {BUILD_SOURCE}\n    uri: {root / 'data'}/*.jsonl\n    format: jsonl\n"
                       "    id_field: id\n    files_per_shard: 1\n")
    registry = root / "registry.yaml"
    registry.write_text(f"tokenizers:\n  {BUILD_SOURCE}:\n    train_on: [{BUILD_SOURCE}]\n    vocab_size: 1024\n"
                        f"tokenized:\n  {BUILD_SOURCE}:\n    tokenizer: {BUILD_SOURCE}\n    validation_fraction: 0.1\n"
                        "mixtures: {}\n")
    return sources, registry


def build_through_tokenized(env: dict[str, str]) -> dict[str, str]:
    """`marin materialize tokenized/<source>` from an empty store: every committed artifact's data version,
    each verified against its files, by its path in the store."""
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", f"tokenized/{BUILD_SOURCE}",
                           "--json"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = ArtifactStore(env["MARIN_PREFIX"])
    versions = {}
    for path in sorted(Path(env["MARIN_PREFIX"]).rglob(".artifact.json")):
        manifest = store.read_manifest(str(path.parent))
        assert store.verify(manifest) == [], path
        versions[str(path.parent.relative_to(env["MARIN_PREFIX"]))] = manifest.data_version
    return versions


def latest_metadata(root: Path, key: str, monkeypatch) -> dict:
    monkeypatch.setenv("DAGSTER_HOME", str(root / "home"))
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        event = instance.get_latest_materialization_event(asset_key(key))
    return {name: value.value for name, value in event.asset_materialization.metadata.items()}


@pytest.mark.slow  # two builds of 12 MB through tokenized/ (about 90 s on 2 cores)
def test_dedup_units_fan_out_over_both_nodes_to_the_one_process_bytes(build_sources, head, worker2,
                                                                                  tmp_path, monkeypatch):
    sources, registry = build_sources
    root = tmp_path / "build"  # the same store path for both builds: a token cache's ledger names its files
    one_process = build_through_tokenized(marin_env(sources, root, MARIN_RAY="off", MARIN_REGISTRY=str(registry)))
    shutil.rmtree(root)
    # One document per deduplicated task: each shard its own task (200,000 by default, for real corpora).
    on_cluster = build_through_tokenized({**cluster_env(sources, root, head), "MARIN_REGISTRY": str(registry),
                                          "MARIN_RAY_CHUNK_DOCS": "1"})
    assert on_cluster == one_process and any(key.startswith("tokenized/") for key in on_cluster)

    # Each shard is encoded by its own token_shards partition's run, in row ranges of about a chunk as
    # Ray tasks; the cache, under one zarr shard file of tokens, is assembled in its step's own process.
    assert sum(key.startswith(f"token_shards/{BUILD_SOURCE}/") for key in on_cluster) == BUILD_SHARDS
    encoding = latest_metadata(root, f"token_shards/{BUILD_SOURCE}", monkeypatch)
    assert encoding["chunks"] >= 2 and encoding["marin/ray_tasks"] == encoding["chunks"], encoding
    assembly = latest_metadata(root, f"tokenized/{BUILD_SOURCE}", monkeypatch)
    assert assembly.get("marin/ray_tasks", 0) == 0, assembly
    passes = latest_metadata(root, f"dedup_index/{BUILD_SOURCE}", monkeypatch)
    # One task per new shard's keys, per bucket range's pass, per unit of collision components (if
    # any collide), per bucket range's new run.
    assert passes["marin/ray_tasks"] == BUILD_SHARDS + 16 + passes["update/centre_units"] + 16, passes
    written = latest_metadata(root, f"deduplicated/{BUILD_SOURCE}", monkeypatch)
    assert written["marin/ray_tasks"] == BUILD_SHARDS, written  # one task per shard to write
    assert written["marin/files_vouched"] == 2 * BUILD_SHARDS, written  # data/ and duplicates/: not re-read
    assert len({*passes["marin/ray_nodes"], *written["marin/ray_nodes"]}) == 2


@pytest.mark.slow  # Ray, through a `marin` process
def test_an_unreachable_cluster_stops_the_cli_in_one_line_before_anything_is_built(sources, tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = materialize(marin_env(sources, tmp_path, MARIN_RAY="cluster", RAY_ADDRESS=address))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"marin: cannot reach the Ray cluster at RAY_ADDRESS={address} "
        "(ConnectionRefusedError: [Errno 111] Connection refused)"], proc.stderr
    assert not list(tmp_path.glob("store/**/.artifact.json"))


def test_a_run_started_elsewhere_fails_at_resource_setup_with_the_same_line(tmp_path):
    """A run the CLI did not start (UI, sensor) meets the check when it sets up its resources, before
    any asset's body runs."""
    address = f"127.0.0.1:{free_port()}"
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_RAY": "cluster",
                                       "RAY_ADDRESS": address})
    ran = []

    @dg.asset
    def chunked(data_parallel: DataParallel) -> None:
        ran.append(True)

    result = dg.materialize([chunked], resources={"data_parallel": build_resources(settings)["data_parallel"]},
                            raise_on_error=False)
    assert not result.success and not ran
    (failure,) = [e for e in result.all_events if e.event_type == dg.DagsterEventType.RESOURCE_INIT_FAILURE]
    assert f"cannot reach the Ray cluster at RAY_ADDRESS={address}" in failure.event_specific_data.error.to_string()
    with pytest.raises(RayUnavailableError, match="RAY_ADDRESS"):
        check_ray_reachable(settings)


def test_cluster_mode_needs_a_ray_address(tmp_path):
    from marin_resources.ray_parallel import RayCluster, RayDataParallel

    chosen = build_resources(MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path), "MARIN_RAY": "cluster",
                                                     "RAY_ADDRESS": "ray://head.example:10001",
                                                     "MARIN_RAY_CHUNK_MB": "4"}))["data_parallel"]
    assert isinstance(chosen, RayDataParallel) and isinstance(chosen.ray, RayCluster)
    assert chosen.ray.address == "ray://head.example:10001" and chosen.chunk_bytes == 4 * 1024 * 1024
    for bad in ({}, {"RAY_ADDRESS": "auto"}, {"RAY_ADDRESS": "head:port"}):
        with pytest.raises(ValueError, match="RAY_ADDRESS"):
            MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path), "MARIN_RAY": "cluster", **bad})
