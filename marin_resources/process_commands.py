"""The processes a launcher starts: a `ProcessCommand` and its command line and environment.

``build_command_and_env`` is the single definition of both, shared by every launcher
(`marin_resources.launchers`, `marin_resources.k8s`) and by the benchmarks that start the training
process themselves. No Dagster here: a training host that runs the processes without Dagster's
daemon or webserver (docs/tpu-host.md) imports this module, and Dagster is not installed there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ProcessCommand:
    """A Python process to launch: ``python -m {module} {args}``, writing into ``output_dir``.

    ``kind`` names it (``train``, ``eval``: the pod's name, the log file ``{kind}_output.log``);
    ``inputs`` are local files outside ``output_dir`` that it reads, which a launcher whose
    process runs elsewhere carries there."""

    kind: str
    module: str
    args: tuple[str, ...]
    output_dir: str
    inputs: tuple[str, ...] = ()

    @property
    def log_file(self) -> str:
        return os.path.join(self.output_dir, f"{self.kind}_output.log")


@dataclass(frozen=True)
class ProcessLaunch:
    """A ready-to-run process: argv and the environment variables to add to the inherited ones."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


def build_command_and_env(
    process: ProcessCommand,
    *,
    accelerator: Literal["cpu", "gpu", "tpu"] = "cpu",
    cpu_devices: int = 1,
    wandb_api_key: str | None = None,
    python_executable: str | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> ProcessLaunch:
    """Command and env of ``process``.

    Env: JAX_PLATFORMS=cpu for CPU runs and empty otherwise (so an inherited ``cpu`` cannot hide
    a GPU/TPU); on CPU, ``cpu_devices`` > 1 virtual devices through XLA_FLAGS (how a sharded run
    gets its mesh without an accelerator); Ray usage stats off; HF hub offline (tokenizers are local
    artifacts); W&B online only when an API key is given, which travels in WANDB_API_KEY and nowhere else.
    """
    command = [python_executable or sys.executable, "-m", process.module, *process.args]
    env = {
        "JAX_PLATFORMS": "cpu" if accelerator == "cpu" else "",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "online" if wandb_api_key else "offline",
        "WANDB_DIR": process.output_dir,
        "PYTHONUNBUFFERED": "1",
    }
    if accelerator == "cpu" and cpu_devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cpu_devices}"
    if wandb_api_key:
        env["WANDB_API_KEY"] = wandb_api_key
    env.update(extra_env or {})
    return ProcessLaunch(command=command, env=env)
