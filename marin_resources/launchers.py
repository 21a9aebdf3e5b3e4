"""Launch training/eval processes under Dagster Pipes.

``build_command_and_env`` is the single definition of how a training or eval process is started
(command line and environment). ``TrainingLauncher`` is the one interface the ``checkpoint`` and
``eval`` assets use: ``LocalPipesLauncher`` runs the command as a local subprocess and
``marin_resources.k8s.K8sTrainingLauncher`` runs it in a pod (or one pod per TPU host). Both get
the run's ``ResourceSpec`` (accelerator kind, device count, TPU type, pool) on every launch.
JAX/Levanter are never imported here.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Sequence

import dagster as dg
from dagster_pipes import PipesDefaultMessageWriter

from marin_assets.training.spec import ResourceSpec

ProcessKind = Literal["train", "eval", "harness"]
ENTRY_MODULES: dict[str, str] = {
    "train": "marin_assets.training.train_main",
    "eval": "marin_assets.training.eval_main",
    "harness": "marin_assets.evaluation.harness_main",
}
TRAIN_CONFIG_FILE = "train_config.yaml"
EVAL_REPORT_FILE = "eval_report.json"
HARNESS_REPORT_FILE = "harness_report.json"
REPORT_FILES: dict[str, str] = {"eval": EVAL_REPORT_FILE, "harness": HARNESS_REPORT_FILE}
OUTPUT_LOG_FILES: dict[str, str] = {"train": "train_output.log", "eval": "eval_output.log",
                                    "harness": "harness_output.log"}
FAILURE_TAIL_LINES = 40


@dataclass(frozen=True)
class ProcessLaunch:
    """A ready-to-run process: argv and the environment variables to add to the inherited ones."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


