"""The claim run by name through libpq, when nothing watches the connection's queries.

Every keyed request starts with the claim (:data:`~idempotency.statements.BEGIN`), which also
answers a replay. Through Django's cursor, ``EXECUTE name(...)`` costs the client 140-180 µs of
CPU a call (measured on the benchmark's machine: Django's cursor wrapper, psycopg's cursor, the
values quoted into the text, the result sets), and the server parses that text before running
the plan it prepared. Run by name with libpq's ``Bind``/``Execute`` (the values sent apart from
the text, as :mod:`leases.backends._pgprepared` runs the lease statements) it costs about
55 µs, and the server parses nothing. Rows are loaded with the connection's own adapters, so
they come back as from a cursor, and errors come back as Django's (the connection's error
translation), with the SQLSTATE the cursor path would see.

Only when nothing would miss the query: no query log (``DEBUG``, ``CaptureQueriesContext`` and
``assertNumQueries`` in tests), no execute wrapper, Django's own cursor path (an agent or a
debug toolbar that watches queries replaces ``cursor()`` on the connection, the cursor
wrapper's ``execute`` or psycopg's cursor class: then the store's queries go through the
cursor, where it sees them), and only for a statement the session is known to have prepared:
the first use of one, its recovery after a session lost it, server-side binding and
``PREPARED_STATEMENTS = False`` all go through the cursor as before.
"""

from __future__ import annotations

import contextlib
import os
import re
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import django
import psycopg
from django.db.backends.utils import CursorWrapper
from psycopg import abc, pq
from psycopg.adapt import PyFormat, Transformer

from leases._pgnotifies import keep_notifies

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["IN_TRANSACTION", "connection", "run", "run_text"]

_DJANGO = os.path.dirname(django.__file__) + os.sep
# What a debug toolbar or an agent sets on a connection to watch its cursors.
_CURSOR_HOOKS = ("cursor", "chunked_cursor", "make_cursor", "make_debug_cursor", "create_cursor")
# (cursor wrapper's execute, connection's cursor, make_cursor) -> whether all are Django's.
_STOCK: dict[tuple[Any, ...], bool] = {}
_IDLE = pq.TransactionStatus.IDLE
IN_TRANSACTION = _INTRANS = pq.TransactionStatus.INTRANS
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
# A query text -> its pieces between placeholders (encoded) and the placeholders' names.
_SPLIT: dict[str, tuple[tuple[bytes, ...], tuple[str, ...]]] = {}
# Where a psycopg connection keeps the Transformer its statements are dumped and loaded with.
_TRANSFORMER_ATTR = "_idempotency_transformer"


def _djangos(function: Any) -> bool:
    """Whether ``function`` is still Django's own: an agent's replacement or wrapper has its
    code in its own package, or is not a plain function at all."""
    return type(function) is types.FunctionType and function.__code__.co_filename.startswith(
        _DJANGO
    )


def connection(db: BaseDatabaseWrapper) -> psycopg.Connection[Any] | None:
    """The psycopg connection to run a statement on by name, or None when it must go through
    Django's cursor: something logs or wraps queries, or the connection is in a state only the
    cursor handles (a transaction psycopg has yet to open, a broken atomic block, a pipeline),
    or it is not a psycopg connection with Django's own client-side binding cursors."""
    if db.queries_logged or db.execute_wrappers or db.needs_rollback:
        return None
    if not vars(db).keys().isdisjoint(_CURSOR_HOOKS):
        return None
    kind = type(db)
    functions = (CursorWrapper.execute, kind.cursor, kind.make_cursor)
    stock = _STOCK.get(functions)
    if stock is None:
        stock = _STOCK[functions] = all(_djangos(function) for function in functions)
    if not stock:
        return None
    db.close_if_health_check_failed()
    db.ensure_connection()  # refused in an event loop's thread, as a cursor would be
    db.validate_thread_sharing()
    conn = db.connection
    if not isinstance(conn, psycopg.Connection):
        return None
    factory = conn.cursor_factory
    if not (factory.__module__.startswith("django.") and issubclass(factory, psycopg.ClientCursor)):
        return None  # an agent's cursor class, or binding on the server
    pgconn = conn.pgconn
    status = pgconn.transaction_status
    if not (status == _INTRANS or (status == _IDLE and conn.autocommit)):
        return None  # psycopg would send BEGIN first, or the transaction failed
    if pgconn.pipeline_status:
        return None
    return conn


