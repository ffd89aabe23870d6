"""Every statement the key store sends, and the one way they are sent: prepared, once per
connection.

A replay must cost less than running the view it stands for, and it is one round trip either
way; what is left is the server's work, and for the claim's CTE parsing and planning cost more
than running it (measured on the benchmark's server: ~450 µs a call as plain SQL, ~80 µs as a
prepared statement). So each statement is prepared (``PREPARE``) on a connection the first time
that connection needs it, in the same query as its first ``EXECUTE`` when the cursor binds on
the client (Django's default), and then sent as ``EXECUTE name(...)`` through Django's own
cursor (its execute wrappers, query logging and error translation all still apply). When
nothing would see the difference (no query log, no execute wrapper, Django's own cursor path),
the hot path's two queries skip the cursor, whose client CPU is now the larger share: the claim
runs by name with libpq's ``Bind``/``Execute`` (:func:`fetch_one`) and the outcome's write with
its ``COMMIT`` goes as the same text through ``PQexec`` (:func:`owned_write_on`); see
:mod:`idempotency._direct`.
Prepared statements live as long as the database session (a rollback keeps them); a session
that lost them (a pooler that swaps server connections, ``DEALLOCATE ALL``) is detected by
SQLSTATE 26000 and prepared again, outside a transaction (and, for the outcome's write with
its ``COMMIT``, inside one too: see :func:`owned_write_on`). Behind a pooler in transaction mode
that cannot keep SQL-level prepared statements, set ``IDEMPOTENCY["PREPARED_STATEMENTS"] =
False``: the same SQL is then sent as it is.

A write only the key's owner may make (:class:`OwnedWrite`) comes in two forms: one that
reports the rows it changed, and one that raises :data:`LOST` instead, so that a ``COMMIT``
sent in the same round trip (:func:`owned_write`) never runs after a refused write and the
attempt's effects roll back with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from django.db import DatabaseError, connections
from django.db.backends.utils import CursorWrapper

from . import _direct, conf

__all__ = [
    "ASYNC_CLAIM_SQL",
    "BEGIN",
    "FINISH",
    "GATE_SESSION_SQL",
    "GATE_XACT_SQL",
    "LOST",
    "PROBE",
    "RECORD_STEP",
    "RELEASE",
    "ROW_WAIT_SQL",
    "STORE",
    "UNLOCK_SQL",
    "OwnedWrite",
    "Statement",
    "execute",
    "fetch_one",
    "owned_write",
    "owned_write_on",
    "prepare",
]

#: ``invalid_text_representation``: raised on purpose by a statement whose row is gone (see
#: :data:`_REFUSE_UNLESS_ONE`); no other text is cast to a number in these statements.
LOST = "22P02"
_NOT_PREPARED = "26000"
_ALREADY_PREPARED = "42P05"

#: Taken in the same query before a committing write sent by name straight through libpq
#: (:func:`owned_write_on`): if the session lost the statement during the attempt, the
#: ``EXECUTE``'s error aborts only what follows the savepoint, so the write can be prepared
#: and sent again in the same transaction instead of losing the view's work with it.
_WRITE_SAVEPOINT = "SAVEPOINT idempotency_owned_write"
_BACK_TO_WRITE_SAVEPOINT = "ROLLBACK TO SAVEPOINT idempotency_owned_write"

# The last line of a conditional write: one row changed, or an error that aborts the
# transaction (and any COMMIT after it in the same query). The cast's operand is not a
# constant, so the planner cannot fold it into an error of its own.
_LOST_TEXT = "idempotency key lost: "
_REFUSE_UNLESS_ONE = (
    "SELECT CASE WHEN count(*) = 1 THEN 1 "  # noqa: S608 (constants only)
    f"ELSE ('{_LOST_TEXT}' || count(*))::int END FROM changed"
)


@dataclass(frozen=True)
class Statement:
    """SQL with ``%(name)s`` placeholders, and the SQL types of its parameters in order."""

    name: str
    params: tuple[tuple[str, str], ...]
    sql: str
    # Both texts built once: every keyed request sends one of them.
    _prepare: str = field(init=False, repr=False, compare=False)
    _execute: str = field(init=False, repr=False, compare=False)
    #: For libpq (:mod:`idempotency._direct`): the name, and the parameters in ``$n`` order.
    key: bytes = field(init=False, repr=False, compare=False)
    order: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        body = self.sql
        for position, (param, _type) in enumerate(self.params, start=1):
            body = body.replace(f"%({param})s", f"${position}")
        types = ", ".join(sql_type for _param, sql_type in self.params)
        placeholders = ", ".join(f"%({param})s" for param, _type in self.params)
        object.__setattr__(self, "_prepare", f"PREPARE {self.name} ({types}) AS {body}")
        object.__setattr__(self, "_execute", f"EXECUTE {self.name} ({placeholders})")
        object.__setattr__(self, "key", self.name.encode())
        object.__setattr__(self, "order", tuple(param for param, _type in self.params))

    def prepare_sql(self) -> str:
        return self._prepare

    def execute_sql(self) -> str:
        return self._execute


# Evaluated by BEGIN when its ``async`` parameter is true (a claim in autocommit, one implicit
# transaction) and only for a row it claimed: the started row's commit does not wait for the
# WAL to reach the disk, which saves a first request or task one of its two fsyncs. Nothing
# waits on that row being durable: anything the attempt commits afterwards (its effects with the
# outcome, a recorded step) commits synchronously, and flushing that commit flushes all the WAL
# before it, the claim's included. So a server crash can lose only a claim under which nothing
# has committed yet, and losing it frees the key at once, which is what a retry wants (the
# crashed attempt's uncommitted work died with the server). A duplicate sees the row as soon as
# it is committed, durable or not. Local to the claim's own implicit transaction: never asked
# for inside an open transaction, whose commit carries effects. Part of the statement rather
# than a query of its own, so the claim stays one prepared statement that libpq can run by name
# (:mod:`idempotency._direct`).
ASYNC_CLAIM_SQL = "set_config('synchronous_commit', 'off', true)"

# Evaluated by BEGIN when its ``row_wait`` parameter is not NULL (a claim in autocommit), before
# the insert: its wait on a row another transaction holds lasts at most that long (a
# ``lock_timeout``, local to the claim's own implicit transaction). That row may be a started
# row a claim inside an open transaction inserted and will not commit before its request ends;
# a duplicate queued on it for as long, instead of being told 409 or 422 within its own wait.
# Part of the statement, as above, so the uncontended claim stays one round trip; when the
# timeout fires, the caller reads the holder's locks (see ``idempotency.store``). A claim inside
# an open transaction passes NULL: it bounds the wait itself, and a ``SET LOCAL`` there would
# outlast the claim.
ROW_WAIT_SQL = "set_config('lock_timeout', %(row_wait)s::text, true)"


# The claim. A read-only probe first: a key that is there and may not be taken (completed and
# unexpired, or started and locked) is only read, so a replay or a duplicate writes nothing,
# takes no row lock and assigns no transaction id (an INSERT ... ON CONFLICT DO UPDATE locks
# the row it conflicts with even when its WHERE refuses the update). Otherwise an insert that,
# on conflict, takes over only a key whose lock lapsed (a crashed attempt, keeping the steps it
# recorded when the request is the same) or whose TTL passed. ``xmax = 0`` on the returned row
# tells a fresh insert from a take-over. A key committed between the statement's snapshot and
# its conflict check shows up in neither half; the caller runs it again.
#
# "The same request" is the request's fingerprint or its ``legacy`` one (the fingerprint of
# versions up to 0.1.0, see :mod:`idempotency.fingerprint`; the fingerprint itself where there
# is none). A take-over that keeps a crashed attempt's steps keeps its fingerprint too, which
# the steps' derived keys were made from, and returns it as the claim's.
BEGIN = Statement(
    "idempotency_begin_v5",
    (
        ("scope", "text"),
        ("key", "text"),
        ("fingerprint", "text"),
        ("legacy", "text"),
        ("owner", "uuid"),
        ("lock", "float8"),
        ("ttl", "float8"),
        ("row_wait", "text"),
        ("async", "boolean"),
    ),
    """
