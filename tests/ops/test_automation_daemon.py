"""New data reaches the token cache with no command typed, and nothing else sets automation off:
a real `dagster-daemon` ticks the new-shard sensor and the automation sensor (both on by default)
against the embedded default instance (SQLite, queued runs launched by the daemon through its
code server).

The source groups its files into shards (`files_per_shard: 2`, content-defined boundaries). The
store is built once with `marin materialize mixture/letters`; then the daemon starts. First what
churned before (issue 34): a launch through GraphQL, as the UI does, of `tokenized/letters`, and a
rerun of the whole chain (`marin materialize mixture/letters --force`: every step runs and reuses
its artifact) must make no automatic run in the automation ticks that follow. Then two files land
in the watched directory: one joins an existing shard (issue 50: its `decontaminated` and
`token_shards` partitions were never requested, and `tokenized` refused), one starts a new shard.
The test waits for `tokenized/letters` and `mixture/letters` to be committed again, failing at
once on any failed run. Only the two shards may have been encoded. The daemon's process group is
ended in teardown.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from marin_assets.curation.discovery import _unit_hash
from marin_assets.tokenization.registry import MIXTURE_VERSION, TOKENIZED_VERSION
from marin_resources.dagster_private import finished_sensor_ticks
from marin_resources.keys import asset_key
from marin_resources.storage.store import ArtifactStore
from tests.ops.conftest import stop

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Generous: sensor and automation ticks every 30 s, each run a worker process on a loaded 2-core machine.
ARRIVAL_TIMEOUT_S = 600
RUN_END_TIMEOUT_S = 180
TICKS_TIMEOUT_S = 240
LETTERS = {
    "alpha": "The harbour master counted the boats at dawn and wrote each name in a heavy green ledger. ",
    "bravo": "In the mountain village the school bell rang twice and the children climbed the steep path. ",
    "charlie": "A travelling clockmaker arrived with a cart full of gears, springs and tiny brass hammers. ",
}
# Shards start where a file's path hashes below 1/2 (`group_into_shards`): alpha | bravo, charlie.
# foxtrot joins bravo's shard; golf starts a shard of its own.
FILES_PER_SHARD = 2
JOINS, STARTS = "foxtrot", "golf"
NEW_LETTERS = {
    JOINS: "A lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp and watched the ships "
           "pass safely between the rocks while the tide turned slowly in the bay below. ",
    STARTS: "The orchard keeper pruned the old pear trees in winter and grafted young branches onto the "
            "roots so that the spring would bring a second harvest to the valley farms. ",
}
REGISTRY = """tokenizers:
  letters_bpe: {train_on: [letters], vocab_size: 400}
tokenized:
  letters: {tokenizer: letters_bpe, validation_fraction: 0.2}
mixtures:
  letters:
    tokenizer: letters_bpe
    components: {letters: {weight: 1.0}}
"""


def write_letter(directory: Path, name: str, body: str) -> None:
    (directory / f"{name}.txt").write_text("\n\n".join(f"Letter {name}, part {i}. " + body * (3 + i)
                                                       for i in range(6)))


def failure_messages(instance: dg.DagsterInstance, run_ids: list[str]) -> str:
    """Each failed run's error events, so a CI failure says why a run failed, not only that it did."""
    lines = []
    for run_id in run_ids:
        for record in instance.all_logs(run_id):
            event = record.dagster_event
            if event is not None and (event.is_failure or event.event_type_value in ("ENGINE_EVENT", "RUN_CANCELED")):
                error = getattr(event.event_specific_data, "error", None)
                lines.append(f"{run_id} {event.event_type_value}: {event.message or ''} "
                             f"{error.to_string() if error is not None else ''}")
    return "\n".join(lines)


def committed(store: ArtifactStore, key: str, version: str):
    return store.find(key, version, None)


LAUNCH = """mutation Launch($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on InvalidSubsetError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}"""
GRAPHQL_TAG = "test/launched_by"


