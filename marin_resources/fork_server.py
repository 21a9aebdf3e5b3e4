"""Imported by the run workers' fork server alone (`RUN_WORKER_PRELOAD` in `dagster_private.py`).

The fork server (multiprocessing's ``forkserver``) imports Dagster once, then forks each run worker.
When the code server that started it ends, it sees its pipe close and exits, and Python's teardown of
those imports took about 0.4 s of CPU, after the `marin` command had returned, while holding the
command's output open (whoever reads it to the end waits for that). It has nothing to clean up: it
holds no files, it never waits for the workers it forked at its exit (the code server follows them),
and its exit status is read by nobody. So its last exit handler ends it at once
(`marin_resources/process_exit.py` says why the teardown is skipped elsewhere).

Its workers inherit the handler but never run it: a forked worker always ends with ``os._exit``.
"""

import atexit
import os

from marin_resources.process_exit import flush_output


def _end_without_teardown() -> None:
    flush_output()
    os._exit(0)


# Registered after the handlers of what the fork server imported before it (multiprocessing's,
# logging's): exit handlers run last-registered first, so this one ends the process before them.
# They would only flush loggers the fork server never writes to and join `Process` children it has none of.
atexit.register(_end_without_teardown)
