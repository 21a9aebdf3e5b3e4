"""Dagster's private APIs, wrapped: the one module that imports ``dagster._core`` (and Dagster's other
underscored packages). Each name here stands where Dagster 1.13.27, the version pyproject.toml pins,
has no public equivalent; everything else uses ``dg.`` names.

tests/foundation/test_dagster_private.py calls every one of them against the installed Dagster, so an
upgrade that moves, renames or changes one fails there, naming it, instead of in a run. The last
group serves the tests only: they check what Dagster itself records or configures.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import dagster as dg
from dagster._core.definitions.data_version import DATA_VERSION_TAG  # noqa: F401 - re-exported, see below
from dagster._core.storage.tags import GRPC_INFO_TAG, PARTITION_NAME_TAG  # noqa: F401 - re-exported, see below

# DATA_VERSION_TAG: the tag an asset event's data version rides on. A public AssetObservation takes
# no data version, only tags, so a runless observation of one partition (the planner's, a sensor's)
# states its version with this tag.
# PARTITION_NAME_TAG: the run tag naming a run's partition, for the runs the planner creates itself.
# GRPC_INFO_TAG (tests): the tag of a run launched through a code server, naming that server.


def observable_source_assets_def(source_asset: dg.SourceAsset) -> dg.AssetsDefinition:
    """The AssetsDefinition Dagster itself makes of an observable source asset when it loads one, so
    its specs can be mapped (`@dg.observable_source_asset` takes no owners; an AssetSpec does)."""
    from dagster._core.definitions.external_asset import create_external_asset_from_source_asset

    return create_external_asset_from_source_asset(source_asset)


def open_workspace(stack: contextlib.ExitStack, instance: dg.DagsterInstance, workspace_file: str):
    """A request context over the code locations of ``workspace_file`` (a workspace.yaml), whose
    code servers start here and stop when ``stack`` closes: what `dagster dev` holds, for a process
    that creates and launches runs itself."""
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import WorkspaceFileTarget

    process = stack.enter_context(WorkspaceProcessContext(instance, WorkspaceFileTarget(paths=[workspace_file])))
    return process.create_request_context()


def webserver_app(stack: contextlib.ExitStack, instance: dg.DagsterInstance, workspace_file: str):
    """The ASGI app `dagster-webserver` serves (the UI and its GraphQL endpoint) over the code locations of
    ``workspace_file``, set up as that command sets it up; its code servers stop when ``stack`` closes."""
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import WorkspaceFileTarget
    from dagster_webserver.app import create_app_from_workspace_process_context
    from dagster_webserver.cli import DEFAULT_DB_STATEMENT_TIMEOUT, DEFAULT_POOL_MAX_OVERFLOW, DEFAULT_POOL_RECYCLE
    from dagster_webserver.version import __version__

    instance.optimize_for_webserver(DEFAULT_DB_STATEMENT_TIMEOUT, DEFAULT_POOL_RECYCLE, DEFAULT_POOL_MAX_OVERFLOW)
    process = stack.enter_context(WorkspaceProcessContext(instance, WorkspaceFileTarget(paths=[workspace_file]),
                                                          version=__version__))
    return create_app_from_workspace_process_context(process)


async def run_request_execution_data(workspace, request: dg.RunRequest, instance: dg.DagsterInstance,
                                     cache: dict):
    """The remote job and execution plan of ``request``'s asset selection in ``workspace``, as the
    daemon's sensors compute them before creating a run (``cache`` is reused across requests)."""
    from dagster._core.execution.submit_asset_runs import get_job_execution_data_from_run_request

    return await get_job_execution_data_from_run_request(workspace.asset_graph, request, instance, workspace, cache)


# What a run worker imports before it loads the code location, and nothing that starts a thread
# (numpy's BLAS, pyarrow's and polars' pools do): a process with threads cannot be forked safely.
# The last is for the fork server itself: it ends without the interpreter's teardown.
RUN_WORKER_PRELOAD = ("dagster", "dagster._grpc.impl", "dagster._core.storage.runs.sqlite", "alembic",
                     "marin_resources.fork_server")


# The fork server listens on a Unix socket at <tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX, and a
# socket path has at most 107 bytes (Linux's sun_path): under a longer TMPDIR, workers are spawned.
_FORK_SERVER_SOCKET_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
_UNIX_SOCKET_PATH_MAX = 107


# Set by a process that launches runs through the code servers it starts (the CLI on the embedded
# default): those servers warm their first spare as they load, not when the first run asks.
RUNS_START_HERE_ENV = "MARIN_RUNS_START_IN_THIS_CODE_SERVER"
# A file that process creates before it launches its last run: then no spare is warmed after that run.
NO_MORE_RUNS_FILE_ENV = "MARIN_NO_MORE_RUNS_FILE"


