"""The default backend: leases in the ``leases_lease`` table of a Django PostgreSQL database.

Every state change is one statement on a connection of the backend's own, in autocommit, so the
caller's transaction can neither hide nor roll back an acquire or a release (and a grant commits
durably: ``synchronous_commit`` is forced on for this connection, because a grant lost in a crash
would be handed out again with the same token). Expiry is decided by ``clock_timestamp()`` on the
server, and a row is never deleted: it carries the name's token counter.

A failed try writes nothing. ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` alone would lock the
held row even when its ``WHERE`` is false, which assigns a transaction id and costs a WAL record
and a commit flush per failed try; the read-only ``NOT EXISTS`` probe in the same statement makes
the insert produce no row at all when the lease is held, so nothing is locked or written
(``tests/test_lease_database.py::test_failed_try_assigns_no_transaction_id`` proves both).

The release statement notifies channel :data:`CHANNEL` (payload = name) in the same round
trip. Waiters queue in a per-name "waiting room" (a session advisory lock): the one inside
listens on its own connection and retries on each release, the rest sleep in the server's lock
queue, so a release wakes one waiter instead of a herd. Waiters that find no room (too many,
or queued past :data:`ROOM_TIMEOUT`) sleep on the process's shared ``LISTEN`` connection.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import psycopg
from django.db import connections
from django.db.backends.signals import connection_created

from ..errors import BackendUnavailable, LeaseLost, LeaseNotHeld, LeasesImproperlyConfigured
from ..keys import advisory_key
from ._pgconn import CHANNEL, Listener, close_quietly, connect, stale
from .base import FORGED, Capability, Grant, LeaseBackend, LeaseInfo, new_secret, not_revoked

__all__ = ["CHANNEL", "Backend"]

_connect = connect  # the old private name, still imported by leases.backends._counter

logger = logging.getLogger("leases")

#: Take ``name`` if it is free or expired, bumping its token; nothing is written when it is held.
#: The row keeps only the SHA-256 of the grant's secret, computed here on the server, so the
#: table (backups, replicas, anyone with SELECT) never holds the credential itself.
ACQUIRE_SQL = """
INSERT INTO leases_lease AS l
    (name, holder, token, acquired_at, expires_at, renewed_at, meta, secret_hash)
SELECT %(name)s::text, %(holder)s::text, 1, clock_timestamp(),
       clock_timestamp() + make_interval(secs => %(ttl)s), NULL, '{}', sha256(%(secret)s::bytea)
WHERE NOT EXISTS (
    SELECT 1 FROM leases_lease
    WHERE name = %(name)s::text AND holder <> '' AND expires_at > clock_timestamp()
)
ON CONFLICT (name) DO UPDATE
SET holder = EXCLUDED.holder, token = l.token + 1, acquired_at = EXCLUDED.acquired_at,
    expires_at = EXCLUDED.expires_at, renewed_at = NULL, secret_hash = EXCLUDED.secret_hash
WHERE l.holder = '' OR l.expires_at IS NULL OR l.expires_at <= clock_timestamp()
RETURNING l.token, l.expires_at
"""

#: Extend a grant that is still ours (holder, token and secret) and still valid on the server's
#: clock. One row back: the new expiry, or NULL when holder and token are the current grant's
#: but the secret is not (a forged grant: nothing was written). No row: expired or taken over.
RENEW_SQL = """
WITH renewed AS (
    UPDATE leases_lease
    SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
        renewed_at = clock_timestamp()
    WHERE name = %(name)s::text AND holder = %(holder)s::text AND token = %(token)s
      AND secret_hash = sha256(%(secret)s::bytea) AND expires_at > clock_timestamp()
    RETURNING expires_at
)
SELECT expires_at FROM renewed
UNION ALL
SELECT NULL FROM leases_lease
WHERE name = %(name)s::text AND holder = %(holder)s::text AND token = %(token)s
  AND secret_hash IS DISTINCT FROM sha256(%(secret)s::bytea) AND NOT EXISTS (SELECT FROM renewed)
"""

#: Free a grant that is still ours, keeping the token counter, and wake waiters (same trip).
#: One row back: ``true`` when freed, ``false`` for a forged grant (as in :data:`RENEW_SQL`).
RELEASE_SQL = """
WITH freed AS (
    UPDATE leases_lease SET holder = '', expires_at = clock_timestamp(), secret_hash = NULL
    WHERE name = %(name)s::text AND holder = %(holder)s::text AND token = %(token)s
      AND secret_hash = sha256(%(secret)s::bytea) AND expires_at > clock_timestamp()
    RETURNING name
)
SELECT pg_notify('leases_released', name)::text IS NOT NULL FROM freed
UNION ALL
SELECT false FROM leases_lease
WHERE name = %(name)s::text AND holder = %(holder)s::text AND token = %(token)s
  AND secret_hash IS DISTINCT FROM sha256(%(secret)s::bytea) AND NOT EXISTS (SELECT FROM freed)
