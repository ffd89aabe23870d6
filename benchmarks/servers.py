"""The servers and the Django set-up a benchmark run stands on, written once for
``python -m benchmarks`` and the stand-alone tools that need the same (``redis_isolated``,
``handoff_steps``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from devservers import PostgresServer, RedisServer, configured_or_throwaway

__all__ = ["DURABLE", "django_on_servers"]

#: A throwaway PostgreSQL's settings for a server that flushes its commits, as in production:
#: what :class:`devservers.PostgresServer` turns off (its data is thrown away), back on.
DURABLE = {"fsync": "on", "full_page_writes": "on"}


@contextlib.contextmanager
def django_on_servers(
    variables: tuple[str, ...] = ("DATABASE_URL", "REDIS_URL"),
    postgres_settings: Mapping[str, str] | None = None,
) -> Iterator[list[PostgresServer | RedisServer]]:
    """``variables``' servers (the configured ones when reachable, else throwaway ones), Django
    set up with the demo project's settings on them and migrated; every server in the list it
    yields (those started here, and any the caller appends) is destroyed on the way out.

    ``DJANGO_DEBUG`` defaults to off, for this process and those it starts (Celery workers,
    the ASGI server): the demo's ``DEBUG`` logs every query, a tax on each Django-based
    contender that the raw driver floors do not pay."""
    owned: list[PostgresServer | RedisServer] = []
    try:
        os.environ.update(configured_or_throwaway(owned, variables, postgres_settings))
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")
        os.environ.setdefault("DJANGO_DEBUG", "0")
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        yield owned
    finally:
        for server in owned:
            server.destroy()
