"""Round trips that a cancellation never abandons halfway, for the async API.

A release, a try or a place taken in a line must run to its end once sent: cut off halfway,
it leaves the name held (or the line blocked) for the rest of a TTL with nobody knowing.
:func:`finish` runs such a step in a task of its own and waits for it in a way a cancellation
of the caller cannot cut short: the cancellation is held back until the step has ended, then
delivered (after ``undo``, for a step whose effect must not outlive a cancelled caller).

Why not ``asyncio.shield``: the shield raises the cancellation at once and the caller must
then await the step again; it also puts an outer future between the step and the caller, one
more turn of the event loop to wake the caller, on every acquire and every release (the async
API's hot path). Here the caller awaits a stand-in for the step's task (:class:`_Awaiting`):
woken by the task's end like by the task itself, but declining to be cancelled, which the
event loop's task answers by delivering the cancellation when it wakes, i.e. once the step has
ended. The step's own deadlines still work: they cancel the step's task, not the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, Coroutine, Generator
from contextvars import Context
from typing import Any, TypeVar

__all__ = ["finish"]

T = TypeVar("T")


class _Awaiting:
    """What the caller's task waits on instead of ``task``: the future protocol of asyncio
    (``_asyncio_future_blocking``, ``get_loop``, ``add_done_callback``, ``result``,
    ``cancel``), with a ``cancel`` that declines. The task then records the cancellation and
    raises it into the caller when this wakes it, once ``task`` is done."""

    _asyncio_future_blocking = False

    def __init__(self, task: asyncio.Future[Any]) -> None:
        self._task = task

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._task.get_loop()

    def add_done_callback(
        self, fn: Callable[[Any], object], *, context: Context | None = None
    ) -> None:
        self._task.add_done_callback(lambda _: fn(self), context=context)

    def cancel(self, msg: Any = None) -> bool:
        return False  # held back: the caller's task raises it when the step has ended

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return self._task.done()

    def result(self) -> None:
        return None  # the step's outcome is read from its task, after the wait

    def __await__(self) -> Generator[Any, None, None]:
        if not self._task.done():
            self._asyncio_future_blocking = True
            yield self


def _start(step: Awaitable[T]) -> asyncio.Future[T]:
    if not asyncio.iscoroutine(step):
        return asyncio.ensure_future(step)
    coro: Coroutine[Any, Any, T] = step
    if sys.version_info >= (3, 12):  # runs at once, up to its first wait: one turn fewer
        return asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)
    return asyncio.get_running_loop().create_task(coro)


async def finish(step: Awaitable[T], undo: Callable[[Any], Awaitable[object]] | None = None) -> T:
    """``await step``, to its end even if the caller is cancelled meanwhile; then the
    cancellation is raised.

    Without ``undo`` the step's own failure comes first (a failed release must not be hidden
    by the cancellation). With ``undo``, a step cancelled that way is undone instead: its
    result, if not ``None``, is given to ``undo`` (run to its end likewise), its failure
    ignored, and the cancellation raised.
    """
    task = _start(step)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await _Awaiting(task)
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is None:
        return task.result()
    if undo is None:
        task.result()
    elif not task.cancelled() and task.exception() is None:
        won = task.result()
        if won is not None:
            with contextlib.suppress(Exception):
                await finish(undo(won))
    raise cancelled
