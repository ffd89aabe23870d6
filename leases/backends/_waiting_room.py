"""The database backend's waiting room: a queue of waiters per name, served in arrival order.

A waiter enters a name's room after its first failed try: it takes a session advisory lock on a
connection of its own, so other waiters of the name sleep in the server's lock queue (which is
first come, first served) instead of all retrying on every release (a herd that costs a failed
round trip each). The waiter inside listens on its room connection, so only it is woken by the
name's release, and it retries on that connection. Granted, it leaves the room once the grant
has committed: the unlock goes out with the ``UNLISTEN``, without waiting for the reply (the
next user of the connection reads it), so the new holder returns as soon as its grant does,
and the next waiter in the queue, let in by that unlock, finds the name held by the committed
grant and waits for its release without a try (see
:data:`~leases.backends.database.ROOM_ACQUIRE_SQL` for what unlocking before the commit cost).

That is a task's visit (:class:`AsyncWaitingRoom`). A thread's (:class:`WaitingRoom`) does
not enter, listen and look before it tries: each of its tries queues for the room itself, in
its own statement, then on the *tenure lock* of the grant that holds the name, and takes the
name as soon as that grant's release lets it go, without a wake-up of the waiter's process in
between (see :mod:`~leases.backends._tenure`). A grant won that way leaves the room in its
statement and keeps its connection (a :class:`~._tenure.Pin`), whose session holds its own
tenure lock for the next waiter, until its release. Only when a try finds a holder that keeps
no tenure lock (it won outside the room, or is gone) does the thread listen in the room and
wait for the release's ``NOTIFY``, as a task does. Both queue on the same room lock, so sync
and async waiters of a name are served in one arrival order.

The room is a queue, not just a herd limiter, because a caller outside it cannot overtake it:
the acquire statement of a caller outside the room takes a free name only when nobody is in or
queued for the room, or when the name has been free for longer than :data:`ROOM_GRACE`. So a
process that has just released cannot take the name straight back while others wait (it goes
to the back of the queue), and a waiter is served after those that queued before it.

Every statement on a room connection waits at most ``REQUEST_TIMEOUT`` for its reply (queueing:
its ``lock_timeout`` more), as on the backend's own connection (:mod:`~leases._pgdeadline`): a room
connection gone silent (a NAT, a proxy, a paused server) is dropped, and its waiter carries on
without a room, so it still gives up by its deadline.

Best effort throughout: queueing lasts at most :data:`ROOM_TIMEOUT` at a time (a paused waiter
inside must not hold the queue back for longer: the waiter retries, which succeeds once the
name has been free for :data:`ROOM_GRACE`, then queues again at the back), the connections per
process are capped (waiters past the cap wait in line for one, in arrival order: see
:mod:`._room_slots`), and any failure just means waiting without a room. Safety never depends on
it: the acquire statement alone decides who holds the name.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import math
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

import psycopg
from psycopg import pq, sql

from .._fdwait import writable
from .._pgdeadline import REQUEST_TIMEOUT, Deadline, aarmed, armed
from .._pgpooler import BACKEND_PID_SQL
from .._pgreplies import read_replies
from ..errors import BackendUnavailable
from ..keys import hashed_key
from ._pg_shared import GROUP
from ._pgaio import _aclose_quietly, aconnect
from ._pgconn import close_quietly, connect, inherit, stale, track
from ._pgpooled import keeps_sessions, warn_pooled
from ._pgprepared import Prepared, arun_prepared, run_prepared
from ._room_slots import RoomSlots, Ticket
from ._tenure import (
    PINS,
    PREPARED_QUEUE,
    PREPARED_QUEUED_ACQUIRE,
    UNLOCK_STRAYS_SQL,
    Pin,
    queue_then_try,
)

__all__ = [
    "ROOM_CONNECTIONS",
    "ROOM_GRACE",
    "ROOM_TIMEOUT",
    "AsyncWaitingRoom",
    "WaitingRoom",
    "room_key",
]

logger = logging.getLogger("leases")

#: Enter (and queue again after :data:`ROOM_TIMEOUT`): queue on the name's room lock,
#: ``lock_timeout`` bounding the queueing; once inside, listen (committed at once: ``LISTEN``
#: takes effect at commit), then look at the name in a statement of its own (its snapshot is
#: taken after the ``LISTEN`` took effect, so a release is either seen by the look or
#: announced to us). The look says whether the name is held (``'shared'`` by readers,
#: ``'held'`` by one holder; no row: free) and for how many seconds more unless renewed, so
#: the waiter skips a try bound to fail (that holder's release will wake it), and stops new
#: readers only when readers hold the name. Only the waiter inside listens: a session queued
#: on the lock would be signalled by every release of every name for nothing. A timeout
#: ends the round trip before the ``LISTEN``.
#: Leave: unlock and stop listening. Each is one simple-protocol round trip (several
#: statements, values formatted in as literals: no parameters are allowed there); a granted
#: waiter's leave is sent without waiting for its reply (:func:`_send`).
ROOM_ENTER_SQL = """SELECT set_config('lock_timeout', {timeout_ms}, false), pg_advisory_lock({key});
BEGIN; LISTEN leases_released; COMMIT;
SELECT CASE WHEN holder = {group} AND secret_hash IS NULL THEN 'shared' ELSE 'held' END,
       extract(epoch FROM expires_at - clock_timestamp())::float8
