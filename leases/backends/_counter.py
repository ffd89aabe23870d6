"""Durable counters in the Django database, for the numbers Redis cannot be trusted to keep.

Redis forgets (a restart without persistence, a failover to a lagging replica, eviction), so
the Redis backends take the numbers that must never go backwards from the database: the Redis
backend's *epochs* and Redlock's *tokens*. Each bump is one statement, committed on a connection
of its own, so a caller's ``transaction.atomic()`` rolling back can never un-issue a number
(a rolled-back bump would hand the same number out twice).

The async twins (:meth:`DurableCounter.abump_lease`, :meth:`DurableCounter.acurrent_lease`,
:meth:`DurableCounter.abump_fence`) run the same statements on one psycopg ``AsyncConnection``
per event loop (:class:`~._pgaio.AsyncPrivateConnection`: the same connection recipe, the same
prepared statement run by name, the same reply deadline), so an async Redlock grant awaits its
token, and an async Redis grant its epoch, on the loop instead of holding a worker thread for a
blocking statement.
"""

from __future__ import annotations

from typing import Any

import psycopg

from ..errors import BackendUnavailable, FencingUnavailable
from ._aio import PerLoop
from ._pgaio import AsyncPrivateConnection
from ._pgconn import PrivateConnection
from ._pgprepared import Prepared
from ._pruning import FLOOR_SQL

__all__ = ["DurableCounter"]

#: Next value of a named counter in ``leases_fence``, at least ``floor``. ``GREATEST`` keeps it
#: increasing even if the database was restored from a backup older than the Redis data. Named
#: parameters, so the sync and async connections send the very same text.
BUMP_FENCE_SQL = """
INSERT INTO leases_fence (resource, token) VALUES (%(resource)s, %(floor)s)
ON CONFLICT (resource) DO UPDATE SET token = GREATEST(leases_fence.token + 1, EXCLUDED.token)
RETURNING token
"""

#: The lowest lease token the server's current timeline may issue: ``(timeline - 1) << 32``,
#: read from the current WAL file's name (no privilege needed, no I/O). An asynchronous standby
#: that is promoted may never have received the old primary's last bumps (the lost tail), whose
#: tokens may already sit in resources elsewhere. Promotion starts a new, higher timeline, and
#: every token of the old one was below this floor (a name would need 2**32 grants on one
#: timeline to reach the next), so the new primary's tokens stay higher than every lost one.
#: Zero on timeline 1: tokens there count 1, 2, 3... as they always did.
TIMELINE_FLOOR_SQL = (
    "((('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::bigint - 1) << 32)"
)

#: Next token of a lease name, in the database backend's own row for the name, so a name's
#: tokens keep increasing even when it moves between the database and Redlock backends. Only the
#: counter moves: the row stays free (empty holder) for the database backend. A new row starts
#: above every pruned token (:data:`~._pruning.FLOOR_SQL`); no token is ever below the
#: timeline's floor (:data:`TIMELINE_FLOOR_SQL`).
BUMP_LEASE_SQL = f"""
INSERT INTO leases_lease (name, holder, token, meta)
VALUES (%(name)s, '', GREATEST({FLOOR_SQL}, {TIMELINE_FLOOR_SQL}), '{{}}')
ON CONFLICT (name) DO UPDATE SET token = GREATEST(leases_lease.token + 1, {TIMELINE_FLOOR_SQL})
RETURNING token
"""  # noqa: S608

#: Every Redlock grant runs :data:`BUMP_LEASE_SQL`: prepared, so the server parses and plans it
#: once per session and the client runs it by name (libpq ``Bind``/``Execute``, no cursor; see
#: :mod:`~._pgprepared`). As plain text it cost the server more to plan than to run.
PREPARED_BUMP_LEASE = Prepared("bump_lease", BUMP_LEASE_SQL)

#: Which database the counters are in: its cluster's system identifier (made by ``initdb``, kept
#: by physical standbys, so a failover keeps it) and the database's name. Any role may run it.
SOURCE_SQL = (
    "SELECT system_identifier::text || '/' || current_database() AS source FROM pg_control_system()"
)

#: Whether the counters' database answers, on the connection the bumps use: the health check
#: (a bump would write).
PING_SQL = "SELECT 1"

CURRENT_LEASE_SQL = "SELECT token FROM leases_lease WHERE name = %s"
#: :data:`CURRENT_LEASE_SQL` with a named parameter, as the async connection takes them.
ACURRENT_LEASE_SQL = "SELECT token FROM leases_lease WHERE name = %(name)s"
#: :data:`CURRENT_LEASE_SQL` of many names in one statement (operators' listings).
CURRENT_LEASES_SQL = "SELECT name, token FROM leases_lease WHERE name = ANY(%s::text[])"

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