def launch_through_graphql(key: str, env: dict) -> str:
    """Launch a materialization of ``key`` with the GraphQL mutation the UI's Materialize button sends
    (`dagster-graphql` runs it against the workspace in-process; the run is queued for the daemon)."""
    params = {"selector": {"repositoryLocationName": "marin", "repositoryName": "__repository__",
                           "jobName": "__ASSET_JOB", "assetSelection": [{"path": asset_key(key).path}]},
              "executionMetadata": {"tags": [{"key": GRAPHQL_TAG, "value": "graphql"}]}}
    out = subprocess.run([str(BIN / "dagster-graphql"), "-w", "workspace.yaml", "-t", LAUNCH, "-v",
                          json.dumps({"params": params})], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    # The answer is the first JSON document on stdout; log lines may follow it.
    answer, _ = json.JSONDecoder().raw_decode(out.stdout[out.stdout.index("{"):])
    answer = answer["data"]["launchRun"]
    assert answer["__typename"] == "LaunchRunSuccess", out.stdout + out.stderr
    return answer["run"]["runId"]


def wait_for(what: str, ready, timeout_s: float, daemon: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert daemon.poll() is None, f"dagster-daemon exited {daemon.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s; daemon log:\n{log.read_text()[-4000:]}"
        time.sleep(2)


@pytest.mark.slow  # a real dagster-daemon and its runs (minutes)
@pytest.mark.heaviest
def test_a_new_file_reaches_the_token_cache_with_no_command(tmp_path, monkeypatch):
    starts = {name: _unit_hash(f"{name}.txt") < 1 / FILES_PER_SHARD for name in [*LETTERS, *NEW_LETTERS]}
    assert starts == {"alpha": False, "bravo": True, "charlie": False, JOINS: False, STARTS: True}, starts
    letters = tmp_path / "letters"
    letters.mkdir()
    for name, body in LETTERS.items():
        write_letter(letters, name, body)
    (tmp_path / "sources.yaml").write_text(f"sources:\n  - name: letters\n    uri: {letters}/*.txt\n    format: text\n"
                                           f"    files_per_shard: {FILES_PER_SHARD}\n")
    (tmp_path / "registry.yaml").write_text(REGISTRY)
    (tmp_path / "runs.yaml").write_text("runs: {}\n")
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "DAGSTER_HOME": str(home), "MARIN_ENV": "local", "MARIN_PREFIX": str(tmp_path / "store"),
           "MARIN_SOURCES": str(tmp_path / "sources.yaml"), "MARIN_REGISTRY": str(tmp_path / "registry.yaml"),
           "MARIN_RUNS": str(tmp_path / "runs.yaml"),
           # Launching a run waits on the code server's answer; on a loaded machine Dagster's 60 s
           # deadline passed and the launch was recorded as a failed run.
           "DAGSTER_GRPC_TIMEOUT_SECONDS": "300"}
    built = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", "mixture/letters"], env=env,
                           cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0, built.stdout + built.stderr
    store = ArtifactStore(str(tmp_path / "store"))
    before = committed(store, "tokenized/letters", TOKENIZED_VERSION)
    assert before.metrics["shards"] == 2  # alpha | bravo, charlie

    log = tmp_path / "daemon.log"
    with open(log, "w") as out:
        daemon = subprocess.Popen([str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"], cwd=REPO, env=env,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    arrived = False
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            # The automation sensor's first evaluation only records where it starts.
            wait_for("first automation tick", lambda: finished_sensor_ticks(instance, "automation", 0.0) > 0,
                     TICKS_TIMEOUT_S, daemon, log)
            graphql_run = launch_through_graphql("tokenized/letters", env)
            wait_for("end of the GraphQL-launched run",
                     lambda: (run := instance.get_run_by_id(graphql_run)) is not None and run.is_finished,
                     RUN_END_TIMEOUT_S, daemon, log)
            assert instance.get_run_by_id(graphql_run).status == dg.DagsterRunStatus.SUCCESS
            rerun = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", "mixture/letters",
                                    "--force"], env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
            assert rerun.returncode == 0, rerun.stdout + rerun.stderr
            assert committed(store, "tokenized/letters", TOKENIZED_VERSION).data_version == before.data_version
            # Two full evaluations after the last of those materializations: it was seen, and ignored.
            quiet_since = time.time()
            wait_for("two automation ticks", lambda: finished_sensor_ticks(instance, "automation", quiet_since) >= 2,
                     TICKS_TIMEOUT_S, daemon, log)
            automatic = [r.run_id for r in instance.get_runs(dg.RunsFilter(tags={"dagster/sensor_name": "automation"}))]
            assert automatic == [], f"reuses set off automatic runs: {automatic}"
        mixture_reused = committed(store, "mixture/letters", MIXTURE_VERSION)

        started = time.monotonic()
        for name, body in NEW_LETTERS.items():
            write_letter(letters, name, body)

        def new_mixture() -> bool:
            # A new run's commit: the mixture rendered from the new cache (caches.json records it).
            mixture = committed(store, "mixture/letters", MIXTURE_VERSION)
            return mixture is not None and mixture.producer["run_id"] != mixture_reused.producer["run_id"]

        with dg.DagsterInstance.from_config(str(home)) as instance:
            def failed_runs() -> list[str]:
                return [r.run_id for r in instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]))]

            def new_mixture_and_no_failure() -> bool:
                failed = failed_runs()
                assert not failed, failure_messages(instance, failed)
                return new_mixture()

            wait_for("new mixture", new_mixture_and_no_failure, ARRIVAL_TIMEOUT_S, daemon, log)
        mixture = committed(store, "mixture/letters", MIXTURE_VERSION)
        arrived = True
        print(f"new file -> mixture committed in {time.monotonic() - started:.0f} s")
        # The mixture is committed before its run ends; stopping the daemon then would kill that run
        # worker and record an interrupted run. Wait until no run is queued or in flight.
        finish_by = time.monotonic() + RUN_END_TIMEOUT_S
        with dg.DagsterInstance.from_config(str(home)) as instance:
            while not all(run.is_finished for run in instance.get_runs()):
                assert time.monotonic() < finish_by, f"runs unfinished {RUN_END_TIMEOUT_S} s after the mixture"
                time.sleep(1)
    finally:
        stop(daemon, grace_s=30)
        if not arrived:  # the whole daemon log, for the CI artifacts (the assertion quotes its tail)
            (REPO / "tests" / "artifacts").mkdir(exist_ok=True)
            shutil.copy(log, REPO / "tests" / "artifacts" / "automation_daemon.log")

    after = committed(store, "tokenized/letters", TOKENIZED_VERSION)
    # The grown shard and the new one were encoded; alpha's was reused from the committed cache.
    assert (after.metrics["shards"], after.metrics["shards_reused"], after.metrics["shards_encoded"]) == (3, 1, 2)
    assert after.metrics["documents"] > before.metrics["documents"]
    grown = after.metrics["decontaminated_from"]["bravo.txt"][0]
    assert grown != before.metrics["decontaminated_from"]["bravo.txt"][0]
    assert after.data_version != before.data_version
    assert ("tokenized/letters", after.data_version) in {(u.asset_key, u.data_version) for u in mixture.upstream}
    assert mixture.data_version != mixture_reused.data_version  # a mixture over the grown cache is another one

    # Every run came from the daemon's sensors, none from a command: the new shard's raw run from
    # its sensor, the rest from automation.
    with dg.DagsterInstance.from_config(str(home)) as instance:
        daemon_runs = [r.dagster_run for r in instance.get_run_records(dg.RunsFilter(created_after=None))
                       if "marin/cli" not in r.dagster_run.tags and GRAPHQL_TAG not in r.dagster_run.tags]
        failed = [r.run_id for r in daemon_runs if r.status != dg.DagsterRunStatus.SUCCESS]
        assert daemon_runs and not failed, failure_messages(instance, failed)
        sensors = {r.tags.get("dagster/sensor_name") for r in daemon_runs}
        assert sensors == {"letters_new_shards", "automation"}, json.dumps(sorted(map(str, sensors)))
