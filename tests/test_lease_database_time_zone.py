"""The database backend's own connections read times as Django's connections do, whatever time
zone the server gives a new session, and load them with psycopg's own loader only where it
gives the same values as Django's.

Django's ``timestamptz`` loader parses a value in the session's time zone and then sets the
connection's own zone on the result (UTC under ``USE_TZ``) without converting it: it relies on
each connection's session being in that zone, which Django sets when it connects. A server
whose ``timezone`` setting is not UTC (initdb copies the machine's) hands every new session its
own zone, so a connection that does not set it reads times shifted by that zone's offset.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection
from psycopg import abc, pq, sql
from psycopg.types.datetime import TimestamptzLoader

from leases.backends._pgconn import connect, connect_params
from leases.backends._pgloading import transformer
from leases.backends.database import Backend
from tests.lease_backends import lease_name
from tests.test_lease_database import own_connection

__all__ = ["lease_name"]

pytestmark = pytest.mark.django_db

#: 5 h 30 min east of UTC: an offset no rounding could hide.
ELSEWHERE = "Asia/Kolkata"


@contextmanager
def new_sessions_in(zone: str) -> Iterator[None]:
    """New sessions of the test database start in ``zone`` (set for the database, committed
    at once so new connections see it), reset afterwards."""
    name = sql.Identifier(connection.settings_dict["NAME"])
    admin = connect("default")
    try:
        alter = sql.SQL("ALTER DATABASE {} SET timezone = {}")
        admin.execute(alter.format(name, sql.Literal(zone)))
        try:
            yield
        finally:
            admin.execute(sql.SQL("ALTER DATABASE {} RESET timezone").format(name))
    finally:
        admin.close()


def stored_times(name: str) -> tuple[datetime.datetime, datetime.datetime]:
    """``name``'s ``acquired_at`` and ``expires_at`` as a Django connection reads them."""
    with own_connection() as conn:
        row = conn.execute(
            "SELECT acquired_at, expires_at FROM leases_lease WHERE name = %s", [name]
        ).fetchone()
    assert row is not None
    return row[0], row[1]


def test_a_new_session_starts_elsewhere_here() -> None:
    """The premise: the server really gives a new session the zone (else the tests below
    would pass on the old code too)."""
    params = connect_params("default").params
    with new_sessions_in(ELSEWHERE), psycopg.connect(**params) as conn:
        assert conn.info.parameter_status("TimeZone") == ELSEWHERE


def test_the_backends_connections_read_times_as_django_does(lease_name: str) -> None:
    with new_sessions_in(ELSEWHERE):
        backend = Backend("time-zone-test", {})
        try:
            grant = backend.try_acquire(lease_name, "time-zone-holder", 30)
            assert grant is not None
            info = backend.inspect(lease_name)
            assert info is not None
            acquired_at, expires_at = stored_times(lease_name)
            assert grant.expires_at == expires_at
            assert info.acquired_at == acquired_at and info.expires_at == expires_at
            assert grant.expires_at is not None
            now = datetime.datetime.now(datetime.UTC)
            assert now < grant.expires_at < now + datetime.timedelta(seconds=31)
            backend.release(grant)
        finally:
            backend.close()


def test_the_backends_async_connections_read_times_as_django_does(lease_name: str) -> None:
    async def main() -> None:
        backend = Backend("time-zone-async-test", {})
        try:
            grant = await backend.atry_acquire(lease_name, "time-zone-holder", 30)
            assert grant is not None
            _acquired_at, expires_at = await asyncio.to_thread(stored_times, lease_name)
            assert grant.expires_at == expires_at
            await backend.arelease(grant)
        finally:
            await backend.aclose()
            backend.close()

    with new_sessions_in(ELSEWHERE):
        asyncio.run(main())


#: Values the loaders must agree on: fractions of a second, another zone's offset, the largest
#: expiry the package shows, a whole second.
TIMES = (
    "2026-12-05 03:33:47.32579+00",
    "2026-01-01 12:00:00.000001-08",
    "9999-12-30 00:00:00+00",
    "2026-12-05 03:33:47+05:30",
)


def loaded(conn: psycopg.Connection[Any], tx: abc.Transformer, value: str) -> object:
    result = conn.pgconn.exec_(f"SELECT '{value}'::timestamptz".encode())
    tx.set_pgresult(result)
    return tx.load_rows(0, 1, tuple)[0][0]


TIMESTAMPTZ = psycopg.adapters.types["timestamptz"].oid


def timestamptz_loader(tx: abc.Transformer) -> type:
    return type(tx.get_loader(TIMESTAMPTZ, pq.Format.TEXT))


def test_rows_load_times_with_psycopgs_loader_where_it_gives_djangos_values() -> None:
    """A session in UTC under ``USE_TZ``: psycopg's own ``timestamptz`` loader, giving what a
    cursor of the connection (Django's loader) gives, to the microsecond and the zone."""
    conn = connect("default")
    try:
        tx = transformer(conn)
        assert timestamptz_loader(tx) is psycopg.adapters.get_loader(TIMESTAMPTZ, pq.Format.TEXT)
        for value in TIMES:
            (expected,) = conn.execute(f"SELECT '{value}'::timestamptz").fetchone() or (None,)
            found = loaded(conn, tx, value)
            assert found == expected
            assert isinstance(found, datetime.datetime) and found.tzinfo is datetime.UTC
    finally:
        conn.close()


def test_a_session_in_another_zone_loads_times_as_its_cursor_does() -> None:
    conn = connect("default")
    try:
        conn.execute("SELECT set_config('TimeZone', %s, false)", [ELSEWHERE])
        tx = transformer(conn)
        assert timestamptz_loader(tx) is conn.adapters.get_loader(TIMESTAMPTZ, pq.Format.TEXT)
        for value in TIMES:
            (expected,) = conn.execute(f"SELECT '{value}'::timestamptz").fetchone() or (None,)
            assert loaded(conn, tx, value) == expected
    finally:
        conn.close()


def test_a_projects_own_time_loader_is_kept() -> None:
    """A loader a project registered on the connection is what loads times, not psycopg's."""

    class Marked(TimestamptzLoader):
        def load(self, data: Any) -> Any:  # not a datetime: a mark of who loaded it
            return ("marked", bytes(data))

    conn = connect("default")
    try:
        conn.adapters.register_loader("timestamptz", Marked)
        tx = transformer(conn)
        assert timestamptz_loader(tx) is Marked
        assert loaded(conn, tx, TIMES[0]) == ("marked", TIMES[0].encode())
    finally:
        conn.close()
