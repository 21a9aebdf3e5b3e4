"""A CLI run whose process was killed is marked failed and gives back its pool slot."""

import socket
import subprocess
import sys

import dagster as dg

from marin_assets.catalog import Catalog
from marin_assets.planning import CLI_TAG, HOST_TAG, PID_TAG, Planner
from marin_resources.store import ArtifactStore


def test_dead_cli_run_is_reaped_and_its_slot_freed(tmp_path):
    @dg.asset(pool="cpu-train")
    def trained():
        return 1

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with dg.instance_for_test() as instance:
        instance.event_log_storage.set_concurrency_slots("cpu-train", 1)
        job = dg.Definitions(assets=[trained]).resolve_implicit_global_asset_job_def()
        run = instance.create_run_for_job(job, tags={CLI_TAG: "materialize", HOST_TAG: socket.gethostname(),
                                                     PID_TAG: str(dead.pid)})
        instance.handle_run_event(run.run_id, dg.DagsterEvent(
            event_type_value=dg.DagsterEventType.RUN_START.value, job_name=run.job_name))
        instance.event_log_storage.claim_concurrency_slot("cpu-train", run.run_id, "trained")
        assert instance.event_log_storage.get_concurrency_info("cpu-train").claimed_slots

        planner = Planner(dg.Definitions(assets=[trained]), Catalog(), ArtifactStore(str(tmp_path)), instance)
        messages = []
        assert planner.reap_orphaned_runs(messages.append) == [run.run_id]
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
        assert not instance.event_log_storage.get_concurrency_info("cpu-train").claimed_slots
        assert planner.reap_orphaned_runs(messages.append) == []  # idempotent
