"""Notifications that libpq read with a reply, handed to psycopg.

For statements run straight on libpq (``exec_prepared``, ``exec_``, a pipeline's replies read
with ``get_result``) rather than through psycopg's cursor, whose ``execute`` does the same:
the database backend's prepared statements and tenure locks, and the idempotency store's
statements in :mod:`idempotency._direct`.
"""

from __future__ import annotations

from psycopg import pq

__all__ = ["keep_notifies"]


def keep_notifies(pgconn: pq.abc.PGconn) -> None:
    """Hand the notifications libpq read with the reply to psycopg, as its own ``execute``
    does: left in libpq's queue, a listening connection's ``notifies()`` would not see them
    (it waits for the socket, which has nothing more to read), and the waiter in the database
    backend's waiting room, whose try runs straight on libpq, would sleep through the release
    that it was woken for."""
    while (note := pgconn.notifies()) is not None:
        if pgconn.notify_handler:
            pgconn.notify_handler(note)
