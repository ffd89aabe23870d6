"""The database backend's waiting room: one waiter per name listens, the others sleep.

A waiter enters a name's room after its first failed try: it takes a session advisory lock on a
connection of its own, so other waiters of the name sleep in the server's lock queue instead of
all retrying on every release (a herd that costs a failed round trip each). The waiter inside
also listens on its room connection, so only it is woken by the name's release, not every idle
process. Best effort throughout: queueing is bounded by :data:`ROOM_TIMEOUT` (a paused waiter
inside must not hold the others back for longer), the connections per process are capped, and
any failure just means waiting without a room. Safety never depends on it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import psycopg

from ..errors import BackendUnavailable
from ..keys import advisory_key
from ._pgconn import close_quietly, connect, inherit, stale, track

__all__ = ["ROOM_CONNECTIONS", "ROOM_TIMEOUT", "WaitingRoom"]

logger = logging.getLogger("leases")

#: Enter: listen, then queue on the name's room lock; ``lock_timeout`` bounds the queueing.
#: Leave: unlock and stop listening. Each is one simple-protocol round trip (two statements,
#: integers formatted in: no parameters are allowed there).
ROOM_ENTER_SQL = (
    "LISTEN leases_released; "
    "SELECT set_config('lock_timeout', '{timeout_ms}ms', false), pg_advisory_lock({key})"
)
ROOM_LEAVE_SQL = "SELECT pg_advisory_unlock({key}); UNLISTEN *"
#: Longest a waiter queues for the room before it waits on its own (a paused waiter in the
#: room must not hold the others back for longer).
ROOM_TIMEOUT = 1.0
#: Room connections a process may have open (in use or idle) per backend.
ROOM_CONNECTIONS = 8
_IDLE_ROOM_CONNECTIONS = 4


def room_key(name: str) -> int:
    """The advisory key of ``name``'s room (apart from any key a user could lock by name)."""
    key = advisory_key(f"leases:room:{name}")
    assert isinstance(key, int)  # a name always maps to one 64-bit key
    return key


class WaitingRoom:
    """The rooms of one backend alias on database ``db_alias``, per process."""

    def __init__(self, db_alias: str, alias: str, *, enabled: bool = True) -> None:
        self.db_alias = db_alias
        self.alias = alias
        self.enabled = enabled
        self._lock = threading.Lock()
        self._local = threading.local()
        self._idle: list[psycopg.Connection[Any]] = []
        self._slots = threading.BoundedSemaphore(ROOM_CONNECTIONS)
        track(self)

    @contextlib.contextmanager
    def enter(self, name: str, timeout: float | None) -> Iterator[None]:
        """Queue on the name's room lock (at most :data:`ROOM_TIMEOUT`), then wait inside it.

        Each waiter in the room holds a connection of its own, since its session sleeps in the
        lock queue; at most :data:`ROOM_CONNECTIONS` per process, so many waiting threads
        cannot exhaust the server's connections (the rest wait without a room).
        """
        if not self.enabled or not self._slots.acquire(blocking=False):
            yield
            return
        try:
            key = room_key(name)
            conn, entered = self._enter(name, key, timeout)
            self._local.room = conn if entered else None
            try:
                yield
            finally:
                self._local.room = None
                if conn is not None:
                    self._leave(conn, key, entered)
        finally:
            self._slots.release()

    def wait(self, name: str, timeout: float) -> bool | None:
        """Wait for ``name``'s release in this thread's room; ``None`` when not in one.

        The room connection listens since entering and buffers what arrived since, so a
        release between the failed try and this wait is not missed.
        """
        room: psycopg.Connection[Any] | None = getattr(self._local, "room", None)
        if room is None:
            return None
        try:
            for note in room.notifies(timeout=max(0.0, timeout)):
                if note.payload == name:
                    return True
        except psycopg.Error:
            self._local.room = None  # the session is gone (and its room lock with it)
        return False

    def _enter(
        self, name: str, key: int, timeout: float | None
    ) -> tuple[psycopg.Connection[Any] | None, bool]:
        queue_for = ROOM_TIMEOUT if timeout is None else min(timeout, ROOM_TIMEOUT)
        enter = ROOM_ENTER_SQL.format(timeout_ms=max(1, int(queue_for * 1000)), key=int(key))
        conn = None
        try:
            conn = self._connection()
            conn.execute(enter.encode())
            return conn, True
        except psycopg.errors.LockNotAvailable:
            return conn, False  # queued long enough: wait on our own
        except (psycopg.Error, BackendUnavailable) as exc:
            logger.debug("leases: waiting without a room for %r: %s", name, exc)
            close_quietly(conn)
            return None, False

    def _connection(self) -> psycopg.Connection[Any]:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not stale(conn):
                    return conn
                close_quietly(conn)
        return connect(self.db_alias)

    def _leave(self, conn: psycopg.Connection[Any], key: int, entered: bool) -> None:
        try:
            leave = ROOM_LEAVE_SQL.format(key=int(key)).encode()
            if entered and conn.execute(leave).fetchone() != (True,):
                # The unlock ran on another server session (a transaction-pooling proxy):
                # the room cannot work here, so stop using it rather than leak locks.
                self.enabled = False
                logger.warning("leases: waiting room disabled on %r: unlock failed", self.alias)
        except psycopg.Error:
            close_quietly(conn)  # closing the session releases its advisory lock
            return
        with self._lock:
            if len(self._idle) < _IDLE_ROOM_CONNECTIONS:
                self._idle.append(conn)
                return
        close_quietly(conn)

    def close(self) -> None:
        """Close the idle room connections (those in use close when their waiter leaves)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            close_quietly(conn)

    def forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(ROOM_CONNECTIONS)
        inherit(*self._idle, getattr(self._local, "room", None))
        self._idle = []
        self._local = threading.local()
