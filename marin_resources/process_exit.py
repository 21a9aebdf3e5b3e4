"""Ending a process whose work is done without Python's interpreter teardown.

At a normal exit Python frees every module's objects one by one: in a process that imported Dagster,
polars, pyarrow and grpc that takes 1.2-1.5 s of CPU, with nothing left to do. `marin` (when its
command returns) and the code servers it starts (when they stop serving) end with `exit_now` instead.
What an exit must still do happens first: the exit handlers run (log handlers, temporary directories,
multiprocessing's children) and the output is flushed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Exit with ``code``: exit handlers, flushed output, then no teardown. A thread that is not a daemon
    still running means work unfinished: then the process exits as usual, which waits for it."""
    if any(thread.is_alive() and not thread.daemon and thread is not threading.main_thread()
           for thread in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # noqa: SLF001 - what a normal exit runs before the teardown skipped here
    flush_output()
    os._exit(code)


def flush_output() -> None:
    """Flush stdout and stderr, as the teardown skipped by ``os._exit`` would have."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that went away (`marin status | head`)
            stream.flush()
