"""Settings for a child ``manage.py migrate`` onto a SQLite file with ``leases.E002``
silenced (tests/test_migrations.py): the run must be refused before it creates anything.

``ROUTE_ELSEWHERE`` set: the ``leases`` and ``idempotency`` apps are routed to a second SQLite
file, so migrating ``default`` must go ahead.
"""

from __future__ import annotations

import os
from typing import Any

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
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["SQLITE_PATH"]},
    "coordination": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["SQLITE_PATH"] + ".coordination",
    },
}
SILENCED_SYSTEM_CHECKS = ["leases.E002"]
if os.environ.get("ROUTE_ELSEWHERE"):
    DATABASE_ROUTERS = ["tests.sqlite_settings.CoordinationRouter"]


class CoordinationRouter:
    """``leases`` and ``idempotency`` live in ``coordination``; everything else in ``default``."""

    apps = frozenset({"leases", "idempotency"})

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return (db == "coordination") == (app_label in self.apps)
