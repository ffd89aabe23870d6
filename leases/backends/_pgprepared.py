"""The database backend's hot statements as server-side prepared statements.

Acquire and release are each one round trip, and what is left is the server's work: for the
acquire's ``INSERT ... SELECT`` with its probes and floors, parsing and planning cost more
than running it (measured on the benchmark's server: about 300 µs of the pair's 770 µs sent
as plain SQL, where the naive two statements of issue 14 take 450 µs). Django's connection
parameters turn psycopg's own preparation off (``prepare_threshold`` ``None``: its names
``_pg3_0``, ``_pg3_1``... would collide behind a pooler in transaction mode, where one session
may hold another client's ``_pg3_0``), so these statements are prepared in SQL, under names of
our own that say what they are: ``leases_<what>_<hash of the text>``. Any session that has a
statement of that name has this very text, whichever client prepared it, so a pooler handing
the connection another server session can never make an ``EXECUTE`` run something else.

A session that does not have the statement (a new connection, a pooler's other session,
``DISCARD ALL``) answers SQLSTATE 26000 before running anything; it is then prepared and
executed in one simple query (one implicit transaction, so on one server session even behind a
transaction pooler). A session that has it although this connection did not prepare it answers
42P05 to the ``PREPARE``, which aborts the query before its ``EXECUTE``; the statement is then
only executed. Both refusals happen before the statement runs, so sending it again is safe;
after :data:`ATTEMPTS` of them the plain text is sent instead. Option ``PREPARED_STATEMENTS``
``False`` always sends the plain text.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg

__all__ = ["ATTEMPTS", "Prepared", "run_prepared"]

#: Refusals (26000, 42P05) tolerated for one call before its plain text is sent instead.
ATTEMPTS = 3
_NOT_PREPARED = "26000"
_ALREADY_PREPARED = "42P05"
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


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
    execute_sql: str = field(init=False)
    #: Both in one query: one round trip, and one server session even behind a pooler.
    first_sql: str = field(init=False)

    def __post_init__(self) -> None:
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match[1] not in order:
                order.append(match[1])
            return f"${order.index(match[1]) + 1}"

        body = _PLACEHOLDER.sub(number, self.sql)
        digest = hashlib.sha256(self.sql.encode()).hexdigest()[:12]
        name = f"leases_{self.what}_{digest}"
        arguments = ", ".join(f"%({param})s" for param in order)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "prepare_sql", f"PREPARE {name} AS {body}")
        execute = f"EXECUTE {name}({arguments})" if order else f"EXECUTE {name}"
        object.__setattr__(self, "execute_sql", execute)
        object.__setattr__(self, "first_sql", f"{self.prepare_sql}; {execute}")


def run_prepared(
    conn: psycopg.Connection[Any],
    statement: Prepared,
    params: Mapping[str, Any],
    prepared: set[str],
) -> list[tuple[Any, ...]]:
    """Run ``statement`` on ``conn`` (autocommit) and fetch its rows, in one round trip when
    ``prepared`` (the names this connection's session is known to have) is right.

    Values are bound on the client (psycopg's quoting), so a ``PREPARE`` and its first
    ``EXECUTE`` share one query; the ``EXECUTE``'s text is a few bytes to parse.
    """
    cursor = psycopg.ClientCursor(conn)
    for _ in range(ATTEMPTS):
        known = statement.name in prepared
        text = statement.execute_sql if known else statement.first_sql
        try:
            cursor.execute(text, params)
        except psycopg.Error as exc:
            if exc.sqlstate == _NOT_PREPARED:
                prepared.discard(statement.name)
                continue
            if exc.sqlstate == _ALREADY_PREPARED and not known:
                prepared.add(statement.name)
                continue
            raise
        prepared.add(statement.name)
        if not known:
            cursor.nextset()  # the EXECUTE's rows follow the PREPARE's empty result
        return cursor.fetchall() if cursor.description else []
    plain = conn.execute(statement.sql, params)
    return plain.fetchall() if plain.description else []