def warm_run_workers(module: str) -> str | None:
    """Make this process's code server start each run in a warm spare (`marin_resources/run_workers.py`):
    a process that has imported ``module``, the code location, before the run asks for it.

    Dagster's gRPC code server starts each run's worker with the multiprocessing context
    ``DagsterApiServer._mp_ctx``, set in ``__init__`` (which may run before the code location is
    imported): a data descriptor on the class wins over that instance attribute. The spares start
    from a ``forkserver`` that imported ``RUN_WORKER_PRELOAD`` once, in a process of its own with one
    thread, rather than each importing Dagster again; where the temporary directory's path is too long
    for the fork server's socket, they are spawned. The first spare waits for the first run, unless
    ``RUNS_START_HERE_ENV`` says runs will come: then it starts now, beside the rest of the load (a
    code server whose runs are pods never holds one). Once the file ``NO_MORE_RUNS_FILE_ENV`` names
    exists, a run that starts warms no spare after it. Returns the spares' start method, or None in a
    process that runs no code server (one that has not imported ``dagster._grpc.server``; it is left
    alone and spared that import).
    """
    import multiprocessing
    import os
    import sys
    import tempfile
    import threading

    from marin_resources.run_workers import WarmRunWorkers

    server = sys.modules.get("dagster._grpc.server")
    if server is None:
        return None
    if len(tempfile.gettempdir().encode()) + _FORK_SERVER_SOCKET_SUFFIX > _UNIX_SOCKET_PATH_MAX:
        context = multiprocessing.get_context("spawn")
    else:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(RUN_WORKER_PRELOAD))
    no_more_runs_file = os.environ.get(NO_MORE_RUNS_FILE_ENV)
    workers = WarmRunWorkers(context, module,
                             no_more_runs=(lambda: os.path.exists(no_more_runs_file)) if no_more_runs_file else
                             (lambda: False))
    server.DagsterApiServer._mp_ctx = property(lambda self: workers, lambda self, value: None)
    if os.environ.get(RUNS_START_HERE_ENV) == "1":
        # In a thread: the fork server's start imports Dagster (seconds), and the load goes on meanwhile.
        threading.Thread(target=workers.warm_next, name="marin-warm-first-run", daemon=True).start()
    return context.get_start_method()


def end_code_server_when_it_stops() -> bool:
    """Make this process's code server end without Python's teardown once it stops serving
    (`marin_resources/process_exit.py`): about a second of CPU, after the `marin` command that
    stopped it has returned, and an EOF that whoever reads the command's output waits for.

    ``DagsterGrpcServer.serve`` returns once the server has stopped and its calls have ended; the
    `dagster api grpc` command then only logs and returns 0. That return now ends the process, exit
    handlers run (the idle run worker, multiprocessing's children) and exit code 0. A ``serve`` that
    raises propagates as before. The code location is loaded before ``serve`` is called, so the
    class's method is the one called. Returns whether it was installed: only in a process that runs
    a code server (one that has imported ``dagster._grpc.server``; any other is left alone).
    """
    import sys

    from marin_resources.process_exit import exit_now

    server = sys.modules.get("dagster._grpc.server")
    if server is None:
        return False
    serve = server.DagsterGrpcServer.serve
    if getattr(serve, "_marin_ends_process", False):
        return True

    def serve_then_end(self) -> None:
        serve(self)
        exit_now(0)

    serve_then_end._marin_ends_process = True
    server.DagsterGrpcServer.serve = serve_then_end
    return True


def automation_instance(context: dg.AutomationContext) -> dg.DagsterInstance:
    """The instance a custom automation condition is evaluated against (its runs, its events)."""
    return context.asset_graph_view.instance


def subset_partition_keys(subset) -> set[str | None]:
    """The partition keys of an automation condition's entity subset ({None} for a whole unpartitioned asset)."""
    if not subset.is_partitioned:
        return set() if subset.is_empty else {None}
    return set(subset.expensively_compute_partition_keys())


def subset_of_partitions(subset, keys: set[str | None]):
    """The part of ``subset`` whose partition keys are in ``keys``."""
    if not subset.is_partitioned:
        return subset if None in keys else subset.compute_difference(subset)
    return subset.compute_intersection_with_partition_keys({k for k in keys if k is not None})


def store_runless_events(instance: dg.DagsterInstance, events: list, batch: int = 5_000) -> None:
    """What `report_runless_asset_event` records for each of ``events`` (materializations, or
    observations: one kind), written ``batch`` at a time: one insert per event took minutes for the
    tens of thousands of partitions the benchmarks set up."""
    from dagster._core.events import AssetObservationData, DagsterEvent, DagsterEventType, StepMaterializationData
    from dagster._core.events.log import EventLogEntry
    from dagster._core.instance.utils import RUNLESS_JOB_NAME, RUNLESS_RUN_ID

    def entry(event) -> EventLogEntry:
        kind, data = (DagsterEventType.ASSET_MATERIALIZATION, StepMaterializationData(event)) \
            if isinstance(event, dg.AssetMaterialization) else (DagsterEventType.ASSET_OBSERVATION,
                                                                AssetObservationData(event))
        happened = DagsterEvent(event_type_value=kind.value, event_specific_data=data, job_name=RUNLESS_JOB_NAME)
        return EventLogEntry(error_info=None, level="debug", user_message="", run_id=RUNLESS_RUN_ID,
                             timestamp=time.time(), step_key=None, job_name=RUNLESS_JOB_NAME, dagster_event=happened)

    for start in range(0, len(events), batch):
        instance.event_log_storage.store_event_batch([entry(e) for e in events[start:start + batch]])


