"""``manage.py leases``: the operators' view and force release from a terminal."""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from django.test import override_settings

from devservers import free_port
from leases import acquire
from leases._asking import ANSWER_BOUND
from leases.backends import get_backend
from leases.models import ForceRelease
from leases.operations import advisory_locks
from tests.clusters import etcd_ready, zookeeper_ready
from tests.factories import UserFactory
from tests.harness import manage
from tests.locks_fixture import LockScene, lock_scene_fixture  # noqa: F401 - fixture


def run(*args: str) -> str:
    out = StringIO()
    call_command("leases", *args, stdout=out)
    return out.getvalue()


def line_of(output: str, name: str, status: str) -> str:
    lines = [line for line in output.splitlines() if name in line and status in line.split()]
    assert lines, f"no {status} line for {name} in:\n{output}"
    return lines[0]


def test_list_shows_held_expired_free_and_waiting(lock_scene: LockScene) -> None:
    output = run("list")
    header = output.splitlines()[0].split()
    assert header[:4] == ["KIND", "BACKEND", "NAME", "STATE"]
    held = line_of(output, lock_scene.held, "held")
    assert lock_scene.holder in held and str(lock_scene.tokens[lock_scene.held]) in held
    line_of(output, lock_scene.expired, "expired")
    line_of(output, lock_scene.free, "free")
    owner = line_of(output, lock_scene.advisory, "held")
    assert f"pid {lock_scene.holder_pid}" in owner and "lock-owner" in owner
    waiter = line_of(output, lock_scene.advisory, "WAITING")
    assert f"pid {lock_scene.waiter_pid}" in waiter and "ExclusiveLock" in waiter


def test_show_tells_holder_parts_and_token(lock_scene: LockScene) -> None:
    output = run("show", lock_scene.held)
    assert "worker-1 / 4242 / MainThread" in output
    assert "billing" in output and f"token: {lock_scene.tokens[lock_scene.held]}" in output
    with pytest.raises(CommandError, match="no backend knows"):
        run("show", "never-used-name")


def test_release_needs_the_permission_and_is_recorded(lock_scene: LockScene) -> None:
    old = lock_scene.tokens[lock_scene.held]
    plain: Any = UserFactory(username="plain-operator")
    with pytest.raises(CommandError, match="force_release_lease"):
        run("release", lock_scene.held, "--token", str(old), "--user", plain.username)
    assert get_backend().inspect(lock_scene.held).held  # type: ignore[union-attr]

    operator: Any = UserFactory(username="operator")
    operator.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    output = run("release", lock_scene.held, "--token", str(old), "--user", operator.username)
    assert f"token {old} revoked" in output
    info = get_backend().inspect(lock_scene.held)
    assert info is not None and not info.held and info.token > old
    record = ForceRelease.objects.get(name=lock_scene.held)
    assert (record.by, record.via, record.token) == (operator, "command", old)
    assert record.holder == lock_scene.holder and record.new_token == info.token


def test_release_of_a_token_that_changed_hands_releases_nothing(lock_scene: LockScene) -> None:
    """The operator names the grant they saw; a successor's grant is never evicted."""
    current = lock_scene.tokens[lock_scene.held]
    operator: Any = UserFactory(username="careful-operator")
    operator.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    with pytest.raises(
        CommandError, match=f"not held by grant {current + 1}: .* now {current}, not {current + 1}"
    ):
        run("release", lock_scene.held, "--token", str(current + 1), "--user", operator.username)
    info = get_backend().inspect(lock_scene.held)
    assert info is not None and info.held and info.token == current
    assert not ForceRelease.objects.filter(name=lock_scene.held).exists()


def test_release_of_a_free_name_says_nobody_holds_it(lock_scene: LockScene) -> None:
    """The operator is not "this caller": the refusal says the name is free, not that the
    operator does not hold it."""
    operator: Any = UserFactory(username="tidy-operator")
    operator.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    with pytest.raises(CommandError) as refused:
        run("release", "never-held-here", "--token", "1", "--user", operator.username)
    assert str(refused.value) == (
        "'never-held-here' is not held by anyone on backend 'default': nothing to release"
    )


def test_release_requires_the_token(lock_scene: LockScene) -> None:
    with pytest.raises(CommandError, match="--token"):
        run("release", lock_scene.held, "--user", "anyone")


def test_watch_refreshes_a_bounded_number_of_times(lock_scene: LockScene) -> None:
    output = run("watch", "--interval", "0.01", "--count", "2")
    assert output.count("leases at ") == 2 and output.count(lock_scene.held) == 2


