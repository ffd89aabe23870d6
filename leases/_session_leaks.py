"""Session locks still held when a request ends: released and reported, never inherited.

A session lock belongs to the database *session*, and a session outlives its request whenever
Django keeps connections (``CONN_MAX_AGE > 0``) or pools them (``OPTIONS={"pool": ...}``,
Django 5.1+). A ``session_lock`` whose block never exited (entered by hand, a suspended
generator, a thread killed mid-block) would then hold the lock for whatever request gets the
connection next, silently: that request could not take the lock itself and would not know why,
and every other process would wait behind a lock no code holds.

So :func:`track` remembers, per Django connection object, which session locks this package
took on it and has not yet unlocked (nothing is asked of the server: a request that took no
session lock pays nothing). When a request starts, :func:`mark_start` notes how many were
already held on each connection: those belong to whoever holds them around the request (a
test or a command serving requests through Django's test ``Client`` on its own thread and
connection), not to the request. When the request finishes, :func:`release_leaked` unlocks what
the request took and left on that connection, and logs an error naming each lock
(``event: advisory_lock_leaked``).
Releasing, not raising: the response is already sent, and the one thing that must not happen
is the next request inheriting the lock. It runs *before* Django's own ``close_old_connections``
(which would hand a pooled connection back with the lock still on it); see :func:`install`.
Locks taken with raw SQL (``SELECT pg_advisory_lock(...)``) are not tracked. A Celery task is
swept the same way (:mod:`leases.celery._sessions`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from django.core.signals import request_finished, request_started
from django.db import close_old_connections, connections
from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = [
    "end_session",
    "holds",
    "install",
    "mark_start",
    "release_leaked",
    "track",
    "untrack",
]

logger = logging.getLogger("leases.advisory")

#: Per Django connection object (one per thread or async context and alias): the unlock
#: statement of each session lock taken on it and not yet unlocked, with the lock's label.
_held: weakref.WeakKeyDictionary[BaseDatabaseWrapper, list[tuple[str, str]]] = (
    weakref.WeakKeyDictionary()
)


#: Per Django connection object: how many of its tracked locks were held when each request
#: now running on it started (they are not that request's to release), innermost last. A
#: stack, not one count: a request served inside another on the same thread (Django's test
#: ``Client`` called from a view) overwrote the outer request's count, then popped it, so the
#: outer request's end released a lock taken before either began.
_before: weakref.WeakKeyDictionary[BaseDatabaseWrapper, list[int]] = weakref.WeakKeyDictionary()


#: Django connection objects whose ``close()`` ends the server session while they hold a
#: tracked lock (see :func:`_end_on_close`).
_guarded: weakref.WeakSet[BaseDatabaseWrapper] = weakref.WeakSet()


def track(connection: BaseDatabaseWrapper, label: str, unlock_sql: str) -> None:
    """A session lock was taken on ``connection``; ``unlock_sql`` releases it once."""
    _held.setdefault(connection, []).append((label, unlock_sql))
    if connection not in _guarded:
        _end_on_close(connection)


def end_session(connection: BaseDatabaseWrapper) -> None:
    """End ``connection``'s server session, and with it every lock of it; then let Django
    forget the connection (it reconnects on the next query).

    Django's ``close()`` does not end the session of a pooled alias (``OPTIONS={"pool":
    ...}``): it hands the session back to the pool, locks and all, and the pool lends it to
    another thread, whose ``session_lock`` of the same name is then let straight in (advisory
    locks are re-entrant per session): two holders, and both unlocks succeed. Finishing the
    driver's connection first ends the session whatever happens next: a pool discards a
    closed connection and opens another. (Not the driver's ``close()``: a pool made with
    ``close_returns`` would take the connection back instead.)
    """
    raw = connection.connection
    if raw is not None:
        raw.pgconn.finish()
    connection.close()


def _end_on_close(connection: BaseDatabaseWrapper) -> None:
    """Make Django's own closing of ``connection`` (``close_old_connections`` between units
    of work, ``connections.close_all()``) end the server session while a tracked lock is
    held on it, as it does without a pool: the lock goes with the session, never into the
    pool, and its holder learns it at ``ensure_held()`` or at the block's exit.

    Django has no hook around closing, so the instance's ``close`` (which every closing path
    calls, and which pools the driver's connection) is wrapped, once per connection object.
    The wrapper holds the connection weakly, so it does not keep it (and its entries) alive.
    """
    _guarded.add(connection)
    owner = weakref.ref(connection)
    close = type(connection).close

    def close_ending_locked_sessions() -> None:
        wrapper = owner()
        if wrapper is None:
            return
        wrapper.validate_thread_sharing()  # another thread's close must not end our session
        if _held.get(wrapper) and wrapper.connection is not None:
            wrapper.connection.pgconn.finish()
        close(wrapper)

    connection.close = close_ending_locked_sessions  # type: ignore[method-assign]


def holds(connection: BaseDatabaseWrapper, unlock_sql: str) -> bool:
    """Whether a session lock this package took on ``connection`` with ``unlock_sql`` is held."""
    return any(sql == unlock_sql for _, sql in _held.get(connection, ()))


def untrack(connection: BaseDatabaseWrapper, unlock_sql: str) -> None:
    """The block of a session lock ended (unlocked, or found lost): forget one entry, the
    latest with that unlock statement. Matched by the statement (its key and mode), not by
    the label: a shared and an exclusive lock of one name share a label, and so do the name
    ``"advisory key 5"`` and the key 5; forgetting the other one left the lock still held
    untracked, and released the wrong one at the end of the request."""
    held = _held.get(connection)
    if not held:
        return
    for index in range(len(held) - 1, -1, -1):
        if held[index][1] == unlock_sql:
            del held[index]
            break


def mark_start(**kwargs: Any) -> None:
    """At the start of a request: what is held now was taken outside it."""
    for connection in connections.all(initialized_only=True):
        _before.setdefault(connection, []).append(len(_held.get(connection, ())))


def release_leaked(*, unit: str = "request", **kwargs: Any) -> None:
    """At the end of a request (or a Celery task, the ``unit`` the log line names): unlock
    every session lock it took and left held, and say so."""
    for connection in connections.all(initialized_only=True):
        starts = _before.get(connection)
        kept = starts.pop() if starts else 0
        held = _held.pop(connection, None)
        if held and kept:
            _held[connection], held = held[:kept], held[kept:]
        if not held:
            continue
        labels = [label for label, _ in held]
        outcome = "gone" if connection.connection is None else _unlock(connection, held)
        released = outcome in ("released", "closed")  # closed: the lock went with the session
        logger.error(
            "leases: session_lock(%s) still held on database %r when the %s ended; %s",
            ", ".join(repr(label) for label in labels),
            connection.alias,
            unit,
            _OUTCOMES[outcome],
            extra={
                "event": "advisory_lock_leaked",
                "locks": labels,
                "database": connection.alias,
                "released": released,
            },
        )


_OUTCOMES = {
    "released": "released it so whatever runs next on this connection does not inherit it",
    "closed": "could not unlock it, so its connection was closed, and the lock went with it",
    "not held": "but its session no longer held it (lost with a reconnect, or unlocked by raw SQL)",
    "gone": "its connection is gone, and with it the lock",
}


def _unlock(connection: BaseDatabaseWrapper, held: list[tuple[str, str]]) -> str:
    """Unlock on the driver's connection (Django's cursor would refuse inside a broken
    transaction); if even that fails, end the session, the release of last resort. Which of
    :data:`_OUTCOMES` it was: an unlock that finds nothing answers false, not an error."""
    found = True
    try:
        with connection.connection.cursor() as cursor:
            for _, sql in reversed(held):
                cursor.execute(sql)
                row = cursor.fetchone()
                found = found and bool(row and row[0])
    except Exception as exc:  # the driver's error, whatever the state of the session
        logger.warning("leases: could not unlock a leaked session lock (%s); closing", exc)
        end_session(connection)
        return "closed"
    return "released" if found else "not held"


def install(
    signal: Any = request_finished, closer: Callable[..., None] = close_old_connections
) -> None:
    """Run :func:`mark_start` when a request starts and :func:`release_leaked` when it ends,
    before Django closes or pools the request's connections (its ``close_old_connections`` is
    moved after ours)."""
    request_started.connect(mark_start, dispatch_uid="leases.mark_session_locks_at_start")
    signal.disconnect(closer)
    signal.connect(release_leaked, dispatch_uid="leases.release_leaked_session_locks")
    signal.connect(closer)
