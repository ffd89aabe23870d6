"""Signals sent by the idempotency app. Receivers must accept ``**kwargs``.

Sent by :mod:`idempotency.store`, the one place every front end (``@idempotent`` views, DRF's
``IdempotentMixin``, ``idempotency_key()`` operations, ``idempotent_task``) claims and finishes
keys through, so a receiver (the metrics of :mod:`leases.metrics`) sees every duplicate however
it arrived. Sent with :func:`leases.signals.send`: a receiver that raises is logged and never
breaks the request. ``sender`` is the database alias the key lives in (a ``str``).

- ``replayed(sender, scope, key)``: a duplicate of a completed request got its stored outcome
  instead of running again (HTTP: the stored response with ``Idempotent-Replayed: true``).
- ``conflict(sender, scope, key, reason)``: a key could not be used: ``reason`` is
  ``"mismatch"`` (same key, different request: HTTP 422), ``"in_progress"`` (another attempt
  holds it: HTTP 409) or ``"lost"`` (this attempt's lock lapsed and another took the key over
  before it finished: HTTP 409, nothing stored). The guide's "Operating" page has the table.
"""

from __future__ import annotations

from django.dispatch import Signal

__all__ = ["CONFLICT_REASONS", "conflict", "replayed"]

replayed = Signal()
conflict = Signal()

#: The values of ``conflict``'s ``reason``.
CONFLICT_REASONS = ("mismatch", "in_progress", "lost")
