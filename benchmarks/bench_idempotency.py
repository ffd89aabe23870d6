"""``@idempotent`` on a trivial POST view: overhead, round trips, replay; drf-idempotency too.

The view inserts one row (a payment) and answers 201. Contenders, on the same server in one run:
the undecorated view in autocommit, the same view in ``transaction.atomic()`` (what atomic mode
needs anyway: the effect and the key commit together), ``@idempotent`` with a new key per
request, ``@idempotent`` replaying a stored response, the same two with
``claim_in_transaction=True`` (the key claimed by an advisory lock in the view's transaction,
its row written once, with the response: one commit a request instead of two), and
drf-idempotency's ``@idempotent()`` (database backend) on the same view when it is installed,
and a hand-written floor (:func:`_naive`): the least SQL a correct key needs, in the package's
round trips, on a table with nothing but its primary key and its unique ``(scope, key)``.
Views are called directly with RequestFactory requests, so middleware costs are left out for
everyone alike. Round trips are counted on the wire (libpq trace), as in the advisory
benchmark.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory, override_settings

from benchmarks.bench_advisory import round_trips
from benchmarks.common import Report, interleaved
from demo_project.payments.models import Payment
from demo_project.payments.scopes import by_api_key
from idempotency import idempotent
from idempotency.models import IdempotencyKey

TITLE = "idempotency: @idempotent vs the undecorated view, and drf-idempotency"

BODY = json.dumps({"amount": 1000, "currency": "EUR"})
PREFIX = "bench-idem-"
OPS = 100
ROUNDS = 11
GATED_FIRST = "claim_in_transaction, first request"
GATED_REPLAY = "claim_in_transaction, replay"
# The goal's allowance made concrete: the atomic view plus one trivial round trip before it.
PLUS_ONE = "view in atomic() + one SELECT 1 round trip"
NAIVE_FIRST = "hand-written key SQL, first request"
NAIVE_REPLAY = "hand-written key SQL, replay"

# The floor's table and statements: a key row with its two indexes (primary key, unique key),
# claimed in autocommit by one prepared statement that also answers a replay, the response
# stored by the query that commits the view's transaction (as the package does), both sent
# straight through psycopg and libpq (no Django cursor). No lock expiry, take-over, per-user
# scope checks, stored headers or signals: what is left is what any correct key store pays.
NAIVE_TABLE_SQL = """
CREATE TABLE IF NOT EXISTS bench_naive_key (
    id bigserial PRIMARY KEY, scope text NOT NULL, key text NOT NULL,
    fingerprint text NOT NULL, status integer, body bytea, UNIQUE (scope, key))
