"""The package's own PostgreSQL connections act with the identity Django's connections have.

A login role that does not inherit its group's privileges (``NOINHERIT``) reaches the tables
only after ``SET ROLE``, which Django does for ``OPTIONS["assume_role"]``: the lease
connection, the waiting room's and the durable counters' must do the same, or every grant
fails with "permission denied for table leases_lease".
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from django.test import override_settings

from leases import acquire
from leases.backends import get_backend

pytestmark = pytest.mark.django_db

#: Statements run as the test database's owner, with the role names formatted in.
CREATE_ROLES_SQL = [
    "CREATE ROLE {owner} NOLOGIN",
    "GRANT SELECT, INSERT, UPDATE ON leases_lease, leases_fence TO {owner}",
    # new rows start above the pruned names' floor (``leases prune``): acquire reads it
    "GRANT SELECT ON leases_token_floor TO {owner}",
    "CREATE ROLE {login} LOGIN NOINHERIT IN ROLE {owner}",
]
DROP_ROLES_SQL = [
    "DROP OWNED BY {owner}",
    "DROP ROLE IF EXISTS {login}",
    "DROP ROLE IF EXISTS {owner}",
]


def run_as_owner(statements: list[str], **names: str) -> None:
    """Run ``statements`` committed at once, on a connection outside the test's transaction."""
    wrapper = connections.create_connection("default")
    try:
        with wrapper.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement.format(**names))
    finally:
        wrapper.close()


@pytest.fixture
def login_alias() -> Iterator[str]:
    """A ``DATABASES`` alias for the test database that logs in as a ``NOINHERIT`` role with
    no privileges of its own and assumes a role that may use the lease tables."""
    suffix = uuid.uuid4().hex[:8]
    names = {"owner": f"leases_owner_{suffix}", "login": f"leases_login_{suffix}"}
    run_as_owner(CREATE_ROLES_SQL, **names)
    settings: dict[str, Any] = {
        **connections.settings["default"],
        "USER": names["login"],
        "PASSWORD": "",
        "OPTIONS": {"assume_role": names["owner"]},
    }
    connections.settings["login"] = settings
    try:
        yield "login"
    finally:
        del connections.settings["login"]
        run_as_owner(DROP_ROLES_SQL, **names)


@pytest.fixture
def backends_on(login_alias: str) -> Iterator[None]:
    """The database backend, and a Redis backend taking its epochs, on ``login_alias``."""
    backends = {
        "default": {"ENGINE": "leases.backends.database", "DATABASE": login_alias},
        "redis": {
            "ENGINE": "leases.backends.redis",
            "CACHE": "default",
            "PREFIX": f"roles-{uuid.uuid4().hex[:8]}:",
            "EPOCH_DATABASE": login_alias,
        },
    }
    with override_settings(LEASES={"BACKENDS": backends}):
        yield
        for alias in backends:
            get_backend(alias).close()  # before the roles are dropped


@pytest.mark.parametrize("backend", ["default", "redis"])
def test_lease_connections_assume_the_configured_role(backends_on: None, backend: str) -> None:
    held = acquire(f"roles-{uuid.uuid4().hex[:8]}", ttl=5, backend=backend, keepalive=False)
    held.renew()
    held.release()
    if backend == "default":
        conn = get_backend(backend).connection()  # type: ignore[attr-defined]
        assert conn is not None
        (user, role) = conn.execute("SELECT session_user, current_user").fetchone() or ("", "")
        assert user.startswith("leases_login_") and role.startswith("leases_owner_")
