"""Settings for a child ``manage.py migrate``: the package's tables routed to a database of
their own that has no ``auth`` tables (tests/test_migrations.py)."""

from __future__ import annotations

import os
from typing import Any

from devservers import database_settings

SECRET_KEY = "tests-only-not-secret"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "leases",
    "idempotency",
]
DATABASES = {
    "default": database_settings(os.environ["DATABASE_URL"]),
    "coordination": database_settings(os.environ["COORDINATION_DATABASE_URL"]),
}
DATABASE_ROUTERS = ["tests.migrate_elsewhere_settings.CoordinationRouter"]
LEASES = {
    "BACKENDS": {"default": {"ENGINE": "leases.backends.database", "DATABASE": "coordination"}}
}
IDEMPOTENCY = {"DATABASE": "coordination"}


class CoordinationRouter:
    """``leases`` and ``idempotency`` live in ``coordination``; everything else in ``default``."""

    apps = frozenset({"leases", "idempotency"})

    def db_for_read(self, model: type[Any], **hints: Any) -> str:
        return "coordination" if model._meta.app_label in self.apps else "default"

    db_for_write = db_for_read

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool:
        return True

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return (db == "coordination") == (app_label in self.apps)
