"""The package's own PostgreSQL connections, apart from Django's.

Lease state must not ride on the caller's connection (its transaction could hide or roll back
a grant), so the database backend, the waiting room and the durable counters open plain psycopg
connections from the Django alias's settings, read at connect time (a test database's name is
used), built the way Django builds its own (:func:`connect`: the same parameters, the same
``assume_role``), in autocommit, with ``synchronous_commit`` forced on. :class:`Listener` keeps
one more connection in ``LISTEN`` so waiters wake when a release is announced on
:data:`CHANNEL`.

Every object that keeps such connections registers here (:func:`track`), so one place handles
the two moments they must be let go: a fork (the child drops the parent's connections without
closing them) and Django opening a no-database connection (to create or drop a database).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import psycopg
from django.db import connections
from django.db.backends.signals import connection_created
from django.utils.connection import ConnectionDoesNotExist
from psycopg import sql

from .. import _process
from .._fdwait import readable
from .._pgdeadline import REQUEST_TIMEOUT, Deadline, armed
from .._pgpooler import BACKEND_PID_SQL
from ..errors import BackendUnavailable, LeasesImproperlyConfigured
from ._pgpooled import keeps_sessions, warn_unheard
from ._pgprepared import Prepared, run_prepared

__all__ = [
    "APPLICATION_NAME",
    "CHANNEL",
    "LISTEN_SQL",
    "Connecting",
    "Listener",
    "PrivateConnection",
    "ThreadNotes",
    "cannot_connect",
    "close_quietly",
    "connect",
    "connect_params",
    "driver_failure",
    "inherit",
    "remember",
    "stale",
    "track",
]

logger = logging.getLogger("leases")

#: The NOTIFY channel every release and forced release announces the name on.
CHANNEL = "leases_released"
LISTEN_SQL = "LISTEN leases_released"
#: How many names (or keys) :func:`remember` keeps, newest first.
_RECENT_RELEASES = 4096

KeyT = TypeVar("KeyT", bound=Hashable)


def remember(recent: OrderedDict[KeyT, float], key: KeyT, at: float) -> None:
    """``recent[key] = at``, as the newest entry, keeping only the latest
    :data:`_RECENT_RELEASES`.

    For what is noted per name and read back only if something comes for that name later
    (a release heard for a waiter, a failed try for the wait after it): most never are read
    (nobody waited; ``timeout=0``; the other slots of a full semaphore), so a plain dict grows
    by one entry per name for the life of the process, thread or event loop. One function for
    the sync and async sides, so their bound cannot drift apart."""
    recent[key] = at
    recent.move_to_end(key)
    while len(recent) > _RECENT_RELEASES:
        recent.popitem(last=False)


class ThreadNotes:
    """When each thread last noted each name, for the whole process (:func:`remember`'s
    bound, one for all threads).

    What a thread notes for itself (its failed try, for the wait after it; its release that
    saw waiters queued, for its next try) is its own, but kept per thread (a
    ``threading.local``), the bound held for each thread alive: a process of 200 threads could
    keep 200 times as much (about 200 bytes an entry, 0.8 MB a thread at the bound). So one
    dictionary under a lock holds them all, keyed by thread (its number, never reused); a
    thread's entries outlive it only until newer ones push them out.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: OrderedDict[tuple[int, str], float] = OrderedDict()

    def note(self, name: str, at: float) -> None:
        """This thread noted ``name`` at ``at`` (monotonic)."""
        key = (_process.thread.number, name)
        with self._lock:
            remember(self._at, key, at)

    def take(self, name: str, default: float) -> float:
        """When this thread last noted ``name`` (``default`` if it did not), forgotten now.

        Nothing noted is the common case (every try asks): answered without the lock, which
        is safe since only this thread adds this thread's entries."""
        if not self._at:
            return default
        key = (_process.thread.number, name)
        with self._lock:
            return self._at.pop(key, default)

    def __len__(self) -> int:
        return len(self._at)


