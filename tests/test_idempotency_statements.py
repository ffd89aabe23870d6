"""How the key store's statements are sent: prepared once per connection, recovered when a
session lost them, plain SQL when told, and a replay that writes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from idempotency.store import Attempt, Outcome, Status, begin, finish

pytestmark = pytest.mark.django_db(transaction=True)

FP = "f" * 64
OUTCOME = Outcome(status=201, headers=[("Content-Type", "text/plain")], body=b"done")


def _cycle(key: str) -> list[str]:
    """Claim, store, replay; the SQL sent for it."""
    with CaptureQueriesContext(connection) as sent:
        claim = begin("s", key, FP, ttl=60, lock_timeout=60).claim
        assert claim is not None
        finish(claim, OUTCOME, ttl=60)
        assert begin("s", key, FP, ttl=60, lock_timeout=60).status is Status.COMPLETED
    return [query["sql"] for query in sent.captured_queries]


def test_statements_are_prepared_once_per_connection_then_executed() -> None:
    connection.close()  # a new session: nothing prepared yet
    first = _cycle("k1")
    assert first[0].startswith("PREPARE idempotency_begin") and "EXECUTE" in first[0]
    again = _cycle("k2")
    assert all(sql.startswith("EXECUTE idempotency_") for sql in again), again


def _attempt_cycle(key: str) -> None:
    """Claim, then store and commit inside an atomic attempt (the statements it sends in its
    transaction are prepared at its start)."""
    claim = begin("s", key, FP, ttl=60, lock_timeout=60).claim
    assert claim is not None
    attempt = Attempt(claim, atomic=True, ttl=60)
    attempt.start()
    attempt.commit(OUTCOME)
    assert begin("s", key, FP, ttl=60, lock_timeout=60).status is Status.COMPLETED


def test_a_session_that_lost_its_prepared_statements_prepares_them_again() -> None:
    _attempt_cycle("k3")
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")  # what a pooler's server reset does
    _attempt_cycle("k4")
    assert _cycle("k4b")[-1].startswith("EXECUTE")


def test_plain_sql_when_prepared_statements_are_off() -> None:
    with override_settings(IDEMPOTENCY={"PREPARED_STATEMENTS": False}):
        sent = _cycle("k5")
    assert not any("PREPARE" in sql or "EXECUTE" in sql for sql in sent)


def _xid_assigned() -> Any:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_xact_id_if_assigned()")
        return cursor.fetchone()[0]


def test_a_replay_or_a_duplicate_takes_no_transaction_id_and_no_row_lock() -> None:
    """The claim's probe only reads a key it may not take: a replay writes nothing (an
    INSERT ... ON CONFLICT DO UPDATE would lock the row and assign an xid even when refused)."""
    _cycle("k6")
    running = begin("s", "k7", FP, ttl=60, lock_timeout=60)
    from django.db import transaction

    with transaction.atomic():
        assert begin("s", "k6", FP, ttl=60, lock_timeout=60, wait=0).status is Status.COMPLETED
        assert begin("s", "k7", FP, ttl=60, lock_timeout=60).status is Status.IN_PROGRESS
        assert _xid_assigned() is None
    assert running.claim is not None


def test_the_outcome_and_the_commit_travel_together_in_atomic_mode() -> None:
    claim = begin("s", "k8", FP, ttl=60, lock_timeout=60).claim
    assert claim is not None
    attempt = Attempt(claim, atomic=True, ttl=60)
    attempt.start()
    with CaptureQueriesContext(connection) as sent:
        attempt.commit(OUTCOME)
    assert any(query["sql"].endswith("; COMMIT") for query in sent.captured_queries)
    assert begin("s", "k8", FP, ttl=60, lock_timeout=60).status is Status.COMPLETED
