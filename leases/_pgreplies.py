"""Reading, within a bound, the replies to a statement whose sender did not wait for them.

A statement sent without waiting (a room left on the way out, a statement cancelled after an
interrupt) leaves its replies on the connection, and the connection is fit for another
statement only once they are all read. ``get_result`` alone would read them, but waits on the
socket with no bound whenever the reply it is asked for has not fully arrived: so each reply is
first waited for here, up to the caller's deadline, and only read once ``is_busy`` says it is
complete. One loop for every such reader, so none of them can wait unbounded.
"""

from __future__ import annotations

import time

from psycopg.pq.abc import PGconn, PGresult

from ._fdwait import readable

__all__ = ["read_replies"]


def read_replies(pgconn: PGconn, deadline: float) -> list[PGresult] | None:
    """Every reply to the statement in flight on ``pgconn``, once the last has been read;
    ``None`` if one has not arrived by ``deadline`` (``time.monotonic()`` seconds): the
    statement is then still running, or the connection gone silent. A broken connection
    raises as ``consume_input`` does."""
    results: list[PGresult] = []
    while True:
        pgconn.consume_input()
        if pgconn.is_busy():
            left = deadline - time.monotonic()
            if left <= 0 or not readable(pgconn.socket, left):
                return None
            continue
        result = pgconn.get_result()
        if result is None:
            return results
        results.append(result)