#: How the package's own sessions name themselves to the server (unless the database's
#: ``OPTIONS`` say otherwise): operators' views tell its internal locks by it.
APPLICATION_NAME = "django-leases"

#: libpq settings that bound how long a dead server can hang us (unless the user set them).
_CONNECT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
    "application_name": APPLICATION_NAME,
}


#: Django's ``OPTIONS["assume_role"]``, applied as Django's own connections apply it: a login
#: role that does not inherit its privileges reaches the lease tables only through this role.
SET_ROLE_SQL = "SET ROLE {role}"
#: The session's time zone, set to Django's ``timezone_name`` for the database as Django's own
#: connections set it when they connect (``ensure_timezone``), and only when the server gave
#: the new session another one: Django's ``timestamptz`` loader, which these connections load
#: with, parses a value in the session's zone and then puts Django's zone on it without
#: converting, so a session left in the server's default zone (initdb copies the machine's)
#: read every time shifted by that zone's offset (``tests/test_lease_database_time_zone.py``).
SET_TIME_ZONE_SQL = "SELECT set_config('TimeZone', {zone}, false)"


def driver_failure(alias: str, exc: psycopg.Error, what: str = "") -> BackendUnavailable:
    """A driver error as :class:`BackendUnavailable`, saying what to do where that is known:
    a missing table or function means the ``leases`` app is not migrated on that database,
    which "UndefinedTable: relation … does not exist" leaves the operator to work out."""
    if isinstance(exc, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedFunction):
        what += "is the leases app migrated on its database? run `manage.py migrate`: "
    return BackendUnavailable(alias, f"{what}{type(exc).__name__}: {exc}")


def connect(db_alias: str, alias: str | None = None) -> psycopg.Connection[Any]:
    """A new autocommit connection to the database Django's ``db_alias`` points at *now*;
    failing, :class:`BackendUnavailable` names the lease backend ``alias`` (default: the
    database alias) and the database.

    Read at connect time, not at start-up, so a test database's name is used. The parameters
    are Django's own (``get_connection_params()``: user, ``options`` such as a ``search_path``,
    ``sslmode``, a service file...), and ``assume_role`` and the time zone are set as Django
    sets them (:meth:`Connecting.setup`), so these connections act with the identity Django's
    would and read times as Django's do; only Django's pool and cursor classes are left out,
    since these connections are used by psycopg directly.
    """
    connecting = connect_params(db_alias)
    conn = None
    try:
        conn = psycopg.connect(autocommit=True, **connecting.params)
        setup = connecting.setup(conn.info)
        if setup is not None:
            conn.execute(setup)
    except psycopg.Error as exc:
        close_quietly(conn)
        raise BackendUnavailable(alias or db_alias, cannot_connect(db_alias, exc)) from exc
    return conn


def cannot_connect(db_alias: str, exc: Exception) -> str:
    """What a failed connect says: the database alias too, since the lease backend's alias
    (which the error is raised for) is often not the database's name in ``DATABASES``."""
    return f"cannot connect to database {db_alias!r}: {exc}"


@dataclass(frozen=True)
class Connecting:
    """How to open a connection like Django's to a database: psycopg's parameters, and what
    Django sets on a session once it is open."""

    params: dict[str, Any]
    #: Django's ``OPTIONS["assume_role"]``, if any.
    role: str | None
    #: Django's ``timezone_name`` for the database (``None``: leave the session's).
    time_zone: str | None

    def setup(self, info: psycopg.ConnectionInfo) -> sql.Composed | None:
        """What to run on a new session whose ``info`` this is (one simple query, so one round
        trip), or ``None`` when it needs nothing: a session the server already gave Django's
        time zone and no role to assume costs no round trip, as with Django's connections."""
        statements = []
        if self.role:
            statements.append(sql.SQL(SET_ROLE_SQL).format(role=sql.Literal(self.role)))
        if self.time_zone and info.parameter_status("TimeZone") != self.time_zone:
            zone = sql.Literal(self.time_zone)
            statements.append(sql.SQL(SET_TIME_ZONE_SQL).format(zone=zone))
        return sql.SQL("; ").join(statements) if statements else None


