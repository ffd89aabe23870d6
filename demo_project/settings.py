"""Settings of the demo project: PostgreSQL from DATABASE_URL, Redis from REDIS_URL.

``scripts/demo`` sets both (starting throwaway servers when nothing is configured).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "demo-only-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "demo_project.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "leases",
    "idempotency",
    "demo_project.shop",
    "demo_project.payments",
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
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    )
}

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "OPTIONS": {
            "CLIENT_CLASS": "django_redis.client.DefaultClient",
            # room for one connection per waiting acquire, as the URL clients have (leases.W005)
            "CONNECTION_POOL_KWARGS": {"max_connections": 10_000},
        },
    }
}

# Celery (demo_project/celery.py): the same Redis, databases 1 (broker) and 2 (results).
CELERY_BROKER_URL = urlunsplit(urlsplit(REDIS_URL)._replace(path="/1"))
CELERY_RESULT_BACKEND = urlunsplit(urlsplit(REDIS_URL)._replace(path="/2"))
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ACKS_LATE = True  # redeliver what a dead worker was running; the decorators cope
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Every task but the partitioned sync_customer (which picks a queue per call) goes to the
# shop's queue, demo_project.shop.tasks.QUEUE: routed here, as Celery 5.7 deprecates queue=
# given to a task decorator.
CELERY_TASK_ROUTES = {
    f"demo_project.shop.tasks.{name}": {"queue": "demo-shop"}
    for name in ("finalise_invoice", "charge_invoice", "rebuild_report", "nightly_summary")
}
CELERY_BEAT_SCHEDULE = {  # run beat on several hosts: leader_only sends each tick once
    "nightly-summary": {"task": "demo_project.shop.tasks.nightly_summary", "schedule": 60.0},
}

# Redlock over three databases of the one demo Redis (3-5; Celery uses 1 and 2): the algorithm
# runs as in production, where NODES are three independent servers.
REDLOCK_NODES = [urlunsplit(urlsplit(REDIS_URL)._replace(path=f"/{db}")) for db in (3, 4, 5)]
LEASES = {
    "BACKENDS": {
        "default": {"ENGINE": "leases.backends.database"},
        "redis": {"ENGINE": "leases.backends.redis", "CACHE": "default"},
        "redlock": {"ENGINE": "leases.backends.redlock", "NODES": REDLOCK_NODES},
    },
    "DEFAULT_TTL": 30,
}

STATIC_URL = "/static/"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "leases": {"handlers": ["console"], "level": "INFO"},
        # The demo provokes 409s and 422s on purpose and narrates them itself.
        "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False},
    },
}