WITH found AS (
    SELECT id, state, fingerprint, response_status, response_headers, response_body,
           locked_until, expires_at
    FROM idempotency_key WHERE scope = %(scope)s AND key = %(key)s
), claimed AS (
    INSERT INTO idempotency_key AS k (scope, key, fingerprint, state, owner, locked_until,
        response_status, response_headers, response_body, steps, created_at, expires_at)
    SELECT %(scope)s::text, %(key)s::text, %(fingerprint)s::text, 'started', %(owner)s::uuid,
        clock_timestamp() + %(lock)s::float8 * interval '1 second', NULL, '[]'::jsonb, NULL,
        '{}'::jsonb, clock_timestamp(),
        clock_timestamp() + %(ttl)s::float8 * interval '1 second'
    WHERE NOT EXISTS (
        SELECT 1 FROM found f
        WHERE NOT ((f.state = 'completed' AND f.expires_at < clock_timestamp())
            OR (f.state = 'started' AND f.locked_until < clock_timestamp()
                AND (f.fingerprint IN (%(fingerprint)s, %(legacy)s)
                     OR f.expires_at < clock_timestamp())))
    ) AND (%(row_wait)s::text IS NULL OR {ROW_WAIT_SQL} IS NOT NULL)
    ON CONFLICT (scope, key) DO UPDATE SET
        fingerprint = CASE WHEN k.state = 'started' AND k.expires_at >= clock_timestamp()
                                AND k.fingerprint IN (EXCLUDED.fingerprint, %(legacy)s::text)
                           THEN k.fingerprint ELSE EXCLUDED.fingerprint END,
        state = 'started', owner = EXCLUDED.owner,
        locked_until = EXCLUDED.locked_until, response_status = NULL,
        response_headers = '[]'::jsonb, response_body = NULL,
        steps = CASE WHEN k.state = 'started' AND k.expires_at >= clock_timestamp()
                          AND k.fingerprint IN (EXCLUDED.fingerprint, %(legacy)s::text)
                     THEN k.steps ELSE '{}'::jsonb END,
        created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
    WHERE (k.state = 'completed' AND k.expires_at < clock_timestamp())
       OR (k.state = 'started' AND k.locked_until < clock_timestamp()
           AND (k.fingerprint IN (EXCLUDED.fingerprint, %(legacy)s::text)
                OR k.expires_at < clock_timestamp()))
    RETURNING k.id, CASE WHEN k.xmax = 0 THEN 'new' ELSE 'taken_over' END AS kind, k.steps,
              k.fingerprint
)
SELECT id, kind, NULL, fingerprint, NULL, NULL, NULL, 0.0, steps,
       CASE WHEN %(async)s THEN {ASYNC_CLAIM_SQL} END
