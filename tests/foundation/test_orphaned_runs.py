"""A CLI run whose process was killed is marked failed and gives back its pool slot."""

import socket
import subprocess
import sys

import dagster as dg

from marin_assets.catalog import Catalog
from marin_assets.planning import CLI_TAG, HOST_TAG, PID_TAG, Planner
from marin_resources.dagster_private import worker_started_event_data
from marin_resources.storage.store import ArtifactStore


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


def test_a_launched_run_is_judged_by_its_worker_process_not_the_cli(tmp_path):
    """A launched run's worker outlives a killed CLI: while that worker lives the run is left alone,
    once it is gone the run is reaped."""
    @dg.asset
    def shard():
        return 1

    dead_cli = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_cli.wait()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with dg.instance_for_test() as instance:
            job = dg.Definitions(assets=[shard]).resolve_implicit_global_asset_job_def()
            run = instance.create_run_for_job(job, tags={CLI_TAG: "materialize", HOST_TAG: socket.gethostname(),
                                                         PID_TAG: str(dead_cli.pid)})
            instance.handle_run_event(run.run_id, dg.DagsterEvent(
                event_type_value=dg.DagsterEventType.RUN_START.value, job_name=run.job_name))
            instance.report_engine_event(f"Started process for run (pid: {worker.pid}).", run,
                                         worker_started_event_data(worker.pid))
            planner = Planner(dg.Definitions(assets=[shard]), Catalog(), ArtifactStore(str(tmp_path)), instance)
            assert planner.run_worker_pid(run.run_id) == str(worker.pid)
            assert planner.reap_orphaned_runs(lambda m: None) == []  # its worker still runs it
            worker.kill()
            worker.wait()
            assert planner.reap_orphaned_runs(lambda m: None) == [run.run_id]
            assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
    finally:
        worker.kill()
        worker.wait()
