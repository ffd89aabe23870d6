"""System checks: misconfiguration is reported by ``manage.py check``, not at first use."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, register

from . import conf


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.E001: the LEASES setting is invalid."""
    return [
        Error(message, hint="See the settings section of the guide.", id="leases.E001")
        for message in conf.problems()
    ]
