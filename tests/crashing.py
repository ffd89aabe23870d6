"""Crash a test's own PostgreSQL server right after an action, losing what it committed
without flushing (see ``tests/test_lease_database_crash.py`` for why this is a real crash)."""

from __future__ import annotations

import os
import signal
from typing import Any

import psycopg

from tests.waiting import wait_until

__all__ = ["crash_after"]


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
    recovery: what ``action`` committed without flushing is lost."""
    walwriter = _walwriter(server)
    os.kill(walwriter, signal.SIGSTOP)
    try:
        action()
    finally:
        os.kill(walwriter, signal.SIGKILL)  # the postmaster ends every backend and recovers

    def recovered() -> bool:
        try:
            with _admin(server) as admin:
                return admin.execute("SELECT NOT pg_is_in_recovery()").fetchone() == (True,)
        except psycopg.Error:
            return False

    wait_until(recovered, 60, "the server to recover from the crash")
