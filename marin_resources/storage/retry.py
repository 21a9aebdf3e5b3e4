"""One retry policy for storage: transient errors retried with exponential backoff and jitter.

`STORAGE_RETRY.attempts` is the total number of tries a call gets, whoever makes them. Where the
client retries by itself, its tries count against that total instead of multiplying it: botocore
is configured for `SDK_ATTEMPTS` per call and `with_retries` around it makes
`attempts_around(SDK_ATTEMPTS)` calls (2 x 3 = 6); tensorstore, which nothing wraps, gets the
whole budget. gcsfs retries 6 times with no option to change it (documented in
docs/object-stores.md). See `marin_resources.storage.object_stores` for the SDK settings.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int
    """Total attempts, the first included."""
    base_delay_s: float
    max_delay_s: float


STORAGE_RETRY = RetryPolicy(attempts=6, base_delay_s=0.2, max_delay_s=5.0)
SDK_ATTEMPTS = 2
"""Tries an object-store SDK that retries by itself (botocore) is configured to make per call."""


def attempts_around(sdk_attempts: int) -> int:
    """How many calls `with_retries` makes around a client that tries ``sdk_attempts`` times per call."""
    return max(1, STORAGE_RETRY.attempts // sdk_attempts)


def with_retries(fn: Callable[[], T], *, attempts: int = STORAGE_RETRY.attempts,
                 base_delay_s: float = STORAGE_RETRY.base_delay_s, max_delay_s: float = STORAGE_RETRY.max_delay_s,
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
