"""Where a process runs: accelerator kind and count, TPU slice, scheduling pool.

Runtime only: a run's placement never enters its identity, so moving a run from CPU to a TPU
pool does not invalidate its artifacts. Launchers read it; the training run specs carry one.
The TPU slice geometry (chips, ICI topology, hosts of a Cloud TPU type) lives here, without any
cluster import, because a run's default mesh depends on how many hosts hold its devices.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from marin_resources.config_identity import runtime
from marin_resources.typed_config import typed_config

Accelerator = Literal["cpu", "gpu", "tpu"]


class PlacementError(ValueError):
    """A placement no machine offers (an unknown TPU type, a slice size that does not exist)."""


@dataclass(frozen=True)
class TpuGeneration:
    gke_accelerator: str
    # Cloud TPU type names count TensorCores for v4/v5p ("v4-16" = 8 chips) but chips for
    # v5e/v6e ("v5litepod-16" = 16 chips).
    cores_per_chip: int
    chips_per_host: tuple[int, ...]


TPU_GENERATIONS: dict[str, TpuGeneration] = {
    "v4": TpuGeneration("tpu-v4-podslice", cores_per_chip=2, chips_per_host=(4,)),
    "v5p": TpuGeneration("tpu-v5p-slice", cores_per_chip=2, chips_per_host=(4,)),
    "v5litepod": TpuGeneration("tpu-v5-lite-podslice", cores_per_chip=1, chips_per_host=(1, 4, 8)),
    "v6e": TpuGeneration("tpu-v6e-slice", cores_per_chip=1, chips_per_host=(1, 4, 8)),
}

# GKE's topology for a whole slice of each size (chips -> ICI shape): v5e/v6e slices are 2D,
# v4/v5p slices 3D. Single-host machine types carry up to 8 (v5e/v6e) or 4 (v4/v5p) chips;
# multi-host slices use 4-chip hosts.
_SLICE_TOPOLOGIES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
                        256: "16x16"}
_SLICE_TOPOLOGIES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
                        256: "4x8x8", 512: "8x8x8"}
_MULTI_HOST_CHIPS_PER_HOST = 4


def tpu_generation(tpu_type: str) -> tuple[str, TpuGeneration]:
    """(generation name, its geometry) of a Cloud TPU type such as ``v5litepod-16``."""
    generation, _, size = tpu_type.rpartition("-")
    if generation not in TPU_GENERATIONS or not size.isdigit():
        known = ", ".join(f"{g}-N" for g in TPU_GENERATIONS)
        raise PlacementError(f"unknown TPU type {tpu_type!r}; expected one of {known}")
    return generation, TPU_GENERATIONS[generation]


def tpu_slice_geometry(tpu_type: str) -> tuple[int, str, int]:
    """(chips, ICI topology, hosts) of the whole slice a TPU type names: ``v5litepod-16`` is 16, 4x4, 4."""
    _, gen = tpu_generation(tpu_type)
    chips = int(tpu_type.rpartition("-")[2]) // gen.cores_per_chip
    topologies = _SLICE_TOPOLOGIES_3D if gen.cores_per_chip == 2 else _SLICE_TOPOLOGIES_2D
    if chips not in topologies:
        raise PlacementError(f"{tpu_type} ({chips} chips) is not a slice size GKE offers: {sorted(topologies)} chips")
    hosts = 1 if chips <= max(gen.chips_per_host) else chips // _MULTI_HOST_CHIPS_PER_HOST
    return chips, topologies[chips], hosts


@typed_config
@dataclass(frozen=True)
class ResourceSpec:
    """Where a run executes. Runtime only: excluded from the run's identity."""

    accelerator: Accelerator = runtime("cpu")
    device_count: int = runtime(1)
    """JAX devices of the whole job (on CPU, virtual ones: XLA's host platform device count)."""
    tpu_type: str | None = runtime(None)
    """e.g. ``v5litepod-16``; required when ``accelerator == "tpu"``."""
    pool: str | None = runtime(None)
    """Scheduling pool (node pool / queue) name, interpreted by the launcher."""
    processes: int | None = runtime(None)
    """Training processes (hosts) that hold the devices together, ``device_count / processes`` each,
    joined by ``jax.distributed``. None: a TPU slice's hosts, otherwise one. On CPU the local
    launcher starts them all on this machine."""

    @property
    def process_count(self) -> int:
        if self.processes is not None:
            return self.processes
        if self.accelerator == "tpu" and self.tpu_type:
            return tpu_slice_geometry(self.tpu_type)[2]
        return 1

    def for_evaluation(self) -> ResourceSpec:
        """Where an evaluation of the run goes: its processes join no process group, so a CPU job's
        processes become one process with all the devices. (On a TPU slice every host takes part, joined
        by JAX's own TPU detection.)"""
        return replace(self, processes=None) if self.accelerator == "cpu" else self