FROM claimed
UNION ALL
SELECT id, 'existing', state, fingerprint, response_status, response_headers, response_body,
       extract(epoch FROM locked_until - clock_timestamp())::float8, NULL, NULL
FROM found WHERE NOT EXISTS (SELECT 1 FROM claimed)
""".replace("{ASYNC_CLAIM_SQL}", ASYNC_CLAIM_SQL).replace("{ROW_WAIT_SQL}", ROW_WAIT_SQL),
)


# The writes below find their row by ``id`` and ``owner`` alone. Only a claim sets ``owner`` (a
# new UUID per attempt, with ``state = 'started'``), and finishing or releasing clears it, so a
# matching owner already means "started"; a ``state = 'started'`` test would add nothing but
# a match for the partial index of started keys, which the planner then preferred to the
# primary key (its generic plan walked that index, dead entries and all, to find one id).
@dataclass(frozen=True)
class OwnedWrite:
    """An UPDATE only the key's owner may make, in two forms: ``counting`` answers with the
    rows it changed (0: the key was taken over); ``strict`` raises :data:`LOST` instead, so a
    ``COMMIT`` sent after it in the same query runs only when it changed its row."""

    counting: Statement
    strict: Statement


def _owned(name: str, params: tuple[tuple[str, str], ...], update: str) -> OwnedWrite:
    body = f"WITH changed AS (\n{update}\n    RETURNING 1\n)\n"
    counting = body + "SELECT count(*) FROM changed"  # noqa: S608 (constants only)
    return OwnedWrite(
        Statement(name, params, counting),
        Statement(f"{name}_strict", params, body + _REFUSE_UNLESS_ONE),
    )


# Store the outcome.
FINISH = _owned(
    "idempotency_finish_v3",
    (
        ("id", "bigint"),
        ("owner", "uuid"),
        ("status", "integer"),
        ("headers", "jsonb"),
        ("body", "bytea"),
        ("ttl", "float8"),
    ),
    """    UPDATE idempotency_key
    SET state = 'completed', owner = NULL, locked_until = NULL,
        response_status = %(status)s::integer, response_headers = %(headers)s::jsonb,
        response_body = %(body)s::bytea, steps = '{}'::jsonb,
        expires_at = clock_timestamp() + %(ttl)s::float8 * interval '1 second'
    WHERE id = %(id)s AND owner = %(owner)s""",
)

# A started row's recorded steps are kept for a retry until its ``expires_at``, which BEGIN
# and PROBE (steps reset on a take-over past it) and the purge (row deleted past it) all read.
# Set at the claim, it would count the TTL from the claim: an operation that ran or waited
# longer than the TTL lost the steps it had committed, while still running or right after
# failing, and its retry ran them again. So recording a step and giving the key up push it to
# at least TTL from then: the TTL counts from the attempt's last step or its failure.
_STEPS_KEPT_SQL = (
    "expires_at = greatest(expires_at, clock_timestamp() + %(ttl)s::float8 * interval '1 second')"
)

# A completed step, recorded in the transaction of its local effects; it renews the lock, so
# LOCK_TIMEOUT bounds one step rather than the whole operation, and the key's TTL (see above).
RECORD_STEP = _owned(
    "idempotency_record_step_v3",
    (
        ("id", "bigint"),
        ("owner", "uuid"),
        ("step", "text"),
        ("result", "jsonb"),
        ("lock", "float8"),
        ("ttl", "float8"),
    ),
    f"""    UPDATE idempotency_key
    SET steps = steps || jsonb_build_object(%(step)s::text, %(result)s::jsonb),
        locked_until = clock_timestamp() + %(lock)s::float8 * interval '1 second',
        {_STEPS_KEPT_SQL}
    WHERE id = %(id)s AND owner = %(owner)s""",  # noqa: S608 (constants only)
)

# A failed attempt gives its key up: deleted when it recorded no step, so the retry starts
# afresh; unlocked (kept, for a TTL from now) when it did, so the retry resumes after the last
# recorded step instead of redoing effects that committed. Never another owner's key.
RELEASE = Statement(
    "idempotency_release_v4",
    (("id", "bigint"), ("owner", "uuid"), ("ttl", "float8")),
    f"""
