"""Idempotency keys: run an effect once however often a client retries it.

``import idempotency`` must not touch Django's app registry (it may run while ``INSTALLED_APPS``
load), so everything that needs models, views or Celery is re-exported lazily through a module
``__getattr__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from leases._lazy import lazy_exports

from .errors import (
    IdempotencyClientUnidentified,
    IdempotencyError,
    IdempotencyImproperlyConfigured,
    IdempotencyKeyInProgress,
    IdempotencyKeyInvalid,
    IdempotencyKeyLost,
    IdempotencyKeyMismatch,
    IdempotencyKeyMissing,
    IdempotencyKeyMultiple,
    IdempotencyResultNotRecorded,
    ResponseNotStorable,
)

if TYPE_CHECKING:
    from .celery import idempotent_task
    from .operations import idempotency_key
    from .steps import astep, step
    from .views import IdempotentMixin, idempotent

__all__ = [
    "IdempotencyClientUnidentified",
    "IdempotencyError",
    "IdempotencyImproperlyConfigured",
    "IdempotencyKeyInProgress",
    "IdempotencyKeyInvalid",
    "IdempotencyKeyLost",
    "IdempotencyKeyMismatch",
    "IdempotencyKeyMissing",
    "IdempotencyKeyMultiple",
    "IdempotencyResultNotRecorded",
    "IdempotentMixin",
    "ResponseNotStorable",
    "astep",
    "idempotency_key",
    "idempotent",
    "idempotent_task",
    "step",
]

_LAZY = {
    "idempotent": "views",
    "IdempotentMixin": "views",
    "idempotency_key": "operations",
    "idempotent_task": "celery",
    "step": "steps",
    "astep": "steps",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
