"""Async clients kept per event loop, for the backends that do real async I/O.

An async connection (psycopg's ``AsyncConnection``, a ``redis.asyncio`` pool) belongs to the
loop that opened it: used from another loop it fails or, worse, hangs. So a backend keeps one
per running loop, made on first use there; :meth:`PerLoop.aclose` (reached through
:meth:`~leases.backends.LeaseBackend.aclose`) closes the running loop's before it ends, and a
loop that ends without it only drops its entry (the weak reference dies with the loop).

A forked child starts with none of its parent's values and a fresh lock: another thread of
the parent may have held the lock at the fork (the child would wait on it forever), and a
parent's connection is the parent's session. Those values stay referenced in the child, never
closed: a psycopg connection closed or collected there sends ``Terminate`` on the parent's
socket (the same rule as :func:`~._pgconn.inherit` on the sync side).
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

__all__ = ["PerLoop"]

T = TypeVar("T")

#: Every :class:`PerLoop`, so a forked child can renew them all (:func:`_after_fork_in_child`).
_all: weakref.WeakSet[PerLoop[Any]] = weakref.WeakSet()
#: The parent's values in a forked child: kept alive, never used, never closed.
_inherited: list[object] = []


class PerLoop(Generic[T]):
    """One ``T`` per running event loop: ``make()`` on first use, ``close(value)`` at the end."""

    def __init__(self, make: Callable[[], T], close: Callable[[T], Awaitable[object]]) -> None:
        self._make = make
        self._close = close
        self._lock = threading.Lock()
        self._values: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = (
            weakref.WeakKeyDictionary()
        )
        _all.add(self)

    def get(self) -> T:
        """The running loop's value (made now if it has none); only call it from a coroutine."""
        loop = asyncio.get_running_loop()
        with self._lock:
            value = self._values.get(loop)
            if value is None:
                value = self._values[loop] = self._make()
            return value

    async def aclose(self) -> None:
        """Close and forget the running loop's value, if it has one."""
        with self._lock:
            value = self._values.pop(asyncio.get_running_loop(), None)
        if value is not None:
            await self._close(value)

    def forget_after_fork(self) -> None:
        """In a forked child: a fresh lock, and the parent's values put aside unclosed."""
        self._lock = threading.Lock()
        _inherited.extend(self._values.values())
        self._values = weakref.WeakKeyDictionary()


def _after_fork_in_child() -> None:
    for per_loop in list(_all):
        per_loop.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
