"""Scale: the same operations on small tables and on a million lease rows / ten million keys.

Two schemas hold copies of ``leases_lease`` and ``idempotency_key`` made with ``LIKE`` after
``migrate`` and given every index and constraint the migrations define: ``scale_small``
(300 rows each, a third of them held or started, so every filtered page is full) and
``scale_big`` (``--rows`` lease rows, default 1,000,000, and ``--keys`` keys, default ten times
as many), filled in SQL with ``generate_series`` and ``VACUUM ANALYZE``d.
A connection's ``search_path`` decides which copy it sees; every other table stays in
``public``. Rounds alternate small and big, so the load waves of a shared machine land on both:
on such a machine absolute numbers are noise and the ratios big/small of one run are the result.

Measured per operation (p50 and p99): acquire, renew and release on the database backend;
``@idempotent`` first request and replay; the admin's leases and idempotency-key changelists,
page 1 and a filtered page, through Django's test client; ``manage.py leases list``. Then, on
the big tables only: the peak RSS of ``manage.py leases list`` (and of ``--limit 0``) in a
process of its own; a probe inserting a key every 20 ms, first alone, then while
``purge_idempotency_keys`` deletes the expired keys (half of them); and a probe acquiring and
releasing a new name every 20 ms, alone, then while ``manage.py leases prune`` deletes the
released lease rows (nearly all of them). ``--rounds 1`` turns it into a quick check of all
this, without timing anything (``tests/test_scale.py`` runs it at 10,000 rows).
"""

from __future__ import annotations

import io
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.db.backends.signals import connection_created
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, RequestFactory, override_settings

from benchmarks.common import Report
from demo_project.payments.scopes import by_api_key
from idempotency import idempotent
from leases.backends import get_backend
from leases.backends.database import Backend
from leases.models import Lease

TITLE = "scale: 1M lease rows and 10M idempotency keys vs 300 rows, interleaved"

SMALL, BIG = "scale_small", "scale_big"
#: The small tables: 300 rows each, one in three held / expired / free and one key in three
#: ``started``, so each filtered admin page shows a full page (100 rows) at both sizes: a
#: page of 0 rows against a page of 100 would measure the template, not the table.
SMALL_ROWS = 300
SMALL_EVERY = 3
#: On the big tables: one lease row in a thousand held (and one expired with a holder), one
#: key in ten thousand ``started``.
BIG_LEASES_EVERY = 1000
BIG_KEYS_EVERY = 10000
TABLES = ("leases_lease", "idempotency_key")
ROUNDS = 7
TTL = 30.0
#: The purge's and the prune's ``--batch-size`` (their defaults).
PURGE_BATCH = 1000
PRUNE_BATCH = 1000

#: Lease rows: one in ``every`` (a thousand on the big table) held for a day, one in ``every``
#: held by a holder that crashed (expired with its holder set), the rest released; tokens spread
#: over 1..50.
FILL_LEASES_SQL = """
INSERT INTO {schema}.leases_lease
    (name, holder, token, acquired_at, expires_at, renewed_at, meta, secret_hash)
SELECT 'job:' || lpad(g::text, 9, '0'),
       CASE WHEN g %% %(every)s IN (0, 1) THEN 'host-' || (g %% 7) || ':' || g ELSE '' END,
       1 + g %% 50, now() - interval '1 hour',
       CASE WHEN g %% %(every)s = 0 THEN now() + interval '1 day'
            ELSE now() - interval '1 hour' END,
       NULL, '{{}}', CASE WHEN g %% %(every)s IN (0, 1) THEN sha256(g::text::bytea) END
FROM generate_series(1, %(rows)s) AS g
"""
#: Keys created evenly over the last two days with a TTL of one day: half are expired (the purge's
#: work), one in ``every`` (ten thousand on the big table) is still ``started``; a thousand
#: client scopes.
FILL_KEYS_SQL = """
INSERT INTO {schema}.idempotency_key (scope, key, fingerprint, state, owner, locked_until,
    response_status, response_headers, response_body, created_at, expires_at)
SELECT 'client:' || (g %% 1000), 'key-' || g, md5(g::text),
       CASE WHEN g %% %(every)s = 0 THEN 'started' ELSE 'completed' END,
       NULL, CASE WHEN g %% %(every)s = 0 THEN now() + interval '1 minute' END,
       201, '[]'::jsonb, '{{"id": 1}}'::bytea,
       now() - (g::bigint * 172800 / %(rows)s) * interval '1 second',
       now() - (g::bigint * 172800 / %(rows)s) * interval '1 second' + interval '1 day'
FROM generate_series(1, %(rows)s) AS g
"""

