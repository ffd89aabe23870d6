"""Helpers shared by the advisory lock tests: another session, and who holds a lock."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import connection

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