"""
NAIVE_DROP_SQL = "DROP TABLE IF EXISTS bench_naive_key"
NAIVE_PREPARE_SQL = """
PREPARE bench_naive_claim (text, text, text) AS
WITH claimed AS (
    INSERT INTO bench_naive_key (scope, key, fingerprint) VALUES ($1, $2, $3)
    ON CONFLICT (scope, key) DO NOTHING RETURNING id
)
SELECT id, NULL, NULL, NULL FROM claimed
UNION ALL
SELECT NULL, fingerprint, status, body FROM bench_naive_key
WHERE scope = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claimed);
PREPARE bench_naive_store (integer, bytea, bigint) AS
UPDATE bench_naive_key SET status = $1, body = $2 WHERE id = $3
"""
NAIVE_STORE_SQL = "EXECUTE bench_naive_store (%s, %s, %s); COMMIT"


def _view(request: HttpRequest) -> HttpResponse:
    payment = Payment.objects.create(amount_cents=1000, description="bench")
    return JsonResponse({"id": payment.pk, "status": "paid"}, status=201)


def _requests() -> Callable[[str | None], HttpRequest]:
    factory = RequestFactory()

    def make(key: str | None) -> HttpRequest:
        # The demo scopes keys by the client's API key (demo_project/payments/scopes.py).
        extra: dict[str, Any] = {}
        if key:
            extra = {"HTTP_IDEMPOTENCY_KEY": key, "HTTP_X_API_KEY": "bench"}
        return factory.post("/payments/", BODY, content_type="application/json", **extra)

    return make


CPU_SHOWN = (
    "undecorated view in atomic()",
    "@idempotent, first request",
    GATED_FIRST,
    NAIVE_FIRST,
)


def _client_cpu(fn: Callable[[], Any], ops: int = 200) -> float:
    """Median thread CPU seconds of one call: what the client spends in Python (Django, the
    driver, the guard), apart from waiting on the server."""
    samples = []
    for _ in range(ops):
        start = time.thread_time()
        fn()
        samples.append(time.thread_time() - start)
    return statistics.median(samples)


WAL_POSITION_SQL = "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"


def _backend_cpu(pid: int) -> float | None:
    """CPU seconds the server process ``pid`` has spent, or None when it is not a PostgreSQL
    process on this machine (a configured remote server)."""
    try:
        with open(f"/proc/{pid}/comm") as comm, open(f"/proc/{pid}/stat") as stat:
            if comm.read().strip() != "postgres":
                return None
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_costs(fn: Callable[[], Any], ops: int = 500) -> tuple[float | None, float]:
    """Server CPU seconds (the connection's backend process, from ``/proc``) and WAL bytes per
    call over ``ops`` calls: what a request asks of the server apart from its round trips."""
    pid = connection.connection.info.backend_pid
    with connection.cursor() as cursor:
        cursor.execute(WAL_POSITION_SQL)
        wal_before = cursor.fetchone()[0]
        cpu_before = _backend_cpu(pid)
        for _ in range(ops):
            fn()
        cpu_after = _backend_cpu(pid)
        cursor.execute(WAL_POSITION_SQL)
        wal_after = cursor.fetchone()[0]
    server = None if cpu_before is None or cpu_after is None else (cpu_after - cpu_before) / ops
    return server, float(wal_after - wal_before) / ops


def _one_more_round_trip(atomic: Callable[[HttpRequest], Any], request: HttpRequest) -> Any:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return atomic(request)


def _naive(view: Callable[[HttpRequest], HttpResponse]) -> Callable[[HttpRequest], HttpResponse]:
    """The hand-written floor: the claim (one prepared statement in autocommit, run by name
    through libpq, which answers a replay too), the view in ``atomic()``, the response stored
    by the query that commits (``EXECUTE`` of a prepared statement, then ``COMMIT``). psycopg
    finds the transaction committed when ``atomic()`` exits and sends nothing. Prepared as SQL:
    Django's connection has psycopg's own preparing off (``prepare_threshold`` None)."""
    with connection.cursor() as cursor:
        cursor.execute(NAIVE_PREPARE_SQL)

    def guarded(request: HttpRequest) -> HttpResponse:
        key = request.headers["Idempotency-Key"]
        scope = request.headers["X-Api-Key"]
        fingerprint = hashlib.sha256(request.body).hexdigest()
        pgconn = connection.connection.pgconn
        params = [scope.encode(), key.encode(), fingerprint.encode()]
        row = pgconn.exec_prepared(b"bench_naive_claim", params)
        if row.status != psycopg.pq.ExecStatus.TUPLES_OK:
            raise psycopg.errors.error_from_result(row)
        claimed = row.get_value(0, 0)
        if claimed is None:
            if row.get_value(0, 1) != fingerprint.encode():
                return HttpResponse(status=422)
            body = psycopg.pq.Escaping().unescape_bytea(row.get_value(0, 3) or b"")
            status = int(row.get_value(0, 2) or 0)
            return HttpResponse(body, status=status, content_type="application/json")
        with transaction.atomic():
            response = view(request)
            store = psycopg.ClientCursor(connection.connection)
            store.execute(NAIVE_STORE_SQL, [response.status_code, response.content, int(claimed)])
        return response

    return guarded


def _contenders(make: Callable[[str | None], HttpRequest]) -> dict[str, Callable[[], Any]]:
    ours = idempotent(scope=by_api_key)(_view)
    gated = idempotent(scope=by_api_key, claim_in_transaction=True)(_view)
    atomic = transaction.atomic(_view)
    naive = _naive(_view)
    fresh = (f"{PREFIX}{n}" for n in itertools.count())
    ours(make(f"{PREFIX}replay"))
    naive(make(f"{PREFIX}naive-replay"))
    gated(make(f"{PREFIX}gated-replay"))
    return {
        "undecorated view (autocommit)": lambda: _view(make(None)),
        "undecorated view in atomic()": lambda: atomic(make(None)),
        PLUS_ONE: lambda: _one_more_round_trip(atomic, make(None)),
        "@idempotent, first request": lambda: ours(make(next(fresh))),
        "@idempotent, replay": lambda: ours(make(f"{PREFIX}replay")),
        GATED_FIRST: lambda: gated(make(next(fresh))),
        GATED_REPLAY: lambda: gated(make(f"{PREFIX}gated-replay")),
        NAIVE_FIRST: lambda: naive(make(next(fresh))),
        NAIVE_REPLAY: lambda: naive(make(f"{PREFIX}naive-replay")),
    }


def _drf_idempotency(make: Callable[[str | None], HttpRequest]) -> dict[str, Callable[[], Any]]:
    """drf-idempotency's contenders, or {} with a note when it is not installed."""
    try:
        from drf_idempotency import idempotent as drf_idempotent
    except ImportError:
        return {}
    theirs = drf_idempotent()(_view)
    fresh = (f"{PREFIX}drf-{n}" for n in itertools.count())
    theirs(make(f"{PREFIX}drf-replay"))
    return {
        "drf-idempotency, first request": lambda: theirs(make(next(fresh))),
        "drf-idempotency, replay": lambda: theirs(make(f"{PREFIX}drf-replay")),
    }


def _with_drf_idempotency_table(run: Callable[[], None]) -> None:
    """Install drf-idempotency's app and table for the run, and remove both afterwards."""
    from django.conf import settings

    apps = [*settings.INSTALLED_APPS, "drf_idempotency"]
    with override_settings(INSTALLED_APPS=apps):
        from drf_idempotency.models import IdempotencyRecord

        with connection.schema_editor() as editor:
            editor.create_model(IdempotencyRecord)
        try:
            run()
        finally:
            with connection.schema_editor() as editor:
                editor.delete_model(IdempotencyRecord)


def main(report: Report) -> None:
    make = _requests()
    connection.ensure_connection()
    pgconn = connection.connection.pgconn

    with connection.cursor() as cursor:
        cursor.execute("SHOW fsync")
        (fsync,) = cursor.fetchone()
    report.note(
        f"this server has fsync={fsync}: "
        + (
            "a first request's commit waits for the disk, as in production"
            if fsync == "on"
            else "no commit waits for the disk (`--durable` for a server that flushes)"
        )
    )

    def measure(contenders: dict[str, Callable[[], Any]]) -> None:
        rows = interleaved(contenders, ops=OPS, rounds=ROUNDS)
        trips = {name: round_trips(pgconn, fn) for name, fn in contenders.items()}
        report.table("median time per request (ratio to the undecorated view)", rows)
        for name, count in trips.items():
            report.note(f"{name}: {count} round trip(s)")
        base, atomic = trips["undecorated view (autocommit)"], trips["undecorated view in atomic()"]
        first, replay = trips["@idempotent, first request"], trips["@idempotent, replay"]
        report.note(
            f"first request: {first - atomic} extra round trips over the atomic view "
            f"({first - base} over autocommit, whose effect is not atomic with anything); "
            f"replay: {replay} round trip(s)"
        )
        times = dict(rows)
        faster = times["@idempotent, replay"] < times["undecorated view in atomic()"]
        report.note(f"replay faster than running the (atomic) view: {faster}")
        for label in (PLUS_ONE, NAIVE_FIRST, "@idempotent, first request", GATED_FIRST):
            ratio = times[label] / times["undecorated view in atomic()"]
            report.note(f"{label}: x {ratio:.2f} the view in atomic() (goal <= 1.3)")
        for label in ("@idempotent, first request", GATED_FIRST):
            ratio = times[label] / times[NAIVE_FIRST]
            report.note(f"{label}: x {ratio:.2f} the hand-written key SQL (the floor)")
        for label in ("@idempotent, replay", GATED_REPLAY):
            ratio = times[label] / times["undecorated view (autocommit)"]
            report.note(f"{label}: x {ratio:.2f} the view (goal <= 1.0)")
        cpu = {label: _client_cpu(contenders[label]) for label in CPU_SHOWN}
        server = {label: _server_costs(contenders[label]) for label in CPU_SHOWN}
        report.note(
            "server per request (CPU of the connection's backend process; WAL bytes written): "
            + ", ".join(
                f"{label} "
                + ("?" if seconds is None else f"{seconds * 1e6:.0f} us")
                + f", {wal:.0f} B WAL"
                for label, (seconds, wal) in server.items()
            )
        )
        report.note(
            "client CPU per request (this process's thread; the rest of a request's time is "
            "waiting for the server): "
            + ", ".join(f"{label} {seconds * 1e6:.0f} us" for label, seconds in cpu.items())
        )

    with connection.cursor() as cursor:
        cursor.execute(NAIVE_TABLE_SQL)
    try:
        contenders = _contenders(make)
        try:
            import drf_idempotency  # noqa: F401
        except ImportError:
            report.note("drf-idempotency is not installed (pip install drf-idempotency): skipped")
            measure(contenders)
            return
        _with_drf_idempotency_table(lambda: measure({**contenders, **_drf_idempotency(make)}))
        report.note("drf-idempotency keys are not scoped per user: one key space for all clients")
    finally:
        IdempotencyKey.objects.filter(key__startswith=PREFIX).delete()
        Payment.objects.filter(description="bench").delete()
        with connection.cursor() as cursor:
            # Its prepared statements stay with the session, harmless: a DEALLOCATE here would
            # fail (and hide the error) when the run stopped before preparing them.
            cursor.execute(NAIVE_DROP_SQL)
