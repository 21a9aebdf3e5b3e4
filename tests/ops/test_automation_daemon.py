"""New data reaches the token cache with no command typed: a real `dagster-daemon` ticks the
new-shard sensor and the automation sensor (both on by default) against the embedded default
instance (SQLite, queued runs launched by the daemon through its code server).

The store is built once with `marin materialize mixture/letters`; then the daemon starts, a new
file lands in the watched directory, and the test waits for `tokenized/letters` and
`mixture/letters` to be committed again. Only the new shard may have been encoded. The daemon's
process group is ended in teardown.
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

from marin_assets.tokenization.assets import MIXTURE_VERSION, TOKENIZED_VERSION
from marin_resources.store import ArtifactStore
from tests.ops.conftest import stop

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Generous: sensor and automation ticks every 30 s, each run a worker process on a loaded 2-core machine.
ARRIVAL_TIMEOUT_S = 480
RUN_END_TIMEOUT_S = 180
LETTERS = {
    "alpha": "The harbour master counted the boats at dawn and wrote each name in a heavy green ledger. ",
    "bravo": "In the mountain village the school bell rang twice and the children climbed the steep path. ",
    "charlie": "A travelling clockmaker arrived with a cart full of gears, springs and tiny brass hammers. ",
}
NEW_LETTER = ("A lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp and watched the ships "
              "pass safely between the rocks while the tide turned slowly in the bay below. ")
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


@pytest.mark.slow  # a real dagster-daemon and its runs (minutes)
@pytest.mark.heaviest
def test_a_new_file_reaches_the_token_cache_with_no_command(tmp_path, monkeypatch):
    letters = tmp_path / "letters"
    letters.mkdir()
    for name, body in LETTERS.items():
        write_letter(letters, name, body)
    (tmp_path / "sources.yaml").write_text(
        f"sources:\n  - name: letters\n    uri: {letters}/*.txt\n    format: text\n    files_per_shard: 1\n")
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
    mixture_before = committed(store, "mixture/letters", MIXTURE_VERSION)
    assert before.metrics["shards"] == 3

    log = tmp_path / "daemon.log"
    with open(log, "w") as out:
        daemon = subprocess.Popen([str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"], cwd=REPO, env=env,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    started = time.monotonic()
    arrived = False
    try:
        write_letter(letters, "delta", NEW_LETTER)
        deadline = started + ARRIVAL_TIMEOUT_S
        while True:
            assert daemon.poll() is None, f"dagster-daemon exited {daemon.returncode}:\n{log.read_text()[-3000:]}"
            # The mixture's bytes name the cache by path, so its data version stays; its record of
            # the token cache it was rendered from changes.
            mixture = committed(store, "mixture/letters", MIXTURE_VERSION)
            if mixture is not None and mixture.producer["run_id"] != mixture_before.producer["run_id"]:
                break
            assert time.monotonic() < deadline, (f"no new mixture after {ARRIVAL_TIMEOUT_S} s; daemon log:\n"
                                                 f"{log.read_text()[-4000:]}")
            time.sleep(2)
        arrived = True
        print(f"new file -> mixture committed in {time.monotonic() - started:.0f} s")
        # The mixture is committed before its run ends; stopping the daemon then would kill that run
        # worker and record an interrupted run. Wait until no run is queued or in flight.
        monkeypatch.setenv("DAGSTER_HOME", str(home))
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
    # Only the new shard was encoded; the three old ones were reused from the committed cache.
    assert (after.metrics["shards"], after.metrics["shards_reused"], after.metrics["shards_encoded"]) == (4, 3, 1)
    assert after.metrics["documents_encoded"] == after.metrics["documents"] - before.metrics["documents"] > 0
    assert after.data_version != before.data_version
    assert ("tokenized/letters", after.data_version) in {(u.asset_key, u.data_version) for u in mixture.upstream}

    # Every run came from the daemon's sensors, none from a command: the new shard's raw run from
    # its sensor, the rest from automation.
    with dg.DagsterInstance.from_config(str(home)) as instance:
        daemon_runs = [r.dagster_run for r in instance.get_run_records(dg.RunsFilter(created_after=None))
                       if "marin/cli" not in r.dagster_run.tags]
        failed = [r.run_id for r in daemon_runs if r.status != dg.DagsterRunStatus.SUCCESS]
        assert daemon_runs and not failed, failure_messages(instance, failed)
        sensors = {r.tags.get("dagster/sensor_name") for r in daemon_runs}
        assert sensors == {"letters_new_shards", "automation"}, json.dumps(sorted(map(str, sensors)))
