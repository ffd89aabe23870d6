"""Which Django databases hold a ``leases`` table: one alias per physical PostgreSQL database.

Revocations must be written wherever fenced rows live, and operators' views read advisory locks
wherever the name table joins ``pg_locks``: both ask the same question, answered here once.
"""

from __future__ import annotations

import re

import psycopg
from django.db import DatabaseError, connections, models, router

__all__ = ["migrated_databases", "note_if_unmigrated", "same_database", "where"]


def migrated_databases(model: type[models.Model]) -> list[str]:
    """PostgreSQL aliases the router migrates ``model`` onto, the first alias of each database.

    Aliases naming the same database with the same user and options (a test mirror, a second
    alias for one server) count once, so nothing is written or shown twice (see :func:`where`).
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


#: A ``search_path`` set in libpq's ``options`` (``-c search_path=...``, ``-csearch_path=...``
#: or ``--search_path=...``; the server reads a dash in a name as an underscore).
_SEARCH_PATH = re.compile(r"(?:-c\s*|--)search[_-]path=((?:\\.|\S)+)", re.IGNORECASE)


def where(alias: str) -> tuple[object, ...]:
    """The tables ``alias`` reaches: its host, port and database name (or service), and what
    chooses the schema an unqualified table name resolves in: a ``search_path`` in
    ``OPTIONS["options"]`` (a schema per tenant), else the default ``"$user", public``, which
    depends on the role (``USER``, ``OPTIONS["assume_role"]``). Two aliases that differ only
    there may name two ``leases_revocation`` tables: a revocation written to one alone left the
    evicted holder's fenced writes through the other accepted. Other options (a read-only
    default, timeouts) leave the tables alone: aliases differing only by them count once."""
    settings = connections[alias].settings_dict
    options = settings.get("OPTIONS") or {}
    return (
        settings.get("HOST"),
        settings.get("PORT"),
        settings.get("NAME"),
        options.get("service"),
        settings.get("USER"),
        options.get("assume_role"),
        tuple(_SEARCH_PATH.findall(str(options.get("options") or ""))),
    )


def same_database(first: str, second: str) -> bool:
    """Whether two aliases reach the same tables (a statement on either sees the other's)."""
    return where(first) == where(second)


def note_if_unmigrated(exc: DatabaseError, alias: str) -> None:
    """Add a note naming the fix to ``exc`` if a missing table caused it: "relation
    "leases_fence" does not exist" leaves the reader to work out that the ``leases`` app was
    never migrated there. The exception keeps its type: callers may already catch it."""
    if isinstance(exc.__cause__, psycopg.errors.UndefinedTable):
        exc.add_note(
            f"leases: is the leases app migrated on database {alias!r}? run `manage.py migrate`"
        )
