"""Every backend's whole listing read page by page: all backends at once, each page bounded.

``manage.py leases list --limit 0`` reads every lease of every backend, a million rows of the
database backend among them. Read one backend after the other, through lazy streams that a
merge advances one item at a time, the first page of each backend waited for the one before
it, and a store that stopped answering half-way (a paused etcd member, a ZooKeeper behind a
dropped link) stalled the whole listing for its own timeouts, once per page.

Here each backend's stream is read ``page`` items at a time on a thread of a pool of the
listing's own, one thread per backend: every backend's first page is asked for at once, and the
next page of a backend is read while the current one is written out, so at most two pages per
backend are in memory. A page not read within ``bound`` seconds of being asked for ends that
backend's stream, with an error for it; the other backends go on. The thread stuck on it stays
until the backend's own timeouts end the call (every wait of a backend is bounded), and the
listing does not wait for it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from django.db import connections

from .errors import LeaseError

__all__ = ["Pages"]

T = TypeVar("T")


class Pages(Generic[T]):
    """One backend's stream (made by ``open_stream``, on the pool), read ahead a page at a time.

    The first page is asked for when this is made; iterating yields the items in the stream's
    order. A :class:`~leases.errors.LeaseError` or ``NotImplementedError`` (the backend failed,
    or cannot list), or a page late by more than ``bound`` seconds, ends the iteration and is
    put in ``errors[alias]``; any other error is a bug and raised.
    """

    def __init__(
        self,
        alias: str,
        open_stream: Callable[[], Iterator[T]],
        pool: ThreadPoolExecutor,
        errors: dict[str, str],
        *,
        page: int,
        bound: float,
    ) -> None:
        self.alias = alias
        self._open = open_stream
        self._pool = pool
        self._errors = errors
        self._page = page
        self._bound = bound
        self._source: Iterator[T] | None = None
        self._current: Iterator[T] = iter(())
        self._pending: Future[list[T]] | None = None
        self._deadline = 0.0
        self._ask()

    def _ask(self) -> None:
        self._deadline = time.monotonic() + self._bound
        self._pending = self._pool.submit(self._read)

    def _read(self) -> list[T]:
        """On the pool: the next page (fewer items: the stream is done)."""
        try:
            if self._source is None:
                self._source = self._open()
            return list(itertools.islice(self._source, self._page))
        finally:
            # A backend may use Django's connections: a pool thread never ends to close its own.
            connections.close_all()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        for item in self._current:
            return item
        pending = self._pending
        if pending is None:
            raise StopIteration
        self._pending = None
        try:
            batch = pending.result(timeout=max(0.0, self._deadline - time.monotonic()))
        except TimeoutError:
            self._errors[self.alias] = f"unreachable: no page within {self._bound:g}s"
            raise StopIteration from None
        except (LeaseError, NotImplementedError) as exc:
            self._errors[self.alias] = str(exc)
            raise StopIteration from None
        if len(batch) == self._page:
            self._ask()  # read ahead while this page is written
        self._current = iter(batch)
        return next(self)