_schema = {"current": SMALL}


def _set_search_path(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Every new Django connection (the admin's requests close theirs) sees the chosen copy."""
    with connection.cursor() as cursor:
        cursor.execute(f"SET search_path TO {_schema['current']}, public")


#: The indexes and unique / primary-key constraints of ``public.<table>`` (what ``migrate``
#: made), as statements to rebuild them on a copy once it is filled: a sorted build of each
#: index after the fill, instead of ten million random insertions into each during it.
INDEXES_SQL = """
SELECT 'ALTER TABLE {schema}.' || quote_ident(%(table)s) || ' ADD CONSTRAINT '
       || quote_ident(c.conname) || ' ' || pg_get_constraintdef(c.oid)
FROM pg_constraint c
WHERE c.conrelid = ('public.' || %(table)s)::regclass AND c.contype IN ('p', 'u')
UNION ALL
SELECT replace(pg_get_indexdef(i.indexrelid), ' ON public.', ' ON {schema}.')
FROM pg_index i
WHERE i.indrelid = ('public.' || %(table)s)::regclass
  AND NOT EXISTS (SELECT FROM pg_constraint c WHERE c.conindid = i.indexrelid)
"""


def _fill(schema: str, leases: int, keys: int) -> None:
    """Copies of the two tables, filled with one ``INSERT ... SELECT generate_series`` each.

    Each copy is made unlogged and without its indexes, filled (no WAL, no index insertions),
    made logged (one sequential copy of the heap into the WAL) and then indexed (a sorted
    build per index): at ten million keys, minutes instead of the best part of an hour that
    filling the indexed, logged table row by row took on a loaded 2-core machine. The result is
    the same logged, fully indexed table a shop would have.
    """
    small = schema == SMALL
    with connection.cursor() as cursor:
        cursor.execute("SET maintenance_work_mem = '256MB'")
        cursor.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        cursor.execute(f"CREATE SCHEMA {schema}")
        for table in TABLES:
            cursor.execute(
                f"CREATE UNLOGGED TABLE {schema}.{table}"
                f" (LIKE public.{table} INCLUDING ALL EXCLUDING INDEXES)"
            )
        cursor.execute(
            FILL_LEASES_SQL.format(schema=schema),
            {"rows": leases, "every": SMALL_EVERY if small else BIG_LEASES_EVERY},
        )
        cursor.execute(
            FILL_KEYS_SQL.format(schema=schema),
            {"rows": keys, "every": SMALL_EVERY if small else BIG_KEYS_EVERY},
        )
        for table in TABLES:
            cursor.execute(f"ALTER TABLE {schema}.{table} SET LOGGED")
            cursor.execute(INDEXES_SQL.format(schema=schema), {"table": table})
            for (statement,) in cursor.fetchall():
                cursor.execute(statement)
        cursor.execute("RESET maintenance_work_mem")
        for table in TABLES:
            cursor.execute(f"VACUUM ANALYZE {schema}.{table}")


def _use(schema: str, backend: Backend) -> None:
    _schema["current"] = schema
    with connection.cursor() as cursor:
        cursor.execute(f"SET search_path TO {schema}, public")
    own = backend.connection()
    assert own is not None
    own.execute(f"SET search_path TO {schema}, public")


def _percentiles(samples: list[float]) -> tuple[float, float]:
    if len(samples) < 2:  # a one-round check
        return samples[0], samples[0]
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return cuts[49], cuts[98]


def released_name(pick: int, rows: int, every: int) -> int:
    """The number of a seeded released name (:data:`FILL_LEASES_SQL`) for ``pick`` in
    ``1..rows``: names ``g`` with ``g % every`` 0 or 1 are held (or crashed holders'), so those
    move up to the next released one, and from the top of the table down a period instead.
    Moved past the last row, an acquire inserted a name of its own: the table grew by a row, and
    the listing counted one line more than the table was seeded with (CI's check of this
    benchmark failed on it now and then)."""
    if pick % every in (0, 1):
        pick += 2 - pick % every
        if pick > rows:
            pick -= every
    return pick


def _lease_ops(backend: Backend, rows: int) -> dict[str, Callable[[], Any]]:
    """acquire, renew and release of a random released name (cold rows on the big table)."""
    grants: list[Any] = []

    def acquire() -> None:
        big = _schema["current"] == BIG
        every = BIG_LEASES_EVERY if big else SMALL_EVERY
        size = rows if big else SMALL_ROWS
        g = released_name(random.randint(1, size), size, every)
        grant = backend.try_acquire(f"job:{g:09d}", "bench-scale", TTL)
        assert grant is not None
        grants.append(grant)

    def renew() -> None:
        grants[-1] = backend.renew(grants[-1], TTL)

    def release() -> None:
        backend.release(grants.pop())

    return {"acquire": acquire, "renew": renew, "release": release}


def _idempotent_ops() -> dict[str, Callable[[], Any]]:
    def view(request: HttpRequest) -> HttpResponse:
        return JsonResponse({"status": "paid"}, status=201)

    ours = idempotent(scope=by_api_key)(view)
    factory = RequestFactory()

    def request(key: str) -> HttpRequest:
        return factory.post(
            "/payments/",
            "{}",
            content_type="application/json",
            HTTP_IDEMPOTENCY_KEY=key,
            HTTP_X_API_KEY="bench",
        )

    def first() -> None:
        assert ours(request(f"bench-scale-{uuid.uuid4().hex}")).status_code == 201

    def seed() -> None:
        ours(request(f"bench-scale-replay-{_schema['current']}"))

    def replay() -> None:
        response = ours(request(f"bench-scale-replay-{_schema['current']}"))
        assert response.headers.get("Idempotent-Replayed") == "true"

    return {"idempotent first request": first, "idempotent replay": replay, "seed replay": seed}


def _admin_ops(client: Client) -> dict[str, Callable[[], Any]]:
    pages = {
        "admin leases page 1": "/admin/leases/lease/",
        "admin leases held": "/admin/leases/lease/?state=held",
        "admin keys page 1": "/admin/idempotency/idempotencykey/",
        "admin keys started": "/admin/idempotency/idempotencykey/?state__exact=started",
    }

    def get(url: str) -> Callable[[], Any]:
        def op() -> None:
            assert client.get(url).status_code == 200

        return op

    return {label: get(url) for label, url in pages.items()}


def _command_ops() -> dict[str, Callable[[], Any]]:
    def listing() -> None:
        call_command("leases", "list", stdout=io.StringIO())

    return {"manage.py leases list": listing}


def _measure(
    backend: Backend, rounds: int, groups: list[tuple[dict[str, Callable[[], Any]], int]]
) -> dict[tuple[str, str], list[float]]:
    """Rounds alternate the two schemas; each op of each group runs ``ops`` times a round."""
    samples: dict[tuple[str, str], list[float]] = {}
    for round_ in range(rounds + 1):
        for schema in (SMALL, BIG) if round_ % 2 else (BIG, SMALL):
            _use(schema, backend)
            for ops, count in groups:
                for _ in range(count):
                    for label, fn in ops.items():
                        start = time.perf_counter()
                        fn()
                        if round_:  # round 0 warms caches and plans
                            samples.setdefault((label, schema), []).append(
                                time.perf_counter() - start
                            )
    return samples


def _big_tables_env() -> dict[str, str]:
    """The environment of a ``manage.py`` process of its own that sees the big tables.

    The search path rides in ``DATABASE_URL``'s ``options`` (not ``PGOPTIONS``, which libpq
    ignores for a connection that sets ``options`` itself, as the backends' own connections
    do to force ``synchronous_commit``), so Django's connection and the backend's see them.
    """
    url = urlsplit(os.environ["DATABASE_URL"])
    query = urlencode({"options": f"-c search_path={BIG},public"})
    return {**os.environ, "DATABASE_URL": urlunsplit(url._replace(query=query))}


#: Runs ``manage.py`` and, as it exits, prints the peak RSS of its own address space.
#: ``VmHWM`` belongs to the address space ``exec`` made, so it is the command's alone: the
#: ``ru_maxrss`` that ``wait4`` reports also keeps the high-water mark of the process before
#: ``exec``, which for a child forked (or vforked) from this benchmark is this benchmark's RSS.
PEAK_RSS_RUNNER = """
import atexit, runpy, sys
def peak():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                sys.stderr.write("peak-rss-kib " + line.split()[1] + "\\n")
atexit.register(peak)
sys.argv = ["manage.py", *sys.argv[1:]]
runpy.run_path("manage.py", run_name="__main__")
"""


def _peak_rss_of_listing(*args: str) -> tuple[int, int, list[str]]:
    """KiB, and the lease lines it printed: ``manage.py leases list *args`` in a process of
    its own, seeing the big tables. Its output is counted line by line from a file (read
    whole, a million lines would make this process, not the command, big)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        status = subprocess.run(
            [sys.executable, "-c", PEAK_RSS_RUNNER, "leases", "list", *args],
            env=_big_tables_env(),
            stdout=out,
            stderr=err,
            text=True,
            check=False,
        ).returncode
        err.seek(0)
        errors = err.read()
        assert status == 0, errors
        out.seek(0)
        listed, unavailable = 0, []
        for line in out:
            listed += line.startswith("lease ")
            if line.startswith("backend ") and " unavailable: " in line:
                unavailable.append(line.strip())  # a listing cut short says why
    (peak,) = [int(line.split()[1]) for line in errors.splitlines() if line.startswith("peak-rss")]
    return peak, listed, unavailable


#: The longest a purge or prune may take here (ten million keys take minutes, not this).
COMMAND_TIMEOUT = 1800.0
#: How long the probe runs alone before the command starts: its latency without the command.
BASELINE = 10.0


#: A probe slower than this (half the 100 ms goal) is looked at: what its backend waited on.
SLOW_PROBE = 0.05
#: What the probe's backend is doing, sampled every 5 ms by a process of its own while the probe
#: runs (:data:`SAMPLER`). No wait event while ``active`` means running or waiting for a CPU.
WAIT_EVENT_SQL = (
    "SELECT state, coalesce(wait_event_type || '/' || wait_event, 'no wait event')"
    " FROM pg_stat_activity WHERE pid = %s"
)
SAMPLER = f"""
import sys, time, psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as conn, open(sys.argv[3], "w") as out:
    while True:
        row = conn.execute({WAIT_EVENT_SQL!r}, (int(sys.argv[2]),)).fetchone()
        state, event = row if row else ("-", "-")
        out.write(f"{{time.monotonic()}}\\t{{state}}\\t{{event}}\\n")
        out.flush()
        time.sleep(0.005)
"""


@dataclass
class Probed:
    """A probe's latencies alone and beside a command, with what tells the command's cost from
    the machine's: the probe process's own scheduling lag (how late its 20 ms sleeps woke: no
    database in it) and the wait events its backend showed during the slow probes."""

    alone: list[float]
    beside: list[float]
    lag_alone: list[float]
    lag_beside: list[float]
    #: Per slow probe beside the command: (latency, start, end) in ``time.monotonic()``.
    slow: list[tuple[float, float, float]]
    samples: list[tuple[float, str, str]]
    seconds: float
    progress: str

    def slow_probes(self) -> str:
        """``3 probes > 50 ms: waited on no wait event 80%, LWLock/WALWrite 20%``: the share of
        the samples taken during slow probes, by what the probe's backend was doing (``idle``:
        it was not in the database at all, the time was the probe process's own)."""
        if not self.slow:
            return f"no probe > {SLOW_PROBE * 1e3:.0f} ms"
        seen: dict[str, int] = {}
        times = [t for t, _, _ in self.samples]
        for _, start, end in self.slow:
            for _, state, event in self.samples[
                bisect_left(times, start) : bisect_right(times, end)
            ]:
                what = event if state == "active" else state
                seen[what] = seen.get(what, 0) + 1
        if not seen:  # the sampler was not scheduled either: the whole machine stalled
            seen["not sampled"] = 1
        total = sum(seen.values())
        shares = ", ".join(
            f"{what} {count * 100 // total}%"
            for what, count in sorted(seen.items(), key=lambda item: -item[1])
        )
        probes = f"{len(self.slow)} probe{'s' if len(self.slow) > 1 else ''}"
        return f"{probes} > {SLOW_PROBE * 1e3:.0f} ms, their backend: {shares}"


def _probe_beside(
    command: list[str], probe: Callable[[], Any], pid: int, baseline: float
) -> Probed:
    """Call ``probe`` every 20 ms for ``baseline`` seconds, then while ``manage.py
    <command>`` runs in a process of its own (as an operator runs it: a thread here would share
    this process's GIL with the probe and time Python, not the database).

    On a shared machine the probe alone shows what the machine costs; the difference is what the
    command costs. What separates the two during the command: the lateness of the probe's own
    sleeps (the machine's run queue, not the database) and the wait events of its backend
    (``pid``) during the slow probes (a lock or the WAL: the command's doing).
    """
    slow: list[tuple[float, float, float]] = []

    def probing(until: Callable[[], bool], lags: list[float], note: bool) -> list[float]:
        latencies = []
        while not until():
            start = time.monotonic()
            probe()
            end = time.monotonic()
            latencies.append(end - start)
            if note and end - start > SLOW_PROBE:
                slow.append((end - start, start, end))
            time.sleep(0.02)
            lags.append(time.monotonic() - end - 0.02)
        return latencies

    lag_alone: list[float] = []
    lag_beside: list[float] = []
    with tempfile.NamedTemporaryFile("r") as sampled:
        sampler = subprocess.Popen(
            [sys.executable, "-c", SAMPLER, os.environ["DATABASE_URL"], str(pid), sampled.name]
        )
        try:
            alone_until = time.monotonic() + baseline
            alone = probing(lambda: time.monotonic() >= alone_until, lag_alone, False)
            started = time.monotonic()
            # Its progress goes to a file: a pipe nobody reads until the end fills it up.
            with (
                tempfile.TemporaryFile("w+") as out,
                subprocess.Popen(
                    [sys.executable, "manage.py", *command],
                    env=_big_tables_env(),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                ) as proc,
            ):
                beside = probing(
                    lambda: proc.poll() is not None or time.monotonic() - started > COMMAND_TIMEOUT,
                    lag_beside,
                    True,
                )
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                out.seek(0)
                output = out.read()
        finally:
            sampled_throughout = sampler.poll() is None
            sampler.kill()
            sampler.wait()
        samples = []
        for line in sampled:
            at, state, event = line.rstrip("\n").split("\t")
            samples.append((float(at), state, event))
    assert proc.returncode == 0, output
    assert sampled_throughout, "the wait-event sampler died"
    progress = [line for line in output.splitlines() if line.startswith("[")]
    return Probed(
        alone,
        beside,
        lag_alone,
        lag_beside,
        slow,
        samples,
        time.monotonic() - started,
        progress[-1] if progress else "",
    )


def _summary(latencies: list[float]) -> str:
    p50, p99 = _percentiles(latencies) if latencies else (0.0, 0.0)
    worst = max(latencies, default=0.0)
    return f"p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {worst * 1e3:.1f} ms"


def _lag(lags: list[float]) -> str:
    return f"max {max(lags, default=0.0) * 1e3:.1f} ms"


def _probe_note(probed: Probed) -> str:
    return (
        f"the probe process's own sleeps woke late by: alone {_lag(probed.lag_alone)}, beside "
        f"{_lag(probed.lag_beside)}; {probed.slow_probes()}"
    )


def _key_insert_probe() -> None:
    from idempotency.store import begin

    begin("bench-probe", uuid.uuid4().hex, "f" * 64, ttl=3600.0, lock_timeout=30.0)


def _acquire_probe(backend: Backend) -> Callable[[], None]:
    """Acquire and release a new name: the insert path the prune's lock holds back."""

    def probe() -> None:
        grant = backend.try_acquire(f"probe:{uuid.uuid4().hex}", "bench-probe", TTL)
        assert grant is not None
        backend.release(grant)

    return probe


#: What the big tables weigh against the server's buffer cache: a table far bigger than the cache
#: turns each random row into a miss (served by the OS page cache), whatever the statement.
SIZES_SQL = f"""
SELECT current_setting('shared_buffers'),
       pg_size_pretty(pg_total_relation_size('{BIG}.leases_lease')),
       pg_size_pretty(pg_total_relation_size('{BIG}.idempotency_key'))
"""


def _sizes() -> str:
    with connection.cursor() as cursor:
        cursor.execute(SIZES_SQL)
        buffers, leases, keys = cursor.fetchone()
    return f"shared_buffers {buffers}; big tables with their indexes: leases {leases}, keys {keys}"


def main(report: Report) -> None:
    rows = int(report.options.get("rows") or 1_000_000)
    keys = int(report.options.get("keys") or 10 * rows)
    rounds = int(report.options.get("rounds") or ROUNDS)
    baseline = BASELINE if rounds > 1 else 0.5  # a one-round run checks, it does not time
    started = time.perf_counter()
    _fill(SMALL, SMALL_ROWS, SMALL_ROWS)
    _fill(BIG, rows, keys)
    report.note(
        f"filled {rows:,} lease rows and {keys:,} keys (vs {SMALL_ROWS} each) in "
        f"{time.perf_counter() - started:.0f} s"
    )
    report.note(_sizes())
    connection_created.connect(_set_search_path)
    backend = get_backend("default")
    assert isinstance(backend, Backend)
    backend.inspect("bench:warm-up")
    user, _ = get_user_model().objects.get_or_create(
        username="bench-scale", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    hosts = override_settings(ALLOWED_HOSTS=["testserver"])
    hosts.enable()
    idempotent_ops = _idempotent_ops()
    for schema in (SMALL, BIG):  # the key each schema's replays replay
        _use(schema, backend)
        idempotent_ops["seed replay"]()
    del idempotent_ops["seed replay"]
    try:
        samples = _measure(
            backend,
            rounds,
            [
                (_lease_ops(backend, rows), 50),
                (idempotent_ops, 30),
                (_admin_ops(client), 2),
                (_command_ops(), 1),
            ],
        )
        _table(report, samples, rows, keys)
        for args in ([], ["--limit", "0"], ["--limit", "0", "--json"]):
            rss, listed, unavailable = _peak_rss_of_listing(*args)
            lines = f"{listed:,} lease lines" if "--json" not in args else "JSON"
            report.note(
                f"peak RSS of manage.py leases list {' '.join(args)}".rstrip()
                + f" at {rows:,} rows: {rss / 1024:.0f} MiB ({lines})"
                + "".join(f"; {line}" for line in unavailable)
            )
        _use(BIG, backend)
        command = ["purge_idempotency_keys", "--batch-size", str(PURGE_BATCH)]
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            (pid,) = cursor.fetchone()
        probed = _probe_beside(command, _key_insert_probe, pid, baseline)
        report.note(
            f"purge of the expired keys of {keys:,}, --batch-size {PURGE_BATCH}: "
            f"{probed.seconds:.0f} s ({probed.progress}); a key insert every 20 ms: alone "
            f"{_summary(probed.alone)}; during the purge ({len(probed.beside)} inserts) "
            f"{_summary(probed.beside)}; {_probe_note(probed)}"
        )
        command = ["leases", "prune", "--older-than", "30m", "--batch-size", str(PRUNE_BATCH)]
        probe = _acquire_probe(backend)
        own = backend.connection()
        assert own is not None
        probed = _probe_beside(command, probe, own.info.backend_pid, baseline)
        left = Lease.objects.count()
        report.note(
            f"prune of the released lease rows of {rows:,}, --batch-size {PRUNE_BATCH}: "
            f"{probed.seconds:.0f} s ({probed.progress}), {left:,} rows left; an acquire+release "
            f"of a new name every 20 ms: alone {_summary(probed.alone)}; during the prune "
            f"({len(probed.beside)}) {_summary(probed.beside)}; {_probe_note(probed)}"
        )
    finally:
        hosts.disable()
        connection_created.disconnect(_set_search_path)
        _use("public", backend)
        with connection.cursor() as cursor:
            for schema in (SMALL, BIG):
                cursor.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def _table(
    report: Report, samples: dict[tuple[str, str], list[float]], rows: int, keys: int
) -> None:
    print(
        f"\n  p50 and p99 per operation: {SMALL_ROWS} rows vs {rows:,} lease rows / {keys:,} keys"
        "\n  (interleaved rounds on a shared machine: read the ratios, not the absolute times)"
    )
    print(
        f"  {'operation':<28} {'small p50':>10} {'big p50':>10} {'ratio':>6}"
        f" {'small p99':>10} {'big p99':>10} {'ratio':>6}"
    )
    labels = dict.fromkeys(label for label, _ in samples)
    for label in labels:
        s50, s99 = _percentiles(samples[(label, SMALL)])
        b50, b99 = _percentiles(samples[(label, BIG)])
        print(
            f"  {label:<28} {s50 * 1e3:8.2f}ms {b50 * 1e3:8.2f}ms {b50 / s50:6.2f}"
            f" {s99 * 1e3:8.2f}ms {b99 * 1e3:8.2f}ms {b99 / s99:6.2f}"
        )
        report.tables.append((label, [("small p50", s50), ("big p50", b50)]))
    sys.stdout.flush()
