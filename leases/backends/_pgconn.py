"""The database backend's own PostgreSQL connections, apart from Django's.

Lease state must not ride on the caller's connection (its transaction could hide or roll back
a grant), so the backend opens plain psycopg connections from the Django alias's settings,
read at connect time (a test database's name is used), in autocommit, with
``synchronous_commit`` forced on. :class:`Listener` keeps one more connection in ``LISTEN`` so
waiters wake when a release is announced on :data:`CHANNEL`.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections import OrderedDict
from typing import Any

import psycopg
from django.db import connections
from django.utils.connection import ConnectionDoesNotExist

from ..errors import BackendUnavailable, LeasesImproperlyConfigured

__all__ = ["CHANNEL", "LISTEN_SQL", "Listener", "close_quietly", "connect", "stale"]

logger = logging.getLogger("leases")

#: The NOTIFY channel every release and forced release announces the name on.
CHANNEL = "leases_released"
LISTEN_SQL = "LISTEN leases_released"
_RECENT_RELEASES = 4096

#: libpq settings that bound how long a dead server can hang us (unless the user set them).
_CONNECT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
    "application_name": "django-leases",
}


def connect(db_alias: str) -> psycopg.Connection[Any]:
    """A new autocommit connection to the database Django's ``db_alias`` points at *now*.

    Read at connect time, not at start-up, so a test database's name is used.
    """
    try:
        wrapper = connections.create_connection(db_alias)
    except ConnectionDoesNotExist as exc:
        raise LeasesImproperlyConfigured(str(exc)) from exc
    params = wrapper.get_connection_params()
    params.pop("cursor_factory", None)
    for key, value in _CONNECT_DEFAULTS.items():
        params.setdefault(key, value)
    params["options"] = f"{params.get('options', '')} -c synchronous_commit=on".strip()
    try:
        return psycopg.connect(autocommit=True, **params)
    except psycopg.Error as exc:
        raise BackendUnavailable(db_alias, f"cannot connect: {exc}") from exc


def close_quietly(conn: psycopg.Connection[Any] | None) -> None:
    """Close ``conn`` if there is one, ignoring errors (it is being dropped anyway)."""
    if conn is not None:
        with contextlib.suppress(Exception):
            conn.close()


def stale(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection is already dead, without a round trip.

    An idle autocommit session that is not listening has nothing to say; if its socket is
    readable the server has closed it (restart, ``pg_terminate_backend``). Reconnecting first
    avoids failing a request on a connection that died while idle.
    """
    if conn.closed or conn.broken:
        return True
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class Listener:
    """One ``LISTEN`` connection and thread; remembers when each name was last released."""

    def __init__(self, db_alias: str, alias: str) -> None:
        self._db_alias = db_alias
        self._cond = threading.Condition()
        self._released: OrderedDict[str, float] = OrderedDict()
        self._stop = threading.Event()
        self.conn: psycopg.Connection[Any] | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"leases-listen-{alias}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.conn = connect(self._db_alias)
                self.conn.execute(LISTEN_SQL)
                while not self._stop.is_set():
                    for note in self.conn.notifies(timeout=0.25):
                        self._record(note.payload)
            except Exception as exc:  # never die: waiters fall back to their backoff
                if not self._stop.is_set():
                    logger.debug("leases: LISTEN connection failed (%s); retrying", exc)
                    self._stop.wait(0.5)
            finally:
                conn, self.conn = self.conn, None
                close_quietly(conn)

    def _record(self, name: str) -> None:
        with self._cond:
            self._released[name] = time.monotonic()
            self._released.move_to_end(name)
            while len(self._released) > _RECENT_RELEASES:
                self._released.popitem(last=False)
            self._cond.notify_all()

    def wait(self, name: str, since: float, timeout: float) -> bool:
        """Whether ``name`` was released after ``since``, waiting up to ``timeout`` for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._released.get(name, float("-inf")) < since:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(left)
            return True

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
