"""Warm run workers (marin_resources/run_workers.py): a run goes to a spare process that imported the
code location before the run asked for it, one process a run, and nothing is left behind."""

import multiprocessing
import sys
import textwrap
import time

import pytest

from marin_resources.run_workers import WarmRunWorkers

LOCATION = """
    import os, pathlib, time
    IMPORTED_AT = time.time()
    pathlib.Path(os.environ["PROBE_DIR"], f"imported-{os.getpid()}").touch()
"""
BROKEN_LOCATION = """
    raise RuntimeError("the code location does not load")
"""
TARGET = """
    import os, sys
    def run(tag, queue, event):
        location = sys.modules.get("probe_location")
        queue.put((tag, os.getpid(), getattr(location, "IMPORTED_AT", None), event.is_set()))
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """Modules a spawned spare can import: a code location, a broken one, and a run's target."""
    for name, text in (("probe_location", LOCATION), ("probe_broken", BROKEN_LOCATION), ("probe_target", TARGET)):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PROBE_DIR", str(tmp_path))
    import probe_target

    yield tmp_path, probe_target
    sys.modules.pop("probe_target", None)


@pytest.fixture
def spares():
    """spares(module) -> WarmRunWorkers over spawn, warming ``module``; each closed at the end."""
    made = []

    def make(module: str) -> WarmRunWorkers:
        made.append(WarmRunWorkers(multiprocessing.get_context("spawn"), module))
        return made[-1]

    yield make
    for workers in made:
        workers.close()


def start_run(workers: WarmRunWorkers, target, tag: str):
    """What the code server's StartRun does with its context, in its order."""
    queue, event = workers.Queue(), workers.Event()
    process = workers.Process(target=target, args=[tag, queue, event])
    process.start()
    return process, queue


def wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_run_goes_to_a_spare_that_imported_the_location_before_it_was_asked(probe, spares):
    directory, target = probe
    workers = spares("probe_location")
    workers.warm_next()
    wait_for(lambda: list(directory.glob("imported-*")))
    [marker] = directory.glob("imported-*")
    asked_at = time.time()
    process, queue = start_run(workers, target.run, "first")
    tag, pid, imported_at, cancelled = queue.get(timeout=60)
    assert (tag, pid, cancelled) == ("first", int(marker.name.split("-")[1]), False)
    assert imported_at < asked_at
    process.join(60)
    assert process.exitcode == 0 and not process.is_alive()  # one run, then the process ends

    # The next spare started beside the first run: the second run gets a process of its own.
    second, queue = start_run(workers, target.run, "second")
    assert queue.get(timeout=60)[:2] == ("second", second.pid) and second.pid != pid
    second.join(60)


def test_no_spare_is_warmed_after_the_run_the_launcher_said_was_its_last(probe, tmp_path):
    """`marin materialize` says so before its last run (`WorkspaceRuns.no_more_runs`): a spare warmed
    then would import the code location for nothing. A run that comes anyway starts its own process."""
    directory, target = probe
    told = tmp_path / "no-more-runs"
    workers = WarmRunWorkers(multiprocessing.get_context("spawn"), "probe_location", no_more_runs=told.exists)
    try:
        first, queue = start_run(workers, target.run, "first")
        assert queue.get(timeout=60)[0] == "first"
        assert workers._spare is not None  # not told: the next run's spare is warming
        told.touch()
        last, queue = start_run(workers, target.run, "last")
        assert queue.get(timeout=60)[:2] == ("last", last.pid)
        assert workers._spare is None
        anyway, queue = start_run(workers, target.run, "anyway")
        assert queue.get(timeout=60)[:2] == ("anyway", anyway.pid)
        for process in (first, last, anyway):
            process.join(60)
            assert process.exitcode == 0
        assert len(list(directory.glob("imported-*"))) == 3  # one import a run, none spare
    finally:
        workers.close()


def test_closing_ends_the_idle_spare_and_runs_given_out_go_on(probe, spares):
    _, target = probe
    workers = spares("probe_location")
    process, queue = start_run(workers, target.run, "given out")
    assert queue.get(timeout=60)[0] == "given out"
    idle = workers._spare.process
    workers.close()
    assert not idle.is_alive() and idle.exitcode == 0
    process.join(60)
    assert process.exitcode == 0
    workers.warm_next()
    assert workers._spare is None  # closed: no more spares


def test_a_location_that_fails_to_import_still_runs_the_run_which_reports_it(probe, spares):
    """The spare swallows the import error; the run's own load of the location raises it again where
    Dagster reports it. Here the target runs, without the location."""
    _, target = probe
    workers = spares("probe_broken")
    process, queue = start_run(workers, target.run, "broken")
    assert queue.get(timeout=60)[:3] == ("broken", process.pid, None)
    process.join(60)


def test_a_spare_that_died_idle_is_replaced_and_a_cancel_reaches_the_run(probe, spares):
    _, target = probe
    workers = spares("probe_location")
    workers.warm_next()
    dead = workers._spare.process
    dead.kill()
    dead.join(60)
    queue, event = workers.Queue(), workers.Event()
    event.set()  # StartRun hands this event to a cancel
    process = workers.Process(target=target.run, args=["after a death", queue, event])
    process.start()
    tag, pid, _, cancelled = queue.get(timeout=60)
    assert (tag, pid, cancelled) == ("after a death", process.pid, True) and pid != dead.pid
    process.join(60)


def test_a_server_that_stops_calling_the_context_as_expected_is_refused(probe, spares):
    _, target = probe
    workers = spares("probe_location")
    workers.Queue(), workers.Event()
    with pytest.raises(RuntimeError, match="no longer calls Queue"):
        workers.Process(target=target.run, args=["x", multiprocessing.get_context("spawn").Queue(), None])


def test_a_spare_that_cannot_be_warmed_does_not_fail_the_run_that_started(probe, spares, caplog):
    """Warming the next spare happens as a run starts; if it fails, that run goes on and the next
    run starts its own process."""
    _, target = probe
    workers = spares("probe_location")
    context = workers._context

    class Refusing:
        def __getattr__(self, name):
            return getattr(context, name)

        def Process(self, *args, **kwargs):  # noqa: N802
            raise OSError("no more processes")

    queue, event = workers.Queue(), workers.Event()
    process = workers.Process(target=target.run, args=["starts anyway", queue, event])
    workers._context = Refusing()
    process.start()
    assert queue.get(timeout=60)[:2] == ("starts anyway", process.pid)
    assert "could not warm the next run worker: OSError: no more processes" in caplog.text
    workers._context = context
    second, queue = start_run(workers, target.run, "cold")
    assert queue.get(timeout=60)[:2] == ("cold", second.pid)
    process.join(60)
    second.join(60)
