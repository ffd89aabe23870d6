"""How the rows the database backend reads straight from libpq are loaded: as from a cursor,
without Django's ``timestamptz`` loader where psycopg's own gives the same datetimes.

Rows of the hot statements (:mod:`._pgprepared`, :mod:`._tenure`) are loaded with a
:class:`~psycopg.adapt.Transformer` of the connection's adapters, so they come back exactly as
from a Django cursor. Django's adapters differ from psycopg's in one loader on this path:
``timestamptz``, which Django replaces with a Python subclass of psycopg's that parses each
value in Python and then sets the connection's time zone on it. Every grant returns its expiry,
so every acquire paid that parse: 3.9 µs for a grant's row against 0.9 µs with psycopg's C
loader, warm, and several times more on the hand-off's path, where the waiter reads the row
with its caches cold after its wait: with eight processes contending, the waiter's client CPU
from the grant's reply to ``acquire()`` returning went from 93-98 µs to 77-79 µs (the reply's
reading alone from 47-50 µs to 29 µs), and that time is on the path of every hand-off.

The two give the same value exactly when the session's ``TimeZone`` is UTC and Django's loader
sets UTC (``USE_TZ``, the default, and no per-database ``TIME_ZONE``): psycopg's loader returns
an aware datetime in the session's zone, ``datetime.timezone.utc`` itself for UTC, and Django's
replaces that zone with the same object. Only then, and only when the connection's loader is
Django's own (not one a project registered), are rows loaded through a copy of the
connection's adapters with psycopg's loader back in place; otherwise through the connection.
The copy is made once per connection, from the adapters it was opened with (Django registers
its loader when it connects, or in the adapters it connects with); the session's ``TimeZone``,
which libpq keeps current, is checked on every call.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import psycopg
from psycopg import abc, adapt, pq
from psycopg.adapt import Transformer

__all__ = ["transformer"]

_TIMESTAMPTZ = psycopg.adapters.types["timestamptz"].oid
#: psycopg's own loader (in C, with psycopg's binary or C implementation).
_PSYCOPG_LOADER = psycopg.adapters.get_loader(_TIMESTAMPTZ, pq.Format.TEXT)
#: The attribute a connection keeps its loading adapters in (``None``: load through it).
_ATTR = "_leases_loading_adapters"
_UNKNOWN = object()


class _Loading:
    """An adaptation context: the connection, with adapters of our own."""

    __slots__ = ("adapters", "connection")

    def __init__(self, adapters: adapt.AdaptersMap, connection: Any) -> None:
        self.adapters = adapters
        self.connection = connection


def _djangos_utc_loader(loader: object) -> bool:
    """Whether ``loader`` is Django's ``timestamptz`` loader, setting UTC."""
    try:
        from django.db.backends.postgresql.psycopg_any import BaseTzLoader
    except ImportError:  # not psycopg 3 under Django: nothing to replace
        return False
    return (
        isinstance(loader, type)
        and issubclass(loader, BaseTzLoader)
        and getattr(loader, "load", None) is BaseTzLoader.load
        and getattr(loader, "timezone", None) is datetime.UTC
    )


def _adapters(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> Any:
    """The connection's loading adapters (``None``: its own), made on first use."""
    found = getattr(conn, _ATTR, _UNKNOWN)
    if found is not _UNKNOWN:
        return found
    loader = conn.adapters.get_loader(_TIMESTAMPTZ, pq.Format.TEXT)
    adapters: adapt.AdaptersMap | None = None
    if _djangos_utc_loader(loader) and _PSYCOPG_LOADER is not None:
        adapters = adapt.AdaptersMap(conn.adapters)
        adapters.register_loader(_TIMESTAMPTZ, _PSYCOPG_LOADER)
    with contextlib.suppress(AttributeError):  # a connection class that takes no attribute
        setattr(conn, _ATTR, adapters)
    return adapters


def transformer(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> abc.Transformer:
    """A Transformer to dump a statement's values and load its rows on ``conn``."""
    context: abc.AdaptContext = conn
    if conn.pgconn.parameter_status(b"TimeZone") == b"UTC":
        adapters = _adapters(conn)
        if adapters is not None:
            context = _Loading(adapters, conn)
    return Transformer(context)
