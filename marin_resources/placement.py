"""Where a process runs: accelerator kind and count, TPU slice, scheduling pool.

Runtime only: a run's placement never enters its identity, so moving a run from CPU to a TPU
pool does not invalidate its artifacts. Launchers read it; the training run specs carry one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from marin_resources.typed_config import typed_config

Accelerator = Literal["cpu", "gpu", "tpu"]


@typed_config
@dataclass(frozen=True)
class ResourceSpec:
    """Where a run executes. Runtime only: excluded from the run's identity."""

    accelerator: Accelerator = "cpu"
    device_count: int = 1
    tpu_type: str | None = None
    """e.g. ``v5litepod-16``; required when ``accelerator == "tpu"``."""
    pool: str | None = None
    """Scheduling pool (node pool / queue) name, interpreted by the launcher."""
