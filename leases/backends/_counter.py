"""Durable counters in the Django database, for the numbers Redis cannot be trusted to keep.

Redis forgets (a restart without persistence, a failover to a lagging replica, eviction), so
the Redis backends take the numbers that must never go backwards from the database: the Redis
backend's *epochs* and Redlock's *tokens*. Each bump is one statement, committed on a connection
of its own, so a caller's ``transaction.atomic()`` rolling back can never un-issue a number
(a rolled-back bump would hand the same number out twice).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

import psycopg
from django.db.backends.signals import connection_created

from ..errors import BackendUnavailable, FencingUnavailable
from .database import _connect  # one recipe for the package's private connections

__all__ = ["DurableCounter"]

#: Next value of a named counter in ``leases_fence``, at least ``floor``. ``GREATEST`` keeps it
#: increasing even if the database was restored from a backup older than the Redis data.
BUMP_FENCE_SQL = """
INSERT INTO leases_fence (resource, token) VALUES (%s, %s)
ON CONFLICT (resource) DO UPDATE SET token = GREATEST(leases_fence.token + 1, EXCLUDED.token)
RETURNING token
"""

#: Next token of a lease name, in the database backend's own row for the name, so a name's
#: tokens keep increasing even when it moves between the database and Redlock backends. Only the
#: counter moves: the row stays free (empty holder) for the database backend.
BUMP_LEASE_SQL = """
INSERT INTO leases_lease (name, holder, token, meta) VALUES (%s, '', 1, '{}')
ON CONFLICT (name) DO UPDATE SET token = leases_lease.token + 1
RETURNING token
"""

CURRENT_LEASE_SQL = "SELECT token FROM leases_lease WHERE name = %s"

#: Compare-and-bump for a revocation: the token moves on only if it is still the one the
#: operator saw. Returns the new token, or NULL and the current one (NULL if never granted).
REVOKE_LEASE_SQL = """
WITH revoked AS (
    UPDATE leases_lease SET token = token + 1 WHERE name = %s AND token = %s RETURNING token
)
SELECT token, NULL FROM revoked
UNION ALL
SELECT NULL, (SELECT token FROM leases_lease WHERE name = %s)
WHERE NOT EXISTS (SELECT 1 FROM revoked)
"""

_counters: weakref.WeakSet[DurableCounter] = weakref.WeakSet()
#: Connections inherited over fork, kept referenced and never closed: closing (or collecting)
#: one would send a Terminate message on the parent's socket and end the parent's session.
_inherited: list[object] = []


class DurableCounter:
    """Counters on a private autocommit connection to database ``alias``, shared by threads."""

    def __init__(self, backend: str, alias: str) -> None:
        self.backend = backend
        self.alias = alias
        self._lock = threading.Lock()
        self._connection: Any = None
        _counters.add(self)

    def _execute(self, sql: str, params: tuple[object, ...]) -> int | None:
        row = self._fetch(sql, params)
        return None if row is None else int(row[0])

    def _fetch(self, sql: str, params: tuple[object, ...]) -> tuple[Any, ...] | None:
        with self._lock:
            try:
                if self._connection is None:
                    # The database backend's connection recipe: autocommit, synchronous_commit
                    # on (a bump lost in a crash could be handed out again), TCP keepalives and
                    # timeouts so a dead server cannot hang a grant forever.
                    self._connection = _connect(self.alias)
                row: tuple[Any, ...] | None = self._connection.execute(sql, params).fetchone()
            except (psycopg.Error, BackendUnavailable) as exc:
                self._close_locked()
                raise FencingUnavailable(
                    self.backend,
                    f"cannot take a durable counter from database {self.alias!r} ({exc}); "
                    "without it a token could repeat one already handed out",
                ) from exc
        return row

    def bump_fence(self, resource: str, floor: int = 1) -> int:
        """The next value of counter ``resource``: higher than every earlier one, >= ``floor``."""
        value = self._execute(BUMP_FENCE_SQL, (resource, floor))
        assert value is not None
        return value

    def bump_lease(self, name: str) -> int:
        """The next token of lease ``name``, shared with the database backend's counter."""
        value = self._execute(BUMP_LEASE_SQL, (name,))
        assert value is not None
        return value

    def revoke_lease(self, name: str, token: int) -> tuple[int | None, int | None]:
        """``(new token, None)`` if ``name``'s token was ``token`` and moved on, else
        ``(None, current token)`` (``None`` if never granted) and nothing changed."""
        row = self._fetch(REVOKE_LEASE_SQL, (name, token, name))
        assert row is not None
        new, current = row
        return (None if new is None else int(new)), (None if current is None else int(current))

    def current_lease(self, name: str) -> int | None:
        """The last token handed out for ``name``, or ``None`` if none ever was."""
        return self._execute(CURRENT_LEASE_SQL, (name,))

    def _close_locked(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(psycopg.Error):
                self._connection.close()
            self._connection = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()


def _forget_after_fork() -> None:
    for counter in list(_counters):
        counter._lock = threading.Lock()
        if counter._connection is not None:
            _inherited.append(counter._connection)
            counter._connection = None


os.register_at_fork(after_in_child=_forget_after_fork)


def _close_before_database_ddl(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Close counters when Django opens a no-database connection (to create or drop a
    database, as test runs do): an open counter connection would make ``DROP DATABASE`` fail."""
    if getattr(connection, "alias", None) == "__no_db__":
        for counter in list(_counters):
            counter.close()


connection_created.connect(_close_before_database_ddl, dispatch_uid="leases.backends._counter")
