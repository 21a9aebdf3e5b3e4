"""Run submission: starting the plan's Dagster runs and reading back what they did.

The submitters (`RunSubmitter`: `InProcessRuns` in this process, `WorkspaceRuns` through the
instance's run launcher), how many runs go at once by default, each in-flight run's progress lines
(`RunProgress`), and a finished run's outcome (failed ERROR checks, its step failures, a worker
process that died). The planner (`planning.py`) decides which steps run and when; this module only
talks to Dagster about runs. Private Dagster APIs are reached through
`marin_resources/dagster_private.py` alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Protocol

import dagster as dg

from marin_resources.artifacts import REFUSED_METADATA_KEY
from marin_resources.dagster_private import (
    NO_MORE_RUNS_FILE_ENV,
    PARTITION_NAME_TAG,
    RUNS_START_HERE_ENV,
    open_workspace,
    run_request_execution_data,
)
from marin_resources.failures import describe_check, describe_error, failure_outside_steps
from marin_resources.new_shard_launcher import launcher_for
from marin_resources.progress import PRINT_EVERY_S, parse_line

Log = Callable[[str], None]


class RunProgress:
    """Prints what in-flight runs report (marin_resources.progress): each run's notices at once
    (where its process logs), its newest progress line at most every PRINT_EVERY_S, read from the
    run's event log past a cursor, at most every POLL_S per run."""

    POLL_S = 1.0

    def __init__(self, instance: dg.DagsterInstance, log: Log, *, print_every_s: float = PRINT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.instance, self.log, self.print_every_s, self.clock = instance, log, print_every_s, clock
        self.cursors: dict[str, str | None] = {}
        self.polled: dict[str, float] = {}
        self.printed: dict[str, float] = {}
        self.newest: dict[str, str] = {}  # a run's newest progress line not yet printed

    def show(self, run_id: str, label: str) -> None:
        now = self.clock()
        if now - self.polled.get(run_id, -math.inf) < self.POLL_S:
            return
        self.polled[run_id] = now
        connection = self.instance.event_log_storage.get_records_for_run(run_id, cursor=self.cursors.get(run_id))
        self.cursors[run_id] = connection.cursor
        for record in connection.records:
            entry = record.event_log_entry
            parsed = parse_line(entry.user_message) if entry.dagster_event is None else None
            if parsed is None:
                continue
            kind, text = parsed
            if kind == "notice":
                self.log(f"          {label}: {text}")
            else:
                self.newest[run_id] = text
        if run_id in self.newest and now - self.printed.get(run_id, -math.inf) >= self.print_every_s:
            self.log(f"          {label}: {self.newest.pop(run_id)}")
            self.printed[run_id] = now


class RunSubmitter(Protocol):
    """Starts one Dagster run of some assets for one partition and returns its run id; the
    planner follows the run through the instance's run records."""

    max_parallel: int

    def submit(self, keys: list[dg.AssetKey], checks: list[dg.AssetCheckKey], partition: str | None,
               run_config: dict, tags: dict[str, str]) -> str: ...

    def no_more_runs(self) -> None:
        """The next run submitted is the last: nothing need be made ready for one after it."""


class InProcessRuns:
    """Runs in this process, one at a time, for Definitions that no workspace can load (tests,
    notebooks); the run is recorded in the instance like any other."""

    max_parallel = 1

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance):
        self.defs, self.instance = defs, instance

    def submit(self, keys, checks, partition, run_config, tags) -> str:
        result = dg.materialize(
            assets=list(self.defs.assets or []) + list(self.defs.asset_checks or []),
            selection=dg.AssetSelection.assets(*keys), partition_key=partition, instance=self.instance,
            resources=self.defs.resources, run_config=run_config, raise_on_error=False, tags=tags)
        return result.run_id

    def no_more_runs(self) -> None:
        pass


