"""Idempotency keys: run an effect once however often a client retries it.

``import idempotency`` must not touch Django's app registry (it may run while ``INSTALLED_APPS``
load), so everything that needs models, views or Celery is re-exported lazily through a module
``__getattr__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    IdempotencyError,
    IdempotencyImproperlyConfigured,
    IdempotencyKeyInProgress,
    IdempotencyKeyInvalid,
    IdempotencyKeyLost,
    IdempotencyKeyMismatch,
    IdempotencyKeyMissing,
    IdempotencyKeyMultiple,
    ResponseNotStorable,
)

if TYPE_CHECKING:
    from .celery import idempotent_task
    from .operations import idempotency_key
    from .views import IdempotentMixin, idempotent

__all__ = [
    "IdempotencyError",
    "IdempotencyImproperlyConfigured",
    "IdempotencyKeyInProgress",
    "IdempotencyKeyInvalid",
    "IdempotencyKeyLost",
    "IdempotencyKeyMismatch",
    "IdempotencyKeyMissing",
    "IdempotencyKeyMultiple",
    "IdempotentMixin",
    "ResponseNotStorable",
    "idempotency_key",
    "idempotent",
    "idempotent_task",
]

_LAZY = {
    "idempotent": "views",
    "IdempotentMixin": "views",
    "idempotency_key": "operations",
    "idempotent_task": "celery",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'idempotency' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