WITH unlocked AS (
    UPDATE idempotency_key SET owner = NULL, locked_until = clock_timestamp(), {_STEPS_KEPT_SQL}
    WHERE id = %(id)s AND owner = %(owner)s AND steps <> '{{}}'::jsonb
)
DELETE FROM idempotency_key
WHERE id = %(id)s AND owner = %(owner)s AND steps = '{{}}'::jsonb
""",  # noqa: S608 (constants only)
)

# A claim in the view's transaction (``claim_in_transaction``) writes nothing before the view
# runs: the key is held by an advisory lock on the key's hash, and its row is written once, with
# the response, in the view's transaction (STORE). The lock is taken by a statement of its own
# that runs before the look (PROBE, in the same query): under READ COMMITTED each statement
# takes a new snapshot, so a look that follows the lock sees every attempt that committed and
# unlocked before it (a lock taken by the look itself could come after its snapshot, and a
# duplicate would run the view while the first one's row was already committed). The lock's
# outcome goes from one statement to the next through a setting of the session (not local to
# the transaction: a driver binding on the server sends the two as queries of their own).
# Outside a transaction the lock is the session's (released after the COMMIT that stores the
# row, in the same query); inside one it is the transaction's, released with it.
#
# A duplicate that finds the gate held must tell a retry of the running request (409) from
# another request under the same key (422, running or not: the draft's 409 is for a request
# whose key *and* fingerprint were seen). No row says what the holder runs, so the holder shows
# its fingerprint by a second lock, the request's (``request_gate``, on the hash of the key and
# the fingerprint), which every claim takes *before* the gate and holds as long. Then: the
# request's lock held elsewhere is an attempt of this request (``busy``); the request's lock
# ours but the gate held is an attempt of another request (``other``), since a holder of this
# fingerprint would hold its lock; both ours is the claim (``held``). Taken in the other order,
# a holder of this fingerprint could be seen between its two locks and the retry answered 422.
# A session's request lock is given back at once when the gate was not had; a transaction's
# stays until it ends (another retry of this request meanwhile is told 409, never 422). CASE
# evaluates its conditions in order, and only as far as needed. A row claim inside an open
# transaction takes the transaction's two locks too, in a savepoint it rolls back (giving them
# back) unless it claims the row: its row stays uncommitted, so they are all a duplicate can
# read (see :func:`idempotency.store._claim_in_transaction`).
GATE_SESSION_SQL = """SELECT set_config('idempotency.gate', CASE
    WHEN NOT pg_try_advisory_lock(%(request_gate)s::bigint) THEN 'busy'
    WHEN pg_try_advisory_lock(%(gate)s::bigint) THEN 'held'
    WHEN pg_advisory_unlock(%(request_gate)s::bigint) THEN 'other'
    ELSE 'other' END, false)"""
GATE_XACT_SQL = """SELECT set_config('idempotency.gate', CASE
    WHEN NOT pg_try_advisory_xact_lock(%(request_gate)s::bigint) THEN 'busy'
    WHEN pg_try_advisory_xact_lock(%(gate)s::bigint) THEN 'held'
    ELSE 'other' END, false)"""
UNLOCK_SQL = (
    "SELECT pg_advisory_unlock(%(gate)s::bigint), pg_advisory_unlock(%(request_gate)s::bigint)"
)

# The look after the gate: one row whatever is there. ``kind`` is ``claimed`` (the key is free
# or may be taken over, and the gate was ours), ``busy`` (free, but an attempt of this request
# holds the gate: it runs in a transaction not yet committed), ``other`` (free, but an attempt
# of another request holds it) or ``existing`` (a row that may not be taken, reported as BEGIN
# reports it). A session's locks taken for a key that turned out not to be free are given back
# here (``session``), so a replay holds nothing. The steps of a crashed
# attempt of the same request come back (else NULL), and the claim keeps that row's fingerprint,
# as BEGIN does.
PROBE = Statement(
    "idempotency_probe_v2",
    (
        ("scope", "text"),
        ("key", "text"),
        ("fingerprint", "text"),
        ("legacy", "text"),
        ("gate", "bigint"),
        ("request_gate", "bigint"),
        ("session", "boolean"),
    ),
    """