def connect_params(db_alias: str) -> Connecting:
    """How to connect to ``db_alias`` now: what :func:`connect` and its async twin both use."""
    try:
        wrapper = connections.create_connection(db_alias)
    except ConnectionDoesNotExist as exc:
        raise LeasesImproperlyConfigured(str(exc)) from exc
    params = wrapper.get_connection_params()
    params.pop("cursor_factory", None)
    for key, value in _CONNECT_DEFAULTS.items():
        params.setdefault(key, value)
    params["options"] = f"{params.get('options', '')} -c synchronous_commit=on".strip()
    role = wrapper.settings_dict["OPTIONS"].get("assume_role")
    return Connecting(params, role, wrapper.timezone_name)


def close_quietly(conn: psycopg.Connection[Any] | None) -> None:
    """Close ``conn`` if there is one, ignoring errors (it is being dropped anyway)."""
    if conn is not None:
        with contextlib.suppress(Exception):
            conn.close()


def stale(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether an idle connection is already dead, without a round trip.

    An idle autocommit session that is not listening has nothing to say; if its socket is
    readable the server has closed it (restart, ``pg_terminate_backend``). Reconnecting first
    avoids failing a request on a connection that died while idle.
    """
    if conn.closed or conn.broken:
        return True
    try:
        return readable(conn.fileno(), 0)
    except OSError:
        return True


class Owner(Protocol):
    """What keeps private connections: it can close them, and drop them after a fork."""

    def close(self) -> None: ...

    def forget_after_fork(self) -> None:
        """In a forked child: hand the parent's connections to :func:`inherit`, never close
        them, and make fresh locks (a parent thread may have held one at the fork)."""


_owners: weakref.WeakSet[Owner] = weakref.WeakSet()
#: Connections inherited over fork: kept referenced, never closed, because closing (or
#: collecting) one would send a Terminate message on the parent's socket and end its session.
_inherited: list[object] = []


def track(owner: Owner) -> None:
    """Have ``owner`` let its connections go at a fork and before database DDL."""
    _owners.add(owner)


def inherit(*conns: object) -> None:
    """Keep a forked child's copies of the parent's connections alive and unused."""
    _inherited.extend(conn for conn in conns if conn is not None)


def _after_fork_in_child() -> None:
    for owner in list(_owners):
        owner.forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_before_database_ddl(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Close private connections when Django opens a no-database connection.

    Django does that only to create or drop databases (test runs, ``flush``-like tooling), and
    an open private connection would make ``DROP DATABASE`` fail; owners reconnect lazily.
    """
    if getattr(connection, "alias", None) == "__no_db__":
        for owner in list(_owners):
            owner.close()


connection_created.connect(_close_before_database_ddl, dispatch_uid="leases.backends._pgconn")


class PrivateConnection:
    """One private connection to ``db_alias``, shared by threads, opened on first use.

    A dead one (server restart, ``pg_terminate_backend``) is replaced at the next call: what
    it serves (lease rows, counters) lives in tables, not in the session. A
    :class:`~._pgprepared.Prepared` statement is sent prepared unless ``prepared`` is false.
    """

    def __init__(
        self,
        db_alias: str,
        timeout: float = REQUEST_TIMEOUT,
        *,
        prepared: bool = True,
        alias: str | None = None,
    ) -> None:
        self.db_alias = db_alias
        #: The lease backend errors are raised for (default: the database alias).
        self.alias = alias or db_alias
        #: Seconds a statement waits for its reply (see :mod:`~leases._pgdeadline`).
        self.timeout = timeout
        self.prepared = prepared
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        #: The prepared statements the open connection's session is known to have.
        self._names: set[str] = set()
        track(self)

    @property
    def conn(self) -> psycopg.Connection[Any] | None:
        """The connection, if open (for diagnostics and round-trip tests)."""
        return self._conn

    def run(
        self,
        statement: str | Prepared,
        params: Mapping[str, Any] | Sequence[Any],
        timeout: float | None = None,
    ) -> list[tuple[Any, ...]]:
        """Run one statement and fetch its rows: one round trip on an open connection.

        The reply is awaited at most ``timeout`` seconds (default :attr:`timeout`), then the
        connection is dropped. Raises the driver's error (a broken connection is dropped
        first) or :class:`BackendUnavailable` when no connection can be made or no reply came
        in time; callers translate both.
        """
        return self.run_here(statement, params, timeout)[0]

    def run_here(
        self,
        statement: str | Prepared,
        params: Mapping[str, Any] | Sequence[Any],
        timeout: float | None = None,
    ) -> tuple[list[tuple[Any, ...]], psycopg.Connection[Any]]:
        """:meth:`run`, and the connection it ran on: what the statement left in its session
        (a session advisory lock) is there only while that connection is :meth:`run_on`."""
        with self._lock:
            conn = self._conn
            if conn is None or stale(conn):
                self._discard()
                conn = self._conn = connect(self.db_alias, self.alias)
            return self._statement(conn, statement, params, timeout), conn

    def run_on(
        self,
        session: object,
        statement: str | Prepared,
        params: Mapping[str, Any] | Sequence[Any],
        timeout: float | None = None,
    ) -> list[tuple[Any, ...]] | None:
        """:meth:`run`, only if ``session`` (from :meth:`run_here`) is still the open
        connection; ``None``, nothing sent, once it was replaced or found dead (its session,
        and what it held, ended with it)."""
        with self._lock:
            conn = self._conn
            if conn is None or conn is not session or stale(conn):
                return None
            return self._statement(conn, statement, params, timeout)

    def _statement(
        self,
        conn: psycopg.Connection[Any],
        statement: str | Prepared,
        params: Mapping[str, Any] | Sequence[Any],
        timeout: float | None,
    ) -> list[tuple[Any, ...]]:
        due = Deadline(conn.fileno(), self.timeout if timeout is None else timeout)
        try:
            with armed(due):
                if not isinstance(statement, Prepared):
                    cursor = conn.execute(statement, params)
                elif self.prepared and isinstance(params, Mapping):
                    return run_prepared(conn, statement, params, self._names)
                else:
                    cursor = conn.execute(statement.sql, params)
                return cursor.fetchall() if cursor.description else []
        except psycopg.Error as exc:
            if conn.broken or conn.closed or due.fired:
                self._discard()
            if due.fired:
                raise BackendUnavailable(self.alias, due.why()) from exc
            raise

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        self._names = set()
        close_quietly(conn)

    def close(self) -> None:
        with self._lock:
            self._discard()

    def forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        inherit(self._conn)
        self._conn = None
        self._names = set()


class Listener:
    """One ``LISTEN`` connection and thread; remembers when each name was last released.

    Behind a pooler not declared a session pooler (``session_pooling``) it does not listen
    (see :mod:`~leases._pgpooler`): it becomes :attr:`deaf`, its thread ends, and :meth:`wait`
    waits out its timeout (the waiter's backoff delay)."""

    def __init__(self, db_alias: str, alias: str, *, session_pooling: bool = False) -> None:
        self._db_alias = db_alias
        self._alias = alias
        self._session_pooling = session_pooling
        self._cond = threading.Condition()
        self._released: OrderedDict[str, float] = OrderedDict()
        self._stop = threading.Event()
        self.conn: psycopg.Connection[Any] | None = None
        #: Whether it found a pooler in the way and will never listen.
        self.deaf = False
        self._thread = threading.Thread(
            target=self._run, name=f"leases-listen-{alias}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.conn = connect(self._db_alias)
                row = self.conn.execute(BACKEND_PID_SQL).fetchone()
                if row is None or not keeps_sessions(self.conn, row[0], self._session_pooling):
                    self.deaf = True
                    warn_unheard(self._alias)
                    return
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
            remember(self._released, name, time.monotonic())
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
