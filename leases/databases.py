"""Which Django databases hold a ``leases`` table: one alias per physical PostgreSQL database.

Revocations must be written wherever fenced rows live, and operators' views read advisory locks
wherever the name table joins ``pg_locks``: both ask the same question, answered here once.
"""

from __future__ import annotations

from django.db import connections, models, router

__all__ = ["migrated_databases"]


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
        settings = connections.settings[alias]
        where = (settings.get("HOST"), settings.get("PORT"), settings.get("NAME"))
        if where not in seen:
            seen.add(where)
            found.append(alias)
    return found