WITH found AS (
    SELECT id, state, fingerprint, response_status, response_headers, response_body,
           locked_until, expires_at, steps,
           (state = 'completed' AND expires_at < clock_timestamp())
           OR (state = 'started' AND locked_until < clock_timestamp()
               AND (fingerprint IN (%(fingerprint)s, %(legacy)s)
                    OR expires_at < clock_timestamp())) AS free
    FROM idempotency_key WHERE scope = %(scope)s AND key = %(key)s
), look AS (
    SELECT f.*, coalesce(f.free, true) AS claimable,
           coalesce(current_setting('idempotency.gate', true), '') AS gate
    FROM (SELECT 1) AS one LEFT JOIN found AS f ON true
)
SELECT CASE WHEN NOT claimable THEN 'existing' WHEN gate = 'held' THEN 'claimed'
            WHEN gate = 'other' THEN 'other' ELSE 'busy' END,
       id, state, fingerprint, response_status, response_headers, response_body,
       extract(epoch FROM locked_until - clock_timestamp())::float8,
       CASE WHEN claimable AND state = 'started' AND fingerprint IN (%(fingerprint)s, %(legacy)s)
                 AND expires_at >= clock_timestamp() THEN steps END,
       CASE WHEN NOT claimable AND gate = 'held' AND %(session)s
            THEN pg_advisory_unlock(%(gate)s)::int + pg_advisory_unlock(%(request_gate)s)::int
       END
