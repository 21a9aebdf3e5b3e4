"""`RayDataParallel`: the chunks of one step on Ray, through dagster-ray's resource (see
`marin_resources.data_parallel`). Imported only where `MARIN_RAY` chooses it; dagster-ray
imports no Ray, and Ray itself is imported when a step first has more than one chunk."""

from __future__ import annotations

import os
from collections.abc import Sequence

from dagster_ray import Lifecycle, LocalRay, RayResource

from marin_resources.data_parallel import DataParallel, byte_ranges

# Read by Ray when it is imported: no usage reporting, and no per-run uv environment built for
# the workers when the driver was started by `uv run` (they use the driver's interpreter).
RAY_PROCESS_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


class RayDataParallel(DataParallel):
    """Ranges of about `chunk_bytes`, one Ray task each on the cluster of `ray` (dagster-ray's
    `LocalRay`: started in the step's process with `ray_init_options`, e.g. a bounded `num_cpus`).
    `fn` must be importable (a module-level function): the workers import it by name."""

    ray: RayResource
    chunk_bytes: int = 32 * 1024 * 1024
    num_cpus: int = 1

    def ranges(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        return byte_ranges(sizes, self.chunk_bytes)

    def map(self, context, fn, chunks, shared):
        if len(chunks) <= 1:  # nothing to spread: Ray is not started for it
            return [fn(chunk, shared) for chunk in chunks]
        for name, value in RAY_PROCESS_ENV.items():
            os.environ.setdefault(name, value)
        import ray

        if not self.ray.connected:
            self.ray.connect(context)
        task = ray.remote(num_cpus=self.num_cpus, max_retries=0)(fn)
        shared_ref = ray.put(shared)
        context.log.info(f"{len(chunks)} chunks as Ray tasks on {ray.cluster_resources().get('CPU', 0):.0f} CPU(s)")
        return ray.get([task.remote(chunk, shared_ref) for chunk in chunks])


def local_ray_parallel(num_cpus: int, chunk_bytes: int) -> RayDataParallel:
    """Ray on this machine (or this pod) for the steps of a run: `num_cpus` workers at most, no
    dashboard; connected only when a step has more than one chunk, shut down with the run."""
    local = LocalRay(lifecycle=Lifecycle(connect=False),
                     ray_init_options={"num_cpus": num_cpus, "include_dashboard": False,
                                       "logging_level": "warning", "log_to_driver": False})
    return RayDataParallel(ray=local, chunk_bytes=chunk_bytes)
