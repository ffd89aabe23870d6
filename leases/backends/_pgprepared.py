"""The database backend's hot statements as server-side prepared statements.

Acquire and release are each one round trip, and what is left is work on both ends. On the
server, parsing and planning the acquire's ``INSERT ... SELECT`` with its probes and floors
cost more than running it (server CPU per acquire + release, measured on the benchmark's
server: 680 µs as plain text, 250 µs prepared; the naive two statements of issue 14 take
350 µs as plain text). Django's connection parameters turn psycopg's own preparation off
(``prepare_threshold`` ``None``: its names ``_pg3_0``, ``_pg3_1``... would collide behind a
pooler in transaction mode, where one session may hold another client's ``_pg3_0``), so these
statements are prepared in SQL, under names of our own that say what they are:
``leases_<what>_<hash of the text>``. Any session that has a statement of that name has this
very text, whichever client prepared it, so a pooler handing the connection another server
session can never make an ``EXECUTE`` run something else.

On the client, a prepared statement is then run by name with libpq's ``Bind``/``Execute``
(SQL and protocol prepared statements share one namespace per session), without a cursor: the
pair's client CPU drops from about 300 µs through a psycopg cursor to about 70 µs.

A session that does not have the statement (a new connection, a pooler's other session,
``DISCARD ALL``) answers SQLSTATE 26000 before running anything; it is then prepared and run
in one round trip (a pipeline of the protocol's ``Parse`` and ``Bind``/``Execute``: one
implicit transaction, so one server session even behind a transaction pooler). Not
``PREPARE ...; EXECUTE name('<values>')`` in one simple query, as it once was: the values
were then quoted into the text, and PostgreSQL keeps
a prepared statement's whole source text, showing it in ``pg_stat_activity`` (to monitoring
roles) each time the statement runs, for the session's life: the first grant's secret stayed
readable there. A session that has it although this connection did not prepare it answers
42P05 to the ``PREPARE``; the statement is then only run. A migration that changes a returned
column's type makes the session refuse the statement's plan (0A000) until it is made again: it
is deallocated and prepared anew. These refusals happen before the statement runs, so sending
it again is safe; after :data:`ATTEMPTS` of them the plain text is sent instead (its values
bound apart from the text). Option ``PREPARED_STATEMENTS`` ``False`` always sends the plain
text.

On an async connection (:func:`arun_prepared`) the prepared statement is run by name as well:
libpq's non-blocking ``Bind``/``Execute`` (``send_query_prepared``), its reply awaited on the
event loop by psycopg's own waiting function, as an ``AsyncCursor`` awaits its statements
(psycopg has no public awaitable call for a statement by name). The refusals and the first
``PREPARE`` are handled as above.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import pq
from psycopg.abc import Buffer, PQGen
from psycopg.adapt import PyFormat
from psycopg.generators import execute
from psycopg.waiting import Wait, wait, wait_async

from .._pgnotifies import keep_notifies
from ._pgloading import transformer as loading_transformer

__all__ = [
    "ATTEMPTS",
    "Prepared",
    "arun_prepared",
    "read_result",
    "run_prepared",
]

#: Refusals (26000, 42P05) tolerated for one call before its plain text is sent instead.
ATTEMPTS = 3
_NOT_PREPARED = b"26000"
_ALREADY_PREPARED = "42P05"
#: "cached plan must not change result type", raised before the statement runs.
_STALE_PLAN = b"0A000"
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
#: Seconds between the async wait's wake-ups while no reply came, as psycopg's own connections
#: wait (its bare waiting function's default, 0, would wake at every turn of the loop: a spin).
#: Positional: psycopg 3.1 names this parameter ``timeout``, later ones ``interval``.
_WAKE_INTERVAL = 0.1


@dataclass(frozen=True)
class Prepared:
    """``sql`` (with ``%(name)s`` placeholders), prepared as ``leases_<what>_<hash>``.

    Parameter types are the server's inference from the text (each placeholder is cast or
    compared with a typed column), the same inference the plain text gets.
    """

    what: str
    sql: str
    name: str = field(init=False)
    prepare_sql: str = field(init=False)
    #: The text with ``$1``, ``$2``... for the protocol's ``Parse`` (see :func:`_first_run`).
    body: bytes = field(init=False)
    #: The parameters' names in the order of ``$1``, ``$2``...
    order: tuple[str, ...] = field(init=False)
    #: ``name`` for libpq, and the values' formats (text: the server parses them as the
    #: types it inferred when preparing).
    key: bytes = field(init=False)
    formats: tuple[PyFormat, ...] = field(init=False)

    def __post_init__(self) -> None:
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match[1] not in order:
                order.append(match[1])
            return f"${order.index(match[1]) + 1}"

        body = _PLACEHOLDER.sub(number, self.sql)
        digest = hashlib.sha256(self.sql.encode()).hexdigest()[:12]
        name = f"leases_{self.what}_{digest}"
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "prepare_sql", f"PREPARE {name} AS {body}")
        object.__setattr__(self, "body", body.encode())
        object.__setattr__(self, "order", tuple(order))
        object.__setattr__(self, "key", name.encode())
        object.__setattr__(self, "formats", (PyFormat.TEXT,) * len(order))


def run_prepared(
    conn: psycopg.Connection[Any],
    statement: Prepared,
    params: Mapping[str, Any],
    prepared: set[str],
) -> list[tuple[Any, ...]]:
    """Run ``statement`` on ``conn`` (autocommit) and fetch its rows, in one round trip when
    ``prepared`` (the names this connection's session is known to have) is right; else the
    statement is prepared first (a round trip of its own, once per session), its values never
    in the text."""
    for _ in range(ATTEMPTS):
        if statement.name in prepared:
            rows = _bound(conn, statement, params)
            if rows is not None:
                return rows
            prepared.discard(statement.name)  # lost, or dropped as stale: nothing ran
            continue
        transformer = loading_transformer(conn)
        values = transformer.dump_sequence(
            [params[key] for key in statement.order], statement.formats
        )
        pgconn = conn.pgconn
        results = wait(_first_run(pgconn, statement, values), pgconn.socket, _WAKE_INTERVAL)
        keep_notifies(pgconn)
        prepared.add(statement.name)  # made now, or the session had it (42P05: run it by name)
        rows = _first_rows(results, transformer, conn.info.encoding)
        if rows is not None:
            return rows
    plain = conn.execute(statement.sql, params)
    return plain.fetchall() if plain.description else []


def _bound(
    conn: psycopg.Connection[Any], statement: Prepared, params: Mapping[str, Any]
) -> list[tuple[Any, ...]] | None:
    """The prepared statement's rows, run by name with the values sent apart from the text
    (``Bind``/``Execute``: no text to build, quote or parse on either side); ``None`` when
    the session does not have it (SQLSTATE 26000, nothing ran).

    Straight on libpq, as psycopg's cursor would, without the cursor: dumping and loading
    go through a :class:`~psycopg.adapt.Transformer` of the connection's adapters (Django's
    time zone aware loaders included), so rows come back exactly as from a cursor. libpq's
    call blocks with the GIL released, so the reply deadline's thread can cut it.
    """
    transformer = loading_transformer(conn)
    values = transformer.dump_sequence([params[key] for key in statement.order], statement.formats)
    pgconn = conn.pgconn
    result = pgconn.exec_prepared(statement.key, values)  # type: ignore[arg-type]  # NULLs
    keep_notifies(pgconn)
    rows = read_result(result, transformer, conn.info.encoding)
    if rows is False:
        conn.execute(f"DEALLOCATE {statement.name}")
        return None
    return rows


def read_result(
    result: pq.abc.PGresult, transformer: psycopg.abc.Transformer, encoding: str
) -> list[Any] | Literal[False] | None:
    """A prepared statement's reply (sync or async alike): its rows; ``None`` when the session
    does not have the statement (nothing ran); ``False`` when its plan is stale: a migration
    changed a returned column's type, and the session keeps refusing the plan until the
    statement is made again (nothing ran: the caller deallocates it). Any other error raised."""
    if result.status == pq.ExecStatus.TUPLES_OK:
        transformer.set_pgresult(result)
        rows: list[Any] = transformer.load_rows(0, result.ntuples, tuple)
        return rows
    if result.status == pq.ExecStatus.COMMAND_OK:
        return []
    sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE)
    if sqlstate == _NOT_PREPARED:
        return None
    if sqlstate == _STALE_PLAN:
        return False
    raise psycopg.errors.error_from_result(result, encoding=encoding)


async def arun_prepared(
    conn: psycopg.AsyncConnection[Any],
    statement: Prepared,
    params: Mapping[str, Any],
    prepared: set[str],
) -> list[tuple[Any, ...]]:
    """:func:`run_prepared` on an async connection (autocommit): the statement run by name
    (:func:`_abound`) when ``prepared`` says the session has it, else prepared first."""
    for _ in range(ATTEMPTS):
        if statement.name in prepared:
            rows = await _abound(conn, statement, params)
            if rows is not None:
                return rows
            prepared.discard(statement.name)  # lost, or dropped as stale: nothing ran
            continue
        transformer = loading_transformer(conn)
        values = transformer.dump_sequence(
            [params[key] for key in statement.order], statement.formats
        )
        async with conn.lock:
            pgconn = conn.pgconn
            results = await wait_async(
                _first_run(pgconn, statement, values), pgconn.socket, _WAKE_INTERVAL
            )
            keep_notifies(pgconn)
        prepared.add(statement.name)
        rows = _first_rows(results, transformer, conn.info.encoding)
        if rows is not None:
            return rows
    plain = await conn.execute(statement.sql, params)
    return await plain.fetchall() if plain.description else []


async def _abound(
    conn: psycopg.AsyncConnection[Any], statement: Prepared, params: Mapping[str, Any]
) -> list[tuple[Any, ...]] | None:
    """:func:`_bound`, awaited: libpq's ``Bind``/``Execute`` sent without blocking and its
    reply awaited on the loop (psycopg's ``execute`` generator, which also hands the
    notifications read with the reply to psycopg, as :func:`keep_notifies` does).

    Under the connection's own lock, as a cursor's statement is (a suspended ``notifies()``
    holds it). Awaited by psycopg's bare waiting function, not the connection's ``wait``: a
    cancellation then ends the wait at once and the caller drops the connection (whether the
    statement ran is unknown, as after a cut deadline), instead of psycopg asking the server
    to cancel it and waiting up to 5 s more for the answer, on a server that may be stalled."""
    transformer = loading_transformer(conn)
    values = transformer.dump_sequence([params[key] for key in statement.order], statement.formats)
    async with conn.lock:
        pgconn = conn.pgconn
        pgconn.send_query_prepared(statement.key, values)
        results = await wait_async(execute(pgconn), pgconn.socket, _WAKE_INTERVAL)
    rows = read_result(results[-1], transformer, conn.info.encoding)
    if rows is False:
        await conn.execute(f"DEALLOCATE {statement.name}")
        return None
    return rows


def _first_run(
    pgconn: pq.abc.PGconn, statement: Prepared, values: Sequence[Buffer | None]
) -> PQGen[list[pq.abc.PGresult]]:
    """Prepare ``statement`` under its name and run it, in one round trip: a libpq pipeline
    of the protocol's ``Parse`` (named), ``Bind``/``Execute`` and ``Sync``, the values sent
    apart from the text. The ``PREPARE`` and ``EXECUTE`` of one simple query would quote the
    values into the statement's source text, which the session keeps and shows in
    ``pg_stat_activity`` each time the statement runs. One ``Sync``: one implicit transaction,
    so one server session even behind a transaction pooler. The results: the ``Parse``'s and
    the ``Execute``'s (aborted when the ``Parse`` failed)."""
    pgconn.enter_pipeline_mode()
    try:
        pgconn.send_prepare(statement.key, statement.body)
        pgconn.send_query_prepared(statement.key, values)
        pgconn.pipeline_sync()
        while pgconn.flush() == 1:
            yield Wait.W
        results: list[pq.abc.PGresult] = []
        while True:
            while pgconn.is_busy():
                yield Wait.R
                pgconn.consume_input()
            result = pgconn.get_result()
            if result is None:  # the end of one command's results
                continue
            if result.status == pq.ExecStatus.PIPELINE_SYNC:
                return results
            results.append(result)
    finally:
        if pgconn.pipeline_status != pq.PipelineStatus.OFF:
            with contextlib.suppress(psycopg.Error):
                pgconn.exit_pipeline_mode()


def _first_rows(
    results: list[pq.abc.PGresult], transformer: psycopg.abc.Transformer, encoding: str
) -> list[Any] | None:
    """The rows of :func:`_first_run`; ``None`` when the session had the statement already
    (the ``Parse`` failed with 42P05 and the ``Execute`` did not run: run it by name)."""
    parsed, executed = results
    if parsed.status != pq.ExecStatus.COMMAND_OK:
        if parsed.error_field(pq.DiagnosticField.SQLSTATE) == _ALREADY_PREPARED.encode():
            return None
        raise psycopg.errors.error_from_result(parsed, encoding=encoding)
    rows = read_result(executed, transformer, encoding)
    return None if rows is False else rows
