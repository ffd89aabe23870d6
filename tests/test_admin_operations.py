"""What the operator views read: holder identities and advisory keys shown as Postgres has them."""

from __future__ import annotations

import os

import pytest
from django.db import connection, transaction

from leases.keys import advisory_key
from leases.lease import acquire
from leases.operations import advisory_locks, parse_holder, remember_advisory_names


def test_generated_holders_split_into_host_pid_thread_and_label() -> None:
    held = parse_holder("billing@web-1:4242:140245:ab12cd34")
    assert (held.label, held.host, held.pid, held.thread) == ("billing", "web-1", 4242, "140245")
    unlabeled = parse_holder("web-1:7:99:00ff00ff")
    assert (unlabeled.label, unlabeled.host, unlabeled.pid) == ("", "web-1", 7)
    assert parse_holder("a hand-written holder").raw == "a hand-written holder"
    assert parse_holder("").pid is None


@pytest.mark.django_db(transaction=True)
def test_real_holder_identity_is_parsed() -> None:
    held = acquire("operations-holder", ttl=5, timeout=1)
    try:
        parts = parse_holder(held.holder)
        assert parts.pid == os.getpid() and parts.host and parts.thread
    finally:
        held.release()


@pytest.mark.django_db(transaction=True)
def test_advisory_keys_are_shown_as_names_int64_or_int32_pairs() -> None:
    remember_advisory_names("operations-named")
    remember_advisory_names("operations-named")  # idempotent
    named = advisory_key("operations-named")
    assert isinstance(named, int)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [named])
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [-(2**63)])
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [-5, 7])
        rows = {
            row.key: row
            for row in advisory_locks()
            if row.pid == connection.connection.info.backend_pid
        }
    assert rows[str(named)].name == "operations-named"
    assert rows[str(-(2**63))].name == ""
    assert "(-5, 7)" in rows and all(row.status == "held" for row in rows.values())
    assert not [row for row in advisory_locks() if row.key == str(named)]  # released at commit
