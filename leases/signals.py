"""Signals sent by django-leases. Receivers get ``sender`` (the backend alias) and keywords.

Every signal is sent after the fact it reports, from the thread that observed it (the keepalive
thread for renewals and losses). A receiver that raises is logged, never allowed to break the
lease machinery (send with ``send_robust``).

- ``lease_acquired(lease)``: a grant was obtained.
- ``lease_renewed(lease)``: a grant was extended.
- ``lease_released(lease)``: a grant was given back.
- ``lease_lost(lease, reason)``: a holder learnt it no longer holds its grant (expired, taken
  over, revoked, store unreachable past the validity). ``reason`` is a short string.
- ``fence_rejected(resource, offered, stored)``: a fenced write carried a stale token.
- ``leader_elected(leadership)`` / ``leader_lost(leadership, reason)``: leader election.
"""

from __future__ import annotations

from django.dispatch import Signal

__all__ = [
    "fence_rejected",
    "leader_elected",
    "leader_lost",
    "lease_acquired",
    "lease_lost",
    "lease_released",
    "lease_renewed",
]

lease_acquired = Signal()
lease_renewed = Signal()
lease_released = Signal()
lease_lost = Signal()
fence_rejected = Signal()
leader_elected = Signal()
leader_lost = Signal()
