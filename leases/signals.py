"""Signals sent by django-leases. Receivers must accept ``**kwargs``.

Every signal is sent after the fact it reports, from the thread that observed it (the keepalive
thread for renewals and losses), with ``send_robust``: a receiver that raises is logged, never
allowed to break the lease machinery. ``sender`` is the backend alias (a ``str``) except for
``fence_rejected``. The guide's "Operating" page has the same table.

- ``lease_acquired(sender, lease, elapsed, waited)``: ``lease`` (a :class:`~leases.lease.Lease`)
  was granted; ``elapsed`` is the seconds ``acquire()`` spent from its first try to the grant,
  ``waited`` the part of them spent waiting for a holder to let go (``0.0`` when the first try
  won). Both are ``None`` for a grant this process adopted rather than acquired (a Celery
  worker taking over its sender's singleton guard).
- ``lease_acquire_failed(sender, name, error, elapsed, waited)``: ``acquire()`` gave up on
  ``name``: ``error`` is the exception it raises (:class:`~leases.errors.LeaseUnavailable` at
  the deadline, :class:`~leases.errors.BackendUnavailable` for an unreachable store).
- ``lease_renewed(sender, lease)``: the grant was extended (keepalive or ``Lease.renew()``).
- ``lease_released(sender, lease)``: the holder gave the grant back.
- ``lease_renew_failed(sender, lease, error)``: a renewal did not reach a verdict (the store
  was unreachable or slow); the lease is still held until its validity runs out, and the
  keepalive retries. A refused renewal is a loss, reported by ``lease_lost`` instead.
- ``lease_lost(sender, lease, reason, cause)``: the holder learnt it no longer holds its grant
  (expired, renewal refused because it was taken over or force-released, store unreachable past
  the validity); ``reason`` is a short human-readable ``str``, ``cause`` one of a few fixed
  words (``LOSS_CAUSES``) to count by. Sent once per lease.
- ``fence_rejected(sender, resource, offered, stored)``: a fenced write carried a stale token
  and changed nothing; ``sender`` is the fenced model class (``leases.models.Fence`` for
  ``check_fence``), ``resource`` a ``str`` naming the row(s) or resource, ``offered`` the
  write's token (``int``), ``stored`` the greater token already accepted (``int`` or ``None``),
  ``reason`` ``"stale"`` (a greater token was accepted) or ``"revoked"`` (the lease was
  force-released), ``backend`` the alias of the lease that wrote (``None`` for a bare token).
- ``leader_elected(sender, leadership)``: this process won an election;
  ``leadership`` is the :class:`~leases.election.Leadership`.
- ``leader_lost(sender, leadership, reason)``: this process stopped leading; ``reason`` is
  ``"lost"`` (revoked, expired, store unreachable) or ``"resigned"``. Sent once.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

__all__ = [
    "LOSS_CAUSES",
    "fence_rejected",
    "leader_elected",
    "leader_lost",
    "lease_acquire_failed",
    "lease_acquired",
    "lease_lost",
    "lease_released",
    "lease_renew_failed",
    "lease_renewed",
    "send",
]

logger = logging.getLogger(__name__)

lease_acquired = Signal()
lease_acquire_failed = Signal()
lease_renewed = Signal()
lease_renew_failed = Signal()
lease_released = Signal()
lease_lost = Signal()
fence_rejected = Signal()
leader_elected = Signal()
leader_lost = Signal()

#: The values of ``lease_lost``'s ``cause``: few and fixed, so metrics can count by them.
LOSS_CAUSES = ("expired", "renewal_refused", "release_refused", "revoked", "other")


def send(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal`` with ``send_robust`` and log every receiver that raised.

    The one way the package sends its signals: a receiver's bug must never break a lease, a
    fence or an election, and must never vanish either (``send_robust`` alone returns the
    exception and leaves it to the caller to notice). Most processes connect no receivers, and
    signals are sent on every acquire and release, so an unused signal costs one check.
    """
    if not signal.receivers:
        return
    for receiver, result in signal.send_robust(sender=sender, **kwargs):
        if isinstance(result, Exception):
            logger.error(
                "a receiver of a django-leases signal raised: %r",
                result,
                exc_info=result,
                extra={"receiver": getattr(receiver, "__qualname__", repr(receiver))},
            )
