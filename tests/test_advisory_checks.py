"""leases.E002: advisory locks and the database backend refuse non-PostgreSQL databases."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connections
from django.test import override_settings

from leases import advisory
from leases.checks import check_advisory_database
from leases.errors import BackendNotSupported


@pytest.fixture
def lite() -> Iterator[str]:
    """A SQLite alias that is configured but never connected to: only its vendor is read."""
    alias = "lite"
    connections.settings[alias] = {
        **connections["default"].settings_dict,
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": ":memory:",
    }
    try:
        yield alias
    finally:
        del connections[alias]
        connections.settings.pop(alias, None)


def test_postgresql_databases_pass() -> None:
    assert check_advisory_database() == []


def test_database_backend_on_a_non_postgresql_alias_is_an_error(lite: str) -> None:
    backends = {"default": {"ENGINE": "leases.backends.database", "DATABASE": lite}}
    with override_settings(LEASES={"BACKENDS": backends}):
        errors = check_advisory_database()
    assert [e.id for e in errors] == ["leases.E002"]
    assert "'lite' is sqlite" in errors[0].msg


def test_unknown_alias_is_an_error() -> None:
    backends = {"default": {"ENGINE": "leases.backends.database", "DATABASE": "nowhere"}}
    with override_settings(LEASES={"BACKENDS": backends}):
        assert [e.id for e in check_advisory_database()] == ["leases.E002"]


def test_helpers_refuse_a_non_postgresql_alias_before_connecting(lite: str) -> None:
    with pytest.raises(BackendNotSupported), advisory.session_lock("x", using=lite):
        pass
    with pytest.raises(BackendNotSupported), advisory.xact_lock("x", using=lite):
        pass
    assert connections[lite].connection is None