# For the tests: what Dagster itself reads, records or configures, checked as it is.


def finished_sensor_ticks(instance: dg.DagsterInstance, sensor_name: str, after: float) -> int:
    """How many evaluations of the sensor ``sensor_name`` completed (run requests or a skip) after
    the timestamp ``after``."""
    from dagster._core.scheduler.instigation import TickStatus

    return sum(len(instance.get_ticks(state.instigator_origin_id, state.selector_id, after=after,
                                      statuses=[TickStatus.SUCCESS, TickStatus.SKIPPED]))
               for state in instance.all_instigator_state() if state.instigator_name == sensor_name)


def instance_yaml_config(dagster_home: str) -> dict[str, Any]:
    """``dagster_home``'s dagster.yaml, validated and with its defaults, as the instance reads it."""
    from dagster._core.instance.config import dagster_instance_config

    config, custom_class = dagster_instance_config(dagster_home)
    if custom_class is not None:
        raise ValueError(f"{dagster_home}/dagster.yaml names a custom instance class {custom_class!r}")
    return config


def plugin_config_errors(section: dict[str, Any]) -> list[str]:
    """The errors of an instance section's plugin config (``module``/``class``/``config``, as a run
    launcher's) against that class's own schema, which the instance schema treats as opaque."""
    from dagster._config import process_config
    from dagster._serdes import class_from_code_pointer

    klass = class_from_code_pointer(section["module"], section["class"])
    result = process_config(klass.config_type(), section.get("config", {}))
    return [] if result.success else [error.message for error in result.errors]


def python_job_origin(job_name: str, executable: str, module: str, attribute: str, working_directory: str,
                      container_image: str):
    """Where a run's job is loaded from in its worker (``module.attribute`` in an image), as a run
    launcher reads it off the run."""
    from dagster._core.code_pointer import ModuleCodePointer
    from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin

    pointer = ModuleCodePointer(module, attribute, working_directory=working_directory)
    return JobPythonOrigin(job_name, RepositoryPythonOrigin(executable, pointer, container_image=container_image))


def launch_run_context(run: dg.DagsterRun):
    """What ``run_launcher.launch_run`` takes, for a run launched outside any workspace."""
    from dagster._core.launcher import LaunchRunContext

    return LaunchRunContext(dagster_run=run, workspace=None)


def worker_started_event_data(pid: int):
    """The engine event data a run launcher records when the run's worker process starts."""
    from dagster._core.events import EngineEventData

    return EngineEventData.in_process(pid)


def stale_status_reader(instance: dg.DagsterInstance, asset_graph) -> Callable[[dg.AssetKey, str | None], str]:
    """``status(key, partition)``: Dagster's own staleness of an asset partition, as the UI shows it
    ("fresh", "stale" or "missing"), from the instance's data versions."""
    from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
    from dagster._core.loader import LoadingContextForTest

    resolver = CachingStaleStatusResolver(instance, asset_graph, LoadingContextForTest(instance))
    names = {StaleStatus.FRESH: "fresh", StaleStatus.STALE: "stale", StaleStatus.MISSING: "missing"}
    return lambda key, partition: names[resolver.get_status(key, partition)]


@contextlib.contextmanager
def graphql_on_a_python_file(instance: dg.DagsterInstance, python_file: str, attribute: str):
    """(tests) ``query(text, variables) -> data`` against Dagster's GraphQL schema, over the code location
    ``attribute`` of ``python_file`` loaded in this process: what a GraphQL client of the webserver sees."""
    from dagster._core.test_utils import in_process_test_workspace
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
    from dagster_graphql.test.utils import execute_dagster_graphql

    with in_process_test_workspace(instance, LoadableTargetOrigin(python_file=python_file, attribute=attribute)) \
            as context:
        yield lambda text, variables=None: execute_dagster_graphql(context, text, variables).data


# An instance that launches each run at once and runs it in the launching process (tests): Dagster's
# own test run launcher, with no queue for a daemon to drain.
RUN_IN_PROCESS_INSTANCE = {
    "run_coordinator": {"module": "dagster._core.run_coordinator", "class": "DefaultRunCoordinator"},
    "run_launcher": {"module": "dagster._core.launcher.sync_in_memory_run_launcher",
                     "class": "SyncInMemoryRunLauncher"}}

