"""Async clients kept per event loop, for the backends that do real async I/O.

An async connection (psycopg's ``AsyncConnection``, a ``redis.asyncio`` pool) belongs to the
loop that opened it: used from another loop it fails or, worse, hangs. So a backend keeps one
per running loop, made on first use there. :meth:`PerLoop.aclose` (reached through
:meth:`~leases.backends.LeaseBackend.aclose`) closes the running loop's; a loop that ends
without it (``asyncio.run(main())`` in a script, Django's ``async_to_sync``) closes its values
as it shuts down, in ``loop.shutdown_asyncgens()`` (see :meth:`PerLoop._until_the_loop_ends`).
The entry cannot simply die with the loop: a ``redis.asyncio`` connection's streams refer to
their loop, so a value keeps its own key alive and the loop, its sockets and its server
sessions would never go; and a psycopg connection left to the garbage collector lingers on the
server until a collection happens to run, then warns (``ResourceWarning``). A loop closed by
hand without ``shutdown_asyncgens()`` cannot close its values: they are let go when the next
loop first makes one (:meth:`PerLoop._forget_closed_loops`), for the garbage collector.

A forked child starts with none of its parent's values and a fresh lock: another thread of
the parent may have held the lock at the fork (the child would wait on it forever), and a
parent's connection is the parent's session. Those values stay referenced in the child, never
closed: a psycopg connection closed or collected there sends ``Terminate`` on the parent's
socket (the same rule as :func:`~._pgconn.inherit` on the sync side); the shutdown hook of a
parent's loop does nothing in a child either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Generic, NamedTuple, TypeVar

__all__ = ["PerLoop"]

T = TypeVar("T")

#: Every :class:`PerLoop`, so a forked child can renew them all (:func:`_after_fork_in_child`).
_all: weakref.WeakSet[PerLoop[Any]] = weakref.WeakSet()
#: The parent's values in a forked child: kept alive, never used, never closed.
_inherited: list[object] = []


class _Entry(NamedTuple, Generic[T]):
    value: T
    #: Suspended until the loop shuts down or :meth:`PerLoop.aclose`; then closes ``value``.
    closer: AsyncGenerator[None, None]


class PerLoop(Generic[T]):
    """One ``T`` per running event loop: ``make()`` on first use, ``close(value)`` at the end."""

    def __init__(self, make: Callable[[], T], close: Callable[[T], Awaitable[object]]) -> None:
        self._make = make
        self._close = close
        self._lock = threading.Lock()
        self._values: dict[asyncio.AbstractEventLoop, _Entry[T]] = {}
        _all.add(self)

    def get(self) -> T:
        """The running loop's value (made now if it has none); only call it from a coroutine."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._values.get(loop)
            if entry is None:
                self._forget_closed_loops()
                value = self._make()
                entry = self._values[loop] = _Entry(value, self._closer(loop, value))
        return entry.value

    def _forget_closed_loops(self) -> None:
        """Drop the entries of loops closed without ``shutdown_asyncgens()`` (by hand:
        ``loop.run_until_complete(...)`` then ``loop.close()``, common in code that predates
        ``asyncio.run``); called under the lock when a new loop makes its value.

        Nothing can await a close on a closed loop, so the value is only let go, to the
        garbage collector, which ends a psycopg session when it collects the connection (and
        breaks a Redis pool's cycle with its loop); kept here, each such loop would keep its
        connections and server sessions open for the life of the process, one more per loop:
        a worker that runs each job on a new loop would run the server out of connections.
        Its closer is finished first, without closing anything (see
        :meth:`_until_the_loop_ends`), so collecting it later does not ask the closed loop to
        run its end."""
        for loop in [loop for loop in self._values if loop.is_closed()]:
            closer = self._values.pop(loop).closer
            with contextlib.suppress(StopIteration):  # how the finished step says it is done
                closer.aclose().send(None)

    def _closer(self, loop: asyncio.AbstractEventLoop, value: T) -> AsyncGenerator[None, None]:
        """:meth:`_until_the_loop_ends` for ``value``, started: the running loop now tracks it
        (its first step runs here, synchronously, up to its ``yield``)."""
        closer = self._until_the_loop_ends(loop, value, os.getpid())
        with contextlib.suppress(StopIteration):  # how a coroutine's step says it yielded
            closer.asend(None).send(None)
        return closer

    async def _until_the_loop_ends(
        self, loop: asyncio.AbstractEventLoop, value: T, pid: int
    ) -> AsyncGenerator[None, None]:
        """Closes ``value`` when closed itself, on the loop that is ending.

        An async generator started on a loop is what ``loop.shutdown_asyncgens()`` closes: the
        one hook that ``asyncio.run``, ``asyncio.Runner`` and ``async_to_sync`` all run before
        closing the loop, once the loop's tasks are cancelled and done (a task's release in a
        ``finally`` still had its connection), while the loop still runs (so ``value`` closes
        as on :meth:`aclose`: psycopg ends the session with ``Terminate`` and does not warn,
        redis-py disconnects its sockets). :meth:`aclose` closes it too, for the same ending.
        """
        try:
            yield
        finally:
            # Never a parent's value in a forked child; nothing to await on a closed loop
            # (:meth:`_forget_closed_loops` finishes the closer then, under the lock).
            if os.getpid() == pid and not loop.is_closed():
                with self._lock:  # unless :meth:`aclose` took it out already
                    if loop in self._values and self._values[loop].value is value:
                        del self._values[loop]
                await self._close(value)

    async def aclose(self) -> None:
        """Close and forget the running loop's value, if it has one."""
        with self._lock:
            entry = self._values.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry.closer.aclose()

    def forget_after_fork(self) -> None:
        """In a forked child: a fresh lock, and the parent's values put aside unclosed."""
        self._lock = threading.Lock()
        _inherited.extend(self._values.values())
        self._values = {}


def _after_fork_in_child() -> None:
    for per_loop in list(_all):
        per_loop.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
