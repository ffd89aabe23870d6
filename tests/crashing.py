"""Crash a test's own PostgreSQL server right after an action, losing what it committed
without flushing (see ``tests/test_lease_database_crash.py`` for why this is a real crash)."""

from __future__ import annotations

import os
import signal
from typing import Any

import psycopg

from tests.waiting import wait_until

__all__ = ["crash_after", "recovered_from"]

#: The server has been through the crash (a WAL writer other than the killed one runs) and out
#: of its recovery.
RECOVERED_SQL = """
SELECT NOT pg_is_in_recovery() AND EXISTS (
    SELECT FROM pg_stat_activity WHERE backend_type = 'walwriter' AND pid <> %(killed)s
) AND NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %(killed)s)
"""


def _admin(server: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(server.url, autocommit=True, connect_timeout=2)


def _walwriter(server: Any) -> int:
    with _admin(server) as admin:
        row = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def crash_after(server: Any, action: Any) -> None:
    """Run ``action`` with the WAL writer stopped, then crash the server and wait for its
    recovery: what ``action`` committed without flushing is lost.

    Recovered means a *new* WAL writer runs and the server is out of recovery. "Out of
    recovery" alone is also true before the postmaster has noticed the kill: on a loaded
    machine a connection can be served in that gap, and the crash then lands on the caller's
    next statement (which fails as ``BackendUnavailable``, "server closed the connection
    unexpectedly"), not before it. The killed WAL writer's entry stays in
    ``pg_stat_activity`` until the postmaster has reset shared memory for the recovery, so a
    WAL writer with another pid proves the crash has happened and the recovery is over."""
    walwriter = _walwriter(server)
    os.kill(walwriter, signal.SIGSTOP)
    try:
        action()
    finally:
        os.kill(walwriter, signal.SIGKILL)  # the postmaster ends every backend and recovers

    def recovered() -> bool:
        try:
            with _admin(server) as admin:
                return recovered_from(admin, walwriter)
        except psycopg.Error:
            return False

    wait_until(recovered, 60, "the server to recover from the crash")


def recovered_from(admin: psycopg.Connection[Any], killed: int) -> bool:
    """Whether the server ``admin`` is connected to has been through the crash that killing
    its WAL writer ``killed`` started, and is out of the recovery (:data:`RECOVERED_SQL`)."""
    return admin.execute(RECOVERED_SQL, {"killed": killed}).fetchone() == (True,)
