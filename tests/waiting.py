"""The one way tests wait: poll a condition until it holds, bounded by a deadline.

Tests wait on what they expect to happen instead of sleeping a fixed time, so a loaded machine
only makes them slower, never wrong; the deadline is generous and the failure says what never
happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(
    condition: Callable[[], object], timeout: float, what: str, *, interval: float = 0.02
) -> float:
    """Seconds until ``condition()`` was true; ``AssertionError`` naming ``what`` after ``timeout``.

    The condition is checked once more at the deadline, so a slow last poll cannot turn a
    success into a failure.
    """
    start = time.monotonic()
    deadline = start + timeout
    while not condition():
        if time.monotonic() >= deadline:
            if condition():
                break
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start
