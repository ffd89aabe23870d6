"""``check_fence``: fencing for resources that are not rows (a file, an external API).

The ``leases_fence`` table remembers the highest token each named resource has accepted; one
statement advances it or refuses, and consults revocations in the same statement.
"""

from __future__ import annotations

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections

from .. import revocation
from ..databases import note_if_unmigrated
from ..keys import validate_name
from ..revocation import NOT_REVOKED_SQL
from .tokens import FenceLike, fence_offer, reject, revoked

__all__ = ["FENCE_SQL", "FENCE_STORED_SQL", "check_fence"]

#: check_fence's one statement: insert the first token or advance to a token not lower than the
#: stored one; no row comes back when the stored token is greater (the write is stale) or the
#: lease behind it was revoked (parameters: resource, token, then backend, name, token of the
#: revocation check; a bare-int fence passes NULLs, which match no revocation).
FENCE_SQL = (
    "INSERT INTO leases_fence (resource, token) SELECT %s::varchar, %s::bigint "
    f"WHERE {NOT_REVOKED_SQL} "
    "ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token "
    "WHERE leases_fence.token <= EXCLUDED.token "
    "RETURNING token"
)
#: Read only after a rejection, to tell the caller which token beat it.
FENCE_STORED_SQL = "SELECT token FROM leases_fence WHERE resource = %s"


def check_fence(resource: str, fence: FenceLike, *, using: str = DEFAULT_DB_ALIAS) -> int:
    """Advance ``resource``'s fence to the token, or raise ``StaleFencingToken``; one statement.

    Runs on the caller's connection and inside the caller's transaction, on purpose: when the
    guarded effect is in the same database, wrap both in ``transaction.atomic()`` and the fence
    advances if and only if the effect commits, while the fence row stays locked so a
    concurrent stale writer waits and is then rejected. In autocommit the advance commits at
    once, which is what an external effect (a file, an API call) done right after needs.
    Returns the token accepted.
    """
    validate_name(resource)
    offer = fence_offer(fence)
    token = offer.token
    try:
        with connections[using].cursor() as cursor:
            cursor.execute(FENCE_SQL, [resource, token, *offer.params()])
            if cursor.fetchone() is not None:
                return token
            cursor.execute(FENCE_STORED_SQL, [resource])
            row = cursor.fetchone()
    except DatabaseError as exc:
        note_if_unmigrated(exc, using)
        raise
    from ..models import Fence as FenceRow

    stored = None if row is None else int(row[0])
    if stored is None or stored <= token:
        through = revocation.revoked_through(offer, using)
        if through is not None:
            raise revoked(FenceRow, resource, offer, through)
    raise reject(FenceRow, resource, token, stored)
