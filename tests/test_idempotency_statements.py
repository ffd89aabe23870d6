"""How the key store's statements are sent: prepared once per connection, recovered when a
session lost them, plain SQL when told, and a replay that writes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from idempotency import statements
from idempotency.statements import FINISH, RELEASE
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


def test_prepare_covers_both_forms_of_an_owned_write_then_sends_nothing() -> None:
    connection.close()  # a new session: nothing prepared yet
    statements.prepare("default", FINISH, RELEASE)
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements")
        prepared = {name for (name,) in cursor.fetchall()}
    assert {FINISH.counting.name, FINISH.strict.name, RELEASE.name} <= prepared
    with CaptureQueriesContext(connection) as sent:
        statements.prepare("default", FINISH, RELEASE)
    assert sent.captured_queries == []


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


def _index_scanned(statement: Any, params: dict[str, Any]) -> set[str]:
    """The indexes the generic plan of ``statement`` (the one a prepared statement settles on
    after five calls) scans, inside a transaction rolled back afterwards."""
    from django.db import transaction

    names: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        if "Index Name" in node:
            names.add(node["Index Name"])
        for child in node.get("Plans", []):
            walk(child)

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(statement.prepare_sql().replace(statement.name, "plan_probe", 1))
        cursor.execute(
            f"EXPLAIN (FORMAT JSON) {statement.execute_sql()}".replace(
                statement.name, "plan_probe", 1
            ),
            params,
        )
        walk(_json_plan(cursor.fetchone()[0])[0]["Plan"])
        cursor.execute("DEALLOCATE plan_probe")
        transaction.set_rollback(True)
    return names


def _json_plan(value: Any) -> Any:
    import json

    return json.loads(value) if isinstance(value, str) else value


def test_owned_writes_find_their_row_by_primary_key() -> None:
    """The finish, the step record and the release find the row by ``id``: the partial index
    of started keys (an index on ``(created_at, id)``) only matches their ``state`` test, and
    scanning it for an id walks every entry, the dead ones each finish leaves in it too (a
    cost that grew with every request until a vacuum)."""
    from idempotency.statements import FINISH, RECORD_STEP, RELEASE

    for n in range(20):  # enough started rows for the planner to weigh its choices
        assert begin("s", f"started-{n}", FP, ttl=60, lock_timeout=60).claim is not None
    claim = begin("s", "k9", FP, ttl=60, lock_timeout=60).claim
    assert claim is not None
    owned = {"id": claim.id, "owner": claim.owner}
    finish_params = {**owned, "status": 201, "headers": "[]", "body": b"", "ttl": 60.0}
    step_params = {**owned, "step": "a", "result": "1", "lock": 60.0, "ttl": 60.0}
    for statement, params in [
        (FINISH.counting, finish_params),
        (FINISH.strict, finish_params),
        (RECORD_STEP.counting, step_params),
        (RECORD_STEP.strict, step_params),
        (RELEASE, {**owned, "ttl": 60.0}),
    ]:
        assert _index_scanned(statement, params) == {"idempotency_key_pkey"}, statement.name


def _synchronous_commit() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return str(cursor.fetchone()[0])


def test_only_the_claims_own_commit_skips_the_wait_for_the_disk() -> None:
    """The started row commits with synchronous_commit off, set in the claim's own query (one
    implicit transaction); the attempt's transaction, which commits the effects with the
    outcome, and the session afterwards keep synchronous commits."""
    from idempotency.statements import ASYNC_CLAIM_SQL, BEGIN

    with CaptureQueriesContext(connection) as sent:
        claim = begin("s", "k-sync", FP, ttl=60, lock_timeout=60).claim
    assert claim is not None
    (claim_sql,) = [query["sql"] for query in sent.captured_queries]
    assert "'synchronous_commit', 'off', true" in ASYNC_CLAIM_SQL and ASYNC_CLAIM_SQL in BEGIN.sql
    assert "idempotency_begin" in claim_sql and claim_sql.endswith(", true)"), claim_sql
    attempt = Attempt(claim, atomic=True, ttl=60)
    attempt.start()
    in_attempt = _synchronous_commit()
    attempt.commit(OUTCOME)
    assert in_attempt == "on" and _synchronous_commit() == "on"


def test_the_claims_bound_on_its_wait_for_a_row_ends_with_its_own_query() -> None:
    """An autocommit claim bounds its insert's wait on another transaction's row by a
    ``lock_timeout`` set in its own query (one implicit transaction): the session's own
    ``lock_timeout`` is what it was before, for the session's later statements."""
    from idempotency.statements import BEGIN, ROW_WAIT_SQL

    assert ROW_WAIT_SQL in BEGIN.sql and "'lock_timeout'" in ROW_WAIT_SQL
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '7s'")
    try:
        assert begin("s", "k-wait", FP, ttl=60, lock_timeout=60).claim is not None
        with connection.cursor() as cursor:
            cursor.execute("SHOW lock_timeout")
            assert cursor.fetchone()[0] == "7s"
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")


def test_a_claim_inside_an_open_transaction_leaves_its_commit_synchronous() -> None:
    """There the claim's row commits with the caller's effects: nothing may make that commit
    less durable."""
    from django.db import transaction

    with transaction.atomic():
        running = begin("s", "k-open", FP, ttl=60, lock_timeout=60)
        assert running.claim is not None
        assert _synchronous_commit() == "on"
