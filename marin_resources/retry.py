"""Retry transient storage errors with exponential backoff and jitter."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Errors that mean "try again": connection resets, throttling, 5xx surfaced as OSError subclasses.
# FileNotFoundError and PermissionError are answers, not transient faults.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError):
        return True
    name = type(exc).__name__
    return any(word in name for word in ("Throttl", "Timeout", "ServiceUnavailable", "SlowDown", "RetryError",
                                         "TransportError", "ServerError"))


def with_retries(fn: Callable[[], T], *, attempts: int = 5, base_delay_s: float = 0.2, max_delay_s: float = 5.0,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below
            if attempt == attempts or not is_transient(exc):
                raise
            delay = min(max_delay_s, base_delay_s * 2 ** (attempt - 1)) * (0.5 + random.random())
            sleep(delay)
    raise AssertionError("unreachable")
