"""Warm run workers: each run's process is started, and has imported the code location, before the
run asks for it.

Dagster's code server starts every run in a new process (`DagsterApiServer.StartRun`), and that
process imports the code location before the run's first step: about a second of every run's start
on this project, paid on the critical path of every partition. `WarmRunWorkers` stands in for the
server's multiprocessing context. It keeps one spare process that has imported the code location
and waits. A run takes the spare and sends it the function and arguments the server would have
started a process with; a new spare starts at once, beside the run, unless the process that
launches the runs has said that run is its last (`marin materialize` knows its plan: without this,
every command ended with a spare that imported the code location for nothing). Each process still
serves exactly one run and then exits, as before: only when its imports happen changes.

Why not fork each worker from a process that already imported the code location: the code location
imports numpy, pyarrow and polars, whose thread pools a forked child inherits without their threads,
and such children hung. A spare imports in its own process, after it was started.

StartRun makes three calls on its thread, in this order: ``Queue()``, ``Event()``, then
``Process(target, args=[..., queue, event])``. Multiprocessing hands a queue or an event to a process
only as it starts, so a spare is started with its own, and ``Queue()`` and ``Event()`` return the ones
of the spare this thread takes. `tests/foundation/test_dagster_private.py` fails when a Dagster
upgrade changes those calls.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

# How long exiting waits for an idle spare to see its pipe close (it may still be importing).
SPARE_EXIT_WAIT_S = 5.0


def _serve_one_run(module: str, work: Connection, queue: Any, event: Any) -> None:
    """A spare's life: import the code location, wait for a run, run it."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 -- the run's own load of the location fails again and reports it
        pass
    try:
        target, args = work.recv()
    except EOFError:  # the server ended without a run for it
        return
    finally:
        work.close()
    target(*args, queue, event)


@dataclass
class _Spare:
    process: Any  # a started multiprocessing process
    work: Connection  # the server's end of the pipe its run arrives on
    queue: Any
    event: Any


class _TakenSpare:
    """What ``Process()`` returns: the spare, sent its run by ``start()``; the server then reads
    ``is_alive()`` and ``exitcode``."""

    def __init__(self, spare: _Spare, target, args: list, started: Callable[[], None]):
        self._spare, self._target, self._args, self._started = spare, target, args, started

    def start(self) -> None:
        try:
            self._spare.work.send((self._target, self._args))
        except OSError:  # it died while idle: the server finds it gone, with its exit code
            pass
        finally:
            self._spare.work.close()
        try:
            self._started()
        except Exception as exc:  # noqa: BLE001 -- this run is under way; the next one starts a spare itself
            logging.getLogger(__name__).warning("could not warm the next run worker: %s: %s", type(exc).__name__, exc)

    def is_alive(self) -> bool:
        return self._spare.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._spare.process.exitcode

    @property
    def pid(self) -> int | None:
        return self._spare.process.pid

    def join(self, timeout: float | None = None) -> None:
        self._spare.process.join(timeout)


class WarmRunWorkers:
    """A code server's multiprocessing context whose processes are spares, warm with ``module``
    imported (see the module's text). ``context`` starts the spares: a fork server's, or spawn's."""

    def __init__(self, context, module: str, no_more_runs: Callable[[], bool] = lambda: False):
        self._context, self._module = context, module
        # Asked as each run starts: True when the process launching the runs said that run was its last,
        # so no spare is warmed for a run that never comes (an import of the code location, 1.1-1.2 CPU-s).
        self._no_more_runs = no_more_runs
        self._lock = threading.Lock()
        self._spare: _Spare | None = None
        self._taken = threading.local()
        self._closed = False
        # Spares given no run, kept until they exit: a child still starting unpickles its queue and
        # event, which the server's copies would otherwise unlink as they are dropped.
        self._discarded: list[_Spare] = []
        # Registered after multiprocessing's own exit handler, so it runs first: that handler waits
        # for every non-daemon child, and an idle spare exits only once its pipe is closed.
        atexit.register(self.close)

    def get_start_method(self) -> str:
        return self._context.get_start_method()

    def Queue(self):  # noqa: N802 -- multiprocessing's name, which the server calls
        leftover = getattr(self._taken, "spare", None)
        if leftover is not None:  # a start that failed between its calls: that spare has no run
            self._discard(leftover)
        self._taken.spare = self._take()
        return self._taken.spare.queue

    def Event(self):  # noqa: N802
        return self._taken.spare.event

    def Process(self, target, args) -> _TakenSpare:  # noqa: N802
        spare = self._taken.__dict__.pop("spare")
        *run_args, queue, event = args
        if queue is not spare.queue or event is not spare.event:
            self._discard(spare)
            raise RuntimeError("WarmRunWorkers: the code server's StartRun no longer calls Queue(), Event() "
                               "and Process(args=[..., queue, event]) as this module expects")
        return _TakenSpare(spare, target, list(run_args), self._warm_after_run)

    def _warm_after_run(self) -> None:
        if not self._no_more_runs():
            self.warm_next()

    def warm_next(self) -> None:
        """Start the next spare, unless one waits already (also before the first run, to warm it)."""
        with self._lock:
            if self._spare is None and not self._closed:
                self._spare = self._start_spare()

    def close(self) -> None:
        """No more spares; the idle one exits (runs already given out go on)."""
        with self._lock:
            self._closed, spare, self._spare = True, self._spare, None
        if spare is not None:
            spare.work.close()
            spare.process.join(SPARE_EXIT_WAIT_S)

    def _take(self) -> _Spare:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.process.is_alive():
            return spare
        if spare is not None:
            self._discard(spare)
        return self._start_spare()

    def _discard(self, spare: _Spare) -> None:
        spare.work.close()  # it sees EOF and exits
        with self._lock:
            self._discarded = [s for s in self._discarded if s.process.is_alive()] + [spare]

    def _start_spare(self) -> _Spare:
        receive, send = self._context.Pipe(duplex=False)
        queue, event = self._context.Queue(), self._context.Event()
        process = self._context.Process(target=_serve_one_run, args=(self._module, receive, queue, event))
        process.start()
        receive.close()  # the spare holds its end: when the server's end closes, it sees EOF
        return _Spare(process, send, queue, event)