def build_command_and_env(
    kind: ProcessKind,
    *,
    train_config_path: str,
    output_dir: str,
    accelerator: Literal["cpu", "gpu", "tpu"] = "cpu",
    wandb_api_key: str | None = None,
    python_executable: str | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> ProcessLaunch:
    """Command and env for ``train_main``, ``eval_main`` or ``harness_main``.

    - train: ``python -m marin_assets.training.train_main --config CFG --output-dir OUT``
    - eval: ``python -m marin_assets.training.eval_main --config CFG --output OUT/eval_report.json``
      (the checkpoint defaults to the latest under the config's checkpointer path)
    - harness: ``python -m marin_assets.evaluation.harness_main --config CFG --output OUT/harness_report.json``
      (``--harness OUT/harness_config.json`` comes in ``extra_args``)

    Env: JAX_PLATFORMS=cpu for CPU runs and empty otherwise (so an inherited ``cpu`` cannot hide
    a GPU/TPU); Ray usage stats off; HF hub offline (tokenizers are local artifacts); W&B online
    only when an API key is given, which travels in WANDB_API_KEY and nowhere else.
    """
    python = python_executable or sys.executable
    command = [python, "-m", ENTRY_MODULES[kind], "--config", train_config_path]
    if kind == "train":
        command += ["--output-dir", output_dir]
    else:
        command += ["--output", os.path.join(output_dir, REPORT_FILES[kind])]
    command += list(extra_args)
    env = {
        "JAX_PLATFORMS": "cpu" if accelerator == "cpu" else "",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "online" if wandb_api_key else "offline",
        "WANDB_DIR": output_dir,
        "PYTHONUNBUFFERED": "1",
    }
    if wandb_api_key:
        env["WANDB_API_KEY"] = wandb_api_key
    env.update(extra_env or {})
    return ProcessLaunch(command=command, env=env)


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
    does not inherit (marin_resources.object_stores.store_process_env)."""

    def wandb_online(self) -> bool:
        """Whether the process gets a W&B API key (and so logs online)."""
        raise NotImplementedError

    def wandb_settings(self, tags: Sequence[str] = ()):
        from marin_assets.training.levanter_config import WandbSettings

        return WandbSettings(project=self.wandb_project, entity=self.wandb_entity,
                             mode="online" if self.wandb_online() else "offline", tags=tuple(tags))

    def write_train_config(
        self, spec, data_config: Mapping[str, Any], tokenizer_dir: str, output_dir: str
    ) -> str:
        """Render ``spec`` into ``{output_dir}/train_config.yaml``; returns its path."""
        from marin_assets.training.levanter_config import build_train_config, write_train_config

        config = build_train_config(
            spec, data_config, tokenizer_dir, output_dir, wandb=self.wandb_settings(tags=(spec.mixture,))
        )
        return write_train_config(config, Path(output_dir) / TRAIN_CONFIG_FILE)

    def run_training(
        self,
        context,
        *,
        train_config_path: str,
        output_dir: str,
        resources: ResourceSpec = ResourceSpec(),
        extras: Mapping[str, Any] | None = None,
    ) -> dg.PipesClientCompletedInvocation:
        """Train (or resume) into ``output_dir``; the process reports one materialization with the run summary."""
        raise NotImplementedError

    def run_eval(
        self,
        context,
        *,
        train_config_path: str,
        output_dir: str,
        resources: ResourceSpec = ResourceSpec(),
        checkpoint_path: str | None = None,
        extra_args: Sequence[str] = (),
        extras: Mapping[str, Any] | None = None,
    ) -> dg.PipesClientCompletedInvocation:
        """Evaluate the run's latest (or the given) checkpoint; writes ``{output_dir}/eval_report.json``.

        ``extra_args`` go to eval_main (e.g. ``--max-examples N``, ``--prompt TEXT``, ``--eval-set NAME``).
        """
        raise NotImplementedError

    def run_harness(
        self,
        context,
        *,
        train_config_path: str,
        harness_config_path: str,
        output_dir: str,
        resources: ResourceSpec = ResourceSpec(),
        checkpoint_path: str | None = None,
        extras: Mapping[str, Any] | None = None,
    ) -> dg.PipesClientCompletedInvocation:
        """Run an eval suite (``harness_config_path``, a file under ``output_dir`` so that it travels
        with the run directory) on the run's latest (or the given) checkpoint; writes
        ``{output_dir}/harness_report.json``."""
        raise NotImplementedError


def harness_args(harness_config_path: str, checkpoint_path: str | None) -> list[str]:
    return ["--harness", harness_config_path] + eval_args(checkpoint_path, ())


def eval_args(checkpoint_path: str | None, extra_args: Sequence[str]) -> list[str]:
    return (["--checkpoint", checkpoint_path] if checkpoint_path else []) + list(extra_args)


class LocalPipesLauncher(TrainingLauncher):
    """Runs training/eval as local subprocesses through ``dg.PipesSubprocessClient``.

    The process sees this machine's devices: ``resources.accelerator`` picks the JAX platform;
    a device count, TPU type or pool beyond that is the cluster launcher's business.
    Configure ``wandb_api_key=dg.EnvVar("WANDB_API_KEY")`` to log online; without it W&B runs offline.
    """

    wandb_api_key: str | None = None
    python_executable: str | None = None
    cpu_peak_flops: float | None = None
    """Peak FLOP/s of the CPU device for MFU (MARIN_CPU_PEAK_FLOPS); default is an estimate from the core count."""
    output_to_file: bool = False
    """Send the process's stdout/stderr to ``train_output.log``/``eval_output.log`` in its output directory
    (the CLI's choice, MARIN_PROCESS_OUTPUT=file) instead of the console; a failure quotes the file's tail."""

    def wandb_online(self) -> bool:
        return bool(self.wandb_api_key)

    def launch(
        self,
        kind: ProcessKind,
        *,
        train_config_path: str,
        output_dir: str,
        accelerator: Literal["cpu", "gpu", "tpu"] = "cpu",
        extra_args: Sequence[str] = (),
    ) -> ProcessLaunch:
        extra_env = dict(self.extra_env)
        if self.cpu_peak_flops is not None:
            extra_env["MARIN_CPU_PEAK_FLOPS"] = repr(self.cpu_peak_flops)
        return build_command_and_env(
            kind,
            train_config_path=train_config_path,
            output_dir=output_dir,
            accelerator=accelerator,
            wandb_api_key=self.wandb_api_key,
            python_executable=self.python_executable,
            extra_args=extra_args,
            extra_env=extra_env,
        )

    def _run(self, context, kind: ProcessKind, launch: ProcessLaunch, output_dir: str,
             extras: Mapping[str, Any] | None):
        client = dg.PipesSubprocessClient(message_reader=WholeLineMessageReader())
        command, log_file = list(launch.command), None
        if self.output_to_file:
            log_file = os.path.join(output_dir, OUTPUT_LOG_FILES[kind])
            command += ["--log-file", log_file]
            context.log.info(f"{kind} process output: {log_file}")
        try:
            return client.run(context=context, command=command, env=launch.env, extras=dict(extras or {}))
        except dg.DagsterExecutionInterruptedError:
            raise
        except Exception as exc:  # a non-zero exit (Dagster's pipes error type is not public) or a pipes failure
            if log_file is None:
                raise  # the output went to the console, where it already is
            raise dg.Failure(f"{kind} process failed ({exc}); last lines of {log_file}:\n{log_tail(log_file)}") from exc

    def run_training(self, context, *, train_config_path: str, output_dir: str,
                     resources: ResourceSpec = ResourceSpec(), extras: Mapping[str, Any] | None = None):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        launch = self.launch("train", train_config_path=train_config_path, output_dir=output_dir,
                             accelerator=resources.accelerator)
        return self._run(context, "train", launch, output_dir, extras)

    def run_eval(self, context, *, train_config_path: str, output_dir: str, resources: ResourceSpec = ResourceSpec(),
                 checkpoint_path: str | None = None, extra_args: Sequence[str] = (),
                 extras: Mapping[str, Any] | None = None):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        launch = self.launch("eval", train_config_path=train_config_path, output_dir=output_dir,
                             accelerator=resources.accelerator, extra_args=eval_args(checkpoint_path, extra_args))
        return self._run(context, "eval", launch, output_dir, extras)

    def run_harness(self, context, *, train_config_path: str, harness_config_path: str, output_dir: str,
                    resources: ResourceSpec = ResourceSpec(), checkpoint_path: str | None = None,
                    extras: Mapping[str, Any] | None = None):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        launch = self.launch("harness", train_config_path=train_config_path, output_dir=output_dir,
                             accelerator=resources.accelerator,
                             extra_args=harness_args(harness_config_path, checkpoint_path))
        return self._run(context, "harness", launch, output_dir, extras)


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
