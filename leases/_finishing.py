"""Round trips that a cancellation never abandons halfway, for the async API.

A release, a try or a place taken in a line must run to its end once sent: cut off halfway,
it leaves the name held (or the line blocked) for the rest of a TTL with nobody knowing.
:func:`finish` runs such a step so that a cancellation of the caller cannot cut it short: the
cancellation is held back until the step has ended, then delivered (after ``undo``, for a step
whose effect must not outlive a cancelled caller).

How: the step runs **in the caller's own task**, driven here (:class:`_Driven`), and every
future the step waits on reaches the task behind a stand-in (:class:`_Held`) that is woken by
the future's end like the future itself, but declines to be cancelled. Asked to cancel, the
task then records the cancellation and raises it into the driver when the future it waits on
is done; the driver keeps it, finishes the step and raises it at the end.

Why not a task of its own for the step (as before), nor ``asyncio.shield``: both cost two
turns of the event loop per step, one to start the step's task and one to wake the caller
from its end, on every acquire and every release (the async API's hot path: four of the eight
turns an ``alease()`` took, see ``benchmarks/bench_async.py``). Run in the caller's task, the
step also sees the caller's task as its own (``asyncio.current_task()``), so what a backend
keeps per task, such as when a try failed for the wait that follows, is kept for the caller.

What a step must not do: bound itself by cancelling the current task (``asyncio.timeout``
around its own I/O). That cancellation is the caller's too, and is held back like any other
until the step ends. A step's deadline cuts its connection instead (as
:mod:`~leases._pgdeadline` does), or runs in a task of its own (``asyncio.gather``
of per-node calls, ``asyncio.wait_for``), whose cancellation is that task's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Generator
from contextvars import Context
from types import CoroutineType
from typing import Any, Generic, TypeVar

__all__ = ["finish"]

T = TypeVar("T")


class _Held:
    """What the caller's task waits on instead of ``future``: the future protocol of asyncio
    (``_asyncio_future_blocking``, ``get_loop``, ``add_done_callback``, ``result``,
    ``cancel``), with a ``cancel`` that declines. The task then records the cancellation and
    raises it into the driver when this wakes it, once ``future`` is done.

    One is made for every future a step waits on (each round trip of every async acquire and
    release), so what the task calls on it is bound to C callables when it is made (the
    future's own ``get_loop`` and ``done``, and ``result`` answering ``None``): as Python
    methods each ran cold between two round trips, when the cache holds little of this
    package's code."""

    __slots__ = ("_asyncio_future_blocking", "_future", "done", "get_loop", "result")

    def __init__(self, future: Any) -> None:
        self._future = future
        self._asyncio_future_blocking = True
        self.get_loop: Callable[[], asyncio.AbstractEventLoop] = future.get_loop
        self.done: Callable[[], bool] = future.done
        # The step reads the future's outcome itself, when resumed: ``result()`` is ``None``.
        self.result: Callable[[], None] = _NONE

    def add_done_callback(
        self, fn: Callable[[Any], object], *, context: Context | None = None
    ) -> None:
        self._future.add_done_callback(lambda _: fn(self), context=context)

    def cancel(self, msg: Any = None) -> bool:
        return False  # held back: the task raises it into the driver once the future is done

    def cancelled(self) -> bool:
        return False


#: ``None``, called from C: what :attr:`_Held.result` answers.
_NONE: Callable[[], None] = type(None)


class _Driven(Generic[T]):
    """``step`` run in the awaiting task, its futures behind :class:`_Held`: what
    :func:`finish` returns. An awaitable of its own rather than a coroutine around one: it is
    on every async acquire's and release's path, and a coroutine would add a frame to every
    resumption of the step."""

    __slots__ = ("_step", "_undo")

    def __init__(
        self, step: Coroutine[Any, Any, T], undo: Callable[[Any], Awaitable[object]] | None
    ) -> None:
        self._step = step
        self._undo = undo

    def __await__(self) -> Generator[Any, None, T]:
        step, undo = self._step, self._undo
        cancelled: asyncio.CancelledError | None = None  # delivered to the task meanwhile
        try:
            while True:
                try:
                    waited = step.send(None)
                except StopIteration as end:
                    won: T = end.value
                    break
                except BaseException:
                    if cancelled is not None and undo is not None:
                        raise cancelled from None
                    raise
                if getattr(waited, "_asyncio_future_blocking", None):
                    waited._asyncio_future_blocking = False
                    waited = _Held(waited)
                # else: a bare yield (``sleep(0)``), or something the task itself refuses
                try:
                    yield waited
                except asyncio.CancelledError as exc:
                    # Raised only when the task wakes: the future waited on is done, and the
                    # step, resumed, reads its outcome as if nothing had happened.
                    cancelled = exc
        except GeneratorExit:
            step.close()
            raise
        if cancelled is None:
            return won
        if undo is not None and won is not None:
            with contextlib.suppress(Exception):
                yield from finish(undo(won)).__await__()
        raise cancelled


async def _future(step: Awaitable[T]) -> T:
    return await step


def finish(
    step: Awaitable[T], undo: Callable[[Any], Awaitable[object]] | None = None
) -> Awaitable[T]:
    """``await finish(step)``: ``await step``, to its end even if the caller is cancelled
    meanwhile; then the cancellation is raised.

    Without ``undo`` the step's own failure comes first (a failed release must not be hidden
    by the cancellation). With ``undo``, a step cancelled that way is undone instead: its
    result, if not ``None``, is given to ``undo`` (run to its end likewise), its failure
    ignored, and the cancellation raised.
    """
    return _Driven(step if type(step) is CoroutineType else _future(step), undo)
