"""Each stage is an asset job a GraphQL client can launch by name (`marin_assets/jobs.py`, docs/ui.md)."""

from __future__ import annotations

import dagster as dg
import pytest

from marin_assets.curation.config import load_sources
from marin_assets.curation.discovery import discover_shards
from marin_assets.definitions import build_definitions
from marin_assets.jobs import JOB_STAGES, build_stage_jobs, stage_job_name
from marin_resources import dagster_private as private
from marin_resources.environments import MarinSettings
from marin_resources.keys import asset_key

JOBS = """{ repositoriesOrError { ... on RepositoryConnection { nodes {
  name location { name } jobs { name isAssetJob } } } } }"""
LAUNCH = """mutation Launch($params: ExecutionParams!) { launchRun(executionParams: $params) {
  __typename ... on LaunchRunSuccess { run { runId status } } ... on PythonError { message }
  ... on InvalidSubsetError { message } ... on RunConfigValidationInvalid { errors { message } } } }"""


def test_each_stage_is_one_job_per_partitions_definition():
    defs, _ = build_definitions(MarinSettings.from_env({}))
    jobs = {job.name: job for job in defs.resolve_all_job_defs()}
    assert {"curation", "curation_shakespeare_shards", "curation_installed_packages_shards", "tokenization",
            "training_runs", "evaluation", "evaluation_runs", "export_runs", "scaling", "scaling_demo_sweep_runs",
            "scaling_micro_delphi_sweep_runs"} <= set(jobs)
    assert jobs["training_runs"].partitions_def.name == "runs"
    assert jobs["tokenization"].partitions_def is None
    # Every materializable asset of a stage is in exactly the one job of its stage and partitions.
    in_jobs = {}
    for name, job in jobs.items():
        if name in ("__ASSET_JOB", "failure_report_job"):
            continue
        for key in job.asset_layer.executable_asset_keys:
            assert key not in in_jobs, f"{key} in {in_jobs[key]} and {name}"
            in_jobs[key] = name
    graph = defs.resolve_asset_graph()
    for key in graph.materializable_asset_keys:
        node = graph.get(key)
        if node.group_name in JOB_STAGES:
            assert in_jobs.get(key) == stage_job_name(node.group_name, node.partitions_def), key
    # The asset's checks come with it.
    checks = {c.asset_key for c in jobs["training_runs"].asset_layer.asset_graph.asset_check_keys}
    assert dg.AssetKey("checkpoint") in checks


def test_a_stage_cannot_mix_two_partitions_definitions_under_one_name():
    one, other = dg.DynamicPartitionsDefinition(name="a-b"), dg.DynamicPartitionsDefinition(name="a_b")

    @dg.asset(group_name="curation", partitions_def=one)
    def first(): ...

    @dg.asset(group_name="curation", partitions_def=other)
    def second(): ...

    with pytest.raises(ValueError, match="'curation_a_b' would mix two partitions definitions"):
        build_stage_jobs([dg.Definitions(assets=[first, second])])


def test_a_stage_job_launched_through_graphql_builds_its_partition(tmp_path, monkeypatch):
    """What a GraphQL client sends, against the code location loaded from a file: the job by its stage
    name, two of its assets, a partition tag; the run builds that shard's documents."""
    (tmp_path / "letters").mkdir()
    for name in ("alpha", "beta"):
        (tmp_path / "letters" / f"{name}.txt").write_text(f"A letter called {name}, long enough to be kept. " * 20)
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - {{name: letters, uri: {tmp_path}/letters/*.txt, format: text}}\n")
    monkeypatch.setenv("MARIN_SOURCES", str(sources))
    monkeypatch.setenv("MARIN_PREFIX", str(tmp_path / "store"))
    location = tmp_path / "location.py"
    location.write_text("from marin_assets.definitions import build_definitions\n"
                        "from marin_resources.environments import MarinSettings\n"
                        "defs, _ = build_definitions(MarinSettings.from_env())\n")
    [shard] = discover_shards(load_sources(sources)[0])
    # Launched at once and run in this process (the UI's instance queues it for the daemon instead).
    with dg.instance_for_test(overrides=private.RUN_IN_PROCESS_INSTANCE) as instance, \
            private.graphql_on_a_python_file(instance, str(location), "defs") as query:
        instance.add_dynamic_partitions("letters_shards", [shard.key])
        [repo] = query(JOBS)["repositoriesOrError"]["nodes"]
        jobs = {job["name"] for job in repo["jobs"] if job["isAssetJob"]}
        assert {"curation", "curation_letters_shards"} <= jobs
        selected = [asset_key(k).path for k in ("raw/letters", "documents/letters")]
        params = {"selector": {"repositoryLocationName": repo["location"]["name"], "repositoryName": repo["name"],
                               "jobName": "curation_letters_shards",
                               "assetSelection": [{"path": path} for path in selected]},
                  "executionMetadata": {"tags": [{"key": "dagster/partition", "value": shard.key}]}}
        answer = query(LAUNCH, {"params": params})["launchRun"]
        assert answer["__typename"] == "LaunchRunSuccess", answer
        run = instance.get_run_by_id(answer["run"]["runId"])
        assert run.status == dg.DagsterRunStatus.SUCCESS and run.job_name == "curation_letters_shards"
        documents = instance.get_latest_materialization_event(asset_key("documents/letters"))
        assert documents.run_id == run.run_id and documents.asset_materialization.partition == shard.key
