"""Progress lines: a producer logs them at most every few seconds; `marin materialize` reads them from
an in-flight run's event log and prints notices at once, the newest progress line at most every
PRINT_EVERY_S, and nothing else of the run's log."""

import logging
import time

import dagster as dg

from marin_assets.run_submission import RunProgress
from marin_resources.progress import PRINT_EVERY_S, ProgressMeter, eta, notice_line, parse_line, progress_line


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def log_message(instance: dg.DagsterInstance, run_id: str, message: str) -> None:
    instance.handle_new_event(dg.EventLogEntry(error_info=None, level=logging.INFO, user_message=message,
                                               run_id=run_id, timestamp=time.time(), dagster_event=None))


def test_meter_reports_documents_bytes_share_and_eta_at_most_every_interval():
    clock, lines = Clock(), []
    meter = ProgressMeter(lines.append, "read", total_bytes=4 * 2**20, every_s=10, clock=clock)
    meter.add(documents=100, nbytes=2**20)
    assert lines == []  # nothing before the interval has passed
    clock.now += 10
    meter.add(documents=100, nbytes=2**20)
    assert lines == [progress_line("read: 200 documents, 2 MiB of 4 MiB (50%), eta 10 s")]
    clock.now += 5
    meter.add(documents=1, nbytes=1)
    assert len(lines) == 1
    assert parse_line(lines[0]) == ("progress", "read: 200 documents, 2 MiB of 4 MiB (50%), eta 10 s")
    assert parse_line("step 3 loss 2.0") is None and parse_line(notice_line("x")) == ("notice", "x")
    assert eta(0, 10, 5) is None and eta(10, 10, 5) is None and eta(30, 300, 60) == "eta 9 min 00 s"


def test_cli_prints_notices_at_once_and_the_newest_progress_line_per_interval():
    clock, printed = Clock(), []
    with dg.instance_for_test() as instance:
        run = instance.create_run_for_job(job_def=dg.GraphDefinition(name="g").to_job())
        progress = RunProgress(instance, printed.append, clock=clock)
        log_message(instance, run.run_id, notice_line("train process output: /tmp/run/train_output.log"))
        log_message(instance, run.run_id, "Levanter chatter that stays in the run's log")
        log_message(instance, run.run_id, progress_line("step 1/100 loss 7.0000 tokens/s 900"))
        log_message(instance, run.run_id, progress_line("step 2/100 loss 6.5000 tokens/s 950"))
        progress.show(run.run_id, "checkpoint [tiny]")
        assert printed == ["          checkpoint [tiny]: train process output: /tmp/run/train_output.log",
                           "          checkpoint [tiny]: step 2/100 loss 6.5000 tokens/s 950"]
        log_message(instance, run.run_id, progress_line("step 3/100 loss 6.0000 tokens/s 990 eta 1 min 10 s"))
        clock.now += PRINT_EVERY_S / 2
        progress.show(run.run_id, "checkpoint [tiny]")
        assert len(printed) == 2  # within the interval: kept for later
        clock.now += PRINT_EVERY_S / 2
        progress.show(run.run_id, "checkpoint [tiny]")
        assert printed[-1] == "          checkpoint [tiny]: step 3/100 loss 6.0000 tokens/s 990 eta 1 min 10 s"
        clock.now += PRINT_EVERY_S
        progress.show(run.run_id, "checkpoint [tiny]")
        assert len(printed) == 3  # nothing new: nothing printed
