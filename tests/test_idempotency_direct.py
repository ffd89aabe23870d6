"""The claim runs by name through libpq, and the store's query goes without a cursor, only when
nothing watches the connection's queries; every watcher Django offers still sees all of them."""

from __future__ import annotations

import gc
import re
import tempfile
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection, connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from psycopg import pq

from idempotency.store import Attempt, Outcome, Status, begin

pytestmark = pytest.mark.django_db(transaction=True)

FP = "f" * 64
OUTCOME = Outcome(status=201, headers=[("Content-Type", "text/plain")], body=b"\x00done\xff")


@contextmanager
def wire() -> Iterator[list[tuple[str, str]]]:
    """The messages libpq sends meanwhile (type, content), from its trace, whoever sends them."""
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    sent: list[tuple[str, str]] = []
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield sent
        finally:
            pgconn.untrace()
        trace.seek(0)
        for line in trace:
            fields = line.rstrip("\n").split("\t", 3)
            if fields[0] == "F":
                sent.append((fields[2], fields[3] if len(fields) > 3 else ""))


@contextmanager
def psycopg_cursors() -> Iterator[list[object]]:
    """Every psycopg cursor opened meanwhile: each query Django's cursor sends opens one."""
    made: list[object] = []
    original = psycopg.Connection.cursor

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(self)
        return original(self, *args, **kwargs)

    psycopg.Connection.cursor = counting  # type: ignore[method-assign]
    try:
        yield made
    finally:
        psycopg.Connection.cursor = original  # type: ignore[method-assign]


def _first_request_and_replay(key: str) -> None:
    claim = begin("d", key, FP, ttl=60, lock_timeout=60).claim
    assert claim is not None
    attempt = Attempt(claim, atomic=True, ttl=60)
    attempt.start()
    with connection.cursor() as cursor:  # the view's own query
        cursor.execute("SELECT 1")
    attempt.commit(OUTCOME)
    done = begin("d", key, FP, ttl=60, lock_timeout=60)
    assert done.status is Status.COMPLETED and done.outcome == OUTCOME


def _claims_by_name(sent: list[tuple[str, str]]) -> int:
    return sum(kind == "Bind" and '"idempotency_begin_' in content for kind, content in sent)


def _claims_by_text(sent: list[tuple[str, str]]) -> int:
    return sum(kind == "Query" and "idempotency_begin_" in content for kind, content in sent)


def test_unwatched_the_claims_run_by_name_and_the_store_skips_the_cursor() -> None:
    _first_request_and_replay("warm")  # the session has the statements now
    with psycopg_cursors() as cursors, wire() as sent:
        _first_request_and_replay("direct")
    assert _claims_by_name(sent) == 2 and _claims_by_text(sent) == 0, sent
    assert len(cursors) == 1, "only the view's own query used a cursor"
    stores = [content for kind, content in sent if "idempotency_finish" in content]
    assert len(stores) == 1 and stores[0].rstrip().endswith('; COMMIT"'), stores
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")  # the claim's setting was its own
        assert cursor.fetchone() == ("on",)


def test_a_closed_connection_is_not_kept_alive_by_the_direct_path() -> None:
    """What the direct path keeps per connection goes with the connection: Django opens a new
    one per request with ``CONN_MAX_AGE = 0``, and a closed one kept alive would be a leak."""
    _first_request_and_replay("warm")
    _first_request_and_replay("direct-then-closed")  # the claim and the store went direct
    closed = weakref.ref(connection.connection)
    connection.close()
    gc.collect()
    assert closed() is None, gc.get_referrers(closed())


def test_captured_queries_include_every_claim_and_replay() -> None:
    _first_request_and_replay("warm")
    with CaptureQueriesContext(connection) as captured, wire() as sent:
        _first_request_and_replay("captured")
    claims = [q["sql"] for q in captured.captured_queries if "idempotency_begin_" in q["sql"]]
    assert len(claims) == 2 and _claims_by_text(sent) == 2 and _claims_by_name(sent) == 0


def test_an_execute_wrapper_sees_every_query_of_the_store() -> None:
    _first_request_and_replay("warm")
    seen: list[str] = []

    def spy(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        seen.append(re.sub(r"_v\d+", "", sql.split(" (")[0]))  # whatever their version
        return execute(sql, *args)

    with connection.execute_wrapper(spy):
        _first_request_and_replay("wrapped")
    assert seen == [
        "EXECUTE idempotency_begin",
        "SELECT 1",
        "EXECUTE idempotency_finish_strict",
        "EXECUTE idempotency_begin",
    ], seen


def test_the_query_log_under_debug_has_every_claim() -> None:
    _first_request_and_replay("warm")
    with override_settings(DEBUG=True):
        connection.queries_log.clear()
        _first_request_and_replay("logged")
        logged = [query["sql"] for query in connection.queries]
    assert sum("EXECUTE idempotency_begin" in sql for sql in logged) == 2, logged


def test_a_cursor_replaced_on_the_connection_sees_every_query_of_the_store() -> None:
    """What a debug toolbar does to watch queries: the store's queries go through it too."""
    _first_request_and_replay("warm")
    wrapper = connections["default"]
    original = wrapper.cursor
    opened: list[object] = []

    def watching() -> Any:
        opened.append(wrapper)
        return original()

    wrapper.cursor = watching  # type: ignore[method-assign]
    try:
        _first_request_and_replay("toolbar")
    finally:
        del wrapper.cursor
    assert len(opened) == 4, "the claim, the view's query, the store and the replay"


def test_a_session_that_lost_its_statements_prepares_the_claim_again() -> None:
    """What a pooler's server reset does; nothing ran when the claim was refused (26000)."""
    _first_request_and_replay("warm")
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    with wire() as sent:
        _first_request_and_replay("lost")
    queries = [content for kind, content in sent if kind == "Query"]
    assert any("PREPARE idempotency_begin" in query for query in queries), queries
    with wire() as again:
        _first_request_and_replay("found-again")
    assert _claims_by_name(again) == 2


def test_statements_lost_inside_the_attempt_are_prepared_again_in_its_transaction() -> None:
    """A session that lost its prepared statements between the claim and the store (a
    ``DEALLOCATE ALL`` in the view, a pooler's reset) used to fail the request: the store's
    ``EXECUTE`` (SQLSTATE 26000) aborted the transaction with the view's work in it. The store
    is prepared again and sent again in the same transaction, which commits the view's work
    with the outcome."""
    from tests.testapp.models_idempotency import Charge

    _first_request_and_replay("warm")  # the session has the statements; the store goes direct
    claim = begin("d", "lost-mid-attempt", FP, ttl=60, lock_timeout=60).claim
    assert claim is not None
    attempt = Attempt(claim, atomic=True, ttl=60)
    attempt.start()
    Charge.objects.create(key="lost-mid-attempt", amount=7)  # the view's work
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    with psycopg_cursors() as cursors:
        attempt.commit(OUTCOME)
    assert not cursors, "the store still went straight through libpq"
    assert not connection.in_atomic_block
    assert Charge.objects.filter(key="lost-mid-attempt").count() == 1
    done = begin("d", "lost-mid-attempt", FP, ttl=60, lock_timeout=60)
    assert done.status is Status.COMPLETED and done.outcome == OUTCOME
    with wire() as again:
        _first_request_and_replay("found-again")  # and the session has its statements again
    assert _claims_by_name(again) == 2
