"""Lease-checked writes: the writing statement itself checks that the lease is still held.

A fence compares tokens, so it refuses a stale holder only once someone newer has written (or an
operator revoked the grant): between its lease expiring and a successor's first write, a paused
holder's write still lands. When the lease rows live in the same database as the rows written,
the statement can ask the lease table directly: ``... AND EXISTS (the lease row is this grant,
held, and unexpired by the database clock)``. The write then lands only while the grant is
current, so an expired holder is refused even when nobody else wants the name. It is stronger
than a fence, but only within one database: a lease in Redis, or in another database, cannot be
read by the statement (:class:`~leases.errors.LeaseCheckUnavailable`); fences work everywhere.

The check names the grant by name, holder and token (tokens are unique per name), never by its
secret: statements and their parameters reach query logs, and checking a lease is not proving
ownership of it (renew and release do that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL

from ..backends import Capability, get_backend
from ..databases import same_database
from ..errors import InvalidLeaseOption, LeaseCheckFailed, LeaseCheckUnavailable

__all__ = ["LEASE_HELD_SQL", "LeaseCheck", "lease_check"]

#: The condition a lease-checked statement carries; parameters: name, holder, token. The lease
#: row is this grant (a newer grant has a greater token; a release empties the holder; a force
#: release advances the token) and its expiry is still ahead on the database's clock.
LEASE_HELD_SQL = (
    "EXISTS (SELECT 1 FROM leases_lease WHERE name = %s AND holder = %s AND token = %s "
    "AND holder <> '' AND expires_at > clock_timestamp())"
)


@dataclass(frozen=True)
class LeaseCheck:
    """The grant a write is checked against, and where (a database that holds its row)."""

    name: str
    holder: str
    token: int

    def params(self) -> list[str | int]:
        return [self.name, self.holder, self.token]

    def condition(self) -> RawSQL:
        """:data:`LEASE_HELD_SQL` as an ORM filter (``qs.filter(check.condition())``)."""
        return RawSQL(LEASE_HELD_SQL, self.params(), output_field=BooleanField())  # noqa: S611

    def holds(self, using: str) -> bool:
        """The condition alone, read after a write that changed nothing: was it the lease?"""
        with connections[using].cursor() as cursor:
            cursor.execute(f"SELECT {LEASE_HELD_SQL}", self.params())
            row = cursor.fetchone()
        return bool(row and row[0])

    def refused(self, resource: str) -> LeaseCheckFailed:
        return LeaseCheckFailed(self.name, self.token, resource)


def lease_check(held: Any, using: str) -> LeaseCheck:
    """What a write to database ``using`` checks for ``held``, after ``held.ensure_held()``.

    Raises :class:`~leases.errors.LeaseCheckUnavailable` before any round trip when the lease's
    backend keeps no lease rows, or keeps them in another database.
    """
    backend, name = getattr(held, "backend", None), getattr(held, "name", None)
    holder, token = getattr(held, "holder", None), getattr(held, "token", None)
    if not (isinstance(backend, str) and isinstance(name, str) and isinstance(holder, str)):
        raise InvalidLeaseOption("lease", held, "must be a Lease (from acquire() or lease())")
    if not isinstance(token, int) or not hasattr(held, "ensure_held"):
        raise InvalidLeaseOption("lease", held, "must be a Lease (from acquire() or lease())")
    store = get_backend(backend)
    if getattr(held, "shared", False) is True:
        raise LeaseCheckUnavailable(
            backend, "a shared lease's row is its readers' group; fence the write instead"
        )
    if Capability.LEASE_ROWS not in store.capabilities:
        raise LeaseCheckUnavailable(
            backend, "its leases are not rows of a database table; fence the write instead"
        )
    homes = type(store).databases(store.options)
    if not any(same_database(home, using) for home in homes):
        raise LeaseCheckUnavailable(
            backend,
            f"its lease table is in database {', '.join(sorted(homes))!s}, not in {using!r} "
            "where the write goes; fence the write instead",
        )
    held.ensure_held()
    return LeaseCheck(name, holder, token)
