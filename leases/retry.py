"""Exponential backoff with full jitter, bounded by a deadline.

Every waiter in the package (acquire loops, keepalive retries) backs off the same way: the n-th
delay is drawn uniformly from ``[0, min(cap, base * 2**n)]`` ("full jitter", AWS architecture
blog), so contenders that failed together do not retry together, and no delay ever runs past
the caller's deadline. Time comes from a :class:`Clock`, so tests can step it instead of sleeping.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Backoff", "Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    """Where waiting code reads time and sleeps; :class:`FakeClock` steps it in tests."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """``time.monotonic`` and ``time.sleep``.

    ``monotonic`` is ``time.monotonic`` itself rather than a method calling it: every
    acquire and release reads the clock several times."""

    monotonic = staticmethod(time.monotonic)

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


class FakeClock:
    """A clock that only moves when told to: ``sleep`` advances it instantly and records it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.slept: list[float] = []
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self.now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.slept.append(seconds)
            self.now += max(0.0, seconds)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


@dataclass
class Backoff:
    """Successive delays for one waiter, never past ``deadline`` (a ``clock`` time, or None).

    ``next_delay()`` returns ``None`` once the deadline has passed: the caller gives up.
    ``floor`` is the shortest delay there is (but the time left): for a waiter woken by the
    release, whose waits are not polls (see ``LeaseBackend.wait_at_least``).
    """

    base: float = 0.005
    cap: float = 0.25
    floor: float = 0.0
    deadline: float | None = None
    clock: Clock = field(default=SYSTEM_CLOCK)
    #: ``None``: the ``random`` module's generator (reseeded in forked children, so processes
    #: forked from one parent do not draw the same delays).
    rng: random.Random | None = None
    attempt: int = 0

    def remaining(self) -> float | None:
        """Seconds left before the deadline (``None`` for no deadline, never negative)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - self.clock.monotonic())

    def next_delay(self) -> float | None:
        """The next jittered delay (``floor`` at least), clipped to the time left; ``None``
        when none is left."""
        left = self.remaining()
        if left is not None and left <= 0:
            return None
        ceiling = min(self.cap, self.base * 2 ** min(self.attempt, 32))
        self.attempt += 1
        delay = max(self.floor, (self.rng or random).uniform(0.0, ceiling))
        return delay if left is None else min(delay, left)
