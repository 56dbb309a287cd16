"""Retries with capped exponential backoff, the one way obd waits before trying a target again.

`Backoff` says how long to wait after the n-th failure in a row. `retrying` retries a call on
the errors it is told are transient (the Runpod API); `FailureGate` remembers failures across
calls and refuses attempts until the backoff has passed (the SSH reconnect, where callers that
arrive meanwhile get the last error at once instead of piling up connection attempts).
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Waits of `base`, doubling after each failure up to `cap`; with `jitter`, each wait is
    drawn from its upper half so that many clients do not retry in step."""

    base: float
    cap: float
    jitter: bool = False

    def delay(self, failures: int) -> float:
        """The wait after `failures` failures in a row (the first failure waits `base`)."""
        wait = min(self.cap, self.base * 2 ** max(0, failures - 1))
        return wait * (0.5 + random.random() / 2) if self.jitter else wait


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    transient: tuple[type[BaseException], ...],
    retries: int,
    backoff: Backoff,
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """Await `call()`, again after a backoff on a `transient` error, up to `retries` more times.

    The last transient error is raised when the retries run out; any other error at once.
    `on_retry(attempt, error, wait)` is told of each retry (to log it).
    """
    failures = 0
    while True:
        try:
            return await call()
        except transient as exc:
            failures += 1
            if failures > retries:
                raise
            wait = backoff.delay(failures)
            if on_retry is not None:
                on_retry(failures, exc, wait)
            await sleep(wait)


class FailureGate:
    """Consecutive failures of one resource and when it may be tried again.

    After a failure, attempts are refused until the backoff for that many failures has
    passed; a success clears it.
    """

    def __init__(self, backoff: Backoff, clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff = backoff
        self.clock = clock
        self.failures = 0
        self.next_attempt = 0.0

    def wait_left(self) -> float:
        """Seconds until the next attempt is allowed (0 when it is allowed now)."""
        if self.failures == 0:
            return 0.0
        return max(0.0, self.next_attempt - self.clock())

    def failed(self) -> float:
        """Count a failure; the wait before the next attempt."""
        self.failures += 1
        wait = self.backoff.delay(self.failures)
        self.next_attempt = self.clock() + wait
        return wait

    def succeeded(self) -> None:
        self.failures = 0
        self.next_attempt = 0.0
