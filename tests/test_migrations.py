"""The apps migrate onto a database of their own, routed away from the user table."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import psycopg

from tests.harness import ROOT


def test_both_apps_migrate_onto_a_database_without_auth_tables(
    child_env: dict[str, str], python: str, empty_database: str
) -> None:
    env = {
        **child_env,
        "DJANGO_SETTINGS_MODULE": "tests.migrate_elsewhere_settings",
        "COORDINATION_DATABASE_URL": empty_database,
    }
    done = subprocess.run(
        [python, "-m", "django", "migrate", "--database", "coordination", "-v", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    with psycopg.connect(empty_database) as conn:
        tables: Any = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
    found = {row[0] for row in tables}
    assert {"leases_lease", "leases_force_release", "leases_revocation"} <= found
    assert "auth_user" not in found


#: Run in a child against the unmigrated ``coordination`` database: an acquire on the database
#: backend and a table fence, each printing the error it met and its notes.
UNMIGRATED_CHILD = """
import json
import django
django.setup()
from leases import acquire
from leases.fencing import check_fence
for attempt in (
    lambda: acquire("job", ttl=5, timeout=0, keepalive=False),
    lambda: check_fence("invoice:1", 7, using="coordination"),
):
    try:
        attempt()
    except Exception as exc:
        print(json.dumps([type(exc).__name__, str(exc), getattr(exc, "__notes__", [])]))
"""


def test_an_unmigrated_database_says_to_run_migrate(
    child_env: dict[str, str], python: str, empty_database: str
) -> None:
    """A backend or a fence on a database the ``leases`` app was never migrated onto says
    so, instead of a bare "relation … does not exist" the operator must decode. The fence
    keeps Django's ``ProgrammingError`` (callers may catch it) and gains a note."""
    env = {
        **child_env,
        "DJANGO_SETTINGS_MODULE": "tests.migrate_elsewhere_settings",
        "COORDINATION_DATABASE_URL": empty_database,
    }
    done = subprocess.run(
        [python, "-c", UNMIGRATED_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert len(printed) == 2, done.stdout
    (backend, said, _), (fence, refused, notes) = printed
    assert backend == "BackendUnavailable", printed
    assert "run `manage.py migrate`: UndefinedTable" in said and "leases_lease" in said, said
    assert fence == "ProgrammingError" and "leases_fence" in refused, printed
    assert notes == [
        "leases: is the leases app migrated on database 'coordination'? run `manage.py migrate`"
    ], notes


def _migrate_sqlite(tmp_path: Path, *args: str, **env: str) -> tuple[CompletedProcess[str], Path]:
    """``manage.py migrate ARGS`` in a child, onto a fresh SQLite file (tests/sqlite_settings)."""
    database = tmp_path / "project.sqlite3"
    done = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v", "0", *args],
        env={
            **os.environ,
            **env,
            "DJANGO_SETTINGS_MODULE": "tests.sqlite_settings",
            "SQLITE_PATH": str(database),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, database


def _tables(database: Path) -> set[str]:
    """The tables of a SQLite file (none if it was never created)."""
    if not database.exists():
        return set()
    with contextlib.closing(sqlite3.connect(database)) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {name for (name,) in rows}


def test_migrate_onto_sqlite_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    """With ``leases.E002`` silenced, ``migrate`` onto SQLite used to create the first tables
    and die at the first index built ``CONCURRENTLY`` (a TypeError of the SQLite schema
    editor), leaving a half-migrated database; it is refused up front, with a typed error."""
    done, database = _migrate_sqlite(tmp_path)
    assert done.returncode != 0
    assert "leases.errors.DatabaseNotSupported: database 'default' is sqlite" in done.stderr, (
        done.stderr[-2000:]
    )
    assert "migrations need PostgreSQL; nothing was migrated" in done.stderr
    assert _tables(database) == set()


def test_migrate_onto_sqlite_goes_ahead_when_a_router_keeps_the_apps_off_it(
    tmp_path: Path,
) -> None:
    """The refusal honours the routers: the project's other apps still migrate onto SQLite."""
    done, database = _migrate_sqlite(tmp_path, "--database", "default", ROUTE_ELSEWHERE="1")
    assert done.returncode == 0, done.stderr[-2000:]
    tables = _tables(database)
    assert "auth_user" in tables
    assert not {name for name in tables if name.startswith(("leases_", "idempotency_"))}
