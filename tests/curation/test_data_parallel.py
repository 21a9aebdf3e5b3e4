"""One shard's filtering in chunks: on a local Ray through dagster-ray, the same bytes and data
version as in one piece; and Ray is never imported when the code location loads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from marin_assets.curation.filter_shard import FilterTask, filter_chunk, merge_chunks
from marin_assets.curation.minhash import MinHashConfig
from marin_assets.curation.quality import QualityConfig
from marin_assets.deployment import Deployment
from marin_resources.data_parallel import DataParallel, balanced_ranges, weighted_ranges
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.keys import asset_key

LICENSES = "/usr/share/common-licenses"
SOURCES = f"""sources:
  - name: licenses
    uri: {LICENSES}/*
    format: text
    files_per_shard: 100
    filters: {{min_words: 1000}}  # the short licences (BSD, CC0, ...) are dropped
"""


def test_weighted_ranges_cover_every_row_in_order():
    assert weighted_ranges([5, 5, 5, 5, 20, 1, 1], 10) == [(0, 2), (2, 4), (4, 5), (5, 7)]
    assert weighted_ranges([3, 3], None) == [(0, 2)]
    assert weighted_ranges([], 10) == [(0, 0)]
    with pytest.raises(ValueError, match="positive"):
        weighted_ranges([1], 0)


def test_balanced_ranges_fill_the_slots_evenly_with_chunks_at_least_half_the_target():
    def sizes(ranges):
        assert ranges[0][0] == 0 and ranges[-1][1] == 40 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        return [end - start for start, end in ranges]

    files = [1] * 40  # eval_ngrams' 40 files of validation text, chunks of 16
    assert sizes(balanced_ranges(files, 16, None)) == [16, 16, 8]  # the CPUs unknown: as cut
    assert sizes(balanced_ranges(files, 16, 2)) == [10, 10, 10, 10]  # 1.5 chunks' time, not 2
    assert sizes(balanced_ranges(files, 16, 3)) == [16, 16, 8]  # a multiple already
    assert sizes(balanced_ranges(files, 16, 500)) == [7, 7, 7, 7, 7, 5]  # at most twice as many
    assert balanced_ranges(files, 64, 2) == [(0, 40)]  # one chunk stays in the step's process


@pytest.fixture(scope="module")
def licenses(tmp_path_factory):
    """The licence texts as one shard's documents, read by the source's own reader."""
    from marin_assets.curation.config import load_curation_config
    from marin_assets.curation.discovery import discover_shards
    from marin_assets.curation.readers import read_shard

    sources = tmp_path_factory.mktemp("licenses") / "sources.yaml"
    sources.write_text(SOURCES)
    source = load_curation_config(str(sources)).sources[0]
    (shard,) = discover_shards(source)
    return sources, source, read_shard(source, shard).documents


def test_chunks_merge_to_the_one_piece_result_with_and_without_a_quality_score(licenses):
    _, source, docs = licenses
    for task in (FilterTask(source.filters, MinHashConfig()),
                 FilterTask(source.filters, MinHashConfig(), QualityConfig(classifier="compression"))):
        whole = merge_chunks([filter_chunk(docs, task)], task)
        ranges = weighted_ranges(docs["text"].str.len_bytes().to_list(), 30_000)
        assert len(ranges) > 3
        parts = merge_chunks([filter_chunk(docs.slice(a, b - a), task) for a, b in ranges], task)
        assert parts.kept.equals(whole.kept) and parts.dropped.equals(whole.dropped)
        assert parts.counts == whole.counts and whole.dropped.height > 0
        assert (parts.signatures.hashvalues == whole.signatures.hashvalues).all()
        assert list(parts.signatures.ids) == list(whole.signatures.ids)


def _filtered(tmp_path: Path, sources: Path, data_parallel: DataParallel | None):
    """Materialize filtered/licenses in this process; its manifest and the run's event log."""
    from marin_assets.curation.assets import build_curation_stage
    from marin_assets.stages import build_stage

    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SOURCES": str(sources)})
    stage, catalog = build_stage(build_curation_stage, settings, Deployment.load(settings))
    resources = build_resources(settings)
    if data_parallel is not None:
        resources["data_parallel"] = data_parallel
    defs = dg.Definitions.merge(stage, dg.Definitions(resources=resources))
    (partition,) = catalog.discoverers["licenses_shards"]()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("licenses_shards", [partition])
        keys = [asset_key(f"{stage}/licenses") for stage in ("raw", "documents", "filtered")]
        result = dg.materialize(list(defs.assets), selection=keys, partition_key=partition, instance=instance,
                                resources=defs.resources)
        assert result.success
        messages = [e.user_message for e in instance.all_logs(result.run_id)]
    (manifest,) = (tmp_path / "store" / "filtered" / "licenses").glob("v*/*/.artifact.json")
    return json.loads(manifest.read_text()), manifest.parent, messages


