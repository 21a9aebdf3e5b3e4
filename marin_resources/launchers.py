"""Launch training and evaluation processes under Dagster Pipes.

A launcher runs a `ProcessCommand` (``python -m MODULE ARGS``, built by the asset that owns the
process: see `marin_assets.training.commands`) with the run's `ResourceSpec`, and knows nothing
else about what runs. ``build_command_and_env`` (`marin_resources.process_commands`, re-exported here)
is the single definition of the command line and environment; ``TrainingLauncher`` is the one
interface the ``checkpoint`` and ``eval`` assets use:
``LocalPipesLauncher`` runs the command as a local subprocess and
``marin_resources.k8s.K8sTrainingLauncher`` runs it in a pod (or one pod per TPU host).
JAX/Levanter are never imported here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
from dagster_pipes import PipesDefaultMessageWriter

from marin_resources.placement import ProcessGroup, ResourceSpec, process_group
from marin_resources.process_commands import ProcessCommand, ProcessLaunch, build_command_and_env
from marin_resources.progress import notice_line

FAILURE_TAIL_LINES = 40
FOLLOWER_EXIT_WAIT_S = 120.0


def whole_lines(path: str, should_stop, poll_seconds: float = 0.01) -> Iterator[str]:
    """Lines appended to ``path``, each yielded only once its newline is written; after
    ``should_stop()``, the rest of the file (a last line without newline included)."""
    pending = ""
    with open(path, encoding="utf-8") as fh:
        while True:
            chunk = fh.readline()
            if chunk:
                pending += chunk
                if pending.endswith("\n"):
                    yield pending
                    pending = ""
            elif should_stop():
                rest = pending + fh.read()
                yield from (line for line in rest.splitlines() if line.strip())
                return
            else:
                time.sleep(poll_seconds)


class WholeLineMessageReader(dg.PipesMessageReader):
    """Pipes messages from a temporary file, parsed one complete line at a time.

    Dagster's file readers tail with ``readline()``, which returns half a line when it catches the
    writer mid-write; ``json.loads`` then fails, the reader thread dies and every later message is
    lost. That happened to a 233-step sweep run: its final materialization never arrived.
    """

    @contextmanager
    def read_messages(self, handler) -> Iterator[dict[str, Any]]:
        done = threading.Event()
        with tempfile.TemporaryDirectory() as tempdir:
            path = os.path.join(tempdir, "messages")
            open(path, "w", encoding="utf-8").close()

            def read() -> None:
                try:
                    for line in whole_lines(path, done.is_set):
                        handler.handle_message(json.loads(line))
                except Exception:
                    handler.report_pipes_framework_exception(f"{type(self).__name__} reader thread", sys.exc_info())
                    raise

            thread = threading.Thread(target=read, daemon=True)
            thread.start()
            try:
                yield {PipesDefaultMessageWriter.FILE_PATH_KEY: path,
                       PipesDefaultMessageWriter.INCLUDE_STDIO_IN_MESSAGES_KEY: False}
            finally:
                done.set()
                thread.join()

    def no_messages_debug_text(self) -> str:
        return "Attempted to read messages from a local temporary file."


class TrainingLauncher(dg.ConfigurableResource):
    """What the training assets need from a launcher; the resource key is ``launcher``.

    ``resources`` is the run spec's placement (never part of its identity). A launcher honours
    what it can express and refuses what it cannot, with a message naming the field; it never
    silently runs a smaller job than the spec asked for.
    """

    wandb_project: str = "marin"
    wandb_entity: str | None = None
    extra_env: dict[str, str] = {}
    """Variables added to the process's environment: the store's endpoints and region, which a pod
    does not inherit (marin_resources.storage.object_stores.store_process_env)."""

    def wandb_online(self) -> bool:
        """Whether the process gets a W&B API key (and so logs online)."""
        raise NotImplementedError

    def run_process(self, context, process: ProcessCommand, *, resources: ResourceSpec = ResourceSpec(),
                    extras: Mapping[str, Any] | None = None) -> dg.PipesClientCompletedInvocation:
        """Run ``process`` to completion under Pipes; a non-zero exit raises."""
        raise NotImplementedError


class LocalPipesLauncher(TrainingLauncher):
    """Runs processes as local subprocesses through ``dg.PipesSubprocessClient``.

    The process sees this machine's devices: ``resources.accelerator`` picks the JAX platform, and
    a CPU run gets ``resources.device_count`` virtual devices; a TPU type or pool beyond that is the
    cluster launcher's business.
    Configure ``wandb_api_key=dg.EnvVar("WANDB_API_KEY")`` to log online; without it W&B runs offline.
    """

    wandb_api_key: str | None = None
    python_executable: str | None = None
    cpu_peak_flops: float | None = None
    """Peak FLOP/s of the CPU device for MFU (MARIN_CPU_PEAK_FLOPS); default is an estimate from the core count."""
    output_to_file: bool = False
    """Send the process's stdout/stderr to ``{kind}_output.log`` in its output directory (the CLI's
    choice, MARIN_PROCESS_OUTPUT=file) instead of the console; a failure quotes the file's tail."""

    def wandb_online(self) -> bool:
        return bool(self.wandb_api_key)

    def launch(self, process: ProcessCommand, *, resources: ResourceSpec = ResourceSpec()) -> ProcessLaunch:
        extra_env = dict(self.extra_env)
        if self.cpu_peak_flops is not None:
            extra_env["MARIN_CPU_PEAK_FLOPS"] = repr(self.cpu_peak_flops)
        return build_command_and_env(process, accelerator=resources.accelerator, cpu_devices=resources.device_count,
                                     wandb_api_key=self.wandb_api_key, python_executable=self.python_executable,
                                     extra_env=extra_env)

    def run_process(self, context, process: ProcessCommand, *, resources: ResourceSpec = ResourceSpec(),
                    extras: Mapping[str, Any] | None = None):
        """One process, or with ``resources.processes`` > 1 (CPU only) that many on this machine, joined
        through ``jax.distributed`` with ``device_count / processes`` virtual devices each: process 0
        under Pipes, the others beside it, their output in ``{kind}_output.process-N.log``."""
        Path(process.output_dir).mkdir(parents=True, exist_ok=True)
        count = resources.process_count
        if count > 1 and resources.accelerator != "cpu":
            raise dg.Failure(f"{count} {resources.accelerator} processes: this launcher starts several processes "
                             "only on CPU (this machine's accelerators belong to one process)")
        per_process = dataclasses.replace(resources, device_count=resources.device_count // count)
        launch = self.launch(process, resources=per_process)
        groups = local_process_groups(count) if count > 1 else []
        followers = [start_follower(launch, process, group) for group in groups[1:]]
        client = dg.PipesSubprocessClient(message_reader=WholeLineMessageReader())
        command, log_file = list(launch.command), None
        if self.output_to_file:
            log_file = process.log_file
            command += ["--log-file", log_file]
            context.log.info(notice_line(f"{process.kind} process output: {log_file}"))
        env = {**launch.env, **(groups[0].env() if groups else {})}
        leader_done = False
        try:
            invocation = client.run(context=context, command=command, env=env, extras=dict(extras or {}))
            leader_done = True
        except dg.DagsterExecutionInterruptedError:
            raise
        except Exception as exc:  # a non-zero exit (Dagster's pipes error type is not public) or a pipes failure
            if log_file is None:
                raise  # the output went to the console, where it already is
            raise dg.Failure(f"{process.kind} process failed ({exc}); last lines of {log_file}:\n"
                             f"{log_tail(log_file)}") from exc
        finally:
            # When process 0 failed, the job has failed: the others are stopped at once.
            failed = stop_followers(followers, wait_s=FOLLOWER_EXIT_WAIT_S if leader_done else 0.0)
        if failed:
            raise dg.Failure(f"{process.kind} process {failed[0][0]} of {count} failed; last lines of {failed[0][1]}:\n"
                             f"{log_tail(failed[0][1])}")
        return invocation


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_process_groups(count: int) -> list[ProcessGroup]:
    """``count`` processes on this machine: the coordinator on 127.0.0.1 at a free port."""
    port = free_port()
    return [process_group(["127.0.0.1"] * count, i, port) for i in range(count)]


def start_follower(launch: ProcessLaunch, process: ProcessCommand,
                   group: ProcessGroup) -> tuple[int, str, subprocess.Popen]:
    """Start a process other than 0 of ``group``: no Pipes channel (process 0 reports), output to a file."""
    log_file = os.path.join(process.output_dir, f"{process.kind}_output.process-{group.process_id}.log")
    popen = subprocess.Popen([*launch.command, "--log-file", log_file], env={**os.environ, **launch.env, **group.env()},
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return group.process_id, log_file, popen


def stop_followers(followers: list[tuple[int, str, subprocess.Popen]], *, wait_s: float) -> list[tuple[int, str]]:
    """Once process 0 has ended: give the others ``wait_s`` to end too (they finish the same steps),
    then kill what is left; returns (process id, log file) of those that did not exit cleanly."""
    deadline = time.monotonic() + wait_s
    failed = []
    for process_id, log_file, popen in followers:
        try:
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
        if popen.returncode != 0:
            failed.append((process_id, log_file))
    return failed


def log_tail(path: str, lines: int = FAILURE_TAIL_LINES) -> str:
    """The last ``lines`` lines of a process log (reading at most its last 64 KB)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(no output log: {exc})"
    return "\n".join(text.splitlines()[-lines:])
