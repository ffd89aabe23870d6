"""Claiming a key from async code without leaking the claim when the awaiting task is cancelled.

Async callers (the async view guard, ``async with idempotency_key(...)``) claim the key and
start the attempt in the thread-sensitive sync thread, where the async ORM also runs. A task
cancelled meanwhile (a client that went away, ``asyncio.timeout``) stops waiting, but asgiref
lets the thread go on and drops its result: the key was claimed for nobody, and in atomic mode
the attempt's block stayed open on the thread's connection, under every later write of that
thread. So the thread leaves what it opened in a box, and the cancelled caller gives it up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from asgiref.sync import sync_to_async

from . import store

__all__ = ["open_cancellably"]

T = TypeVar("T")


async def open_cancellably(
    open_attempt: Callable[[], T], attempt_of: Callable[[T], store.Attempt | None]
) -> T:
    """``open_attempt()`` in the thread-sensitive sync thread; its result, whose attempt (if
    ``attempt_of`` finds one) is aborted when the awaiting task is cancelled first.

    The abort runs in the same thread, where thread-sensitive calls run one after the other,
    so after the claim: its block is the one open on that connection, and it is closed and the
    key freed before the cancellation goes on. (Not a task of its own for the claim: the
    context variables it sets, the attempt's steps among them, must be the caller's.)
    """
    box: list[T] = []

    def open_into_box() -> T:
        opened = open_attempt()
        box.append(opened)
        return opened

    try:
        return await sync_to_async(open_into_box)()
    except asyncio.CancelledError:
        await sync_to_async(_give_up)(box, attempt_of)
        raise


def _give_up(box: list[T], attempt_of: Callable[[T], store.Attempt | None]) -> None:
    """Abort the attempt a claim cut off by a cancellation opened, if it opened one."""
    attempt = attempt_of(box[0]) if box else None
    if attempt is not None:
        attempt.abort()
