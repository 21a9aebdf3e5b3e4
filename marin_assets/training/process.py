"""Process hygiene for the training and eval entry points."""

import argparse
import contextlib
import ctypes
import os
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the launching process dies.

    If the Dagster step that launched training is killed, an orphaned trainer would keep writing
    into the artifact directory while a re-run resumes there; two writers would corrupt it.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def send_output_to(log_file: str | None) -> None:
    """Append this process's stdout and stderr (file descriptors 1 and 2) to ``log_file``.

    Levanter, JAX and W&B log at length; a launcher that prints its own progress (the CLI) keeps
    their lines in the run's directory instead of the terminal, and shows the tail on failure.
    """
    if not log_file:
        return
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def process_parser(description: str) -> argparse.ArgumentParser:
    """The argument parser of a launched entry point (train, eval, harness), with the options every
    launcher passes; the process is tied to its launcher's lifetime first (`die_with_parent`)."""
    die_with_parent()
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--asset-key", help="asset to report the materialization for (multi-asset steps)")
    parser.add_argument("--log-file", help="append stdout and stderr to this file instead of the terminal")
    return parser


def parse_process_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, then send this process's output where ``--log-file`` says."""
    args = parser.parse_args(argv)
    send_output_to(args.log_file)
    return args


INPUT_ERROR_STATUS = 2


@contextlib.contextmanager
def input_errors(kinds: type[Exception] | tuple[type[Exception], ...], error_file: Path):
    """Bad input (an exception of ``kinds``) ends the process with one line: written to
    ``error_file``, which the launching asset quotes instead of a traceback, printed, exit code 2."""
    try:
        yield
    except kinds as exc:
        error_file.parent.mkdir(parents=True, exist_ok=True)
        error_file.write_text(f"{exc}\n")
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(INPUT_ERROR_STATUS)


@contextlib.contextmanager
def exits_when_held(program: str):
    """A process that finds the TPU held by another (JAX's backend start raises a RuntimeError naming
    libtpu's lockfile) ends as `input_errors` ends it: one line, exit code 2, instead of JAX's tracebacks."""
    from marin_assets.training.accelerator import held_message

    try:
        yield
    except RuntimeError as exc:
        held = held_message(str(exc))
        if held is None:
            raise
        print(f"{program}: {held}", file=sys.stderr, flush=True)
        sys.exit(INPUT_ERROR_STATUS)
