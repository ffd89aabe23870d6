"""Advisory xact/session locks: our helpers vs the raw driver, Django's cursor and django-pglock.

Every contender takes and releases one uncontended lock per operation (``BEGIN; lock; COMMIT``
for transaction locks, lock then unlock for session locks) on the same server in the same run.
Round trips are counted from the wire: libpq's protocol trace shows one ``ReadyForQuery`` per
round trip, so nothing depends on how a library structures its calls.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psycopg
from django.db import connection, transaction
from django.test import override_settings
from psycopg import pq

from benchmarks.common import Report, settle
from leases import advisory
from leases.keys import advisory_key

TITLE = "advisory locks: leases.advisory vs psycopg, Django's cursor, django-pglock"

NAME = "bench:advisory"
TIMEOUT = 5.0
ROUNDS = 9
RAW_LOCK_SQL = "SELECT pg_advisory_xact_lock(%s)"
# The same single message xact_lock(timeout=...) sends, for the floor of the timed variant.
RAW_TIMED_SQL = advisory.TIMED_CALL_IN_TRANSACTION_SQL.format(
    timeout_ms=int(TIMEOUT * 1000), function="pg_advisory_xact_lock", key=advisory_key(NAME)
)


def _raw_connection() -> psycopg.Connection[Any]:
    """A plain driver connection made the way Django makes its own (same cursor class)."""
    return psycopg.connect(**connection.get_connection_params())


def round_trips(pgconn: pq.abc.PGconn, fn: Callable[[], object]) -> int:
    """Round trips ``fn`` makes on ``pgconn``: ReadyForQuery messages in libpq's trace."""
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            fn()
        finally:
            pgconn.untrace()
        trace.seek(0)
        return sum(1 for line in trace if line.split("\t")[:3:2] == ["B", "ReadyForQuery"])


def _django_cursor(sql: str, params: list[int] | None) -> Callable[[], None]:
    def run() -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, params)
            while cursor.nextset():
                pass

    return run


def xact_contenders(raw: psycopg.Connection[Any], timeout: float | None) -> dict[str, Any]:
    import pglock

    key = advisory_key(NAME)
    assert isinstance(key, int)  # a name hashes to one int64 key

    def psycopg_raw() -> None:
        if timeout is None:
            raw.execute(RAW_LOCK_SQL, [key])
        else:
            raw.execute(RAW_TIMED_SQL.encode())
        raw.commit()

    def ours() -> None:
        with transaction.atomic(), advisory.xact_lock(NAME, timeout=timeout):
            pass

    def peer() -> None:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        with pglock.advisory(NAME, xact=True, **kwargs):
            pass

    sql, params = (RAW_LOCK_SQL, [key]) if timeout is None else (RAW_TIMED_SQL, None)
    return {
        "psycopg, same SQL (floor)": (psycopg_raw, raw.pgconn),
        "Django cursor, same SQL": (_django_cursor(sql, params), None),
        "leases.advisory.xact_lock": (ours, None),
        "django-pglock advisory(xact=True)": (peer, None),
    }


def session_contenders() -> dict[str, Any]:
    import pglock

    key = advisory_key(NAME)

    def django_cursor() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [key])
            cursor.execute("SELECT pg_advisory_unlock(%s)", [key])

    def django_cursors() -> None:
        """What a lock around a block written by hand does: the block runs between the two
        statements, so each has a cursor of its own, and the unlock's answer is read (false:
        the session did not hold the lock)."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [key])
            cursor.fetchone()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
            if not cursor.fetchone()[0]:
                raise RuntimeError("the unlock found no lock")

    def ours() -> None:
        with advisory.session_lock(NAME):
            pass

    def peer() -> None:
        with pglock.advisory(NAME):
            pass

    return {
        "Django cursor, lock + unlock": (django_cursor, None),
        "Django cursor per statement, unlock checked": (django_cursors, None),
        "leases.advisory.session_lock": (ours, None),
        "django-pglock advisory()": (peer, None),
    }


def _timed(fn: Callable[[], object], ops: int) -> tuple[float, float]:
    """(wall, client CPU) seconds per call over ``ops`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(ops):
        fn()
    return (time.perf_counter() - wall) / ops, (time.process_time() - cpu) / ops


def _measure(report: Report, title: str, contenders: dict[str, Any]) -> None:
    """Time contenders in interleaved rounds (a shared machine's load drifts), keep medians.

    Client CPU per operation is reported too: it is what a library adds on top of the same
    round trips, and it is much less disturbed by other processes than wall time.
    """
    connection.ensure_connection()
    ops = int(os.environ.get("BENCH_OPS", "200"))
    walls: dict[str, list[float]] = {label: [] for label in contenders}
    cpus: dict[str, list[float]] = {label: [] for label in contenders}
    for fn, _pgconn in contenders.values():
        _timed(fn, ops // 5)  # warm up connections, caches and psycopg's per-query state
    for _ in range(ROUNDS):
        for label, (fn, _pgconn) in contenders.items():
            settle(fn)
            wall, cpu = _timed(fn, ops)
            walls[label].append(wall)
            cpus[label].append(cpu)
    report.table(f"{title}: wall time", [(k, statistics.median(v)) for k, v in walls.items()])
    report.table(f"{title}: client CPU", [(k, statistics.median(v)) for k, v in cpus.items()])
    trips = [
        f"{label} {round_trips(pgconn or connection.connection.pgconn, fn)}"
        for label, (fn, pgconn) in contenders.items()
    ]
    report.note("round trips per operation: " + "; ".join(trips))


def main(report: Report) -> None:
    # Production settings: DEBUG's query log would tax every Django-based contender.
    with override_settings(DEBUG=False):
        raw = _raw_connection()
        try:
            _measure(report, "xact lock, BEGIN + lock + COMMIT", xact_contenders(raw, None))
            _measure(
                report,
                f"xact lock with timeout={TIMEOUT:g}s (uncontended)",
                xact_contenders(raw, TIMEOUT),
            )
            _measure(report, "session lock + unlock (autocommit)", session_contenders())
        finally:
            raw.close()
    report.note(
        "Target (issue 2): xact_lock within 1.1x of Django's cursor, no slower than pglock, "
        "and no extra round trip for a timeout."
    )
