"""Waiting on one socket, whatever its descriptor's number.

``select.select`` refuses descriptors from ``FD_SETSIZE`` (1024) up with ``ValueError``. A
process with that many files open (a busy web or task worker: sockets, log files, a pool of
connections) gets its new connections' sockets there, and then a check of an idle connection
would call every one dead (a reconnect per statement), and a wait for a reply would fail. So
the package waits with ``poll``, which has no such limit, and keeps ``select`` only where
``poll`` does not exist (Windows, whose ``select`` takes sockets, not numbers up to a bound).
"""

from __future__ import annotations

import math
import select

__all__ = ["readable", "readable_among", "writable"]

_POLL = hasattr(select, "poll")


def _ready(fd: int, write: bool, timeout: float | None) -> bool:
    if _POLL:
        poller = select.poll()
        poller.register(fd, select.POLLOUT if write else select.POLLIN)
        # Milliseconds, rounded up: rounded down, a wait of less than one would not wait.
        wait = None if timeout is None else math.ceil(max(0.0, timeout) * 1000)
        return bool(poller.poll(wait))  # a hang-up or an error counts as ready: it is news
    found = select.select([] if write else [fd], [fd] if write else [], [fd], timeout)
    return any(found)


def readable(fd: int, timeout: float | None = None) -> bool:
    """Whether ``fd`` has something to read (data, end-of-file or an error) within ``timeout``
    seconds (``None``: however long it takes; ``0``: now, without waiting)."""
    return _ready(fd, False, timeout)


def readable_among(fds: list[int], timeout: float | None = None) -> set[int]:
    """The descriptors of ``fds`` with something to read, waiting up to ``timeout`` seconds
    for the first (none: the time ran out)."""
    if _POLL:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        wait = None if timeout is None else math.ceil(max(0.0, timeout) * 1000)
        return {fd for fd, _ in poller.poll(wait)}
    return set(select.select(fds, [], [], timeout)[0])


def writable(fd: int, timeout: float | None = None) -> bool:
    """Whether ``fd`` can take more to send within ``timeout`` seconds (``None``: no bound)."""
    return _ready(fd, True, timeout)
