"""What a fenced write carries: a token, and the lease it came from; and how a refusal reads.

Shared by the three places that write through a fence (:mod:`.model`, :mod:`.queryset`,
:mod:`.table`), so they validate, check the lease and report a rejection the same way.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, TypeAlias, runtime_checkable

from django.db import models

from .. import signals
from ..errors import FencingTokenRevoked, InvalidFencingToken, StaleFencingToken
from ..revocation import Offer

__all__ = [
    "FENCE_TOKEN_FIELD",
    "FenceHolder",
    "FenceLike",
    "fence_offer",
    "fence_token",
    "has_fence_column",
    "reject",
    "revoked",
    "row_resource",
    "valid_fence",
    "valid_token",
]

logger = logging.getLogger(__name__)

FENCE_TOKEN_FIELD = "fencing_token"  # noqa: S105 (a column name, not a secret)
_INT64_MAX = 2**63 - 1


@runtime_checkable
class FenceHolder(Protocol):
    """Anything that carries a fencing token and knows whether it still holds it (a Lease)."""

    @property
    def token(self) -> int: ...

    def ensure_held(self) -> None: ...


#: What ``fence=`` accepts: a token, or a lease whose token is used after ``ensure_held()``.
FenceLike: TypeAlias = int | FenceHolder


def valid_token(token: object) -> int:
    if isinstance(token, bool) or not isinstance(token, int):
        raise InvalidFencingToken(token, f"must be an int, not {type(token).__name__}")
    if not 1 <= token <= _INT64_MAX:
        raise InvalidFencingToken(token, "must be between 1 and 2**63 - 1")
    return token


def valid_fence(fence: object) -> None:
    """Refuse what can never fence (``None``, a string, a float) when it is given, not later."""
    if isinstance(fence, int):
        valid_token(fence)
    elif not isinstance(fence, FenceHolder):
        raise InvalidFencingToken(
            fence, f"must be an int or a lease (token + ensure_held), not {type(fence).__name__}"
        )


def fence_offer(fence: FenceLike) -> Offer:
    """The token to write with, and the grant it came from, failing fast on a lost lease.

    A holder whose keepalive saw the loss (or whose validity ran out) raises ``LeaseLost`` here
    even when nobody newer has written yet: the database fence alone could not tell
    (DESIGN invariant 5). A lease also names its grant (backend alias and name), which lets the
    fenced statement refuse a grant an operator revoked; a bare int cannot.
    """
    if isinstance(fence, Offer):
        return fence
    valid_fence(fence)
    if isinstance(fence, int):
        return Offer(fence)
    fence.ensure_held()
    token = valid_token(fence.token)
    backend, name = getattr(fence, "backend", None), getattr(fence, "name", None)
    if isinstance(backend, str) and isinstance(name, str):
        return Offer(token, backend, name)
    return Offer(token)


def fence_token(fence: FenceLike) -> int:
    """The token to write with (see :func:`fence_offer`)."""
    return fence_offer(fence).token


def row_resource(row: models.Model) -> str:
    """How a refusal names one row: its model's label and primary key."""
    return f"{row._meta.label}(pk={row.pk!r})"


def revoked(sender: Any, resource: str, offer: Offer, through: int) -> FencingTokenRevoked:
    lease = f"{offer.name!r} on {offer.backend!r}"
    logger.warning(
        "fenced write to %s rejected: token %s of lease %s was revoked",
        resource,
        offer.token,
        lease,
        extra=_rejection(resource, offer.token, None, "revoked", offer.backend, offer.name),
    )
    signals.send(
        signals.fence_rejected,
        sender,
        resource=resource,
        offered=offer.token,
        stored=None,
        reason="revoked",
        backend=offer.backend,
    )
    return FencingTokenRevoked(resource, offer.token, lease, through)


def reject(sender: Any, resource: str, offered: int, stored: int | None) -> StaleFencingToken:
    logger.warning(
        "fenced write to %s rejected: offered token %s, stored %s",
        resource,
        offered,
        stored,
        extra=_rejection(resource, offered, stored, "stale", None, None),
    )
    signals.send(
        signals.fence_rejected,
        sender,
        resource=resource,
        offered=offered,
        stored=stored,
        reason="stale",
        backend=None,
    )
    return StaleFencingToken(resource, offered, stored)


def _rejection(
    resource: str,
    offered: int,
    stored: int | None,
    reason: str,
    backend: str | None,
    lease: str | None,
) -> dict[str, Any]:
    """A rejection's structured log fields, the same for stale and revoked tokens."""
    return {
        "event": "fence_rejected",
        "resource": resource,
        "offered": offered,
        "stored": stored,
        "reason": reason,
        "backend": backend,
        "lease": lease,
    }


def token_owner(model: type[models.Model]) -> type[models.Model] | None:
    """The concrete model whose table holds ``model``'s token: itself, or under multi-table
    inheritance the ancestor that has the column (``None``: not a fenced model)."""
    for field in model._meta.concrete_fields:
        if field.attname == FENCE_TOKEN_FIELD and field.model is not None:
            return field.model._meta.concrete_model
    return None


def has_fence_column(model: type[models.Model]) -> bool:
    """Whether ``model``'s own table holds the fence (not a multi-table parent's)."""
    return any(f.attname == FENCE_TOKEN_FIELD for f in model._meta.local_concrete_fields)
