"""Django settings for the test suite: real PostgreSQL and Redis, owned by the harness."""

from __future__ import annotations

import os
from typing import Any

from devservers import database_settings
from tests.clusters import UNAVAILABLE_ETCD, UNAVAILABLE_ZOOKEEPER
from tests.harness import bootstrap_servers, url_with_database

URLS = bootstrap_servers()

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "leases",
    "idempotency",
    "tests.testapp",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": database_settings(URLS["DATABASE_URL"]),
    # Two more names for the same test database, for router tests (tests/routers.py): a
    # read-only "replica" as a hot standby behaves, and a writable "other" alias.
    "replica": {
        **database_settings(URLS["DATABASE_URL"]),
        "OPTIONS": {"options": "-c default_transaction_read_only=on"},
        "TEST": {"MIRROR": "default"},
    },
    "other": {**database_settings(URLS["DATABASE_URL"]), "TEST": {"MIRROR": "default"}},
}

CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": URLS["REDIS_URL"],
        "OPTIONS": {
            "CLIENT_CLASS": "django_redis.client.DefaultClient",
            # room for as many connections as the backends' own clients (leases.W005)
            "CONNECTION_POOL_KWARGS": {"max_connections": 10_000},
        },
    }
}

# Celery (tests/celery_app.py, real workers): the session Redis, on databases of their own.
CELERY_BROKER_URL = url_with_database(URLS["REDIS_URL"], "3")
CELERY_RESULT_BACKEND = url_with_database(URLS["REDIS_URL"], "4")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

LEASES: dict[str, Any] = {
    "BACKENDS": {
        "default": {"ENGINE": "leases.backends.database"},
        "redis": {"ENGINE": "leases.backends.redis", "CACHE": "default"},
        "redlock": {
            "ENGINE": "leases.backends.redlock",
            "NODES": URLS["LEASES_REDLOCK_URLS"].split(","),
            # Generous for a loaded 2-core CI machine; a production LAN would use ~0.05.
            "NODE_TIMEOUT": 0.5,
        },
        "etcd": {
            "ENGINE": "leases.backends.etcd",
            # Started on first use (tests/clusters.py), which points this alias at it.
            "ENDPOINTS": os.environ.get("LEASES_ETCD_ENDPOINTS", UNAVAILABLE_ETCD).split(","),
            "REQUEST_TIMEOUT": 2.0,
        },
    },
    "DEFAULT_TTL": 30,
}
LEASES["BACKENDS"]["zookeeper"] = {
    "ENGINE": "leases.backends.zookeeper",
    # Started on first use (tests/clusters.py), which points this alias at it.
    "HOSTS": os.environ.get("LEASES_ZOOKEEPER_HOSTS", UNAVAILABLE_ZOOKEEPER),
    # Within the ensemble's bounds (tick 500 ms: 1 to 10 s); short, so fault tests are quick.
    "SESSION_TIMEOUT": 6,
}

STATIC_URL = "/static/"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"leases": {"handlers": ["console"], "level": "WARNING"}},
}
