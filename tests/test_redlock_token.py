"""Redlock's durable token statement: prepared, run by name in one round trip, and a session
that disagrees with what the connection believes (lost the statement, has it already) still
bumps the token exactly once per grant."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from devservers import RedisServer
from leases.backends._counter import PREPARED_BUMP_LEASE
from leases.backends.base import Grant
from leases.backends.redlock import Backend

pytestmark = pytest.mark.django_db(transaction=True)

Servers = Callable[[int], list[RedisServer]]


@pytest.fixture
def backend(redis_servers: Servers) -> Iterator[Backend]:
    made = Backend("redlock-token-test", {"NODES": [s.url for s in redis_servers(3)]})
    try:
        yield made
    finally:
        made.close()


def counter_connection(backend: Backend) -> psycopg.Connection[Any]:
    backend.counter.current_lease("warm-up")  # opens the connection
    conn = backend.counter._connection.conn
    assert conn is not None
    return conn


def granted(backend: Backend, name: str) -> Grant:
    grant = backend.try_acquire(name, "token-test", 5.0)
    assert grant is not None
    backend.release(grant)
    return grant


def sent(conn: psycopg.Connection[Any], action: Callable[[], object]) -> list[list[str]]:
    """The protocol messages the client sent on ``conn`` during ``action`` (libpq's trace)."""
    with tempfile.TemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            action()
        finally:
            conn.pgconn.untrace()
        trace.seek(0)
        lines = [line.split("\t") for line in trace.read().splitlines()]
    return [parts[2:] for parts in lines if parts[0] == "F"]


def test_a_grants_token_is_the_prepared_statement_run_by_name(backend: Backend) -> None:
    """One round trip, no text to parse on the server: ``Bind`` of the statement's name (a
    plain-text statement would send ``Parse`` with its text every time)."""
    name = f"rl-token-{uuid.uuid4().hex[:8]}"
    first = granted(backend, name)  # prepares it in the counter's session
    grants: list[Grant] = []
    messages = sent(counter_connection(backend), lambda: grants.append(granted(backend, name)))
    kinds = [message[0] for message in messages]
    assert kinds.count("Sync") + kinds.count("Query") == 1
    assert "Parse" not in kinds and "Query" not in kinds
    (bind,) = [message for message in messages if message[0] == "Bind"]
    assert f'"{PREPARED_BUMP_LEASE.name}"' in " ".join(bind)
    assert grants[0].token == first.token + 1


def test_a_counter_session_that_lost_the_statement_bumps_once(backend: Backend) -> None:
    """``DISCARD ALL``, ``DEALLOCATE``, a pooler's other session: the refused run changed
    nothing, so the token still moves on by exactly one per grant."""
    name = f"rl-token-{uuid.uuid4().hex[:8]}"
    first = granted(backend, name)
    counter_connection(backend).execute("DEALLOCATE ALL")
    second = granted(backend, name)
    third = granted(backend, name)
    assert (second.token, third.token) == (first.token + 1, first.token + 2)
    assert backend.counter.current_lease(name) == third.token


def test_a_counter_session_that_already_has_the_statement_bumps_once(backend: Backend) -> None:
    """Another client of a pooler prepared it in this session: the ``PREPARE`` is refused
    before its ``EXECUTE`` runs, then the ``EXECUTE`` alone runs once."""
    name = f"rl-token-{uuid.uuid4().hex[:8]}"
    counter_connection(backend).execute(PREPARED_BUMP_LEASE.prepare_sql)
    first = granted(backend, name)
    second = granted(backend, name)
    assert second.token == first.token + 1
    assert backend.counter.current_lease(name) == second.token
