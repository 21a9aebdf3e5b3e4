"""Progress lines: what a long step tells the terminal while it runs.

A step reports progress as ordinary Dagster log messages that start with a marker: a training or
eval process through Pipes (``reporter.log``), an asset body through ``context.log``. So the lines
are in the run's event log and on the UI's run page, wherever the step runs (a local worker, a
pod), and `marin materialize` finds them there while the run is in flight (`RunProgress` in
marin_assets.run_submission): it prints a run's ``NOTICE`` lines at once (the process log's path) and
its newest ``PROGRESS`` line at most every ``PRINT_EVERY_S``. Nothing else of a run's log reaches
the terminal.

A producer logs a progress line at most every ``EMIT_EVERY_S`` (`ProgressMeter`), so a fast loop
does not flood the event log and a slow one is still heard from. Pure: no Dagster import.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PROGRESS = "[progress] "
NOTICE = "[notice] "
EMIT_EVERY_S = 10.0
"""A producer logs a progress line at most this often."""
PRINT_EVERY_S = 15.0
"""The CLI prints a run's newest progress line at most this often: with lines every EMIT_EVERY_S,
one at least every 30 s."""
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float) -> str:
    size, unit = float(n), 0
    while abs(size) >= 1024 and unit < len(_BYTE_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    return f"{int(size)} B" if unit == 0 else f"{size:.3g} {_BYTE_UNITS[unit]}"


def human_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def progress_line(text: str) -> str:
    return PROGRESS + text


def notice_line(text: str) -> str:
    return NOTICE + text


def parse_line(message: str) -> tuple[str, str] | None:
    """("progress" or "notice", the text) of a progress line; None for any other message."""
    for kind, marker in (("progress", PROGRESS), ("notice", NOTICE)):
        if message.startswith(marker):
            return kind, message[len(marker):]
    return None


def eta(done: float, total: float, elapsed_s: float) -> str | None:
    """`eta 3 min 10 s` at the rate so far; None before any work is done."""
    if done <= 0 or total <= done or elapsed_s <= 0:
        return None
    return f"eta {human_duration(elapsed_s / done * (total - done))}"


class Throttle:
    """``due()`` is true at most once every ``every_s`` seconds (not at the start)."""

    def __init__(self, every_s: float = EMIT_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self.started = self.last = clock()

    def due(self) -> bool:
        now = self.clock()
        if now - self.last < self.every_s:
            return False
        self.last = now
        return True


class ProgressMeter:
    """Counts documents and bytes done and logs `what: N documents, X MiB of Y, eta` at most every
    ``every_s`` seconds (``total_bytes`` known: with the share done and an ETA)."""

    def __init__(self, log: Callable[[str], None], what: str, *, total_bytes: int | None = None,
                 every_s: float = EMIT_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.log, self.what, self.total_bytes = log, what, total_bytes
        self.throttle = Throttle(every_s, clock)
        self.documents = self.bytes = 0

    def add(self, *, documents: int = 0, nbytes: int = 0) -> None:
        self.documents += documents
        self.bytes += nbytes
        if self.throttle.due():
            self.log(progress_line(self.text()))

    def text(self) -> str:
        done = f"{self.what}: {self.documents:,} documents, {human_bytes(self.bytes)}"
        if self.total_bytes:
            done += f" of {human_bytes(self.total_bytes)} ({self.bytes / self.total_bytes:.0%})"
            left = eta(self.bytes, self.total_bytes, self.throttle.last - self.throttle.started)
            done += f", {left}" if left else ""
        return done
