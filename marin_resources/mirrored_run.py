"""Run a command in a pod whose only storage in common with its launcher is a bucket.

Usage: ``python -m marin_resources.mirrored_run --input LOCAL=URI ... --output LOCAL=URI ... -- CMD ...``

The launcher uploads what the process reads from its run worker's disk (the run directory with
its ``train_config.yaml`` and any checkpoints of an earlier attempt, or an eval's config file)
to ``URI``; here each ``--input`` and ``--output`` is downloaded to the same absolute ``LOCAL``
path, so every path in the config means the same file in the pod. After ``CMD`` exits (or is
stopped with SIGTERM), each ``--output`` directory goes back up (from host 0 only, on a
multi-host slice), and the launcher copies it into the run directory. The exit status is ``CMD``'s.

Checkpoints of a multi-host slice are written by every host, so they must go straight to the
bucket (the run config's checkpointer path), not through this copy.

Only fsspec is used: credentials and endpoints come from the standard environment
(``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``, workload identity).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path


def _fs(uri: str):
    import fsspec

    return fsspec.core.url_to_fs(uri)


def upload(local: str, uri: str) -> int:
    """Copy a file or a directory tree to ``uri``; returns the number of files copied."""
    fs, root = _fs(uri)
    source = Path(local)
    if source.is_file():
        fs.put_file(str(source), root)
        return 1
    count = 0
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{root}/{path.relative_to(source).as_posix()}")
        count += 1
    return count


def download(uri: str, local: str) -> int:
    """Copy ``uri`` (a file or a prefix) to ``local``; a missing ``uri`` copies nothing."""
    fs, root = _fs(uri)
    if fs.isfile(root):
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(root, local)
        return 1
    count = 0
    for remote in fs.find(root):
        target = Path(local) / os.path.relpath(remote, root)
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))
        count += 1
    return count


def remove(uri: str) -> None:
    fs, root = _fs(uri)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def remove_quietly(uri: str) -> None:
    """``remove`` on a path that may be unreachable: cleanup after a failure must not mask it."""
    try:
        remove(uri)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def _pair(text: str) -> tuple[str, str]:
    local, sep, uri = text.partition("=")
    if not (sep and os.path.isabs(local) and "://" in uri):
        raise argparse.ArgumentTypeError(f"{text!r}: expected /ABSOLUTE/LOCAL/PATH=scheme://bucket/key")
    return local, uri


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m marin_resources.mirrored_run")
    parser.add_argument("--input", type=_pair, action="append", default=[], help="download before the command")
    parser.add_argument("--output", type=_pair, action="append", default=[],
                        help="download before and upload after the command")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    for local, uri in [*args.input, *args.output]:
        download(uri, local)
    child = subprocess.Popen(command)
    # Kubernetes stops a pod with SIGTERM: pass it on, then still upload what the process left.
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    status = child.wait()
    # Every host of a multi-host TPU slice runs the same program; host 0 owns the run's record
    # (as it owns the Pipes channel), so the others upload nothing over it.
    if os.environ.get("JOB_COMPLETION_INDEX", "0") == "0":
        for local, uri in args.output:
            if os.path.isdir(local):
                upload(local, uri)
    return status if status >= 0 else 128 - status  # killed by signal N: the shell's 128 + N


if __name__ == "__main__":
    sys.exit(main())