# Memory per device, by the GKE accelerator label of a GPU (MARIN_GPU_TYPE) and by the generation
# prefix of a TPU type (per chip: one JAX device each on v4 and later).
GPU_MEMORY_GIB = {"nvidia-h200-141gb": 141, "nvidia-h100-mega-80gb": 80, "nvidia-h100-80gb": 80,
                  "nvidia-a100-80gb": 80, "nvidia-tesla-a100": 40, "nvidia-l4": 24, "nvidia-tesla-t4": 16,
                  "nvidia-tesla-v100": 16}
TPU_CHIP_MEMORY_GIB = {"v6e": 32, "v5p": 95, "v5litepod": 16, "v5e": 16, "v4": 32}


def device_memory(resources: ResourceSpec, gpu_type: str) -> tuple[int, str] | None:
    """Bytes of memory one device of ``resources`` holds, and how that figure was found; None for a
    GPU or TPU type not in the tables (nothing is assumed about it). CPU devices share this machine's
    physical memory, each its equal part. Runtime placement, like the spec it reads."""
    gib = 2**30
    if resources.accelerator == "cpu":
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        share = "" if resources.device_count == 1 else f"1/{resources.device_count} of "
        return host // resources.device_count, f"{share}this machine's {host / gib:.1f} GiB of memory (cpu)"
    if resources.accelerator == "gpu":
        per_device, kind = GPU_MEMORY_GIB.get(gpu_type), gpu_type
    else:
        kind = resources.tpu_type or ""
        per_device = next((v for prefix, v in TPU_CHIP_MEMORY_GIB.items() if kind.startswith(prefix)), None)
    if per_device is None:
        return None
    return per_device * gib, f"{per_device} GiB per device ({kind})"


# Where process 0 serves JAX's coordination service on a cluster (JAX's own default port for TPU pods).
COORDINATOR_PORT = 8476
COORDINATOR_ENV = "MARIN_COORDINATOR_ADDRESS"
PROCESS_COUNT_ENV = "MARIN_PROCESS_COUNT"
PROCESS_ID_ENV = "MARIN_PROCESS_ID"


@dataclass(frozen=True)
class ProcessGroup:
    """One process's place in a multi-process (multi-host) job: what ``jax.distributed.initialize`` takes."""

    coordinator_address: str
    process_count: int
    process_id: int

    def env(self) -> dict[str, str]:
        return {COORDINATOR_ENV: self.coordinator_address, PROCESS_COUNT_ENV: str(self.process_count),
                PROCESS_ID_ENV: str(self.process_id)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ProcessGroup | None:
        """The group a launcher placed this process in (None: a single-process job)."""
        if COORDINATOR_ENV not in environ:
            return None
        return cls(environ[COORDINATOR_ENV], int(environ[PROCESS_COUNT_ENV]), int(environ[PROCESS_ID_ENV]))


def process_group(hosts: Sequence[str], process_id: int, port: int = COORDINATOR_PORT) -> ProcessGroup:
    """Process ``process_id`` of a job with one process per entry of ``hosts`` (index order); process 0's
    host serves the coordinator. The one definition both launchers use: the local one with N times
    127.0.0.1 and a free port, the Kubernetes Indexed Job with its pods' DNS names."""
    if not 0 <= process_id < len(hosts):
        raise PlacementError(f"process id {process_id} is outside a job of {len(hosts)} processes")
    return ProcessGroup(f"{hosts[0]}:{port}", len(hosts), process_id)
