"""Settings for a child project whose ``AUTH_USER_MODEL`` has no ``username`` field (it logs in
by e-mail address), on a database of its own (tests/test_custom_user_model.py)."""

from __future__ import annotations

import os

from devservers import database_settings

SECRET_KEY = "tests-only-not-secret"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "tests.email_users",
    "leases",
    "idempotency",
]
AUTH_USER_MODEL = "email_users.EmailUser"
DATABASES = {"default": database_settings(os.environ["EMAIL_USERS_DATABASE_URL"])}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
LEASES = {"BACKENDS": {"default": {"ENGINE": "leases.backends.database"}}}