FROM look
""",
)

# The row of a claim made in the view's transaction, written with the response in that
# transaction: inserted, or written over a row the claim found free (expired, or a crashed
# attempt's lapsed lock). It refuses (LOST) a row that is no longer free: another attempt
# committed the key first, and this one's effects must roll back with the refusal.
STORE = _owned(
    "idempotency_store_v1",
    (
        ("scope", "text"),
        ("key", "text"),
        ("fingerprint", "text"),
        ("status", "integer"),
        ("headers", "jsonb"),
        ("body", "bytea"),
        ("ttl", "float8"),
    ),
    """    INSERT INTO idempotency_key AS k (scope, key, fingerprint, state, owner, locked_until,
        response_status, response_headers, response_body, steps, created_at, expires_at)
    VALUES (%(scope)s::text, %(key)s::text, %(fingerprint)s::text, 'completed', NULL, NULL,
        %(status)s::integer, %(headers)s::jsonb, %(body)s::bytea, '{}'::jsonb, clock_timestamp(),
        clock_timestamp() + %(ttl)s::float8 * interval '1 second')
    ON CONFLICT (scope, key) DO UPDATE SET
        fingerprint = EXCLUDED.fingerprint, state = 'completed', owner = NULL,
        locked_until = NULL, response_status = EXCLUDED.response_status,
        response_headers = EXCLUDED.response_headers, response_body = EXCLUDED.response_body,
        steps = '{}'::jsonb, created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
    WHERE (k.state = 'completed' AND k.expires_at < clock_timestamp())
       OR (k.state = 'started' AND k.locked_until < clock_timestamp()
           AND (k.fingerprint = EXCLUDED.fingerprint OR k.expires_at < clock_timestamp()))""",
)

PREPARED_NAMES_SQL = "SELECT name FROM pg_prepared_statements WHERE name = ANY(%(names)s)"

# psycopg connection -> names prepared on it (a new connection starts empty).
_PREPARED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _sqlstate(exc: BaseException) -> str | None:
    return getattr(exc.__cause__, "sqlstate", None)


def _lost(exc: BaseException) -> bool:
    """Whether ``exc`` is :data:`LOST` raised on purpose (:data:`_REFUSE_UNLESS_ONE`), not the
    same SQLSTATE for another reason (a step result that is not valid ``jsonb``, which was
    reported as the key lost)."""
    return _sqlstate(exc) == LOST and _LOST_TEXT in str(exc.__cause__)


def one_query(cursor: CursorWrapper) -> bool:
    """Whether the cursor sends its text as one simple query, so several statements (a
    ``PREPARE`` and its first ``EXECUTE``, a write and its ``COMMIT``) share a round trip:
    Django's default client-side binding does; ``server_side_binding`` does not."""
    return isinstance(cursor.cursor, psycopg.ClientCursor)


def _prepares(cursor: CursorWrapper) -> bool:
    """Whether statements go as SQL-level prepared statements on this cursor: as configured,
    and only with client-side binding. A connection binding on the server would send
    ``EXECUTE name(...)`` with bind parameters, which PostgreSQL refuses (a utility statement
    takes none); it gets the plain SQL, which psycopg prepares itself once it has been sent
    ``prepare_threshold`` times."""
    return conf.get().prepared_statements and one_query(cursor)


def _text(cursor: CursorWrapper, statement: Statement) -> str:
    """The text to send for ``statement`` on this cursor's connection: ``EXECUTE``, preceded
    by its ``PREPARE`` in the same query the first time."""
    if not _prepares(cursor):
        return statement.sql
    names = _PREPARED.setdefault(cursor.db.connection, set())
    if statement.name in names:
        return statement.execute_sql()
    names.add(statement.name)
    return f"{statement.prepare_sql()}; {statement.execute_sql()}"


def _run(
    cursor: CursorWrapper, text: str, params: dict[str, Any], rows_at: int | None = None
) -> None:
    """Send ``text`` and leave the cursor on the rows of its statement number ``rows_at``
    (from 0), by default its last (after a PREPARE, a gate)."""
    cursor.execute(text, params)
    # The driver's own ``nextset`` under the connection's error translation: going through the
    # wrapper's attribute lookup would build a translating function on every call.
    driver = cursor.cursor
    with cursor.db.wrap_database_errors:
        if rows_at is None:
            while driver.nextset():
                pass
        else:
            for _ in range(rows_at):
                driver.nextset()