class WorkspaceRuns:
    """Real runs of the code location's asset job, started by the instance's run launcher.

    On the embedded default that is the DefaultRunLauncher: each run is a worker subprocess of the
    workspace's code server, so partitions run in parallel processes sharing the instance (runs,
    events, pool slots). On Kubernetes the same call through K8sRunLauncher starts one Job (pod)
    per run. Runs are launched directly, not queued: the CLI bounds how many are in flight, and
    no daemon is needed to dequeue them. Each run executes its steps in-process, so a partition
    costs one worker process, not one per step; pools are still claimed per step."""

    max_parallel = 1 << 16

    def __init__(self, instance: dg.DagsterInstance, workspace_file: str):
        self.instance, self.workspace_file = instance, workspace_file
        self._stack = contextlib.ExitStack()
        self._plans: dict = {}
        self._loop = asyncio.new_event_loop()
        self._stack.callback(self._loop.close)
        self._launches = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="marin-launch")
        self._stack.callback(self._launches.shutdown)

    def __enter__(self) -> WorkspaceRuns:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @functools.cached_property
    def runs_start_here(self) -> bool:
        """Whether this workspace's code server starts the runs' workers (the DefaultRunLauncher). The
        CLI's runs are outside the new-shard flow: a NewShardRunLauncher gives them to the one it wraps."""
        return isinstance(launcher_for(self.instance.run_launcher), dg.DefaultRunLauncher)

    @functools.cached_property
    def workspace(self):
        """The workspace's request context; its code server starts on the first run, so a plan
        with nothing to build starts none."""
        if self.runs_start_here:
            os.environ[RUNS_START_HERE_ENV] = "1"  # its code server warms the first run's worker as it loads
            directory = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="marin-runs-",
                                                                              ignore_cleanup_errors=True))
            os.environ[NO_MORE_RUNS_FILE_ENV] = os.path.join(directory, "no-more-runs")
            self._stack.callback(os.environ.pop, NO_MORE_RUNS_FILE_ENV, None)  # no later server inherits it
        workspace = open_workspace(self._stack, self.instance, self.workspace_file)
        errors = [e for e in workspace.get_code_location_entries().values() if e.load_error is not None]
        if errors:
            raise RuntimeError(f"code location {errors[0].origin.location_name} failed to load: "
                               f"{errors[0].load_error.message.strip()}")
        return workspace

    def submit(self, keys, checks, partition, run_config, tags) -> str:
        run_tags = {**tags, **({PARTITION_NAME_TAG: partition} if partition is not None else {})}
        config = {**run_config, "execution": {"config": {"in_process": {}}}}
        request = dg.RunRequest(asset_selection=keys, asset_check_keys=checks, run_config=config, tags=run_tags)
        # One event loop for the workspace's life: its data loaders are bound to the loop they first ran on.
        data = self._loop.run_until_complete(
            run_request_execution_data(self.workspace, request, self.instance, self._plans))
        job = data.remote_job
        run = self.instance.create_run(
            job_name=job.name, run_id=None, run_config=config, resolved_op_selection=None, op_selection=None,
            step_keys_to_execute=None, status=dg.DagsterRunStatus.NOT_STARTED, tags=run_tags,
            root_run_id=None, parent_run_id=None, job_snapshot=job.job_snapshot,
            execution_plan_snapshot=data.remote_execution_plan.execution_plan_snapshot,
            parent_job_snapshot=job.parent_job_snapshot, remote_job_origin=job.get_remote_origin(),
            job_code_origin=job.get_python_origin(), asset_selection=frozenset(keys),
            asset_check_selection=frozenset(checks), asset_graph=self.workspace.asset_graph)
        # Launching waits for the worker to load the code location (seconds): do it off this thread,
        # so the next partition's run is created and launched meanwhile.
        self._launches.submit(self._launch, run)
        return run.run_id

    def no_more_runs(self) -> None:
        """Tell the code server to warm no run worker after the next run (`warm_run_workers`)."""
        if self.runs_start_here:
            self.workspace  # noqa: B018 -- opened first: it names the file
            with open(os.environ[NO_MORE_RUNS_FILE_ENV], "w"):
                pass

    def _launch(self, run: dg.DagsterRun) -> None:
        try:
            self.instance.launch_run(run.run_id, self.workspace)
        except Exception as exc:  # noqa: BLE001 -- recorded on the run, which the planner then reports
            current = self.instance.get_run_by_id(run.run_id)
            if current is not None and not current.is_finished:
                self.instance.report_run_failed(current, f"launch failed: {type(exc).__name__}: {exc}")


def default_parallelism(instance: dg.DagsterInstance) -> int:
    """Runs in flight at once by default: one per core, and no more than the instance's run limit
    (`concurrency.runs.max_concurrent_runs`, which the webserver's and sensors' queued runs obey)."""
    cores = os.cpu_count() or 1
    queue = instance.get_concurrency_config().run_queue_config
    limit = queue.max_concurrent_runs if queue is not None else -1
    return max(1, min(cores, limit) if limit > 0 else cores)


def process_gone(pid: str | int) -> bool:
    """True when no process with this pid exists on this host (one of another user's counts as alive)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def failed_error_checks(evaluations) -> list[str]:
    """`asset:check (metadata)` for each failed ERROR-severity check evaluation: they fail the command."""
    return [describe_check(e) for e in evaluations if not e.passed and e.severity == dg.AssetCheckSeverity.ERROR]


# What Dagster records when a run is marked failed with no message (e.g. by the code server that
# started a worker which then died).
OUTSIDE_FAILURE = "This run has been marked as failed from outside the execution context."


def worker_died(pid: str) -> str:
    return f"its worker process (pid {pid}) died without reporting an end"


def quiet_run_config() -> dict:
    """Dagster's console logger at WARNING: the CLI prints its own progress."""
    return {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def step_failures(instance: dg.DagsterInstance, run_id: str) -> list:
    """The STEP_FAILURE events of a run, read once for its message and for whether it refused."""
    return [entry.dagster_event for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
            if entry.dagster_event is not None]


def refused_input(failures: list) -> bool:
    """Whether a failed run's steps (``step_failures``) failed only by refusing their input (`input_refused`)."""
    return bool(failures) and all(
        (data := event.step_failure_data).user_failure_data is not None
        and REFUSED_METADATA_KEY in (data.user_failure_data.metadata or {})
        for event in failures)


def failure_message(instance: dg.DagsterInstance, run_id: str, failures: list) -> str:
    """The first step failure of a run (``step_failures``), unwrapped to the user's error; else why
    the run failed outside its steps (`failure_outside_steps`)."""
    for event in failures:
        if event.step_failure_data.error:
            return f"{event.step_key}: {describe_error(event.step_failure_data.error)}"
    return failure_outside_steps(instance, run_id)[1]
