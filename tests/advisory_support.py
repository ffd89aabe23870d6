"""Helpers shared by the advisory lock tests: another session, and who holds a lock."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import connection, connections

from leases.keys import advisory_key, split_key


@contextmanager
def other_session() -> Iterator[psycopg.Connection[Any]]:
    """Another session on the test database, in autocommit: it holds locks and reads pg_locks."""
    s = connection.settings_dict
    conn = psycopg.connect(
        dbname=s["NAME"],
        user=s["USER"],
        password=s["PASSWORD"],
        host=s["HOST"],
        port=s["PORT"],
        autocommit=True,
    )
    try:
        yield conn
    finally:
        conn.close()


def holders(other: psycopg.Connection[Any], name: str, *, granted: bool = True) -> int:
    """How many sessions other than ``other`` hold (or wait for) the lock on ``name``."""
    classid, objid = split_key(advisory_key(name))  # type: ignore[arg-type]
    row = other.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s"
        " AND objid = %s AND objsubid = 1 AND granted = %s AND pid <> pg_backend_pid()",
        [classid, objid, granted],
    ).fetchone()
    assert row is not None
    return int(row[0])


def free_elsewhere(alias: str, name: str, wait: float = 10) -> bool:
    """Whether a session of another thread (Django alias ``alias``) can take the session lock
    ``name`` now; it gives the lock back at once."""
    box: list[bool] = []

    def run() -> None:
        try:
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT pg_try_advisory_lock(%s)", [advisory_key(name)])
                box.append(bool(cursor.fetchone()[0]))
                cursor.execute("SELECT pg_advisory_unlock_all()")
        finally:
            connections[alias].close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(wait)
    return bool(box and box[0])


@contextmanager
def interrupted_while_waiting(name: str, handler: Callable[[], None]) -> Iterator[None]:
    """Run ``handler`` as a signal handler of this (the main) thread once a session waits for
    the lock on ``name``, as Ctrl-C or Celery's soft time limit would: whatever it raises is
    raised where the main thread is blocked, inside the driver's wait for the lock."""

    def on_signal(signum: int, frame: object) -> None:
        handler()

    def signal_once_waiting() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not holders(watcher, name, granted=False):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, on_signal)
    with other_session() as watcher:  # the test's own session may be busy in the handler
        thread = threading.Thread(target=signal_once_waiting)
        thread.start()
        try:
            yield
        finally:
            thread.join(15)
            signal.signal(signal.SIGUSR1, previous)