@pytest.mark.slow  # starts a local Ray (10-40 s on 2 loaded cores)
def test_a_shard_filtered_on_ray_equals_the_one_piece_build(licenses, tmp_path):
    from marin_resources.ray_parallel import local_ray_parallel

    sources, _, _ = licenses
    serial, serial_dir, _ = _filtered(tmp_path / "serial", sources, None)
    on_ray, ray_dir, messages = _filtered(tmp_path / "ray", sources, local_ray_parallel(num_cpus=2,
                                                                                         chunk_bytes=30_000))
    assert on_ray["data_version"] == serial["data_version"]
    assert {f["path"]: f["sha256"] for f in on_ray["files"]} == {f["path"]: f["sha256"] for f in serial["files"]}
    for name in ("documents.parquet", "dropped.parquet", "signatures.parquet"):
        assert (ray_dir / name).read_bytes() == (serial_dir / name).read_bytes()
    # Spread over Ray tasks on a cluster of exactly the CPUs it was given, shut down after the run.
    assert any("chunks as Ray tasks on 2 CPU(s)" in m for m in messages), messages
    import ray

    assert not ray.is_initialized()


@pytest.mark.slow  # processes loading the code location
def test_ray_is_chosen_by_environment_and_not_imported_when_the_code_location_loads(tmp_path):
    from marin_resources.ray_parallel import RayDataParallel

    local = build_resources(MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path), "MARIN_RAY": "local",
                                                    "MARIN_RAY_CPUS": "3", "MARIN_RAY_CHUNK_MB": "8",
                                                    "MARIN_RAY_CHUNK_DOCS": "40", "MARIN_DEDUP_BATCH_SHARDS": "500"}))
    chosen = local["data_parallel"]
    assert isinstance(chosen, RayDataParallel) and chosen.chunk_bytes == 8 * 1024 * 1024
    assert chosen.ray.ray_init_options["num_cpus"] == 3 and chosen.ray.ray_init_options["include_dashboard"] is False
    assert chosen.dedup_batch_shards == 500 and chosen.chunk_documents == 40
    # deduplicated's shards (documents each) grouped into tasks of about 40 documents; in one piece without Ray.
    assert chosen.document_ranges([20, 20, 20, 20, 5]) == [(0, 2), (2, 4), (4, 5)]
    # On a cluster the CPUs are the cluster's: balanced over only where MARIN_RAY_CPUS names them.
    cluster = {"MARIN_PREFIX": str(tmp_path), "MARIN_RAY": "cluster", "RAY_ADDRESS": "127.0.0.1:6379"}
    assert build_resources(MarinSettings.from_env(cluster))["data_parallel"].slots is None
    assert build_resources(MarinSettings.from_env({**cluster, "MARIN_RAY_CPUS": "64"}))["data_parallel"].slots == 64
    default = build_resources(MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path)}))["data_parallel"]
    assert type(default) is DataParallel and default.dedup_batch_shards == 8
    assert default.document_ranges([20, 20, 20, 20, 5]) == [(0, 5)]
    for bad in ({"MARIN_RAY": "cluster"}, {"MARIN_RAY_CPUS": "0"}, {"MARIN_RAY_CHUNK_MB": "big"},
                {"MARIN_RAY_CHUNK_DOCS": "-1"}, {"MARIN_DEDUP_BATCH_SHARDS": "0"}):
        with pytest.raises(ValueError, match="MARIN_RAY|MARIN_DEDUP_BATCH_SHARDS"):
            MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path), **bad})

    probe = ("import sys, marin_assets.definitions as d; "
             "print(type(d.defs.resources['data_parallel']).__name__, 'ray' in sys.modules)")
    env = {"MARIN_RAY": "local", "MARIN_PREFIX": str(tmp_path / "store"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["RayDataParallel", "False"], out.stderr[-2000:]


@pytest.mark.slow  # imports Ray in a new process
def test_ray_workers_use_this_interpreter_where_ray_was_imported_first_under_uv_run(tmp_path):
    # A run worker that imported Levanter, and so Ray, before its first Ray step, started by `uv run`:
    # without marin's setting, Ray has each worker build its own copy of the environment with uv.
    probe = ("import ray, ray._private.runtime_env.uv_runtime_env_hook as hook, ray._private.worker as worker\n"
             "hook._get_uv_run_cmdline = lambda: ['uv', 'run', 'marin', 'materialize']\n"
             "assert 'uv run' in worker._maybe_modify_runtime_env(None, False)['py_executable']\n"
             "from marin_resources.ray_parallel import import_ray\n"
             "import_ray()\n"
             "print(worker._maybe_modify_runtime_env(None, False))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "None"  # the runtime environment as given: none


def test_a_run_on_a_running_cluster_leaves_it_alone_and_says_nothing_of_deleting_it(capfd):
    import socket

    from marin_resources.ray_parallel import cluster_ray_parallel

    with socket.socket() as head:  # a listening address stands in for the head: the set-up checks it answers
        head.bind(("127.0.0.1", 0))
        head.listen()
        cluster = cluster_ray_parallel(f"127.0.0.1:{head.getsockname()[1]}", chunk_bytes=1 << 20).ray
        with cluster.yield_for_execution(dg.build_init_resource_context()) as ready:
            assert not ready.connected  # connected only when a step has chunks to spread
    # dagster-ray's default cleanup logged "Deleted the Ray cluster at ..." at the end of every run.
    assert "Deleted" not in capfd.readouterr().err
