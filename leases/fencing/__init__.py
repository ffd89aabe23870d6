"""Fencing: the protected resource refuses writes that carry a stale token.

A lease can be lost while its holder is paused, so the holder's belief that it holds the lease
proves nothing when its write arrives. Safety lives here instead: every write carries the lease's
token, and the resource accepts it only if no greater token has been accepted before, in the
same statement that makes the change (a separate check would be a race of its own).

- :class:`FencedModel` rows remember the highest token in ``fencing_token``;
  ``obj.save(fence=lease)`` is one conditional ``UPDATE`` (``... AND fencing_token <= token``).
- ``Model.objects.fenced(lease)`` gives querysets whose ``update()``/``bulk_update()`` are
  fenced the same way, all or nothing.
- :func:`check_fence` guards resources that are not rows (files, external APIs) through the
  ``leases_fence`` table.
- A write fenced with a *lease* (not a bare int) is also refused once an operator revoked that
  grant (:mod:`leases.revocation`), in the same statement.
- Lease-checked writes (:mod:`.checked`): ``obj.save(lease=held)``,
  ``qs.under_lease(held).update()`` and ``.delete()`` check in the writing statement that the
  lease row is still this grant and unexpired by the database clock, when the lease rows live
  in that database.

Equal tokens are accepted (one holder writes many times), lower ones never. A rejection raises
:class:`~leases.errors.StaleFencingToken`, sends ``fence_rejected`` (``sender`` is the model
class, :class:`~leases.models.Fence` for ``check_fence``) and logs a warning.

One module per idea: :mod:`.tokens` (what a write carries), :mod:`.model`, :mod:`.queryset` and
:mod:`.table` (the three ways to write through a fence).
"""

from __future__ import annotations

from .checked import LEASE_HELD_SQL, LeaseCheck, lease_check
from .model import UPSERT_FENCE_SQL, FencedModel
from .queryset import FencedManager, FencedQuerySet
from .table import FENCE_SQL, FENCE_STORED_SQL, check_fence
from .tokens import FENCE_TOKEN_FIELD, FenceHolder, FenceLike, fence_offer, fence_token

__all__ = [
    "FENCE_SQL",
    "FENCE_STORED_SQL",
    "FENCE_TOKEN_FIELD",
    "LEASE_HELD_SQL",
    "UPSERT_FENCE_SQL",
    "FenceHolder",
    "FenceLike",
    "FencedManager",
    "FencedModel",
    "FencedQuerySet",
    "LeaseCheck",
    "check_fence",
    "fence_offer",
    "fence_token",
    "lease_check",
]
