"""System checks: misconfiguration is reported by ``manage.py check``, not at first use."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DEFAULT_DB_ALIAS, connections
from django.utils.connection import ConnectionDoesNotExist

from . import conf
from .errors import LeaseError


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


@register(Tags.database, deploy=True)
def check_backend_stores(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.E003 / leases.W003: a lease store is unreachable, or can lose leases.

    Only with ``manage.py check --deploy``: it talks to every configured store (a Redis whose
    ``maxmemory-policy`` may evict lease keys, a Redlock with too few nodes), which must never
    happen at import or on every ``manage.py`` command.
    """
    if conf.problems():
        return []
    from .backends import get_backend

    found: list[CheckMessage] = []
    for alias in sorted(conf.get().backends):
        try:
            problems = get_backend(alias).deploy_checks()
        except LeaseError as exc:
            found.append(Error(f"lease backend {alias!r}: {exc}", id="leases.E003"))
            continue
        found += [Warning(f"lease backend {alias!r}: {p}", id="leases.W003") for p in problems]
    return found


@register(Tags.compatibility)
def check_default_ttl(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """leases.W001: ``DEFAULT_TTL`` leaves no time to retry a renewal before the lease ends."""
    if conf.problems():
        return []
    settings = conf.get()
    window = settings.retry_window(settings.default_ttl)
    if window >= conf.MIN_RETRY_WINDOW:
        return []
    return [
        Warning(
            f'LEASES["DEFAULT_TTL"] = {settings.default_ttl:g}s leaves {window:.3f}s to retry a '
            "failed renewal before the lease's validity ends",
            hint="Raise DEFAULT_TTL or lower RENEW_FRACTION; see 'Sizing the TTL' in the guide.",
            id="leases.W001",
        )
    ]