"""

#: Compare-and-revoke: only if ``name``'s stored token is still ``token``, advance it (so the
#: evicted holder's renewals and fenced writes fail), free the name and wake waiters. Otherwise
#: nothing is written and the one row says what the token is now (``NULL``: never granted);
#: an operator's click on a stale page must not evict whoever holds the name by then.
FORCE_RELEASE_SQL = """
WITH revoked AS (
    UPDATE leases_lease
    SET token = token + 1, holder = '', expires_at = clock_timestamp(), secret_hash = NULL
    WHERE name = %(name)s::text AND token = %(token)s
    RETURNING name, holder, token, acquired_at, expires_at, renewed_at, meta
)
SELECT name, holder, token, acquired_at, expires_at, renewed_at, meta, false,
       pg_notify('leases_released', name)
FROM revoked
UNION ALL
SELECT NULL, NULL, (SELECT token FROM leases_lease WHERE name = %(name)s::text),
       NULL, NULL, NULL, NULL, NULL, NULL
WHERE NOT EXISTS (SELECT 1 FROM revoked)
"""

#: What observers see. ``expires_at`` is clamped into what Python's ``datetime`` can hold: a
#: row written with an absurd TTL (year 33715) must not make every read of the table fail.
INSPECT_SQL = """
SELECT name, holder, token, acquired_at, LEAST(expires_at, '9999-12-30 00:00:00+00'),
       renewed_at, meta, holder <> '' AND expires_at > clock_timestamp()
FROM leases_lease WHERE name = %(name)s::text
"""
INSPECT_ALL_SQL = """
SELECT name, holder, token, acquired_at, LEAST(expires_at, '9999-12-30 00:00:00+00'),
       renewed_at, meta, holder <> '' AND expires_at > clock_timestamp()
FROM leases_lease ORDER BY name
"""

#: The waiting room: one session advisory lock per name, taken by a waiter after its first
#: failed try, so other waiters sleep in the server's lock queue instead of all retrying on
#: every release. ``lock_timeout`` bounds the queueing (see :data:`ROOM_TIMEOUT`).
#: The waiter inside also listens on its room connection (only it needs waking, so the others
#: and idle processes are not woken by every release). Both are one simple-protocol round trip
#: (two statements, integers formatted in: no parameters allowed there).
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
DEPLOY_CHECK_SQL = "SELECT current_setting('synchronous_commit'), to_regclass('leases_lease')"

_KNOWN_OPTIONS = frozenset({"DATABASE", "WAITING_ROOM"})

_instances: weakref.WeakSet[Backend] = weakref.WeakSet()
#: Connections inherited over fork: kept referenced, never closed, because closing them would
#: send a Terminate message on the parent's socket and end the parent's session.
_inherited: list[object] = []


def _owner(grant: Grant) -> dict[str, Any]:
    """What renew and release present: the grant's holder, token and secret."""
    return {
        "name": grant.name,
        "holder": grant.holder,
        "token": grant.token,
        "secret": grant.secret,
    }


def _info(row: tuple[Any, ...], backend: str) -> LeaseInfo:
    name, holder, token, acquired_at, expires_at, renewed_at, meta, held = row[:8]
    return LeaseInfo(
        name=name,
        holder=holder,
        token=int(token),
        held=bool(held),
        backend=backend,
        acquired_at=acquired_at,
        expires_at=expires_at,
        renewed_at=renewed_at,
        meta=json.loads(meta) if isinstance(meta, str | bytes) else meta or {},
    )