def _tx(conn: psycopg.Connection[Any]) -> abc.Transformer:
    """The connection's Transformer, made once: it keeps the dumpers and loaders it looked up
    (a new one per call looked them all up again). Safe to keep: it reads the connection's
    adapters map, and the only adapter Django changes on a live connection is the
    ``timestamptz`` loader (``ensure_timezone``), which no statement sent here loads (no
    parameter is a datetime, no returned column a timestamp). Used under ``conn.lock`` only,
    so threads sharing a connection take turns with it as with the connection.

    Kept on the connection itself: the Transformer refers to its connection, so a mapping
    keyed by connections (even weakly) would keep every closed one alive; as an attribute it
    makes a cycle that goes with the connection."""
    tx: abc.Transformer | None = getattr(conn, _TRANSFORMER_ATTR, None)
    if tx is None:
        tx = Transformer(conn)
        with contextlib.suppress(AttributeError):  # a connection class that takes no attribute
            setattr(conn, _TRANSFORMER_ATTR, tx)
    return tx


def run(
    db: BaseDatabaseWrapper,
    conn: psycopg.Connection[Any],
    name: bytes,
    order: Sequence[str],
    params: Mapping[str, Any],
) -> list[tuple[Any, ...]]:
    """The rows of prepared statement ``name`` run with ``params`` (in ``order``), the values
    in text form, which the server parses as the types the statement was prepared with."""
    with db.wrap_database_errors, conn.lock:
        tx = _tx(conn)
        values = tx.dump_sequence([params[key] for key in order], _formats(len(order)))
        pgconn = conn.pgconn
        result = pgconn.exec_prepared(name, values)  # type: ignore[arg-type]  # NULLs
        keep_notifies(pgconn)
        return _rows(conn, tx, result)


def run_text(
    db: BaseDatabaseWrapper,
    conn: psycopg.Connection[Any],
    texts: Sequence[str],
    params: Mapping[str, Any],
) -> list[tuple[Any, ...]]:
    """The rows of the last of ``texts`` (``%(name)s`` placeholders), sent as one simple query
    whose values are quoted as psycopg's client-side cursor quotes them: the very query the
    cursor would send. ``PQexec`` keeps the last result, or the error that stopped the query
    (a statement after a failed one does not run)."""
    with db.wrap_database_errors, conn.lock:
        tx = _tx(conn)
        query = b"; ".join([_render(tx, text, params) for text in texts])
        pgconn = conn.pgconn
        result = pgconn.exec_(query)
        keep_notifies(pgconn)
        return _rows(conn, tx, result)


_FORMATS: dict[int, tuple[PyFormat, ...]] = {}


def _formats(count: int) -> tuple[PyFormat, ...]:
    """``count`` text formats (the values go as text, parsed as the prepared types)."""
    formats = _FORMATS.get(count)
    if formats is None:
        formats = _FORMATS[count] = (PyFormat.TEXT,) * count
    return formats


def _render(tx: Any, text: str, params: Mapping[str, Any]) -> bytes:
    split = _SPLIT.get(text)
    if split is None:
        pieces = _PLACEHOLDER.split(text)
        split = _SPLIT[text] = tuple(p.encode() for p in pieces[::2]), tuple(pieces[1::2])
    literals, names = split
    out = [literals[0]]
    for name, literal in zip(names, literals[1:], strict=True):
        value = params[name]
        out.append(b"NULL" if value is None else tx.as_literal(value))
        out.append(literal)
    return b"".join(out)


def _rows(conn: psycopg.Connection[Any], tx: Any, result: pq.abc.PGresult) -> list[tuple[Any, ...]]:
    """A result's rows as a cursor would load them, or its error raised (in the caller's
    ``wrap_database_errors``, which makes it Django's)."""
    status = result.status
    if status == pq.ExecStatus.TUPLES_OK:
        tx.set_pgresult(result)
        rows: list[tuple[Any, ...]] = tx.load_rows(0, result.ntuples, tuple)
        return rows
    if status == pq.ExecStatus.COMMAND_OK:
        return []
    if status == pq.ExecStatus.FATAL_ERROR:
        raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    raise psycopg.InterfaceError(f"unexpected result from the server: {pq.ExecStatus(status).name}")
