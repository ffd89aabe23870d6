"""Whether a connection reaches PostgreSQL through a pooler, asked once per connection.

A pooler (PgBouncer or another) answers a client's startup itself, with a cancel key of its
own: the process id in it (``conn.info.backend_pid``) is not that of the server session a
statement then runs on (:data:`BACKEND_PID_SQL`). Directly connected, the two are the same. So
one round trip tells (:func:`behind_pooler`), whatever the pooler's mode and however busy it
is. Asking, rather than finding out by the first failed unlock, matters: that comes one lock
too late, and a busy pooler often hands an unlock back to the very session that took the
lock, so the failure may come late or not at all while locks pile up.

What the answer means is for the caller: only *session* state (a lock taken in one statement
and unlocked in a later one, a ``LISTEN``) is at stake, because behind a transaction pooler
(PgBouncer's ``transaction`` or ``statement`` mode) each transaction may run on another server
session. A session pooler would keep it working, but its mode cannot be read from the client,
so the operator's word, the ``SESSION_POOLING`` option, declares one
(:func:`leases.backends._pgpooled.keeps_sessions`; declared in front of a transaction pooler,
session state would leak).

Where it is asked, before any session state is set on the connection:

- the database backend's waiting rooms and tenure locks (session advisory locks:
  :mod:`~leases.backends._waiting_room`, and the backend's own connection in
  :mod:`~leases.backends.database`) are turned off for good behind a pooler not declared a
  session pooler (:mod:`~leases.backends._pgpooled`), since a lock could stay on a server
  session the pooler keeps open and hands to other clients;
- its listening connections (:mod:`~leases.backends._pgconn`,
  :mod:`~leases.backends._pgaio`) do not ``LISTEN`` behind one: the
  listener would never hear a release, and the pooler's other clients would receive the
  ``leases_released`` notifications (lease names); its waiters retry after their backoff;
- :mod:`leases.advisory` refuses ``session_lock`` behind one not declared a session pooler
  (``LEASES["SESSION_POOLING"]``), since two clients could then hold the same lock.
"""

from __future__ import annotations

from typing import Any

import psycopg

__all__ = ["BACKEND_PID_SQL", "behind_pooler"]

#: The process id of the server session this statement runs on.
BACKEND_PID_SQL = "SELECT pg_backend_pid()"


def behind_pooler(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], pid: int) -> bool:
    """Whether ``conn``, whose statement ran on server process ``pid``, was answered at its
    startup by something else than that server session (a pooler)."""
    return conn.info.backend_pid != pid
