"""Revocation: an operator's force release fences the evicted grant at once, on every backend.

Advancing the token in the lease store is not enough on its own: a fenced row only compares the
offered token with the highest one *it* has accepted, so the evicted holder's writes would pass
until a successor happened to write. So a force release also records ``(backend, name,
revoked-through token)`` in ``leases_revocation``, in every database where the ``leases`` app is
migrated (where fenced rows and ``leases_fence`` live), before it returns; and every write fenced
by a *lease* adds ``NOT EXISTS (revocation covering this grant)`` to the very statement that
writes. Whatever the backend (a Redis key, an etcd revision), the resource itself refuses.

A bare integer fence names no lease, so it cannot be matched with a revocation: ``fence=lease``
is the form that gets this protection.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from django.db import DatabaseError, connections, router
from django.db.backends.utils import CursorWrapper
from django.db.models import Exists, Q

from .databases import migrated_databases

__all__ = [
    "NOT_REVOKED_SQL",
    "REVOKE_SQL",
    "Offer",
    "checked_on",
    "not_revoked",
    "record",
    "revoked_grant",
    "revoked_through",
]

logger = logging.getLogger(__name__)

#: Record a revocation; a later one of the same name only ever raises the revoked-through token.
REVOKE_SQL = """
INSERT INTO leases_revocation (backend, name, token, at)
VALUES (%s, %s, %s, clock_timestamp())
ON CONFLICT (backend, name) DO UPDATE
SET token = GREATEST(leases_revocation.token, EXCLUDED.token), at = EXCLUDED.at
"""
#: The condition a fenced statement carries for a lease's grant; parameters: backend, name,
#: token. Backed by the unique index on ``(backend, name)``: one index probe per write.
NOT_REVOKED_SQL = (
    "NOT EXISTS (SELECT 1 FROM leases_revocation WHERE backend = %s AND name = %s AND token >= %s)"
)
#: ``read_only_sql_transaction``: the database is a hot standby (or read-only by default).
READ_ONLY_SQLSTATE = "25006"
#: Read only after a rejection, to say which revocation refused the write.
REVOKED_THROUGH_SQL = "SELECT token FROM leases_revocation WHERE backend = %s AND name = %s"
#: How long a refused holder waits to learn whether it was revoked (see :func:`revoked_grant`).
LOOKUP_TIMEOUT = 1.0


@dataclass(frozen=True)
class Offer:
    """The token a write carries and, when it came from a lease, which grant it belongs to.

    Also a fence in its own right (``token`` + ``ensure_held``), so a fenced queryset can hand
    the checked offer on to the per-batch updates of ``bulk_update`` without checking the lease
    again or forgetting which grant the token came from.
    """

    token: int
    backend: str | None = None
    name: str | None = None

    @property
    def revocable(self) -> bool:
        return self.backend is not None and self.name is not None

    def ensure_held(self) -> None:
        """Nothing to check: the lease was checked when the offer was made."""

    def params(self) -> list[str | int | None]:
        return [self.backend, self.name, self.token]


def _migrated_on(alias: str) -> bool:
    from .models import Revocation

    vendor = connections[alias].vendor
    return vendor == "postgresql" and router.allow_migrate_model(alias, Revocation)


def checked_on(using: str) -> bool:
    """Whether database ``using`` has the revocation table (the ``leases`` app is migrated there).

    A project that keeps fenced rows in a database without it gets token fencing only there.
    """
    return _migrated_on(using)


def record(backend: str, name: str, token: int) -> list[str]:
    """Revoke every grant of ``name`` on ``backend`` up to ``token``; returns the databases.

    Written on a private connection per database, in autocommit, so the revocation is durable
    when this returns whatever transaction the caller is in (an ``ATOMIC_REQUESTS`` admin
    view, a test): a fenced write that starts afterwards is refused, and a caller's rollback
    cannot undo it. Aliases naming the same database (a test mirror, a second alias for one
    server) are written once; a read-only database (a hot standby replica) refuses the insert
    and is skipped: it takes no fenced writes, and its primary's row replicates to it.
    """
    from .models import Revocation

    return [
        alias for alias in migrated_databases(Revocation) if _write(alias, [backend, name, token])
    ]


def _write(alias: str, params: list[str | int]) -> bool:
    private = connections.create_connection(alias)
    try:
        with private.cursor() as cursor:
            cursor.execute(REVOKE_SQL, params)
    except DatabaseError as exc:
        if getattr(getattr(exc, "__cause__", None), "sqlstate", None) == READ_ONLY_SQLSTATE:
            return False
        raise
    finally:
        private.close()
    return True


def not_revoked(offer: Offer) -> Q:
    """The ORM form of :data:`NOT_REVOKED_SQL`, for querysets' ``filter()``."""
    from .models import Revocation

    revoked = Revocation.objects.filter(
        backend=offer.backend, name=offer.name, token__gte=offer.token
    )
    return ~Q(Exists(revoked))


def revoked_through(offer: Offer, using: str) -> int | None:
    """The revoked-through token when a revocation covers ``offer``'s grant, else ``None``."""
    backend, name = offer.backend, offer.name
    if backend is None or name is None or not checked_on(using):  # not revocable
        return None
    with connections[using].cursor() as cursor:
        return _covering(cursor, backend, name, offer.token)


def _covering(cursor: CursorWrapper, backend: str, name: str, token: int) -> int | None:
    """The revoked-through token when the revocation of ``name`` on ``backend`` covers grant
    ``token`` (it revoked that token or a later one), else ``None``: the one read behind both
    :func:`revoked_through` (on the caller's connection, after a refused write) and
    :func:`revoked_grant` (on a private one, after a refused renewal or release)."""
    cursor.execute(REVOKED_THROUGH_SQL, [backend, name])
    row = cursor.fetchone()
    if row is None or int(row[0]) < token:
        return None
    return int(row[0])


def revoked_grant(backend: str, name: str, token: int) -> int | None:
    """The revoked-through token when an operator's force release covers grant ``token`` of
    ``name`` on ``backend``; ``None`` when none does, or when it cannot be told in
    :data:`LOOKUP_TIMEOUT` (no database has the table, or it does not answer).

    Asked only after the store refused a holder's renewal or release, so the loss it reports
    says "revoked" instead of "expired or taken over": an operator's act is an incident to
    explain, an expiry a tuning question. The read runs on a private connection in a thread of
    its own, bounded: a database that hangs must not hold back the loss's report (``on_lost``,
    ``lease_lost``) or the caller's :class:`~leases.errors.LeaseLost` for longer, nor leave a
    connection open. Never on the alias's shared renewer thread: keepalive words its refusals
    on a thread of their own (``Lease._report_refusal_aside``). It never raises: how a loss is
    worded must not change that it is reported.
    """
    from .models import Revocation

    found: list[int | None] = []

    def read() -> None:
        for alias in migrated_databases(Revocation):
            private = connections.create_connection(alias)
            try:
                with private.cursor() as cursor:
                    through = _covering(cursor, backend, name, token)
            finally:
                private.close()
            if through is not None:
                found.append(through)
                return
        found.append(None)

    def guarded() -> None:
        try:
            read()
        except Exception as exc:  # wording only: any failure leaves the plain reason
            logger.debug("leases: could not tell whether %r was revoked: %s", name, exc)

    reader = threading.Thread(target=guarded, name="leases-revocation-lookup", daemon=True)
    reader.start()
    reader.join(LOOKUP_TIMEOUT)
    return found[0] if found else None