def test_terminate_needs_its_permission_and_a_confirmation(lock_scene: LockScene) -> None:
    pid = lock_scene.holder_pid
    viewer: Any = UserFactory(username="viewer")
    viewer.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    with pytest.raises(CommandError, match="terminate_lock_session"):
        run("terminate", str(pid), "--user", viewer.username, "--yes")

    operator: Any = UserFactory(username="dba")
    operator.user_permissions.add(Permission.objects.get(codename="terminate_lock_session"))
    with pytest.raises(CommandError, match="add --yes"):
        run("terminate", str(pid), "--user", operator.username)
    assert any(row.pid == pid for row in advisory_locks())
    assert "terminated session" in run("terminate", str(pid), "--user", operator.username, "--yes")
    deadline = time.monotonic() + 10
    while any(row.pid == pid for row in advisory_locks()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(row.pid == pid for row in advisory_locks())
    record = ForceRelease.objects.get(action="terminate")
    assert (record.by, record.via) == (operator, "command")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["list", "--database", "nope"], "unknown database 'nope'"),
        (["show", "x", "--database", "nope"], "unknown database 'nope'"),
        (["show", ""], "must not be empty"),
        (["release", "", "--token", "1", "--user", "u"], "must not be empty"),
        (["watch", "--interval", "-1"], "--interval must be greater than 0, not -1"),
        (["watch", "--interval", "nan"], "--interval must be greater than 0, not nan"),
        (["watch", "--interval", "inf"], "--interval must be greater than 0 and finite, not inf"),
        # Printed the leases, then crashed in time.sleep() with an OverflowError traceback.
        (["watch", "--interval", "1e10"], "--interval must be at most 86400 seconds (a day)"),
        (["watch", "--count", "-2"], "--count must be at least 0, not -2"),
        # A bigint LIMIT out of range: the database backend was reported unavailable.
        (["list", "--limit", "9223372036854775808"], "--limit must be at most 10000000"),
    ],
)
@pytest.mark.django_db
def test_bad_input_is_a_command_error(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=re.escape(message)):
        run(*args)


def test_bad_input_from_the_command_line_is_one_line_and_exit_1(child_env: dict[str, str]) -> None:
    done = manage(child_env, "leases", "list", "--database", "nope")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("CommandError: unknown database 'nope' (settings.DATABASES has: default")


