"""System checks: misconfiguration is reported by ``manage.py check``, not at first use."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, register
from django.db import DEFAULT_DB_ALIAS, connections
from django.utils.connection import ConnectionDoesNotExist

from . import conf


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.E001: the LEASES setting is invalid."""
    return [
        Error(message, hint="See the settings section of the guide.", id="leases.E001")
        for message in conf.problems()
    ]


@register(Tags.compatibility, Tags.database)
def check_advisory_database(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.E002: advisory locks or the database backend point at a non-PostgreSQL database.

    Checked: the ``default`` alias (what ``leases.advisory`` uses unless told otherwise) and
    every alias a ``leases.backends.database`` backend names. Projects that never use either on
    a non-PostgreSQL default database silence it with ``SILENCED_SYSTEM_CHECKS``.
    """
    if conf.problems():
        return []
    aliases = {DEFAULT_DB_ALIAS} | {
        str(backend.options.get("DATABASE", DEFAULT_DB_ALIAS))
        for backend in conf.get().backends.values()
        if backend.engine == "leases.backends.database"
    }
    errors: list[CheckMessage] = []
    for alias in sorted(aliases):
        try:
            vendor = connections[alias].vendor
        except ConnectionDoesNotExist:
            vendor = "missing"
        if vendor != "postgresql":
            errors.append(
                Error(
                    f"database {alias!r} is {vendor}, but advisory locks and the database "
                    "lease backend need PostgreSQL",
                    hint="Point it at PostgreSQL (psycopg 3), or silence leases.E002 if you "
                    "use neither advisory locks nor the database backend on it.",
                    id="leases.E002",
                )
            )
    return errors
