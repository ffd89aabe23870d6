"""System checks: a broken ``IDEMPOTENCY`` setting is reported by ``manage.py check``."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, register

from . import conf


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """idempotency.E001: the IDEMPOTENCY setting is invalid."""
    return [
        Error(message, hint="See the idempotency section of the guide.", id="idempotency.E001")
        for message in conf.problems()
    ]
