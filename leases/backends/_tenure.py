"""The database backend's hand-off without a client wake-up: the holder's tenure lock.

A waiter inside a name's waiting room used to wait for the release's ``NOTIFY``: the release
commits, the server signals the waiter's session, the session sends the notification on to
the waiter's process, which wakes and sends its try, which commits the grant. Two round trips
and a client wake-up per hand-off, on top of the grant's commit.

Here a thread's try in the room waits itself, on the server (:data:`QUEUED_ACQUIRE_SQL`): it
queues for the room, then on the *tenure lock* of the grant that holds the name, then takes
the name, all in one statement. A holder that won its grant this way keeps that connection (a
:class:`Pin`), whose session holds the grant's tenure lock, a session advisory lock whose key
is the name *and the token* (:func:`tenure_key_sql`); its release frees the name and unlocks
the tenure lock in one statement (``PINNED_RELEASE_SQL`` in the backend), so the waiter's
session goes on at once, server-side, and its ``INSERT ... ON CONFLICT DO UPDATE`` waits for
the release's commit and judges the newest row version. The new holder takes the tenure lock
of its own token in the same statement, unlocks the one it waited on, and leaves the room.

A grant won outside the room, on the backend's own connection, takes its tenure lock in that
session too (:class:`Tenures`), so the first waiter's hand-off goes the same way.

The lock is a liveness device only: who holds the name is decided by the row, as before, and
the token fences. Keyed by token, a tenure lock never outlives its grant as far as waiters
care: a waiter only queues on the lock of the token the row shows now, so a session that kept
the lock of an older grant (a paused or leaking holder, a revoked one) delays nobody. Every way
a tenure lock can fail to be unlocked when its grant ends falls back to what the room did
before, within :data:`~._waiting_room.ROOM_TIMEOUT`:

- the holder's process or session dies: the lock goes with the session; the waiter's try then
  finds the name still held (until its TTL), and waits in the room for a ``NOTIFY`` or the
  expiry, as before;
- the grant was won on an async connection, or past the per-process caps on kept
  connections (:data:`PINS`) or on the own connection's tenure locks (:data:`OWN_TENURES`):
  nobody holds its tenure lock, so the waiter's try takes it at once, is refused, and the
  waiter waits for the ``NOTIFY``;
- the holder is paused past its expiry, or its grant is revoked (``force_release``): the
  waiter's queueing times out after at most ``ROOM_TIMEOUT`` (or the caller's deadline), and
  its next try takes the name by the row.

A queueing timed out may still have been granted its lock (PostgreSQL can grant it as the
timeout fires; the session keeps it though the statement failed): :data:`UNLOCK_STRAYS_SQL`
then unlocks every advisory lock of the session but the room's, and says whether it holds that.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import pq

from .._fdwait import readable, writable
from .._pgnotifies import keep_notifies
from ._counter import TIMELINE_FLOOR_SQL
from ._pgconn import close_quietly
from ._pgloading import transformer as loading_transformer
from ._pgprepared import Prepared, read_result
from ._pruning import FLOOR_SQL

__all__ = [
    "OWN_TENURES",
    "PINS",
    "PREPARED_QUEUE",
    "PREPARED_QUEUED_ACQUIRE",
    "QUEUED_ACQUIRE_SQL",
    "QUEUE_SQL",
    "UNLOCK_STRAYS_SQL",
    "UNLOCK_TENURES_SQL",
    "Pin",
    "Tenures",
    "queue_then_try",
    "tenure_key_sql",
]


def tenure_key_sql(name_sql: str, token_sql: str) -> str:
    """The tenure lock key of a name and token, computed on the server (``hashtextextended``
    is PostgreSQL's stable 64-bit text hash, the one hash partitioning relies on)."""
    return f"hashtextextended('leases:tenure:' || {name_sql}, {token_sql})"


#: The tenure key of the ``token`` column in scope (the waited-on grant's, or the new one's).
_KEY = tenure_key_sql("%(name)s::text", "token")

#: What is left of a queued try's ``{queue_ms}`` once it waited since its first statement began
#: (the transaction's start), as a ``lock_timeout``: each queueing is bounded by what the ones
#: before it left, so the try as a whole never waits past the caller's deadline.
_LEFT_MS = (
    "GREATEST(1, {queue_ms} - extract(epoch FROM clock_timestamp() - transaction_timestamp())"
    " * 1000)::int::text || 'ms'"
)

#: The first of a queued try's two statements (sent together, see :func:`queue_then_try`):
#: bound the queueings (for the session: the second statement's too), queue for the room
#: unless this session holds it (``{enter}``), then at the name's grant gate: a
#: transaction-level lock, held until the try commits. The try before this one left the room
#: in its statement, before its commit; waiting at the gate, this one goes on only once that
#: grant (if any) committed, so its second statement (its snapshot taken after both queueings)
#: sees it, and queues on the right tenure lock. (The room's lock is taken in a ``CASE``
#: branch's subquery, which runs only when that branch is taken.)
QUEUE_SQL = f"""
SELECT set_config('lock_timeout', %(queue_ms)s::int::text || 'ms', false),
       CASE WHEN %(inside)s::bool THEN 0
            ELSE (SELECT 1 FROM (SELECT pg_advisory_lock(%(room)s::bigint)) AS entered) END,
       set_config('lock_timeout', {_LEFT_MS.format(queue_ms="%(queue_ms)s::int")}, false),
       pg_advisory_xact_lock(hashtextextended('leases:gate:' || %(name)s::text, 0))
"""  # noqa: S608
PREPARED_QUEUE = Prepared("queue", QUEUE_SQL)

#: The second: read the name's grant, queue on its tenure lock if one holder holds it, then
#: take the name as the room's plain try does. The ``INSERT``'s ``ON CONFLICT DO UPDATE``
#: waits for a release still committing and judges its newest row version. (The room's plain
#: try probes with ``NOT EXISTS`` that the name is held before it locks the row, so a failed
#: try writes nothing; that probe reads the statement's snapshot, taken before the tenure
#: queueing, so it would refuse every grant here. A refusal here is rare: it needs a holder
#: that keeps no tenure lock.)
#: Granted: the token, the expiry, how long the try waited before it granted, from its first
#: statement's start (server clock, so the caller counts the lease's time from about when it
#: was granted, not from before its queueings, which may have lasted up to a second: a short
#: TTL would be spent waiting; counted from this second statement alone, a grant whose first
#: statement queued long for the room looked older than one granted before it), whether
#: this session took the new token's tenure lock (``pin``), and that it left the room. Refused:
#: one row with no token, saying whether readers hold the name and for how long its grant
#: lasts unless renewed; the room stays locked (the waiter then waits for the release's
#: ``NOTIFY`` in it). The tenure lock waited on is unlocked either way.
QUEUED_ACQUIRE_SQL = f"""
WITH latest AS (
    SELECT token, holder <> '' AND expires_at > clock_timestamp() AS held,
           holder = %(group)s::text AND secret_hash IS NULL AS shared,
           extract(epoch FROM expires_at - clock_timestamp())::float8 AS lasts
    FROM leases_lease WHERE name = %(name)s::text
), granted AS (
    INSERT INTO leases_lease AS l
        (name, holder, token, acquired_at, expires_at, renewed_at, meta, secret_hash)
    SELECT %(name)s::text, %(holder)s::text, GREATEST({FLOOR_SQL}, {TIMELINE_FLOOR_SQL}),
           clock_timestamp(),
           clock_timestamp() + make_interval(secs => %(ttl)s), NULL, '{{}}',
           sha256(%(secret)s::bytea)
    FROM (SELECT 1) AS one LEFT JOIN (
        SELECT set_config('lock_timeout', {_LEFT_MS.format(queue_ms="%(queue_ms)s::int")}, true),
               pg_advisory_lock({_KEY}) AS tenure
        FROM latest WHERE held AND NOT shared
    ) AS waited ON true
    ON CONFLICT (name) DO UPDATE
    SET holder = EXCLUDED.holder, token = GREATEST(l.token + 1, {TIMELINE_FLOOR_SQL}),
        acquired_at = EXCLUDED.acquired_at,
        expires_at = EXCLUDED.expires_at, renewed_at = NULL, secret_hash = EXCLUDED.secret_hash
    WHERE l.holder = '' OR l.expires_at IS NULL OR l.expires_at <= clock_timestamp()
    RETURNING l.token, l.expires_at, l.acquired_at
), answer AS (
    SELECT token, expires_at,
           extract(epoch FROM acquired_at - transaction_timestamp())::float8 AS waited,
           CASE WHEN %(pin)s::bool THEN pg_try_advisory_lock({_KEY}) ELSE false END
               AS pinned,
           pg_advisory_unlock(%(room)s::bigint) AS left_room,
           NULL::bool AS shared, NULL::float8 AS lasts
    FROM granted
    UNION ALL
    SELECT NULL, NULL, NULL, false, false,
           (SELECT shared FROM latest WHERE held), (SELECT lasts FROM latest WHERE held)
    WHERE NOT EXISTS (SELECT FROM granted)
)
SELECT token, expires_at, waited, pinned, left_room, shared, lasts,
       (SELECT pg_advisory_unlock({_KEY}) FROM latest WHERE held AND NOT shared)
FROM answer
"""  # noqa: S608
PREPARED_QUEUED_ACQUIRE = Prepared("queued_acquire", QUEUED_ACQUIRE_SQL)

#: After a queueing timed out (see the module's docstring): unlock every advisory lock of the
#: session but its room's (``{key}``), and say whether it holds that one (the room's queueing
#: may have been granted as the timeout fired, too; a room connection holds nothing else).
UNLOCK_STRAYS_SQL = """
WITH held AS (
    SELECT (classid::bigint << 32) | objid::bigint AS key FROM pg_locks
    WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1
)
SELECT (SELECT count(pg_advisory_unlock(key)) FROM held WHERE key <> {key}),
       EXISTS (SELECT FROM held WHERE key = {key})
"""

#: Room connections a process keeps for the grants they won, per backend: past it, a grant
#: won in the room lets its connection go and keeps no tenure lock (its waiters fall back to
#: the ``NOTIFY``), so holding many names never pins as many server sessions.
PINS = 8


class Pin:
    """A room connection kept by the grant it won: its session holds the grant's tenure lock
    until the grant's release unlocks it there (or the connection closes).

    Used by one call at a time (its lock): the release, whichever thread makes it. A forked
    child never uses its parent's pins (``pid``), whose sessions are the parent's.
    """

    __slots__ = ("__weakref__", "conn", "lock", "pid", "unsettled")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn: psycopg.Connection[Any] | None = conn
        self.lock = threading.Lock()
        self.pid = os.getpid()
        #: A statement was sent on it without waiting: its reply is to be read first.
        self.unsettled = False

    def usable(self) -> bool:
        conn = self.conn
        return conn is not None and self.pid == os.getpid() and not conn.closed and not conn.broken

    def take(self) -> psycopg.Connection[Any] | None:
        """The connection, given up by the pin (``None`` if it has none usable)."""
        conn = self.conn if self.usable() else None
        self.conn = None
        return conn

    def drop(self) -> None:
        """Close the connection (its session's tenure lock goes with it)."""
        if self.pid == os.getpid():
            close_quietly(self.take())

    def __repr__(self) -> str:
        return f"<tenure pin {'open' if self.usable() else 'closed'}>"

    def __del__(self) -> None:
        # A grant dropped without its release (a leaked lease): end the session rather than
        # leave a connection open for the garbage collector to complain about.
        self.drop()


def queue_then_try(
    conn: psycopg.Connection[Any],
    statements: tuple[Prepared, Prepared],
    params: Mapping[str, Any],
    prepared: set[str],
) -> list[Any] | None:
    """Run two statements by name (:data:`PREPARED_QUEUE`, then a try), in one round trip
    and one implicit transaction (libpq's pipeline mode, one ``Sync``): the second
    starts once the first is over, on a snapshot of its own (one per statement, as always in
    ``READ COMMITTED``), and is skipped if the first fails. The rows of the second, or the
    first failure raised (a queueing that timed out: ``LockNotAvailable``); ``None`` when the
    session lost the try's statement, which then did not run (the queueing did).

    A statement the session does not have yet is prepared first (a round trip, once per
    session). The replies are awaited with the socket watched (``poll``), never in a libpq
    call that would block with the GIL held; the caller's reply deadline cuts the socket.
    """
    for statement in statements:
        if statement.name not in prepared:
            try:
                conn.execute(statement.prepare_sql.encode())
            except psycopg.Error as exc:
                if exc.sqlstate != "42P05":  # the session has it already
                    raise
            prepared.add(statement.name)
    transformer = loading_transformer(conn)
    pgconn = conn.pgconn
    pgconn.enter_pipeline_mode()
    try:
        for statement in statements:
            values = [params[key] for key in statement.order]
            dumped = transformer.dump_sequence(values, statement.formats)
            pgconn.send_query_prepared(statement.key, dumped)
        pgconn.pipeline_sync()
        while pgconn.flush() == 1:
            writable(pgconn.socket)
        results = _until_sync(pgconn)
        keep_notifies(pgconn)
    finally:
        try:
            pgconn.exit_pipeline_mode()
        except psycopg.Error:  # replies left unread (a failure midway): the protocol is lost
            conn.close()
    queued = read_result(results[0], transformer, conn.info.encoding)
    if queued is None or queued is False:  # nothing ran (the try after it was skipped)
        _lost(conn, statements[0], queued, prepared)
        return None
    rows = read_result(results[1], transformer, conn.info.encoding)
    if rows is None or rows is False:  # the queueing ran: the room's lock is held
        _lost(conn, statements[1], rows, prepared)
        return None
    return rows


def _lost(
    conn: psycopg.Connection[Any], statement: Prepared, stale: object, prepared: set[str]
) -> None:
    """The session lost ``statement`` (a pooler's other session, ``DISCARD ALL``), or its
    plan is stale (``stale`` false: a migration): it did not run, and is made again by the
    next call."""
    prepared.discard(statement.name)
    if stale is False:
        conn.execute(f"DEALLOCATE {statement.name}".encode())


def _until_sync(pgconn: pq.abc.PGconn) -> list[pq.abc.PGresult]:
    """The results of a pipeline up to its ``Sync``, one per statement."""
    results: list[pq.abc.PGresult] = []
    while True:
        while pgconn.is_busy():
            readable(pgconn.socket)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            continue  # the end of one statement's results
        if result.status == pq.ExecStatus.PIPELINE_SYNC:
            return results
        results.append(result)


#: Tenure locks the backend's own connection keeps at once, for the grants won on it (outside
#: any room): past it, a grant takes none (its first waiter falls back to the ``NOTIFY``), so
#: a process that holds many names, or drops grants unreleased, never fills the server's
#: shared lock table (``max_locks_per_transaction`` slots per connection).
OWN_TENURES = 16

#: Unlock the tenure locks of grants that ran out unreleased (``names`` and ``tokens`` in
#: step), in the session that took them: how many it held.
UNLOCK_TENURES_SQL = f"""
SELECT count(*) FILTER (WHERE pg_advisory_unlock({tenure_key_sql("u.name", "u.token")}))
FROM unnest(%(names)s::text[], %(tokens)s::bigint[]) AS u(name, token)
"""  # noqa: S608


class Tenures:
    """The tenure locks that the backend's own connection (one session, shared by threads)
    holds for grants won on it: which session took each, and when its grant was due to run
    out as acquired.

    A release unlocks its grant's lock in its statement, in the session that took it if that
    is still the open connection (else the lock ended with its session). A grant never
    released (dropped, or left to expire: a supported pattern) would keep its lock for the
    session's life, so the next grant after its expiry (as acquired, or as last renewed)
    unlocks it first (:meth:`overdue`); at most :data:`OWN_TENURES` are held meanwhile.
    """

    __slots__ = ("_due", "_lock", "enabled")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (name, token) -> (the connection whose session took the lock, when it runs out).
        self._due: dict[tuple[str, int], tuple[object, float]] = {}
        #: Off for good once a release's unlock found no lock in the session that took it (a
        #: transaction pooler hands out server sessions per transaction).
        self.enabled = True

    def wanted(self) -> bool:
        """Whether the next grant on the own connection should take its tenure lock."""
        with self._lock:
            return self.enabled and len(self._due) < OWN_TENURES

    def renewed(self, name: str, token: int, due: float) -> None:
        with self._lock:
            entry = self._due.get((name, token))
            if entry is not None:
                self._due[(name, token)] = (entry[0], due)

    def overdue(self) -> dict[object, list[tuple[str, int]]]:
        """The locks whose grants ran out (as acquired or last renewed), by the session that
        took them (no longer listed: the caller unlocks them there if that session is still
        open); usually none."""
        now = time.monotonic()
        found: dict[object, list[tuple[str, int]]] = {}
        with self._lock:
            for key, (session, due) in list(self._due.items()):
                if due <= now:
                    del self._due[key]
                    found.setdefault(session, []).append(key)
        return found

    def taken(self, session: object, name: str, token: int, due: float) -> None:
        with self._lock:
            self._due[(name, token)] = (session, due)

    def lists(self, name: str, token: int) -> bool:
        with self._lock:
            return (name, token) in self._due

    def give_back(self, name: str, token: int) -> object | None:
        """The session that took the grant's lock, if it is listed (then no more)."""
        with self._lock:
            entry = self._due.pop((name, token), None)
        return None if entry is None else entry[0]

    def disable(self) -> None:
        with self._lock:
            self.enabled = False
            self._due.clear()

    def forget_after_fork(self) -> None:
        """The parent's sessions hold the locks listed: the child's own connection is new."""
        self._lock = threading.Lock()
        self._due = {}
