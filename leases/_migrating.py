"""Refuse ``manage.py migrate`` onto a non-PostgreSQL database before it migrates anything.

The ``leases`` and ``idempotency`` migrations use PostgreSQL-only operations (indexes built
``CONCURRENTLY``, SQL of PostgreSQL's dialect). On another database the run would create the
first tables and then die half-way, leaving a database neither migrated nor clean. ``leases.E002``
says so under ``manage.py check``, but a project may silence it (wrongly, or for a router that
does not do what it thinks), so the refusal is also made where it cannot be skipped: Django's
``pre_migrate`` signal, sent with the whole plan before the first migration runs.
"""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.apps import apps as django_apps
from django.db import connections, router
from django.db.migrations import Migration

from .errors import DatabaseNotSupported


def refuse_unsupported_database(
    sender: AppConfig,
    using: str,
    plan: list[tuple[Migration, bool]] | None = None,
    **kwargs: Any,
) -> None:
    """``pre_migrate`` receiver of the ``leases`` and ``idempotency`` apps: raise
    :class:`DatabaseNotSupported` if ``plan`` would apply one of ``sender``'s migrations to
    ``using`` and ``using`` is not PostgreSQL.

    Django sends ``pre_migrate`` to every app before the first migration of the run, so nothing
    of any app is created when this refuses. Only forward migrations the routers let onto
    ``using`` count: a router that keeps these apps on another database lets the rest of the
    project migrate here, and unapplying (``migrate leases zero``, to clean up after an older
    release that stopped half-way) is left alone.
    """
    vendor = connections[using].vendor
    if vendor == "postgresql" or not plan:
        return
    if any(
        migration.app_label == sender.label and not backwards for migration, backwards in plan
    ) and _lands_on(using, sender.label):
        raise DatabaseNotSupported(using, vendor, sender.label)


def _lands_on(using: str, app_label: str) -> bool:
    """Whether the routers let any of ``app_label``'s models (the tables its migrations
    create) be migrated onto ``using``."""
    models = django_apps.get_app_config(app_label).get_models()
    return any(router.allow_migrate_model(using, model) for model in models)
