"""Which Django databases hold a ``leases`` table: one alias per physical PostgreSQL database.

Revocations must be written wherever fenced rows live, and operators' views read advisory locks
wherever the name table joins ``pg_locks``: both ask the same question, answered here once.
"""

from __future__ import annotations

import psycopg
from django.db import DatabaseError, connections, models, router

__all__ = ["migrated_databases", "note_if_unmigrated", "same_database", "where"]


def migrated_databases(model: type[models.Model]) -> list[str]:
    """PostgreSQL aliases the router migrates ``model`` onto, the first alias of each database.

    Aliases naming the same database (a test mirror, a second alias for one server) count once,
    so nothing is written or shown twice.
    """
    found: list[str] = []
    seen: set[tuple[object, ...]] = set()
    for alias in connections:
        if connections[alias].vendor != "postgresql":
            continue
        if not router.allow_migrate_model(alias, model):
            continue
        place = where(alias)
        if place not in seen:
            seen.add(place)
            found.append(alias)
    return found


def where(alias: str) -> tuple[object, ...]:
    """The physical database ``alias`` names: its host, port and database name."""
    settings = connections[alias].settings_dict
    return (settings.get("HOST"), settings.get("PORT"), settings.get("NAME"))


def same_database(first: str, second: str) -> bool:
    """Whether two aliases name one database (a statement on either sees the other's tables)."""
    return where(first) == where(second)


def note_if_unmigrated(exc: DatabaseError, alias: str) -> None:
    """Add a note naming the fix to ``exc`` if a missing table caused it: "relation
    "leases_fence" does not exist" leaves the reader to work out that the ``leases`` app was
    never migrated there. The exception keeps its type: callers may already catch it."""
    if isinstance(exc.__cause__, psycopg.errors.UndefinedTable):
        exc.add_note(
            f"leases: is the leases app migrated on database {alias!r}? run `manage.py migrate`"
        )