def _composed(
    cursor: CursorWrapper, statement: Statement, before: str, after: str = ""
) -> tuple[str, int]:
    """The query that sends ``statement`` between ``before`` and ``after``, and the number of
    the statement whose rows count."""
    text = _text(cursor, statement)
    parts = [part for part in (before, text, after) if part]
    rows_at = (1 if before else 0) + (1 if text.startswith("PREPARE ") else 0)
    return "; ".join(parts), rows_at


def _forget(cursor: CursorWrapper) -> None:
    _PREPARED.pop(cursor.db.connection, None)


def execute(
    cursor: CursorWrapper,
    statement: Statement,
    params: dict[str, Any],
    *,
    before: str = "",
    undo_before: str = "",
    after: str = "",
) -> None:
    """Run ``statement``; a session that lost its prepared statements (or has one of ours
    we did not know of) prepares them again, outside a transaction only: inside one the error
    has aborted it, so it propagates. ``before`` (SQL) runs first in the same query when the
    cursor sends one query (else as a query of its own), ``after`` last (else as a query of its
    own on another cursor, so this one keeps the statement's rows); ``after`` does not run when
    the statement fails. The cursor is left on the statement's rows. When the statement has to
    be sent again, ``undo_before`` runs first (``before`` already ran: a session lock it took
    would otherwise be taken twice)."""
    alone = ""
    if not one_query(cursor):
        if before:
            cursor.execute(before, params)
        before, alone, after = "", after, ""
    try:
        text, rows_at = _composed(cursor, statement, before, after)
        _run(cursor, text, params, rows_at)
    except DatabaseError as exc:
        if _sqlstate(exc) not in (_NOT_PREPARED, _ALREADY_PREPARED):
            raise
        _forget(cursor)
        if not cursor.db.get_autocommit():
            raise
        if _sqlstate(exc) == _ALREADY_PREPARED:
            cursor.execute(f"DEALLOCATE {statement.name}")
        if before and undo_before:
            cursor.execute(undo_before, params)
        text, rows_at = _composed(cursor, statement, before, after)
        _run(cursor, text, params, rows_at)
    if alone:
        with cursor.db.cursor() as other:
            other.execute(alone, params)


def fetch_one(using: str, statement: Statement, params: dict[str, Any]) -> tuple[Any, ...] | None:
    """The first row of ``statement`` run alone on ``using``'s connection (None: no row).

    Run by name through libpq when nothing watches the connection and its session is known to
    have the statement (:mod:`idempotency._direct`), else sent as :func:`execute` sends it. A
    session found without it (SQLSTATE 26000, nothing ran) is handled as there: forgotten, and
    outside a transaction the statement is prepared again through the cursor."""
    connection = connections[using]
    conn = _direct.connection(connection) if conf.get().prepared_statements else None
    if conn is not None and statement.name in _PREPARED.get(conn, ()):
        try:
            rows = _direct.run(connection, conn, statement.key, statement.order, params)
        except DatabaseError as exc:
            if _sqlstate(exc) != _NOT_PREPARED:
                raise
            _PREPARED.pop(conn, None)
            if not connection.get_autocommit():
                raise
        else:
            return rows[0] if rows else None
    with connection.cursor() as cursor:
        execute(cursor, statement, params)
        return cursor.fetchone() if cursor.description else None


def _each(statements: tuple[Statement | OwnedWrite, ...]) -> Iterator[Statement]:
    """The statements to prepare: an :class:`OwnedWrite` is both of its forms."""
    for statement in statements:
        if isinstance(statement, OwnedWrite):
            yield statement.counting
            yield statement.strict
        else:
            yield statement


