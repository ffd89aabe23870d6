"""A statement left running by an exception the driver does not handle: cancelled, read to its end.

psycopg cancels the statement it waits on when ``KeyboardInterrupt`` or ``SystemExit`` interrupts
the wait, and for nothing else. Any other exception raised by a signal handler (Celery's
``SoftTimeLimitExceeded``, an alarm's) leaves the statement running on the server and its
replies unread: the connection refuses every later statement ("another command is already in
progress"), and a lock the statement was waiting for is granted later, to a session nobody
will ask to unlock. :func:`cancel_running` ends that state: the server is asked to cancel, and
whatever it answers is read, within a bound, so the connection is usable again.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from ._pgreplies import read_replies

__all__ = ["cancel_running"]


def cancel_running(raw: psycopg.Connection[Any], bound: float) -> None:
    """If ``raw`` has a statement running, cancel it and read its replies to the end.

    ``TimeoutError`` if the server has not finished within ``bound`` seconds; the session is
    then in an unknown state and the caller should end it. Whether the statement completed
    before the cancellation reached it is not told here: ask the session afterwards.
    """
    pgconn = raw.pgconn
    if pgconn.transaction_status != TransactionStatus.ACTIVE:
        return
    deadline = time.monotonic() + bound
    raw.cancel_safe(timeout=bound)
    if read_replies(pgconn, deadline) is None:
        raise TimeoutError(f"the cancelled statement did not end within {bound:g}s")
