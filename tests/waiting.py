"""The one way tests wait: poll a condition until it holds, bounded by a deadline.

Tests wait on what they expect to happen instead of sleeping a fixed time, so a loaded machine
only makes them slower, never wrong; the deadline is generous and the failure says what never
happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["released_past_blocked_waits", "stalled", "stalled_handover", "wait_until"]

T = TypeVar("T")


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


async def stalled(
    call: Awaitable[T], condition: Callable[[], object], seconds: float, what: str
) -> T:
    """``call``'s outcome when the event loop blocks for ``seconds`` (a synchronous sleep, as a
    blocking call in some coroutine or GIL-heavy worker threads would) once ``condition``
    holds: the server ran the command, its reply waits in the socket while the loop stalls.

    ``call`` runs as a task made before the polls of ``condition`` (one a loop turn), so each
    turn runs its steps first (sending), then the poll: the stall starts on the very turn the
    request went out, before the loop looked at any socket again. ``AssertionError`` naming
    ``what`` if ``condition`` does not hold within 10 s."""
    task = asyncio.ensure_future(call)
    try:
        deadline = time.monotonic() + 10
        while not condition():
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after 10s waiting for {what}")
            await asyncio.sleep(0)
        time.sleep(seconds)  # the stall: the loop runs nothing else meanwhile
    finally:
        result = await task
    return result


async def stalled_handover(
    backend: Any,
    name: str,
    stall: float,
    *,
    held: Callable[[], object],
    renewed: Callable[[], object],
    freed: Callable[[], object],
) -> tuple[Any, Any]:
    """Through ``backend``'s async methods, holder A acquires ``name`` (TTL 10 s), renews it
    (to 30 s) and releases it, the loop stalling ``stall`` seconds right after each request
    reached the store (``held``, ``renewed``, ``freed`` say when, see :func:`stalled`); then
    B acquires and releases it unstalled. Each must succeed (a warm-up cycle first, so the
    stalled ones run on kept connections). Returns A's grant as renewed, and B's."""
    warm = await backend.atry_acquire(name, "warm", 30)
    assert warm is not None
    await backend.arelease(warm)
    a = await stalled(backend.atry_acquire(name, "A", 10), held, stall, "the acquire")
    assert a is not None
    a = await stalled(backend.arenew(a, 30), renewed, stall, "the renewal")
    await stalled(backend.arelease(a), freed, stall, "the release")
    b = await backend.atry_acquire(name, "B", 10)
    assert b is not None
    await backend.arelease(b)
    return a, b


async def released_past_blocked_waits(
    backend: Any, name: str, grant: Any, blocked: Callable[[], int], waits: int = 110
) -> list[object]:
    """``waits`` tasks of this event loop each wait for ``name`` to be released
    (``await_for_release``, up to 3 s), ``grant`` holding it (won elsewhere, so this loop's
    client has no connection of its own yet); once every wait is blocked on the server
    (``blocked()`` counts them) or has ended, ``grant`` is released from this loop, which
    needs a connection of its own. Each wait's outcome (an exception if it raised)."""
    tasks = [asyncio.ensure_future(backend.await_for_release(name, 3)) for _ in range(waits)]
    try:
        deadline = time.monotonic() + 10
        while blocked() + sum(task.done() for task in tasks) < waits:
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after 10s waiting for {waits} waits to block")
            await asyncio.sleep(0.02)
        await backend.arelease(grant)
    finally:
        outcomes: list[object] = await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes
