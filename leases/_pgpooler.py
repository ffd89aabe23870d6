"""Whether a connection reaches PostgreSQL through a pooler, asked before the first session
lock is taken on it.

Waiting rooms and tenure locks are *session* advisory locks: taken in one statement, unlocked
in a later one, on the same server session. Behind a transaction pooler (PgBouncer's
``transaction`` or ``statement`` mode) each transaction may run on another server session, so
a lock can be taken on one and its unlock sent to another: the unlock finds nothing, and the
lock stays on a server session the pooler keeps open, and hands to other clients, for as long
as that lives. Finding that out by the first failed unlock (as the rooms also do) comes one
lock too late, and a busy pooler often hands a lock's unlock back to the very session that
took it, so the failure may come late or not at all while locks pile up.

A pooler answers a client's startup itself, with a cancel key of its own: the process id in
it (``conn.info.backend_pid``) is not that of the server session a statement then runs on
(``pg_backend_pid()``). Directly connected, the two are the same. So one round trip per
backend and process tells, whatever the pooler's mode and however busy it is; the rooms and
tenure locks are turned off behind any pooler: a session pooler would keep them working, but
its mode cannot be read from the client, so the backend's ``SESSION_POOLING`` option says so
(the operator's word: declared in front of a transaction pooler, session locks would leak).

``LISTEN`` is session state too. Sent through a transaction pooler it lands on a server session
the pooler then hands to other clients: the listener never hears a release, and the pooler's
other clients receive the ``leases_released`` notifications (lease names) they never asked
for. So a listening connection asks the same question before its ``LISTEN`` and, behind a
pooler not declared a session pooler, does not listen: its waiters retry after their backoff.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

__all__ = ["BACKEND_PID_SQL", "behind_pooler", "keeps_sessions", "warn_pooled", "warn_unheard"]

logger = logging.getLogger("leases")

#: The process id of the server session this statement runs on.
BACKEND_PID_SQL = "SELECT pg_backend_pid()"


def behind_pooler(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], pid: int) -> bool:
    """Whether ``conn``, whose statement ran on server process ``pid``, was answered at its
    startup by something else than that server session (a pooler)."""
    return conn.info.backend_pid != pid


def keeps_sessions(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], pid: int, session_pooling: bool
) -> bool:
    """Whether session state set on ``conn`` (whose statement ran on server process ``pid``)
    stays with it: connected directly, or through a pooler the backend's ``SESSION_POOLING``
    option declares a session pooler."""
    return session_pooling or not behind_pooler(conn, pid)


def warn_pooled(alias: str) -> None:
    logger.warning(
        "leases: backend %r reaches PostgreSQL through a pooler (its connection's process id "
        "is not its server session's): waiting rooms and tenure locks are off, since a session "
        "lock taken through a transaction pooler can outlive its unlock; give the backend a "
        "DATABASE alias that connects directly for first-come-first-served hand-offs, or set "
        "its SESSION_POOLING option if the pooler keeps each client's server session",
        alias,
    )


def warn_unheard(alias: str) -> None:
    logger.warning(
        "leases: backend %r reaches PostgreSQL through a pooler: its waiters do not LISTEN for "
        "releases (a LISTEN through a transaction pooler is heard by the pooler's other "
        "clients, not by the listener) and retry after their backoff instead; set the "
        "backend's SESSION_POOLING option if the pooler keeps each client's server session",
        alias,
    )