class DurableCounter:
    """Counters on a private autocommit connection to database ``alias``, shared by threads.

    The connection is the package's one recipe (:func:`~leases.backends._pgconn.connect`):
    ``synchronous_commit`` on, because a bump lost in a crash could be handed out again, and
    TCP keepalives and timeouts, so a dead server cannot hang a grant forever. The async methods
    use one async connection per event loop, made on first use there and closed by
    :meth:`aclose`.
    """

    def __init__(self, backend: str, alias: str) -> None:
        self.backend = backend
        self.alias = alias
        self._connection = PrivateConnection(alias)
        self._aconnections: PerLoop[AsyncPrivateConnection] = PerLoop(
            lambda: AsyncPrivateConnection(alias), lambda conn: conn.close()
        )

    def _execute(
        self, sql: str | Prepared, params: tuple[object, ...] | dict[str, object]
    ) -> int | None:
        row = self._fetch(sql, params)
        return None if row is None else int(row[0])

    def _fetch(
        self, sql: str | Prepared, params: tuple[object, ...] | dict[str, object]
    ) -> tuple[Any, ...] | None:
        try:
            rows = self._connection.run(sql, params)
        except (psycopg.Error, BackendUnavailable) as exc:
            raise self._unavailable(exc) from exc
        return rows[0] if rows else None

    async def _aexecute(self, sql: str | Prepared, params: dict[str, object]) -> int | None:
        """:meth:`_execute` on the running loop's async connection."""
        row = await self._afetch(sql, params)
        return int(row[0]) if row is not None and row[0] is not None else None

    async def _afetch(
        self, sql: str | Prepared, params: dict[str, object]
    ) -> tuple[Any, ...] | None:
        """:meth:`_fetch` on the running loop's async connection."""
        try:
            rows = await self._aconnections.get().run(sql, params)
        except (psycopg.Error, BackendUnavailable) as exc:
            raise self._unavailable(exc) from exc
        return rows[0] if rows else None

    def _unavailable(self, exc: Exception) -> FencingUnavailable:
        return FencingUnavailable(
            self.backend,
            f"cannot take a durable counter from database {self.alias!r} ({exc}); "
            "without it a token could repeat one already handed out",
        )

    def bump_fence(self, resource: str, floor: int = 1) -> int:
        """The next value of counter ``resource``: higher than every earlier one, >= ``floor``."""
        value = self._execute(BUMP_FENCE_SQL, {"resource": resource, "floor": floor})
        assert value is not None
        return value

    async def abump_fence(self, resource: str, floor: int = 1) -> int:
        """:meth:`bump_fence`, awaited on the running loop's async connection: the same
        statement on the same row, so sync and async values of one counter never repeat."""
        value = await self._aexecute(BUMP_FENCE_SQL, {"resource": resource, "floor": floor})
        assert value is not None
        return value

    def bump_lease(self, name: str) -> int:
        """The next token of lease ``name``, shared with the database backend's counter."""
        value = self._execute(PREPARED_BUMP_LEASE, {"name": name})
        assert value is not None
        return value

    async def abump_lease(self, name: str) -> int:
        """:meth:`bump_lease`, awaited on the running loop's async connection: the same
        prepared statement, run by name, so the same row, floors and order of tokens."""
        value = await self._aexecute(PREPARED_BUMP_LEASE, {"name": name})
        assert value is not None
        return value

    def revoke_lease(self, name: str, token: int) -> tuple[int | None, int | None]:
        """``(new token, None)`` if ``name``'s token was ``token`` and moved on, else
        ``(None, current token)`` (``None`` if never granted) and nothing changed."""
        row = self._fetch(REVOKE_LEASE_SQL, (name, token, name))
        assert row is not None
        new, current = row
        return (None if new is None else int(new)), (None if current is None else int(current))

    def source(self) -> str:
        """Which database the counters come from (:data:`SOURCE_SQL`): numbers of one source
        only increase; two sources' numbers are unrelated."""
        row = self._fetch(SOURCE_SQL, {})
        assert row is not None
        return str(row[0])

    async def asource(self) -> str:
        """:meth:`source`, awaited on the running loop's async connection."""
        row = await self._afetch(SOURCE_SQL, {})
        assert row is not None
        return str(row[0])

    def ping(self) -> None:
        """Raise :class:`~leases.errors.FencingUnavailable` unless the database answers."""
        self._fetch(PING_SQL, ())

    def current_lease(self, name: str) -> int | None:
        """The last token handed out for ``name``, or ``None`` if none ever was."""
        return self._execute(CURRENT_LEASE_SQL, (name,))

    def current_leases(self, names: list[str]) -> dict[str, int]:
        """:meth:`current_lease` of each of ``names`` in one round trip (a name never granted
        is left out)."""
        try:
            rows = self._connection.run(CURRENT_LEASES_SQL, (names,))
        except (psycopg.Error, BackendUnavailable) as exc:
            raise self._unavailable(exc) from exc
        return {str(name): int(token) for name, token in rows}

    async def acurrent_lease(self, name: str) -> int | None:
        """:meth:`current_lease`, awaited."""
        return await self._aexecute(ACURRENT_LEASE_SQL, {"name": name})

    def close(self) -> None:
        self._connection.close()

    async def aclose(self) -> None:
        """Close the running loop's async connection, if it has one."""
        await self._aconnections.aclose()