class Backend(LeaseBackend):
    """Leases in the ``leases_lease`` table; option ``DATABASE`` names the Django alias."""

    capabilities = frozenset(
        {
            Capability.NATIVE_FENCING,
            Capability.WAIT_WITHOUT_POLLING,
            Capability.FORCE_RELEASE,
            Capability.DURABLE,
        }
    )

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        unknown = set(self.options) - _KNOWN_OPTIONS
        if unknown:
            raise LeasesImproperlyConfigured(
                f'LEASES["BACKENDS"][{alias!r}] has unknown options {sorted(unknown)} '
                f"(known: {sorted(_KNOWN_OPTIONS)})"
            )
        self.db_alias: str = self.options.get("DATABASE", "default")
        if self.db_alias not in connections.settings:
            raise LeasesImproperlyConfigured(
                f'LEASES["BACKENDS"][{alias!r}]["DATABASE"] = {self.db_alias!r} is not in DATABASES'
            )
        engine = connections.settings[self.db_alias]["ENGINE"]
        if "postgresql" not in engine and "postgis" not in engine:
            raise LeasesImproperlyConfigured(
                f"the database lease backend needs PostgreSQL; {self.db_alias!r} uses {engine}"
            )
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._listener: Listener | None = None
        self._local = threading.local()
        self._room_enabled = bool(self.options.get("WAITING_ROOM", True))
        self._rooms: list[psycopg.Connection[Any]] = []  # idle room connections
        self._room_slots = threading.BoundedSemaphore(ROOM_CONNECTIONS)
        _instances.add(self)

    # -- the connection -------------------------------------------------------------------

    def _run(self, sql: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run one statement on the backend's own connection: one round trip.

        Driver errors become :class:`BackendUnavailable`; a broken connection is dropped and
        the next call reconnects (lease state lives in the table, not in the session).
        """
        with self._lock:
            conn = self._conn
            if conn is None or stale(conn):
                self._discard()
                conn = self._conn = connect(self.db_alias)
            try:
                cursor = conn.execute(sql, params)
                return cursor.fetchall() if cursor.description else []
            except psycopg.Error as exc:
                if conn.broken or conn.closed:
                    self._discard()
                raise BackendUnavailable(self.alias, f"{type(exc).__name__}: {exc}") from exc

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        close_quietly(conn)

    def connection(self) -> psycopg.Connection[Any] | None:
        """The backend's own connection, if open (for diagnostics and round-trip tests)."""
        return self._conn

    # -- the interface --------------------------------------------------------------------

    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        sent_at, secret = time.monotonic(), new_secret()
        params = {"name": name, "holder": holder, "ttl": ttl, "secret": secret}
        rows = self._run(ACQUIRE_SQL, params)
        if not rows:
            self._failed_at()[name] = sent_at
            return None
        token, expires_at = rows[0]
        return Grant(name, holder, int(token), ttl, sent_at, expires_at, secret=secret)

    def renew(self, grant: Grant, ttl: float) -> Grant:
        sent_at = time.monotonic()
        rows = self._run(RENEW_SQL, {**_owner(grant), "ttl": ttl})
        if not rows:
            raise LeaseLost(grant.name, grant.token, "expired or taken over before renewal")
        if rows[0][0] is None:
            raise LeaseNotHeld(grant.name, FORGED)
        return replace(grant, ttl=ttl, sent_at=sent_at, expires_at=rows[0][0])

    def release(self, grant: Grant) -> None:
        rows = self._run(RELEASE_SQL, _owner(grant))
        if not rows:
            raise LeaseLost(grant.name, grant.token, "expired or taken over before release")
        if not rows[0][0]:
            raise LeaseNotHeld(grant.name, FORGED)

    def wait_for_release(self, name: str, timeout: float) -> bool:
        since = self._failed_at().pop(name, time.monotonic())
        room: psycopg.Connection[Any] | None = getattr(self._local, "room", None)
        if room is not None:
            return self._wait_in_room(room, name, timeout)
        with self._lock:
            if self._listener is None:
                self._listener = Listener(self.db_alias, self.alias)
            listener = self._listener
        return listener.wait(name, since, max(0.0, timeout))

    @contextlib.contextmanager
    def waiting_room(self, name: str, timeout: float | None) -> Iterator[None]:
        """Queue on the name's room lock (at most :data:`ROOM_TIMEOUT`), then wait inside it.

        Each waiter in the room holds a connection of its own, since its session sleeps in the
        lock queue; at most :data:`ROOM_CONNECTIONS` per process, so many waiting threads
        cannot exhaust the server's connections (the rest wait without a room). Any failure
        just means waiting without a room.
        """
        if not self._room_enabled or not self._room_slots.acquire(blocking=False):
            yield
            return
        try:
            key = advisory_key(f"leases:room:{name}")
            assert isinstance(key, int)  # a name always maps to one 64-bit key
            conn, entered = self._enter_room(name, key, timeout)
            self._local.room = conn if entered else None
            try:
                yield
            finally:
                self._local.room = None
                if conn is not None:
                    self._leave_room(conn, key, entered)
        finally:
            self._room_slots.release()

    def _wait_in_room(self, room: psycopg.Connection[Any], name: str, timeout: float) -> bool:
        """Wait for ``name``'s release on the room connection, which listens since entering.

        Notifications that arrived since then are buffered on the connection, so a release
        between the failed try and this wait is not missed.
        """
        try:
            for note in room.notifies(timeout=max(0.0, timeout)):
                if note.payload == name:
                    return True
        except psycopg.Error:
            self._local.room = None  # the session is gone (and its room lock with it)
        return False

    def _enter_room(
        self, name: str, key: int, timeout: float | None
    ) -> tuple[psycopg.Connection[Any] | None, bool]:
        queue_for = ROOM_TIMEOUT if timeout is None else min(timeout, ROOM_TIMEOUT)
        enter = ROOM_ENTER_SQL.format(timeout_ms=max(1, int(queue_for * 1000)), key=int(key))
        conn = None
        try:
            conn = self._room_connection()
            conn.execute(enter.encode())
            return conn, True
        except psycopg.errors.LockNotAvailable:
            return conn, False  # queued long enough: wait on our own
        except (psycopg.Error, BackendUnavailable) as exc:
            logger.debug("leases: waiting without a room for %r: %s", name, exc)
            close_quietly(conn)
            return None, False

    def _room_connection(self) -> psycopg.Connection[Any]:
        with self._lock:
            while self._rooms:
                conn = self._rooms.pop()
                if not stale(conn):
                    return conn
                close_quietly(conn)
        return connect(self.db_alias)

    def _leave_room(self, conn: psycopg.Connection[Any], key: int, entered: bool) -> None:
        try:
            leave = ROOM_LEAVE_SQL.format(key=int(key)).encode()
            if entered and conn.execute(leave).fetchone() != (True,):
                # The unlock ran on another server session (a transaction-pooling proxy):
                # the room cannot work here, so stop using it rather than leak locks.
                self._room_enabled = False
                logger.warning("leases: waiting room disabled on %r: unlock failed", self.alias)
        except psycopg.Error:
            close_quietly(conn)  # closing the session releases its advisory lock
            return
        with self._lock:
            if len(self._rooms) < _IDLE_ROOM_CONNECTIONS:
                self._rooms.append(conn)
                return
        close_quietly(conn)

    def inspect(self, name: str) -> LeaseInfo | None:
        rows = self._run(INSPECT_SQL, {"name": name})
        return _info(rows[0], self.alias) if rows else None

    def inspect_all(self) -> list[LeaseInfo]:
        return [_info(row, self.alias) for row in self._run(INSPECT_ALL_SQL, {})]

    def force_release(self, name: str, token: int) -> LeaseInfo:
        row = self._run(FORCE_RELEASE_SQL, {"name": name, "token": token})[0]
        if row[0] is None:
            raise LeaseNotHeld(name, not_revoked(token, row[2]))
        return _info(row, self.alias)

    def deploy_checks(self) -> list[str]:
        try:
            ((sync, table),) = self._run(DEPLOY_CHECK_SQL, {})
        except BackendUnavailable as exc:
            return [str(exc)]
        problems = []
        if table is None:
            problems.append(f"{self.db_alias!r} has no leases_lease table: run migrate")
        if sync in ("off", "local"):
            problems.append(f"synchronous_commit is {sync!r} even when set on per session")
        return problems

    def close(self) -> None:
        with self._lock:
            conns, self._conn, self._rooms = [self._conn, *self._rooms], None, []
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()
        for conn in conns:
            close_quietly(conn)

    # -- internals ------------------------------------------------------------------------

    def _failed_at(self) -> dict[str, float]:
        """Per thread: when this thread's last failed try of each name was sent."""
        failed: dict[str, float] | None = getattr(self._local, "failed", None)
        if failed is None:
            failed = self._local.failed = {}
        return failed

    def _forget_after_fork(self) -> None:
        """In a forked child: drop (never close) the parent's connections; reconnect lazily."""
        self._lock = threading.Lock()
        self._room_slots = threading.BoundedSemaphore(ROOM_CONNECTIONS)
        listener, self._listener = self._listener, None
        _inherited.extend([self._conn, listener.conn if listener else None, *self._rooms])
        self._conn, self._rooms = None, []


def _after_fork_in_child() -> None:
    for backend in list(_instances):
        backend._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_before_database_ddl(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Close lease connections when Django opens a no-database connection.

    Django does that only to create or drop databases (test runs, ``flush``-like tooling), and
    an open lease connection would make ``DROP DATABASE`` fail; leases reconnect lazily.
    """
    if getattr(connection, "alias", None) == "__no_db__":
        for backend in list(_instances):
            backend.close()


connection_created.connect(_close_before_database_ddl, dispatch_uid="leases.backends.database")
