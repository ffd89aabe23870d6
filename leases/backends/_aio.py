"""Async clients kept per event loop, for the backends that do real async I/O.

An async connection (psycopg's ``AsyncConnection``, a ``redis.asyncio`` pool) belongs to the
loop that opened it: used from another loop it fails or, worse, hangs. So a backend keeps one
per running loop, made on first use there; :meth:`PerLoop.aclose` (reached through
:meth:`~leases.backends.LeaseBackend.aclose`) closes the running loop's before it ends, and a
loop that ends without it only drops its entry (the weak reference dies with the loop).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["PerLoop"]

T = TypeVar("T")


class PerLoop(Generic[T]):
    """One ``T`` per running event loop: ``make()`` on first use, ``close(value)`` at the end."""

    def __init__(self, make: Callable[[], T], close: Callable[[T], Awaitable[object]]) -> None:
        self._make = make
        self._close = close
        self._lock = threading.Lock()
        self._values: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = (
            weakref.WeakKeyDictionary()
        )

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
