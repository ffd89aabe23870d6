"""GET every admin page of ``leases`` and ``idempotency`` from an installed wheel; any non-200
fails. Run by ``check.py`` with the fresh virtualenv's Python, outside the checkout.

It needs no package of the repository: only the wheel, Django and psycopg. The database is
``WHEELCHECK_DATABASE_URL`` (a scratch database ``check.py`` creates and drops).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import unquote, urlsplit

URL = urlsplit(os.environ["WHEELCHECK_DATABASE_URL"])
SETTINGS = {
    "SECRET_KEY": "wheelcheck-only-not-secret",
    "DEBUG": False,
    "ALLOWED_HOSTS": ["testserver"],
    "USE_TZ": True,
    "ROOT_URLCONF": __name__,
    "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
    "INSTALLED_APPS": [
        "django.contrib.admin",
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "django.contrib.sessions",
        "django.contrib.messages",
        "leases",
        "idempotency",
    ],
    "MIDDLEWARE": [
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
    ],
    "TEMPLATES": [
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
    ],
    "DATABASES": {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": URL.path.lstrip("/"),
            "USER": unquote(URL.username or ""),
            "PASSWORD": unquote(URL.password or ""),
            "HOST": URL.hostname or "",
            "PORT": str(URL.port or ""),
        }
    },
}


def main() -> int:
    import django
    from django.conf import settings

    settings.configure(**SETTINGS)  # type: ignore[arg-type]
    django.setup()

    import leases

    if "site-packages" not in (leases.__file__ or ""):
        raise SystemExit(f"leases was imported from {leases.__file__}, not from the wheel")

    from django.contrib import admin
    from django.core.management import call_command
    from django.urls import path

    globals()["urlpatterns"] = [path("admin/", admin.site.urls)]
    print(f"   Django {django.get_version()}, Python {sys.version.split()[0]}", flush=True)
    call_command("migrate", verbosity=0)
    call_command("check", fail_level="ERROR")
    # The shipped migrations describe the models as this Django sees them (exits 1 if not).
    call_command("makemigrations", "leases", "idempotency", check=True, dry_run=True)
    with pages_with_rows() as urls:
        failures = [f"{status} {url}" for url, status in visit(urls)]
    if failures:
        print("admin pages that did not answer 200:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    return 0


def _routed(view: str, pk: object) -> bool:
    """Whether the admin routes ``view``: the proxy models' pages (every backend's leases,
    advisory locks) route their own views only, no per-object ones."""
    from django.urls import NoReverseMatch, reverse

    try:
        reverse(view, args=[pk])
    except NoReverseMatch:
        return False
    return True


@contextmanager
def pages_with_rows() -> Iterator[list[str]]:
    """Every admin page of both apps, with rows on them: a held lease and its force-release
    confirmation, an advisory lock and its session's termination page, an idempotency key, and
    the change page of the first row of each model."""
    from django.contrib import admin
    from django.db import connection
    from django.urls import reverse

    from idempotency import store
    from leases import acquire, advisory

    held = acquire("wheelcheck:held", ttl=300, timeout=0)
    store.begin("wheelcheck", "key-1", "fingerprint", ttl=60, lock_timeout=60)
    with advisory.session_lock("wheelcheck:advisory"), connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
        urls = [reverse("admin:index")]
        for app in ("leases", "idempotency"):
            urls.append(reverse("admin:app_list", args=[app]))
            for model in admin.site._registry:
                if model._meta.app_label != app:
                    continue
                info = f"admin:{app}_{model._meta.model_name}"
                urls.append(reverse(f"{info}_changelist"))
                first = model._default_manager.first() if model._meta.managed else None
                if first is not None and _routed(f"{info}_change", first.pk):
                    urls.append(reverse(f"{info}_change", args=[first.pk]))
        release = reverse("admin:leases_backendlease_release")
        urls.append(f"{release}?backend=default&name={held.name}&token={held.token}")
        urls.append(reverse("admin:leases_advisorylock_terminate", args=[pid]))
        yield urls
    held.release()


def visit(urls: list[str]) -> list[tuple[str, int]]:
    from django.contrib.auth import get_user_model
    from django.test import Client

    user = get_user_model().objects.create_superuser("wheelcheck", "", "wheelcheck")
    client = Client()
    client.force_login(user)
    answers = [(url, client.get(url).status_code) for url in urls]
    for url, status in answers:
        print(f"   {status} {url}")
    return [(url, status) for url, status in answers if status != 200]


if __name__ == "__main__":
    sys.exit(main())