def test_settings_and_verbosity_are_accepted_after_the_subcommand(
    child_env: dict[str, str],
) -> None:
    env = {k: v for k, v in child_env.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = manage(env, "leases", "list", "--settings", "tests.settings", "-v", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:4] == ["KIND", "BACKEND", "NAME", "STATE"]


def test_list_json_is_typed_for_scripts(lock_scene: LockScene) -> None:
    # Every configured backend must answer for "unavailable_backends" to be empty: the etcd and
    # ZooKeeper clusters start on first use, so this test asks for them (else it would pass or
    # fail by which tests its xdist worker happened to run before it).
    etcd_ready()
    zookeeper_ready()
    data = json.loads(run("list", "--json"))
    held = next(row for row in data["leases"] if row["name"] == lock_scene.held)
    assert held["state"] == "held" and held["holder"] == lock_scene.holder
    assert held["token"] == lock_scene.tokens[lock_scene.held]
    assert isinstance(held["expires_in"], float) and held["expires_in"] > 0
    assert datetime.fromisoformat(held["acquired_at"]).tzinfo is not None
    waiting = [row for row in data["advisory_locks"] if row["state"] == "WAITING"]
    assert [row["pid"] for row in waiting] == [lock_scene.waiter_pid]
    assert data["unavailable_backends"] == {}


@pytest.mark.django_db(transaction=True)
def test_since_is_when_the_grant_began_not_its_last_renewal() -> None:
    held = acquire(f"since-{uuid.uuid4().hex[:8]}", ttl=30, timeout=0, keepalive=False)
    try:
        time.sleep(1.1)
        held.renew()
        info = get_backend().inspect(held.name)
        assert info is not None and info.acquired_at and info.renewed_at
        assert info.renewed_at - info.acquired_at >= timedelta(seconds=1)
        row = line_of(run("list"), held.name, "held")
        assert row.split()[-1] == info.acquired_at.isoformat(timespec="seconds")
        (listed,) = [
            r for r in json.loads(run("list", "--json"))["leases"] if r["name"] == held.name
        ]
        assert listed["acquired_at"] == info.acquired_at.isoformat()
    finally:
        held.release()


@pytest.mark.django_db(transaction=True)
def test_a_name_with_control_characters_stays_on_its_row() -> None:
    """Names may hold any character but NUL: a newline printed raw split the row in two (and an
    escape sequence could rewrite the operator's terminal). Shown escaped, as in the logs."""
    name = f"line\nbreak-{uuid.uuid4().hex[:8]}\x1b[2J"
    held = acquire(name, ttl=30, timeout=0, keepalive=False)
    try:
        output = run("list")
        row = line_of(output, "line\\nbreak-", "held")
        assert "\\x1b[2J" in row and "\x1b" not in output
    finally:
        held.release()


@pytest.mark.django_db(transaction=True)
def test_list_names_a_waiting_room_instead_of_a_bare_key() -> None:
    """The advisory lock a lease waiter takes for its waiting room is the package's own: the
    admin labels it, and so must the terminal, where a bare 64-bit key held by an application
    called django-leases invites an operator to terminate a waiter's session."""
    import threading

    from leases.operations import lease_waiters
    from tests.waiting import wait_until

    name = f"waited-{uuid.uuid4().hex[:8]}"
    held = acquire(name, ttl=30)

    def wait_for_it() -> None:
        from django.db import connection

        try:
            acquire(name, ttl=30, timeout=120).release()  # `show` asks every backend in turn
        finally:
            connection.close()

    waiter = threading.Thread(target=wait_for_it)
    try:
        waiter.start()
        wait_until(lambda: len(lease_waiters()) == 1, 10, "a waiter in the room")
        (room,) = lease_waiters()
        listing = run("list", "--limit", "0")
        line = line_of(listing, f"waiting room of lease {name!r}", "held")
        assert f"pid {room.pid}" in line and room.key not in line
        line_of(run("show", name), f"waiting room of lease {name!r}", "held")
        locks = json.loads(run("list", "--json", "--limit", "0"))["advisory_locks"]
        (row,) = [lock for lock in locks if lock["pid"] == room.pid and lock["room_of"]]
        assert row["room_of"] == name and row["key"] == room.key and row["name"] is None
    finally:
        held.release()
        waiter.join(30)


def test_show_asks_every_backend_at_once_within_the_bound(
    lock_scene: LockScene, silent: socket.socket
) -> None:
    """``show`` asked the backends one after the other, so an etcd that never answers held the
    operator's terminal for its own timeouts (30 s here) before the healthy backends were
    even asked; like ``list`` it now waits at most the bound and says which store is down."""
    hung = 30.0
    backends = {
        "default": {"ENGINE": "leases.backends.database"},
        "etcd-down": {
            "ENGINE": "leases.backends.etcd",
            "ENDPOINTS": [f"http://127.0.0.1:{silent.getsockname()[1]}"],
            "CONNECT_TIMEOUT": hung,
            "REQUEST_TIMEOUT": hung,
        },
    }
    out, err = StringIO(), StringIO()
    with override_settings(LEASES={"BACKENDS": backends}):
        started = time.monotonic()
        call_command("leases", "show", lock_scene.held, stdout=out, stderr=err)
        took = time.monotonic() - started
        silent.close()  # the stuck call ends before its backend is closed
    # A bound with slack for a loaded machine, well below the store's own timeout.
    assert took < ANSWER_BOUND + 15, f"show took {took:.1f}s"
    assert f"token: {lock_scene.tokens[lock_scene.held]}" in out.getvalue()
    assert "backend etcd-down unavailable: lease backend 'etcd-down' is unavailable: " in (
        err.getvalue()
    )
    assert f"no answer within {ANSWER_BOUND:g}s" in err.getvalue()


def test_with_the_database_down_list_still_lists_the_other_backends_and_the_rest_is_one_line(
    child_env: dict[str, str],
) -> None:
    """The advisory locks' query (and, for show/watch/release, the whole command) crashed with
    a traceback when the database did not answer; ``list`` printed no lease of any backend."""
    env = {
        **child_env,
        # The demo's settings: the tests' own would start a server of their own instead.
        "DJANGO_SETTINGS_MODULE": "demo_project.settings",
        "DATABASE_URL": f"postgres://u:p@127.0.0.1:{free_port()}/none",
    }
    listed = manage(env, "leases", "list")
    assert "Traceback" not in listed.stderr, listed.stderr
    assert listed.returncode == 0, listed.stderr
    assert "advisory locks on default unavailable:" in listed.stdout
    assert "backend default unavailable:" in listed.stdout
    watched = manage(env, "leases", "watch", "--count", "1")
    assert watched.returncode == 0 and "Traceback" not in watched.stderr, watched.stderr
    assert "advisory locks on default unavailable:" in watched.stdout
    shown = manage(env, "leases", "show", "x")
    assert shown.returncode == 1 and "Traceback" not in shown.stderr, shown.stderr
    assert shown.stderr.strip().splitlines()[-1].startswith("CommandError: database unavailable")


#: The backends with shared leases, alone: ``show`` and ``list`` need not wait for the clusters.
SHARED_BACKENDS = {
    "default": {"ENGINE": "leases.backends.database"},
    "redis": {"ENGINE": "leases.backends.redis", "CACHE": "default"},
}


@pytest.mark.django_db(transaction=True)
@override_settings(LEASES={"BACKENDS": SHARED_BACKENDS})
def test_a_shared_lease_shows_its_readers_not_the_groups_internal_holder() -> None:
    """A group of readers is stored under an internal holder (U+241F, ``shared``) that is
    nobody's identity: ``list`` and ``show`` printed it as the holder. They say it is shared;
    ``show`` also how many readers hold it, and who, where the store keeps that (the database
    backend; listings read no ``meta``, so they cannot count)."""
    name = f"read-{uuid.uuid4().hex[:8]}"
    readers = [
        acquire(name, ttl=30, backend=alias, holder=f"reader-{i}", shared=True, keepalive=False)
        for alias in ("default", "redis")
        for i in (1, 2)
    ]
    try:
        listing = run("list", "--limit", "0")
        # Only this test's lines: names of other tests' semaphore slots contain U+241F.
        lines = [line for line in listing.splitlines() if name in line.split()]
        assert lines and not any("\u241f" in line for line in lines), lines
        rows = [line.split() for line in lines]
        assert sorted(row[1] for row in rows) == ["default", "redis"]
        assert all(row[3:6] == ["held", "shared", "(readers)"] for row in rows), rows

        shown = run("show", name)
        assert "\u241f" not in shown and "host / pid / thread" not in shown
        assert "holder: shared (2 readers)" in shown and "holder: shared (readers)" in shown
        for reader in readers[:2]:
            assert f"reader: {reader.holder} (token {reader.token})" in shown

        listed = json.loads(run("list", "--json", "--limit", "0"))["leases"]
        for row in (row for row in listed if row["name"] == name):
            assert row["holder"] == "shared (readers)" and row["shared"] is True
        held = acquire(f"{name}-alone", ttl=30, holder="alone", keepalive=False)
        try:
            listed = json.loads(run("list", "--json", "--limit", "0"))["leases"]
            (alone,) = [row for row in listed if row["name"] == held.name]
            assert alone["holder"] == "alone" and alone["shared"] is False
        finally:
            held.release()
    finally:
        for reader in readers:
            reader.release()


@pytest.mark.django_db(transaction=True)
@override_settings(LEASES={"BACKENDS": SHARED_BACKENDS})
def test_show_prints_a_holder_given_explicitly_as_it_is() -> None:
    """A holder that is not ``acquire()``'s ``[label@]host:pid:thread`` was printed split into
    parts it does not have: ``host / pid / thread:  / None /``."""
    held = acquire(f"custom-{uuid.uuid4().hex[:8]}", ttl=30, holder="nightly report job")
    try:
        shown = run("show", held.name)
        assert "holder: nightly report job" in shown
        assert "None" not in shown and "host / pid / thread" not in shown
    finally:
        held.release()
    made = acquire(f"made-{uuid.uuid4().hex[:8]}", ttl=30)
    try:
        host = socket.gethostname()[:100]
        assert f"host / pid / thread: {host} / {os.getpid()} / " in run("show", made.name)
    finally:
        made.release()


#: A child running ``leases terminate`` with one more alias of the test database, as long as
#: Django allows (it bounds none); an explicit search_path makes it count as a database of its
#: own (see leases.databases.where).
TERMINATE_ON_A_LONG_ALIAS = """
import sys
import django
from django.conf import settings

default = settings.DATABASES["default"]
options = {**default.get("OPTIONS", {}), "options": "-c search_path=public"}
settings.DATABASES[sys.argv[1]] = {**default, "OPTIONS": options}
django.setup()
from django.core.management import call_command

call_command("leases", "terminate", sys.argv[2], "--user", sys.argv[3], "--yes",
             "--database", sys.argv[1])
"""


def test_terminating_a_session_of_a_long_database_alias_is_audited(
    lock_scene: LockScene, child_env: dict[str, str]
) -> None:
    """The audit row's backend is ``postgres:<alias>``, and Django bounds no database alias:
    past 91 characters the insert overflowed the column (100, a lease backend alias's bound),
    so the session was terminated, unaudited, and the command (or the admin) failed."""
    import subprocess
    import sys

    from django.contrib.auth.models import Permission

    alias = "reporting_" + "x" * 110
    operator: Any = UserFactory(username="long-alias-dba")
    operator.user_permissions.add(Permission.objects.get(codename="terminate_lock_session"))
    args = [alias, str(lock_scene.holder_pid), operator.username]
    done = subprocess.run(
        [sys.executable, "-c", TERMINATE_ON_A_LONG_ALIAS, *args],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"terminated session {lock_scene.holder_pid}" in done.stdout
    record = ForceRelease.objects.get(action="terminate")
    column = ForceRelease._meta.get_field("backend").max_length
    assert record.backend == f"postgres:{alias}"[:column] and record.by == operator
    assert lock_scene.advisory in record.name
