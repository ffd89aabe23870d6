"""Database routers for tests of fenced writes under a primary/replica setup."""

from __future__ import annotations

from typing import Any


class ReadReplicaRouter:
    """Reads go to the read-only ``replica``, writes to ``default``: the usual replica setup."""

    def db_for_read(self, model: type[Any], **hints: Any) -> str:
        return "replica"

    def db_for_write(self, model: type[Any], **hints: Any) -> str:
        return "default"

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db == "default"


class OtherDatabaseRouter:
    """Every read and write of the test app goes to the ``other`` alias."""

    def db_for_read(self, model: type[Any], **hints: Any) -> str | None:
        return "other" if model._meta.app_label == "testapp" else None

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        return "other" if model._meta.app_label == "testapp" else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db == "default"


class LeasesElsewhereRouter:
    """The ``leases`` app's tables live in the ``other`` alias only."""

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        if app_label == "leases":
            return db == "other"
        return None