FROM leases_lease
WHERE name = {name} AND holder <> '' AND expires_at > clock_timestamp()"""
ROOM_LEAVE_SQL = "SELECT pg_advisory_unlock({key}); UNLISTEN *"
#: A thread's waiter, inside the room after a queued try was refused (see :mod:`~._tenure`):
#: listen, then look at the name, as the entering above does.
ROOM_LISTEN_SQL = ROOM_ENTER_SQL[ROOM_ENTER_SQL.index("BEGIN") :]
#: After a queueing timed out. PostgreSQL may grant the lock just as the timeout fires, and then
#: keeps it although the statement failed: held unknowingly, the next queueing would take it a
#: second time and the leave release it once, leaving the room locked by an idle pooled
#: connection (whose next visitor gets in at once, again and again, starving every other
#: waiter). A room connection holds no other advisory lock between visits or during one.
ROOM_UNLOCK_ALL_SQL = "SELECT pg_advisory_unlock_all()"
#: Leave after queueing timed out (the room's lock is not held).
ROOM_UNLISTEN_SQL = "UNLISTEN *"
#: Longest a waiter queues for the room at a time (a paused waiter in the room must not hold
#: the others back for longer); then it tries once and queues again.
ROOM_TIMEOUT = 1.0
#: How long after a release the waiters in the room have the name to themselves: callers
#: outside the room take a name that has been free for longer (the waiter inside is paused).
ROOM_GRACE = timedelta(milliseconds=100)
#: Room connections a process may have in use at once per backend (waiters inside rooms),
#: unless the backend's ``ROOM_CONNECTIONS`` option says otherwise; more waiters wait in line
#: for them (:mod:`._room_slots`). Idle ones are kept up to as many (with more waiters than
#: connections, the next in line goes in as a visit ends in a grant, whose connection it keeps
#: until its release, and the release then gives that one back: keeping four of eight at most,
#: one connection in ten grants was closed and made again with 16 threads). Waiting in line
#: costs a thread's wake-up per grant: 16 threads on one name made 1,370-1,470 grants/s with
#: 8 connections and 1,950-1,970 with 16.
ROOM_CONNECTIONS = 8


def room_key(name: str) -> int:
    """The advisory key of ``name``'s room: that of the advisory name ``leases:room:<name>``,
    a prefix the guide reserves for the package (a user's lock of that name would hold the
    room). Hashed without checking the derived text's length: a valid name of up to 255
    characters makes one of up to 267 here."""
    return hashed_key(f"leases:room:{name}")


#: The connection a visit waits on: psycopg's ``Connection`` or ``AsyncConnection``.
_Conn = TypeVar("_Conn")


@dataclass
class _Visit(Generic[_Conn]):
    """One waiter's stay in one name's room: a thread's (:class:`WaitingRoom`) or a task's
    (:class:`AsyncWaitingRoom`), on a connection of the matching kind."""

    name: str
    key: int
    conn: _Conn
    #: When the caller gives up (monotonic), ``None`` for never.
    deadline: float | None
    #: Holding the room lock (inside), rather than queued out after :data:`ROOM_TIMEOUT`.
    inside: bool = False
    #: The name was held when this waiter got inside: its next try is bound to fail.
    held: bool = False
    #: When (monotonic) the grant seen at the last look runs out unless renewed: a holder
    #: gone without releasing is announced by no ``NOTIFY``, so the wait ends then.
    expires: float = math.inf
    #: Readers held the name at this waiter's last look (entering, or a failed try).
    shared: bool = False
    #: Just got inside: the next wait acts on the look taken then (free: try at once). Only
    #: the async room reads it; a thread's room decides in its blocking wait instead.
    fresh: bool = False
    #: A thread's room only (see :mod:`~._tenure`): the next try queues (for the room, then
    #: on the holder's tenure lock) in its own statement; the wait before it returns at once.
    queue: bool = True
    #: A thread's room only: the next try is a plain one, at once (a queueing timed out, or
    #: the name was free at the look).
    try_now: bool = False
    #: A thread's room only: the connection listens for releases (it waits for a ``NOTIFY``).
    listening: bool = False
    #: A thread's room only: the grant this visit won keeps its connection (and tenure lock).
    pin: Pin | None = None

    def queueing(self) -> tuple[float, sql.Composed] | None:
        """How long to queue for the room lock this time, and the statement that does it
        (``None``: no time left)."""
        left = ROOM_TIMEOUT if self.deadline is None else self.deadline - time.monotonic()
        queue_for = min(left, ROOM_TIMEOUT)
        if queue_for <= 0:
            return None
        statement = sql.SQL(ROOM_ENTER_SQL).format(
            timeout_ms=sql.Literal(f"{max(1, int(queue_for * 1000))}ms"),
            key=sql.Literal(self.key),
            name=sql.Literal(self.name),
            group=sql.Literal(GROUP),
        )
        return queue_for, statement

    def entered(self, row: Any) -> None:
        """Inside, with the look the queueing took on the way in."""
        self.inside = True
        self.held = bool(row and row[0])
        self.shared = bool(row and row[0] == "shared")
        # A hint only (the server's clock, a round trip old): the try then decides.
        self.expires = time.monotonic() + row[1] if row else math.inf

    def tried(self, rows: list[Any]) -> list[Any]:
        """What a try inside the room returned: a row with a token is a grant (the waiter
        stays inside until it leaves, after the grant committed); no grant returns no rows
        (its token-less row, if any, says readers hold the name)."""
        if rows and rows[0][0] is not None:
            return rows
        self.shared = bool(rows)
        self.expires = math.inf  # renewed, or taken by another: wait for its release
        return []


#: A thread's visit and a task's.
_SyncVisit = _Visit[psycopg.Connection[Any]]
_AsyncVisit = _Visit[psycopg.AsyncConnection[Any]]


def _left(visits: collections.Counter[str], name: str) -> None:
    """A visit to ``name``'s room ended: counted down, and the name dropped at none (a process
    waiting on ever new names must not keep one entry for each)."""
    visits[name] -= 1
    if visits[name] <= 0:
        del visits[name]


def _behind(stay: _Stay[Any] | None, name: str, visits: collections.Counter[str]) -> bool:
    """Whether the waiter on ``stay`` is in line for a room connection (none handed to it
    yet) while ``visits`` of its process are inside ``name``'s room. Its try outside the room
    would be refused: a caller outside does not overtake those inside, and they are this
    process's own waiters, trying (so not paused past :data:`ROOM_GRACE`). Sent anyway, it
    cost a round trip on the backend's own connection, which every thread of the process
    shares, once per turn of every waiter in line (0.9 per grant with 32 threads)."""
    if stay is None or stay.name != name or stay.ticket.granted:
        return False
    return visits[name] > 0


def _in_line_for(stay: _Stay[Any], timeout: float) -> float:
    """How long a waiter in line waits for a room connection: as long as one inside the room
    waits for a release (:data:`ROOM_TIMEOUT` within its deadline), or ``timeout`` if longer."""
    left = ROOM_TIMEOUT if stay.deadline is None else stay.deadline - time.monotonic()
    return max(timeout, min(left, ROOM_TIMEOUT))


@dataclass
class _Stay(Generic[_Conn]):
    """One waiter's time in :meth:`WaitingRoom.enter` (or the async one's): its claim on a
    room connection and, once it has one, its visit. A waiter that found none free goes in
    later, at its first try (or wait) after one was handed to it (see :mod:`._room_slots`)."""

    name: str
    #: When the caller gives up (monotonic), ``None`` for never.
    deadline: float | None
    ticket: Ticket
    #: The visit the waiter is on (``None`` again once its session is gone).
    visit: _Visit[_Conn] | None = None
    #: The visit the waiter went in on: left when the waiter leaves, gone or not.
    entered: _Visit[_Conn] | None = None

    def due(self, name: str) -> bool:
        """A connection was handed to this waiter of ``name``, which has not gone in with it
        yet and has time left to."""
        if name != self.name or not self.ticket.granted or self.ticket.used:
            return False
        return self.deadline is None or self.deadline > time.monotonic()

    def left(self) -> float | None:
        """Seconds to the deadline (``None``: none), as a timeout for the entry."""
        return None if self.deadline is None else self.deadline - time.monotonic()


def _execute(
    conn: psycopg.Connection[Any],
    statement: Any,
    params: Mapping[str, Any] | None,
    timeout: float,
) -> psycopg.Cursor[Any]:
    """Run ``statement`` on a room connection, waiting at most ``timeout`` for the reply
    (then the connection is cut, and the driver's error raised: the caller drops it)."""
    due = Deadline(conn.fileno(), timeout)
    with armed(due):
        return conn.execute(statement, params)


class WaitingRoom:
    """The rooms of one backend alias on database ``db_alias``, per process."""

    def __init__(
        self,
        db_alias: str,
        alias: str,
        *,
        enabled: bool = True,
        timeout: float = REQUEST_TIMEOUT,
        prepared: bool = True,
        session_pooling: bool = False,
        connections: int = ROOM_CONNECTIONS,
    ) -> None:
        self.db_alias = db_alias
        self.alias = alias
        self.enabled = enabled
        #: Room connections in use at once, at most (the backend's ``ROOM_CONNECTIONS``).
        self.connections = connections
        #: A pooler in the way keeps each client's session (the backend's ``SESSION_POOLING``).
        self.session_pooling = session_pooling
        #: Seconds a room statement waits for its reply (the backend's ``REQUEST_TIMEOUT``).
        self.timeout = timeout
        #: Tries go prepared (the backend's ``PREPARED_STATEMENTS``).
        self.prepared = prepared
        #: The prepared statements each room connection's session is known to have.
        self._prepared: weakref.WeakKeyDictionary[psycopg.Connection[Any], set[str]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._local = threading.local()
        self._idle: list[psycopg.Connection[Any]] = []
        #: Idle connections whose last statement's reply is still to be read (:func:`_send`).
        self._unsettled: set[psycopg.Connection[Any]] = set()
        self._slots = RoomSlots(self.connections)
        #: How many of this process's waiters went into each name's room and are still there.
        self._visits: collections.Counter[str] = collections.Counter()
        #: Whether a connection was asked if a pooler is in the way (:meth:`probed_on`).
        self.probed = False
        #: The connections grants won here keep (:mod:`~._tenure`), at most :data:`PINS`.
        self._pins: weakref.WeakSet[Pin] = weakref.WeakSet()
        track(self)

    @contextlib.contextmanager
    def enter(self, name: str, timeout: float | None) -> Iterator[None]:
        """Queue on the name's room lock (at most :data:`ROOM_TIMEOUT` at a time), then wait
        inside it.

        Each waiter in the room holds a connection of its own, since its session sleeps in the
        lock queue; at most :attr:`connections` per process, so many waiting threads
        cannot exhaust the server's connections. The rest wait without a room, in line for
        the next connection given back, and go in with it at their next try (see
        :mod:`._room_slots`).
        """
        if not self.enabled:
            yield
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        stay: _Stay[psycopg.Connection[Any]] = _Stay(name, deadline, self._slots.ask())
        self._local.stay = stay
        try:
            if stay.ticket.granted:
                self._go_in(stay)
            yield
        finally:
            self._local.stay = None
            try:
                if stay.entered is not None:
                    with self._lock:
                        _left(self._visits, name)
                    self._leave(stay.entered)
            finally:
                self._slots.done(stay.ticket)

    def _go_in(self, stay: _Stay[psycopg.Connection[Any]]) -> None:
        """Enter the room with the connection ``stay`` holds (once: a failed entry waits
        without a room, as before)."""
        stay.ticket.used = True
        with self._lock:  # counted from the start, as a task's (AsyncWaitingRoom._go_in)
            self._visits[stay.name] += 1
        try:
            stay.visit = stay.entered = self._enter(stay.name, stay.left())
        finally:
            if stay.entered is None:
                with self._lock:
                    _left(self._visits, stay.name)

    def _wait_in_line(self, name: str, timeout: float) -> bool | None:
        """A waiter without a room: ``True`` when a room connection was handed to it (its
        next try goes in), ``None`` to wait for the release without a room. While waiters of
        this process fill the name's room, a waiter in line waits for its connection instead
        (``False`` if none came): its try outside would be refused, and every visit that
        ends hands a connection on. As long as a waiter inside would wait, whatever shorter
        ``timeout`` its backoff asked for (:meth:`wait`)."""
        stay = self._stay()
        if stay is None or stay.ticket.used or stay.name != name:
            return None
        if stay.due(name):
            return True
        with self._lock:
            busy = self._visits[name] > 0
        if not busy:
            return None
        handed = threading.Event()
        stay.ticket.wake = handed.set
        try:
            if not stay.ticket.granted:
                handed.wait(_in_line_for(stay, timeout))
        finally:
            stay.ticket.wake = None
        return stay.due(name)

    def _stay(self) -> _Stay[psycopg.Connection[Any]] | None:
        stay: _Stay[psycopg.Connection[Any]] | None = getattr(self._local, "stay", None)
        return stay

    def behind(self, name: str) -> bool:
        """Whether this thread waits in line for a room connection while waiters of this
        process are inside ``name``'s room: its try outside the room would be refused (it may
        not overtake them), so the caller sends none (see :func:`_behind`)."""
        stay = self._stay()
        if stay is None:  # not waiting (an acquire's first try): no lock taken
            return False
        with self._lock:
            return _behind(stay, name, self._visits)

    def probed_on(self, conn: psycopg.Connection[Any], pid: int) -> bool:
        """Record what a statement on ``conn`` that ran on server process ``pid`` says: behind
        a pooler (see :mod:`~leases._pgpooler`) the rooms are turned off for good. Whether they
        are still on."""
        return _probed_on(self, conn, pid)

    def wait(self, name: str, timeout: float) -> bool | None:
        """Wait for ``name``'s release in this thread's room; ``None`` when not in one.

        The room connection listens since entering and buffers what arrived since, so a
        release between the failed try and this wait is not missed. A waiter queued out of the
        room queues again (the caller's next try decides whether the one inside is stuck).

        Inside, the waiter waits for the release's ``NOTIFY`` (up to :data:`ROOM_TIMEOUT`
        within its deadline, whatever shorter ``timeout`` its backoff asked for): a try before
        then is bound to fail, so it would only poll. A holder gone without releasing is found
        by a try when the grant seen on entering runs out (no ``NOTIFY`` announces an expiry;
        a renewed grant costs one failed try), or after :data:`ROOM_TIMEOUT` at the latest.
        """
        visit = self._visit(name)
        if visit is None:
            return self._wait_in_line(name, timeout)
        try:
            if visit.queue or visit.try_now or not visit.inside:
                return True  # the try queues itself, or is due at once
            left = ROOM_TIMEOUT if visit.deadline is None else visit.deadline - time.monotonic()
            timeout = max(timeout, min(left, ROOM_TIMEOUT, visit.expires - time.monotonic()))
            for note in visit.conn.notifies(timeout=max(0.0, timeout)):
                if note.payload == name:
                    return True
        except psycopg.Error:
            self._forget_visit()  # the session is gone (and its room lock with it)
            visit.inside = False
        return False

    def run_inside(
        self, name: str, statement: Prepared, params: Mapping[str, Any]
    ) -> list[Any] | None:
        """Run ``statement`` on the room connection if this thread is inside ``name``'s room
        (else ``None``); a row with a token is a grant (leaving the room then unlocks it). A
        failed try returns no rows (its one token-less row, if any, says readers
        hold the name: :meth:`readers_hold`).

        Sent prepared (unless the backend's ``PREPARED_STATEMENTS`` is off), as the backend's
        own tries are: this try is on the hand-off's path, between the release's ``NOTIFY``
        and the new holder's return, and parsing and planning its text cost the server more
        than running it.
        """
        visit = self._visit(name)
        if visit is None:
            stay = self._stay()
            if stay is None or not stay.due(name):
                return None
            self._go_in(stay)
            visit = self._visit(name)
            if visit is None:
                return None
        try_now, visit.try_now = visit.try_now, False
        if try_now and not visit.inside:
            return None  # queued out of the room: try outside it (the one inside may be stuck)
        queueing = self._queueing(visit, params)
        if queueing is not None:
            return self._try(visit, PREPARED_QUEUED_ACQUIRE, *queueing)
        # No time left to queue: one plain try, inside the room or out of it.
        return self._try(visit, statement, params) if visit.inside else None

    def _queueing(
        self, visit: _SyncVisit, params: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], float] | None:
        """What the queued try takes, and how long it may queue: at most
        :data:`ROOM_TIMEOUT`, and no longer than the caller's deadline or the holder's grant
        as last seen (``None``: no time left)."""
        now = time.monotonic()
        left = min(ROOM_TIMEOUT, visit.expires - now)
        if visit.deadline is not None:
            left = min(left, visit.deadline - now)
        if left < 0.001:
            return None
        with self._lock:
            pin = self.enabled and len(self._pins) < PINS
        queued = {
            **params,
            "pin": pin,
            "room": visit.key,
            "queue_ms": max(1, int(left * 1000)),
            "inside": visit.inside,
        }
        return queued, left

    def _try(
        self,
        visit: _SyncVisit,
        statement: Prepared,
        params: Mapping[str, Any],
        queue: float = 0.0,
    ) -> list[Any] | None:
        """One try on the room connection (a queued one, for up to ``queue`` seconds, when
        ``queue`` is given); ``None``: try outside."""
        conn = visit.conn
        try:
            with armed(Deadline(conn.fileno(), queue + self.timeout)):
                if queue and self.prepared:
                    pair = (PREPARED_QUEUE, statement)
                    rows = queue_then_try(conn, pair, params, self._names(conn))
                elif queue:  # the same two statements in one transaction, each a round trip
                    with conn.transaction():
                        conn.execute(PREPARED_QUEUE.sql, params)
                        rows = conn.execute(statement.sql, params).fetchall()
                else:
                    rows = self._run(conn, statement, params)
        except psycopg.errors.LockNotAvailable:  # queueing (or a row lock) took too long
            return self._queued_out(visit)
        except psycopg.Error as exc:
            logger.debug("leases: retrying outside the room of %r: %s", visit.name, exc)
            if conn.broken or conn.closed:
                visit.inside = False  # the session is gone, and its room lock with it
                self._forget_visit()
            elif queue:
                self._queued_out(visit)  # whether the room's lock was taken before the failure
            return None
        if rows is None:  # a statement was lost, and made again: try again, at once
            return self._queued_out(visit)  # (whether the room's lock was taken before)
        if queue:
            return self._queued(visit, rows)
        return visit.tried(rows)

    def _queued(self, visit: _SyncVisit, rows: list[Any]) -> list[Any]:
        """What a queued try returned: a grant (token, expiry, seconds it waited before the
        grant; the room left), keeping the connection if it took its tenure lock; or, refused,
        nothing: inside the room now, the waiter listens for the release's ``NOTIFY`` (the
        holder kept no tenure lock, or readers hold the name)."""
        token, expires_at, waited, pinned, left_room, shared, lasts = rows[0][:7]
        if token is not None:
            visit.inside = not left_room
            if pinned:
                visit.pin = Pin(visit.conn)
                with self._lock:
                    self._pins.add(visit.pin)
            return [(token, expires_at, waited)]
        visit.inside, visit.queue = True, False  # the next wait waits for a NOTIFY
        visit.shared = bool(shared)
        visit.expires = math.inf if lasts is None else time.monotonic() + lasts
        if not visit.listening:
            self._listen(visit)
        return []

    def _listen(self, visit: _SyncVisit) -> None:
        """Listen for releases, then look at the name (a release after the look is announced
        to us): held, the next wait waits for its ``NOTIFY``; free, the next try is at once."""
        statement = sql.SQL(ROOM_LISTEN_SQL).format(
            name=sql.Literal(visit.name), group=sql.Literal(GROUP)
        )
        try:
            cursor = _execute(visit.conn, statement, None, self.timeout)
            while cursor.nextset():  # past BEGIN, LISTEN and COMMIT, to the look
                pass
            row = cursor.fetchone()
        except psycopg.Error as exc:
            logger.debug("leases: waiting without a room for %r: %s", visit.name, exc)
            close_quietly(visit.conn)  # its session's room lock goes with it
            visit.inside = False
            self._forget_visit()
            return
        visit.listening = True
        visit.entered(row)
        visit.try_now, visit.held = not visit.held, False  # free: try at once

    def _queued_out(self, visit: _SyncVisit) -> list[Any]:
        """A queued try that timed out: try plainly next, at once (the one inside the room,
        or the holder, may be paused past its expiry, or revoked), then queue again; first
        unlock a tenure lock granted as the timeout fired, and see whether the room's was."""
        visit.try_now = visit.queue = True
        try:
            cursor = _execute(
                visit.conn, UNLOCK_STRAYS_SQL.format(key=visit.key), None, self.timeout
            )
            row = cursor.fetchone()
        except psycopg.Error:
            close_quietly(visit.conn)  # the session's locks, the room's too, go with it
            visit.inside = False
            self._forget_visit()
            return []
        visit.inside = bool(row and row[1])
        return []

    def pin(self, name: str) -> Pin | None:
        """The connection kept by the grant this thread's visit to ``name`` just won."""
        visit = self._visit(name)
        return visit.pin if visit is not None else None

    def release_pinned(
        self, pin: Pin, statement: Prepared, params: Mapping[str, Any]
    ) -> list[Any] | None:
        """Run ``statement`` (the release, which unlocks the tenure lock in its last column) on
        the pin's connection, which then rejoins the idle ones; ``None`` when the pin has no
        usable connection (its session, and the tenure lock, are gone: release elsewhere).
        Nothing was sent when ``None`` is returned; a failure once sent is raised."""
        with pin.lock:
            conn = pin.take()
            with self._lock:
                self._pins.discard(pin)
            if conn is None:
                return None
            settled = _settle(conn) if pin.unsettled else True
            if settled is False:
                self._disable()
            if not settled or stale(conn):
                close_quietly(conn)
                return None
            try:
                with armed(Deadline(conn.fileno(), self.timeout)):
                    rows = self._run(conn, statement, params)
            except psycopg.Error:
                close_quietly(conn)
                raise
        if rows and rows[0][-1] is not True:
            self._disable()  # the unlock found no lock: another server session (a pooler)
            close_quietly(conn)
        else:
            self._keep(conn)
        return rows

    def _run(
        self, conn: psycopg.Connection[Any], statement: Prepared, params: Mapping[str, Any]
    ) -> list[Any]:
        """``statement``'s rows on a room connection, prepared unless the backend's
        ``PREPARED_STATEMENTS`` is off (the caller arms the reply deadline)."""
        if self.prepared:
            return run_prepared(conn, statement, params, self._names(conn))
        return conn.execute(statement.sql, params).fetchall()

    def _names(self, conn: psycopg.Connection[Any]) -> set[str]:
        with self._lock:
            return self._prepared.setdefault(conn, set())

    def readers_hold(self, name: str) -> bool | None:
        """Whether readers held ``name`` at this thread's last try (or look) in its room;
        ``None`` when not in one (unknown). A visit's first try is a queued one, which sees
        readers (and then reports them) as well as a look would: until it did, ``False``."""
        visit = self._visit(name)
        return visit.shared if visit is not None else None

    def _visit(self, name: str) -> _SyncVisit | None:
        stay = self._stay()
        visit = None if stay is None else stay.visit
        return visit if visit is not None and visit.name == name else None

    def _forget_visit(self) -> None:
        """The visit's session is gone (and its room lock with it): wait without a room."""
        stay = self._stay()
        if stay is not None:
            stay.visit = None

    def _enter(self, name: str, timeout: float | None) -> _SyncVisit | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = None
        try:
            conn = self._connection()
            if not self.probed:  # before any session lock on it (see _pgpooler)
                row = _execute(conn, BACKEND_PID_SQL, None, self.timeout).fetchone()
                if row is None or not self.probed_on(conn, int(row[0])):
                    self._keep(conn)
                    return None
        except (psycopg.Error, BackendUnavailable) as exc:
            logger.debug("leases: waiting without a room for %r: %s", name, exc)
            close_quietly(conn)
            return None
        # Not queued yet: the first try queues, in its own statement (see _tenure).
        return _SyncVisit(name, room_key(name), conn, deadline)

    def _connection(self) -> psycopg.Connection[Any]:
        while True:
            with self._lock:
                if not self._idle:
                    break
                conn = self._idle.pop()
                unsettled = conn in self._unsettled
                self._unsettled.discard(conn)
            settled = _settle(conn) if unsettled else True
            if settled is False:
                self._disable()
            if settled and not stale(conn):
                # Releases heard on its last visit (read with a later reply) are over: kept,
                # each would wake this visit for a try bound to fail.
                backlog = getattr(conn, "_notifies_backlog", None)
                if backlog:
                    backlog.clear()
                return conn
            close_quietly(conn)
        return connect(self.db_alias)

    def _leave(self, visit: _SyncVisit) -> None:
        conn = visit.conn
        # Inside (giving up, or granted by a plain try): unlock and stop listening; out of the
        # room, only stop listening (a queued try's grant left the room in its statement).
        # Sent without waiting for the reply, which the next user of the connection collects
        # (:func:`_settle`, which also checks the unlock): the new holder returns a round trip
        # sooner, and the next waiter is let in as soon as the server reads it. A grant that
        # kept the connection (its pin) leaves the same way; the pin then reads the reply
        # before its release.
        pin = visit.pin
        if visit.inside:
            statement = ROOM_LEAVE_SQL.format(key=visit.key)
        elif visit.listening:
            statement = ROOM_UNLISTEN_SQL
        elif pin is None:
            self._keep(conn)
            return
        else:
            return
        try:
            if pin is not None and not pin.usable():
                return
            if _send(conn, statement):
                if pin is not None:
                    pin.unsettled = True
                    return
                with self._lock:
                    self._unsettled.add(conn)
            elif visit.inside and _execute(
                conn, statement.encode(), None, self.timeout
            ).fetchone() != (True,):
                self._disable()
            elif not visit.inside:
                _execute(conn, statement.encode(), None, self.timeout)
        except psycopg.Error:
            if pin is not None:
                pin.drop()
            close_quietly(conn)  # closing the session releases its advisory lock
            return
        if pin is None:
            self._keep(conn)

    def _keep(self, conn: psycopg.Connection[Any]) -> None:
        """Keep ``conn`` idle for the next visit, or close it when enough are."""
        with self._lock:
            if len(self._idle) < self.connections:
                self._idle.append(conn)
                return
            self._unsettled.discard(conn)
        close_quietly(conn)

    def _disable(self) -> None:
        """An unlock found no lock to release: it ran on another server session than the
        lock (a transaction-pooling proxy), so the room cannot work here; stop using it rather
        than leak locks."""
        self.enabled = False
        logger.warning("leases: waiting room disabled on %r: unlock failed", self.alias)

    def close(self) -> None:
        """Close the idle room connections (those in use close when their waiter leaves) and
        the kept ones (their grants are then released on the backend's own connection)."""
        with self._lock:
            idle, self._idle = self._idle, []
            pins, self._pins = list(self._pins), weakref.WeakSet()
            self._unsettled.clear()
        for conn in idle:
            close_quietly(conn)
        for pin in pins:
            with pin.lock:
                pin.drop()

    def forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._slots = RoomSlots(self.connections)
        self._visits = collections.Counter()
        stay = self._stay()
        visit = None if stay is None else stay.visit
        inherit(*self._idle, visit.conn if visit is not None else None)
        inherit(*(pin.conn for pin in self._pins))  # never used here: their pid is the parent's
        self._idle = []
        self._pins = weakref.WeakSet()
        self._unsettled = set()
        self._prepared = weakref.WeakKeyDictionary()
        self._local = threading.local()


def _probed_on(
    room: WaitingRoom | AsyncWaitingRoom,
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    pid: int,
) -> bool:
    """:meth:`WaitingRoom.probed_on`, for either room."""
    if room.enabled and not keeps_sessions(conn, pid, room.session_pooling):
        room.enabled = False
        warn_pooled(room.alias)
    room.probed = True
    return room.enabled


#: Longest the next user waits for the reply to a statement sent without waiting.
_SETTLE_TIMEOUT = 1.0


def _send(conn: psycopg.Connection[Any], statement: str) -> bool:
    """Send ``statement`` on idle ``conn`` without waiting for the reply; whether it was sent
    (if not, the caller runs it the ordinary way, or drops a connection left mid-message)."""
    pgconn = conn.pgconn
    if pgconn.transaction_status != pq.TransactionStatus.IDLE:
        return False
    deadline = time.monotonic() + _SETTLE_TIMEOUT
    try:
        pgconn.send_query(statement.encode())
        while pgconn.flush() == 1:  # the socket's buffer is full: wait until it drains
            left = deadline - time.monotonic()
            if left <= 0 or not writable(pgconn.socket, left):
                return False
    except (psycopg.Error, OSError):
        return False
    return True


def _settle(conn: psycopg.Connection[Any]) -> bool | None:
    """Read the reply to what :func:`_send` sent; whether ``conn`` is fit for use again:
    ``True``, or ``None`` (drop it), or ``False`` when an unlock it carried found no lock to
    release (it ran on another server session: the room cannot work here, see
    :meth:`WaitingRoom._disable`).

    The reply has usually arrived long before (the connection sat idle), so this costs no
    round trip; notifications that came with it are buffered for the connection's next
    ``notifies()``, where a stale one costs at most one try.
    """
    pgconn = conn.pgconn
    try:
        results = read_replies(pgconn, time.monotonic() + _SETTLE_TIMEOUT)
        if results is None:
            return None
        ok, unlocked = True, True
        for result in results:
            if result.status == pq.ExecStatus.TUPLES_OK and result.ntuples == 1:
                unlocked = unlocked and result.get_value(0, 0) == b"t"
            else:
                ok = ok and result.status == pq.ExecStatus.COMMAND_OK
        if not ok or pgconn.transaction_status != pq.TransactionStatus.IDLE:
            return None
        return unlocked
    except (psycopg.Error, OSError):
        return None


class AsyncWaitingRoom:
    """The rooms of one backend alias on one event loop: :class:`WaitingRoom` for tasks.

    The same queue (the server's lock queue on the same room lock, so sync and async waiters
    of a name queue together), the same statements, the same reply deadlines, awaited on
    psycopg's ``AsyncConnection``: a waiting task holds a connection of its own (at most
    :attr:`connections` per loop; the rest wait in line for one) but never blocks the loop.
    A task cancelled in the room drops its connection (it may be mid-protocol), which ends
    the session and its room lock with it.
    """

    def __init__(
        self,
        db_alias: str,
        alias: str,
        *,
        enabled: bool = True,
        timeout: float = REQUEST_TIMEOUT,
        prepared: bool = True,
        session_pooling: bool = False,
        connections: int = ROOM_CONNECTIONS,
    ) -> None:
        self.db_alias = db_alias
        self.alias = alias
        self.enabled = enabled
        self.connections = connections
        self.session_pooling = session_pooling
        #: Whether a room connection was asked if a pooler is in the way
        #: (see :mod:`~leases._pgpooler`).
        self.probed = False
        self.timeout = timeout
        self.prepared = prepared
        self._prepared: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], set[str]] = (
            weakref.WeakKeyDictionary()
        )
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._slots = RoomSlots(self.connections)
        #: How many of this loop's waiters went into each name's room and are still there.
        self._visits: collections.Counter[str] = collections.Counter()
        #: The current task's stay; a context variable, so the tasks a waiter starts for
        #: its tries (``aacquire`` shields each in a task of its own) see it too.
        self._current: contextvars.ContextVar[_Stay[psycopg.AsyncConnection[Any]] | None] = (
            contextvars.ContextVar(f"leases_room_{id(self)}", default=None)
        )

    @contextlib.asynccontextmanager
    async def enter(self, name: str, timeout: float | None) -> AsyncIterator[None]:
        """Queue on the name's room lock, then wait inside it (see :meth:`WaitingRoom.enter`:
        past :attr:`connections` in use on this loop, in line for the next one given
        back, going in at the first wait after one is handed over)."""
        if not self.enabled:
            yield
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        stay: _Stay[psycopg.AsyncConnection[Any]] = _Stay(name, deadline, self._slots.ask())
        current = self._current.set(stay)
        try:
            if stay.ticket.granted:
                await self._go_in(stay)
            yield
        except BaseException:
            if stay.entered is not None:  # maybe mid-protocol: never reuse it (left closed)
                await _aclose_quietly(stay.entered.conn)
            raise
        finally:
            self._current.reset(current)
            self._slots.done(stay.ticket)
            visit = stay.entered
            if visit is not None:
                _left(self._visits, name)
                if not visit.conn.closed:
                    await self._leave(visit)

    async def _go_in(self, stay: _Stay[psycopg.AsyncConnection[Any]]) -> None:
        """Enter the room with the connection ``stay`` holds (once). Counted as a visit from
        the start: a task's entry queues for the room lock (up to :data:`ROOM_TIMEOUT`), and
        the tasks in line wait behind it meanwhile, as behind one inside (:func:`_behind`)."""
        stay.ticket.used = True
        self._visits[stay.name] += 1
        try:
            stay.entered = await self._enter(stay.name, stay.left())
        finally:
            if stay.entered is None:
                _left(self._visits, stay.name)

    async def _wait_in_line(self, name: str, timeout: float) -> bool | None:
        """:meth:`WaitingRoom._wait_in_line`, awaited; going in here once handed a
        connection (``None``: wait for the release without a room)."""
        stay = self._current.get()
        if stay is None or stay.ticket.used or stay.name != name:
            return None
        if not stay.due(name) and self._visits[name] > 0:
            handed = asyncio.Event()
            stay.ticket.wake = handed.set
            try:
                if not stay.ticket.granted:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_in_line_for(stay, timeout)):
                            await handed.wait()
            finally:
                stay.ticket.wake = None
            if not stay.due(name):
                return False
        if not stay.due(name):
            return None
        await self._go_in(stay)
        return True if self._visit(name) is not None else None

    def behind(self, name: str) -> bool:
        """:meth:`WaitingRoom.behind`, for this task."""
        return _behind(self._current.get(), name, self._visits)

    def _visit(self, name: str) -> _AsyncVisit | None:
        stay = self._current.get()
        visit = None if stay is None else stay.entered
        if visit is None or visit.name != name or visit.conn.closed:
            return None
        return visit

    async def wait(self, name: str, timeout: float) -> bool | None:
        """:meth:`WaitingRoom.wait`, awaited: woken by the release's ``NOTIFY``. A waiter
        handed a room connection while it waited without one goes in here."""
        visit = self._visit(name)
        if visit is None:
            waited = await self._wait_in_line(name, timeout)
            visit = self._visit(name)
            if waited is not True or visit is None:
                return waited
        try:
            if not visit.inside:
                await self._lock_room(visit)
                if not visit.inside:
                    return False  # queued out: try (the waiter inside may be stuck)
            fresh, visit.fresh = visit.fresh, False
            if fresh and not visit.held:
                return True  # free when we got inside: try at once
            visit.held = False  # held then: the release that wakes us is worth a try
            left = ROOM_TIMEOUT if visit.deadline is None else visit.deadline - time.monotonic()
            timeout = max(timeout, min(left, ROOM_TIMEOUT, visit.expires - time.monotonic()))
            # Closed here, not left to the loop's finalizer: a suspended ``notifies()`` holds
            # the connection's lock, and the try that follows needs it.
            notes = visit.conn.notifies(timeout=max(0.0, timeout))
            async with contextlib.aclosing(notes):
                async for note in notes:
                    if note.payload == name:
                        return True
        except psycopg.Error:
            visit.inside = False  # the session is gone (and its room lock with it)
            await _aclose_quietly(visit.conn)
        return False

    async def run_inside(
        self, name: str, statement: Prepared, params: Mapping[str, Any]
    ) -> list[Any] | None:
        """:meth:`WaitingRoom.run_inside`, awaited (prepared likewise)."""
        visit = self._visit(name)
        if visit is None or not visit.inside:
            return None
        if visit.held:
            visit.held = False
            return []
        conn = visit.conn
        due = Deadline(conn.fileno(), self.timeout)
        try:
            with aarmed(due):
                if self.prepared:
                    names = self._prepared.setdefault(conn, set())
                    rows = await arun_prepared(conn, statement, params, names)
                else:
                    cursor = await conn.execute(statement.sql, params)
                    rows = await cursor.fetchall()
        except psycopg.Error as exc:
            logger.debug("leases: retrying outside the room of %r: %s", name, exc)
            if visit.conn.broken or visit.conn.closed or due.fired:
                visit.inside = False
                await _aclose_quietly(visit.conn)
            return None
        return visit.tried(rows)

    def readers_hold(self, name: str) -> bool | None:
        visit = self._visit(name)
        return visit.shared if visit is not None and visit.inside else None

    async def _enter(self, name: str, timeout: float | None) -> _AsyncVisit | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = None
        try:
            conn = await self._connection()
            if not self.probed:  # before any session lock on it (see _pgpooler)
                with aarmed(Deadline(conn.fileno(), self.timeout)):
                    row = await (await conn.execute(BACKEND_PID_SQL)).fetchone()
                if row is None or not _probed_on(self, conn, int(row[0])):
                    await _aclose_quietly(conn)
                    return None
            visit = _AsyncVisit(name, room_key(name), conn, deadline)
            await self._lock_room(visit)
            return visit
        except (psycopg.Error, BackendUnavailable) as exc:
            logger.debug("leases: waiting without a room for %r: %s", name, exc)
            await _aclose_quietly(conn)
            return None
        except BaseException:
            # Cancelled on the way in (the caller's deadline): the connection may be mid-
            # protocol, or its session may hold the room's lock already (granted as the
            # cancellation came), which it would keep for as long as the task is referenced,
            # every later waiter queueing behind it in vain. Ending the session ends both.
            await _aclose_quietly(conn)
            raise

    async def _lock_room(self, visit: _AsyncVisit) -> None:
        queueing = visit.queueing()
        if queueing is None:
            return
        queue_for, statement = queueing
        due = Deadline(visit.conn.fileno(), queue_for + self.timeout)
        try:
            with aarmed(due):
                cursor = await visit.conn.execute(statement)
                while cursor.nextset():  # to the last look, as in the sync room
                    pass
                row = await cursor.fetchone()
        except psycopg.errors.LockNotAvailable:
            with aarmed(Deadline(visit.conn.fileno(), self.timeout)):
                await visit.conn.execute(ROOM_UNLOCK_ALL_SQL)  # see ROOM_UNLOCK_ALL_SQL
            return
        visit.entered(row)
        visit.fresh = True

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        while self._idle:
            conn = self._idle.pop()
            if not stale(conn):
                backlog = getattr(conn, "_notifies_backlog", None)
                if backlog:
                    backlog.clear()
                return conn
            await _aclose_quietly(conn)
        return await aconnect(self.db_alias)

    async def _leave(self, visit: _AsyncVisit) -> None:
        conn = visit.conn
        statement = ROOM_LEAVE_SQL.format(key=visit.key) if visit.inside else ROOM_UNLISTEN_SQL
        due = Deadline(conn.fileno(), self.timeout)
        try:
            with aarmed(due):
                cursor = await conn.execute(statement.encode())
                row = await cursor.fetchone() if visit.inside else (True,)
        except psycopg.Error:
            await _aclose_quietly(conn)  # closing the session releases its room lock
            return
        except asyncio.CancelledError:
            await _aclose_quietly(conn)
            raise
        if row != (True,):
            self.enabled = False
            logger.warning("leases: waiting room disabled on %r: unlock failed", self.alias)
        if len(self._idle) < self.connections:
            self._idle.append(conn)
        else:
            await _aclose_quietly(conn)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await _aclose_quietly(conn)
