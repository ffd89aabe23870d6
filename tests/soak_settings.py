"""Django settings for ``./scripts/soak`` (:mod:`tests.soak`): its own servers, nothing else.

The soak's controller starts every server and hands them to its workers in the environment:
``SOAK_HISTORY_URL`` (the unfaulted PostgreSQL holding the checker's register and log, the
Redis epochs and the Redlock tokens), ``SOAK_LOCKS_URL`` (the faulted PostgreSQL of the database
backend, through a fault proxy or not) and ``SOAK_BACKEND`` (the ``"soak"`` backend's options,
JSON). Unlike ``tests/settings.py`` it starts no server of its own.
"""

from __future__ import annotations

import json
import os

from devservers import database_settings

SECRET_KEY = "soak-only-not-secret"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "leases",
    "idempotency",
    "tests.testapp",
]

DATABASES = {"default": database_settings(os.environ["SOAK_HISTORY_URL"])}
if os.environ.get("SOAK_LOCKS_URL"):
    DATABASES["locks"] = database_settings(os.environ["SOAK_LOCKS_URL"])

LEASES = {
    "BACKENDS": {
        "default": {"ENGINE": "leases.backends.database"},
        "soak": json.loads(
            os.environ.get("SOAK_BACKEND") or '{"ENGINE": "leases.backends.database"}'
        ),
    },
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    # Renewal retries under the nemesis are expected; only errors are worth a line.
    "loggers": {
        "leases": {"handlers": ["console"], "level": "ERROR"},
        "kazoo": {"handlers": ["console"], "level": "ERROR", "propagate": False},
    },
}
