"""`RayDataParallel`: the chunks of one step on Ray, through dagster-ray's resource (see
`marin_resources.data_parallel`). Imported only where `MARIN_RAY` chooses it; dagster-ray
imports no Ray, and Ray itself is imported when a step first has more than one chunk.

Two Rays: `local_ray_parallel` starts one in the step's process (`MARIN_RAY=local`);
`cluster_ray_parallel` connects to a running cluster (`MARIN_RAY=cluster`, its address from
`RAY_ADDRESS`), checked for an answer before the step's body runs.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Sequence

import dagster as dg
from dagster_ray import Lifecycle, LocalRay, RayResource

from marin_resources.data_parallel import DataParallel, balanced_ranges
from marin_resources.ray_address import RayUnavailableError, ray_host_port

# Read by Ray when it is imported: no usage reporting, and no per-run uv environment built for
# the workers when the driver was started by `uv run` (they use the driver's interpreter).
RAY_PROCESS_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
# A task whose worker or node dies is run again (on a node still alive), up to this many times; an
# exception raised by the chunk function itself is not retried: it would fail the same way again.
TASK_RETRIES = 3
REACH_TIMEOUT_S = 5.0
RAY_NODES_KEY = "marin/ray_nodes"
RAY_TASKS_KEY = "marin/ray_tasks"


class RayCluster(RayResource):
    """A Ray cluster that is already running, at `address`: the head's GCS (`host:6379`; the
    driver then runs on a node of the cluster) or Ray Client (`ray://host:10001`, from anywhere).
    Nothing is created or deleted; `ray.init` connects and the run's end disconnects."""

    address: str

    @property
    def host(self) -> str:
        return ray_host_port(self.address)[0]

    @property
    def ray_address(self) -> str:
        return self.address

    @property
    def name(self) -> str:
        return f"the Ray cluster at {self.address}"

    @property
    def created(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return True

    @contextlib.contextmanager
    def yield_for_execution(self, context: dg.InitResourceContext) -> Iterator[RayCluster]:
        # A run launched without the CLI (UI, sensor) learns of a dead cluster here, when it sets up its
        # resources, before any asset body builds anything, rather than from `ray.init` mid-step.
        check_reachable(self.address)
        with super().yield_for_execution(context) as resource:
            yield resource


def check_reachable(address: str) -> None:
    """One TCP connection to the cluster's address: a missing or unreachable head fails here in one
    line naming RAY_ADDRESS, within REACH_TIMEOUT_S, where `ray.init` keeps trying for minutes."""
    try:
        socket.create_connection(ray_host_port(address), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise RayUnavailableError(f"cannot reach the Ray cluster at RAY_ADDRESS={address} "
                                  f"({type(exc).__name__}: {exc})") from None


def import_ray():
    """`ray`, with RAY_PROCESS_ENV's settings in force even where Ray was imported earlier."""
    for name, value in RAY_PROCESS_ENV.items():
        os.environ.setdefault(name, value)
    import ray
    from ray._private import ray_constants

    # Ray reads that variable once, at its first import. A process that imported Ray before (Levanter
    # does) would otherwise, under `uv run`, have every worker build and byte-compile a copy of the
    # environment first: minutes of both cores, measured in CI.
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    return ray


def _run_on_node(fn, chunk, shared):
    """One chunk as a Ray task: `fn`'s result, and the node it ran on."""
    import ray

    return fn(chunk, shared), ray.get_runtime_context().get_node_id()


class RayDataParallel(DataParallel):
    """Ranges of about `chunk_bytes`, one Ray task each on the cluster of `ray` (dagster-ray's
    `LocalRay`, started in the step's process, or `RayCluster`). `fn` must be importable (a
    module-level function): the workers import it by name. The step's materialization records
    how many tasks ran (`marin/ray_tasks`) and on which nodes (`marin/ray_nodes`)."""

    ray: RayResource
    chunk_bytes: int = 32 * 1024 * 1024
    chunk_documents: int = 200_000
    """A task's share of a pass that is cheap per byte: ``deduplicated`` writes about 50,000
    documents a second per core (measured here), so a task holds some 4 s of work, past what its
    worker's start costs (about 3 s on a fresh Ray job, measured on the two-worker benchmark)."""
    num_cpus: int = 1
    cpus: int | None = None
    """The CPUs the tasks share, where known: a step's chunks are then as many as fill them evenly
    (`balanced_ranges`)."""

    def ranges(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        return balanced_ranges(sizes, self.chunk_bytes, self.slots)

    def document_ranges(self, documents: Sequence[int]) -> list[tuple[int, int]]:
        return balanced_ranges(documents, self.chunk_documents, self.slots)

    @property
    def slots(self) -> int | None:
        """How many tasks run at once, where the CPUs are known."""
        return None if self.cpus is None else max(1, self.cpus // self.num_cpus)

    def worth_spreading(self, nbytes: int) -> bool:
        # Less than a chunk's worth of work takes less time than starting Ray's workers for it.
        return nbytes >= self.chunk_bytes

    def map(self, context, fn, chunks, shared):
        if len(chunks) <= 1:  # nothing to spread: Ray is not started for it
            return [fn(chunk, shared) for chunk in chunks]
        ray = import_ray()
        if not self.ray.connected:
            self.ray.connect(context)
        # SPREAD: the chunks are alike and CPU-bound, so every node takes its share from the start
        # rather than once the driver's node is full. Named after `fn`, as its worker's process title
        # (`ray::filter_chunk`) and Ray's task lists show it.
        task = ray.remote(num_cpus=self.num_cpus, max_retries=TASK_RETRIES, scheduling_strategy="SPREAD")(
            _run_on_node).options(name=fn.__name__)
        shared_ref = ray.put(shared)
        context.log.info(f"{len(chunks)} chunks as Ray tasks on {ray.cluster_resources().get('CPU', 0):.0f} CPU(s)")
        results = ray.get([task.remote(fn, chunk, shared_ref) for chunk in chunks])
        nodes = sorted({node for _, node in results})
        context.log.info(f"{len(chunks)} Ray tasks ran on {len(nodes)} node(s): {', '.join(nodes)}")
        self._record(context, len(chunks), nodes)
        return [result for result, _ in results]

    @staticmethod
    def _record(context: dg.AssetExecutionContext, tasks: int, nodes: list[str]) -> None:
        """Add this map's tasks and nodes to the step's materialization (a step may map more than once)."""
        output = context.assets_def.get_output_name_for_asset_key(context.asset_key)
        earlier = context.get_output_metadata(output) or {}
        context.add_output_metadata({RAY_TASKS_KEY: earlier.get(RAY_TASKS_KEY, 0) + tasks,
                                     RAY_NODES_KEY: sorted({*earlier.get(RAY_NODES_KEY, []), *nodes})},
                                    output_name=output)


def local_ray_parallel(num_cpus: int, chunk_bytes: int, dedup_batch_shards: int = 8,
                       chunk_documents: int = 200_000) -> RayDataParallel:
    """Ray on this machine (or this pod) for the steps of a run: `num_cpus` workers at most, no
    dashboard; connected only when a step has more than one chunk, shut down with the run."""
    local = LocalRay(lifecycle=Lifecycle(connect=False),
                     ray_init_options={"num_cpus": num_cpus, "include_dashboard": False,
                                       "logging_level": "warning", "log_to_driver": False})
    return RayDataParallel(ray=local, cpus=num_cpus, chunk_bytes=chunk_bytes, chunk_documents=chunk_documents,
                           dedup_batch_shards=dedup_batch_shards)


def cluster_ray_parallel(address: str, chunk_bytes: int, dedup_batch_shards: int = 8,
                         chunk_documents: int = 200_000, cpus: int | None = None) -> RayDataParallel:
    """The Ray cluster at `address` for the steps of a run: checked when a step that may use it
    starts, connected only when a step has more than one chunk, disconnected (never stopped) after."""
    # cleanup="never": the cluster is not this run's to delete (dagster-ray's default logged "Deleted
    # the Ray cluster" at every run's end, though nothing was deleted).
    cluster = RayCluster(address=address, lifecycle=Lifecycle(connect=False, cleanup="never"),
                         ray_init_options={"logging_level": "warning", "log_to_driver": False})
    return RayDataParallel(ray=cluster, cpus=cpus, chunk_bytes=chunk_bytes, chunk_documents=chunk_documents,
                           dedup_batch_shards=dedup_batch_shards)
