"""What this host's accelerator is, asked without holding it, and the one-line refusals around it.

A TPU can be opened by one process at a time (libtpu's lockfile), and a GPU's memory is preallocated
by the first JAX program on it, so nothing that only wants to know the device count or kind may keep
it open: `probe` asks a child process, which exits before training starts. Nothing here imports JAX.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from marin_resources.placement import COORDINATOR_ENV

# Cloud TPU type prefixes by JAX's device_kind (lowercase substring; first match wins) and TensorCores
# per chip as Cloud TPU type names count them ("v4-8" is 4 chips, "v5litepod-8" is 8).
_TPU_TYPE_BY_DEVICE_KIND = (("v5 lite", "v5litepod", 1), ("v5e", "v5litepod", 1), ("v6 lite", "v6e", 1),
                            ("v6e", "v6e", 1), ("v5p", "v5p", 2), ("v5", "v5p", 2), ("v4", "v4", 2))
_CHIP_HELD_MARKERS = ("libtpu multi-process lockfile", "TPU is already in use", "/tmp/libtpu_lockfile")


class AcceleratorError(RuntimeError):
    """The accelerator cannot serve the run; the message is one line for the user."""


@dataclass(frozen=True)
class Devices:
    platform: str
    kind: str
    count: int


def tpu_type_for(device_kind: str, chips: int) -> str:
    """The Cloud TPU type of ``chips`` chips of JAX's ``device_kind``: one v5e chip is ``v5litepod-1``."""
    kind = device_kind.lower()
    for marker, prefix, cores_per_chip in _TPU_TYPE_BY_DEVICE_KIND:
        if marker in kind:
            return f"{prefix}-{chips * cores_per_chip}"
    raise AcceleratorError(f"no Cloud TPU type is known for device kind {device_kind!r}; pass --tpu-type")


def held_message(output: str) -> str | None:
    """One line for a process that failed because another one holds the TPU; None for other failures."""
    if any(marker in output for marker in _CHIP_HELD_MARKERS):
        holders = sorted(glob.glob("/tmp/libtpu_lockfile*"))
        return ("the TPU is held by another process (libtpu allows one at a time"
                + (f"; lock {holders[0]}" if holders else "") + "): wait for it to end, or end it, and run again")
    return None


# What JAX's cluster detection reads: a TPU VM's workers, Slurm's and Open MPI's task counts.
_PROCESS_COUNT_VARIABLES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "MEGASCALE_NUM_SLICES")


def sole_process(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``environ`` says this process is alone: no launcher's process group, no multi-task Slurm or
    MPI job, no multislice, and either no TPU VM or one that names exactly one worker. A one-chip TPU host
    sets TPU_WORKER_HOSTNAMES=localhost, and JAX then takes it for a cluster; such a process needs no
    ``jax.distributed``, whose coordination service the host's sandbox may not even allow. A TPU VM that
    names no workers (its list comes from the metadata server) is left to JAX's own detection."""
    if COORDINATOR_ENV in environ:  # our launcher's multi-process group
        return False
    counts = (environ.get(name, "").strip() for name in _PROCESS_COUNT_VARIABLES)
    if any(count.isdigit() and int(count) > 1 for count in counts):
        return False
    workers = [name for name in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if name.strip()]
    on_tpu_vm = any(name.startswith("TPU_") for name in environ)
    return len(workers) == 1 if on_tpu_vm else True


def probe(platform: str) -> Devices:
    """JAX's devices of ``platform`` (``tpu``, ``gpu``), asked in a child process that releases them on
    exit. Raises AcceleratorError in one line: none found, or the TPU held by another process."""
    code = ("import jax, json; d = jax.devices(); "
            "print(json.dumps({'platform': d[0].platform, 'kind': d[0].device_kind, 'count': len(d)}))")
    env = {**os.environ, "JAX_PLATFORMS": platform}
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if found.returncode != 0:
        output = found.stdout + found.stderr
        last = next((line for line in reversed(output.splitlines()) if line.strip()), "no output")
        raise AcceleratorError(held_message(output) or f"no {platform} devices on this host ({last.strip()})")
    record = json.loads(found.stdout.strip().splitlines()[-1])
    return Devices(platform=record["platform"], kind=record["kind"], count=record["count"])
