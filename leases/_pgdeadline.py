"""A reply that never comes: every statement on the package's own connections has a deadline.

libpq waits for a reply for ever. Its keepalives and ``tcp_user_timeout`` only notice a peer
whose *kernel* has gone: anything that keeps the TCP connection alive while the reply is lost
(a NAT or load balancer, PgBouncer, a proxy, a server that is paused or swapping) leaves the
client waiting, and ``statement_timeout`` cannot help, since the server may have answered long
ago. A renewal stuck that way cannot be retried before the lease runs out (a false loss), and
a release or ``close()`` stuck that way never returns, against "every wait is bounded".

So each statement arms a :class:`Deadline`. When it passes before the reply has arrived the
socket is shut down under libpq (``shutdown(2)``, never ``close``: the descriptor stays
psycopg's); the waiting call then sees end-of-file and fails as on a connection the server
dropped, and the connection is discarded. Whether the statement took effect is unknown, which
is why callers report "no reply" (never success) and renewal and release are safe to retry.

Sync statements are watched by one thread per process (:func:`armed`), woken only when a
deadline earlier than the one it sleeps towards is armed, so a hot loop pays two lock
acquisitions per statement, no context switch. Async statements use a timer on their own
event loop (:func:`aarmed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Iterator

__all__ = ["REQUEST_TIMEOUT", "Deadline", "aarmed", "armed"]

#: Seconds a statement waits for its reply by default (the database backend's
#: ``REQUEST_TIMEOUT`` option overrides it): far above any healthy statement's time, far below
#: a lease's default TTL.
REQUEST_TIMEOUT = 5.0


class Deadline:
    """One statement's deadline on the connection whose socket is ``fileno``."""

    __slots__ = ("due", "fileno", "fired", "timeout")

    def __init__(self, fileno: int, timeout: float) -> None:
        self.fileno = fileno
        self.timeout = timeout
        self.due = time.monotonic() + timeout
        self.fired = False

    def cut(self) -> None:
        """Shut the socket down so the waiting call fails at once (a duplicate descriptor is
        shut and closed; the original stays open for psycopg to close)."""
        self.fired = True
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(self.fileno))
            with sock:
                sock.shutdown(socket.SHUT_RDWR)

    def why(self) -> str:
        return (
            f"no reply within {self.timeout:.3g}s, so the connection was dropped; whether the "
            "statement took effect is unknown"
        )


class _Watch:
    """The thread that cuts sync statements past their deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())  # a plain lock: cheaper than RLock
        self._armed: set[Deadline] = set()
        self._wake_at = math.inf
        self._thread: threading.Thread | None = None

    def arm(self, deadline: Deadline) -> None:
        with self._cond:
            self._armed.add(deadline)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="leases-reply-deadlines", daemon=True
                )
                self._thread.start()
            if deadline.due < self._wake_at:
                self._wake_at = deadline.due
                self._cond.notify()

    def disarm(self, deadline: Deadline) -> None:
        """Under the lock, so a descriptor is never cut once its statement is over."""
        with self._cond:
            self._armed.discard(deadline)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for deadline in [d for d in self._armed if d.due <= now]:
                    self._armed.discard(deadline)
                    deadline.cut()
                self._wake_at = min((d.due for d in self._armed), default=math.inf)
                self._cond.wait(None if self._wake_at == math.inf else self._wake_at - now)


_watch = _Watch()


def _forget_after_fork() -> None:
    """The thread does not survive fork; the child's first statement starts its own."""
    global _watch
    _watch = _Watch()


os.register_at_fork(after_in_child=_forget_after_fork)


class armed:
    """Cut the deadline's socket if the block (one statement) is still running when it is due.

    Leave the block before closing the connection: once disarmed, the descriptor is never
    touched again (a cut after a close could hit a new socket that reused its number). A
    class, not ``@contextmanager``: it wraps every statement, and a generator costs more.
    """

    __slots__ = ("deadline", "watch")

    def __init__(self, deadline: Deadline) -> None:
        self.deadline, self.watch = deadline, _watch

    def __enter__(self) -> None:
        self.watch.arm(self.deadline)

    def __exit__(self, *exc: object) -> None:
        self.watch.disarm(self.deadline)


@contextlib.contextmanager
def aarmed(deadline: Deadline) -> Iterator[None]:
    """:func:`armed` for a statement awaited on the running loop: a timer of that loop's."""
    timer = asyncio.get_running_loop().call_later(deadline.timeout, deadline.cut)
    try:
        yield
    finally:
        timer.cancel()