def prepare(using: str, *statements: Statement | OwnedWrite) -> None:
    """Prepare statements an attempt will send inside its transaction, while outside it (one
    round trip, once per connection): a statement found missing there would abort the view's
    work."""
    if not conf.get().prepared_statements:
        return
    connection = connections[using]
    connection.ensure_connection()
    names = _PREPARED.get(connection.connection)
    if names is not None and all(statement.name in names for statement in _each(statements)):
        return  # the common case, on every keyed request: nothing to list, no cursor made
    names = _PREPARED.setdefault(connection.connection, set())
    missing = [statement for statement in _each(statements) if statement.name not in names]
    if not missing:
        return
    with connection.cursor() as cursor:
        if not _prepares(cursor):
            return
        # A new session has none; one whose bookkeeping was dropped after a loss may have some.
        cursor.execute(PREPARED_NAMES_SQL, {"names": [statement.name for statement in missing]})
        names.update(name for (name,) in cursor.fetchall())
        missing = [statement for statement in missing if statement.name not in names]
        if not missing:
            return
        cursor.execute("; ".join(statement.prepare_sql() for statement in missing))
    names.update(statement.name for statement in missing)


def owned_write(
    cursor: CursorWrapper,
    write: OwnedWrite,
    params: dict[str, Any],
    *,
    commit: bool,
    after_commit: str = "",
) -> bool:
    """Run ``write``; False when the key was taken over (nothing changed, nothing committed).

    With ``commit`` (the caller's outermost atomic block), the transaction is committed in the
    same round trip when the driver allows (client-side binding sends ``...; COMMIT`` as one
    query, the strict form keeping a refused write from committing); Django's ``atomic`` exit
    then finds the transaction committed and only runs its on-commit hooks. Otherwise the
    counting form runs alone and the caller's block commits. ``after_commit`` (SQL) follows
    the COMMIT in the same query; it runs only when the write and the COMMIT did.
    """
    if not (commit and one_query(cursor)):
        execute(cursor, write.counting, params)
        row = cursor.fetchone()
        return row is not None and row[0] == 1
    try:
        text = f"{_text(cursor, write.strict)}; COMMIT"
        _run(cursor, f"{text}; {after_commit}" if after_commit else text, params)
    except DatabaseError as exc:
        if _lost(exc):
            return False
        raise
    return True


def owned_write_on(
    using: str,
    write: OwnedWrite,
    params: dict[str, Any],
    *,
    commit: bool,
    after_commit: str = "",
) -> tuple[bool, bool]:
    """:func:`owned_write` on ``using``'s connection: whether the write changed its row, and
    whether its query carried the transaction's ``COMMIT``. Committing, and when nothing
    watches the connection and its session is known to have the statement, the query goes
    straight through libpq (:func:`idempotency._direct.run_text`: the text the cursor would
    send, without the cursor), after a savepoint: a session that lost the statement since the
    attempt began (SQLSTATE 26000, nothing written) has it prepared and sent again in the same
    transaction, so the request does not fail and the view's work is kept."""
    connection = connections[using]
    conn = _direct.connection(connection) if commit and conf.get().prepared_statements else None
    if (
        conn is not None
        and write.strict.name in _PREPARED.get(conn, ())
        and conn.pgconn.transaction_status == _direct.IN_TRANSACTION
    ):
        after = [after_commit] if after_commit else []
        texts = [_WRITE_SAVEPOINT, write.strict.execute_sql(), "COMMIT", *after]
        try:
            _direct.run_text(connection, conn, texts, params)
        except DatabaseError as exc:
            if _lost(exc):
                return False, False
            if _sqlstate(exc) != _NOT_PREPARED:
                raise
            # The session lost its statements during the attempt (the view's DEALLOCATE ALL,
            # a pooler's reset): nothing of the write ran, and the savepoint kept the view's
            # work, so the write is prepared and sent again in the same transaction.
            _PREPARED.pop(conn, None)
            texts = [_BACK_TO_WRITE_SAVEPOINT, write.strict.prepare_sql(), *texts[1:]]
            try:
                _direct.run_text(connection, conn, texts, params)
            except DatabaseError as again:
                if _lost(again):
                    return False, False
                raise
            _PREPARED.setdefault(conn, set()).add(write.strict.name)
        return True, True
    with connection.cursor() as cursor:
        committed = commit and one_query(cursor)
        done = owned_write(cursor, write, params, commit=commit, after_commit=after_commit)
    return done, committed
