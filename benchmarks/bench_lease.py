"""Database leases: our backend vs the same SQL through psycopg and Django, and peer locks.

1. Uncontended acquire + release per operation. The floor is the backend's own two statements
   (``ACQUIRE_SQL`` then ``RELEASE_SQL``) sent through a plain psycopg connection and through
   Django's cursor; ours goes through the backend and through the public ``acquire()`` and
   ``lease()``. Round trips are counted from libpq's protocol trace.
2. Contended throughput: 8 processes acquiring and releasing one name as fast as they can,
   ours vs django-pglock (``advisory(xact=True)``: a transaction-scoped Postgres lock, which
   protects nothing outside its transaction and has no fencing token) vs python-redis-lock.
   Ours runs with and without its waiting room (waiters after the first sleep in the server's
   lock queue instead of all retrying on every release).
3. Hand-off latency: from the holder's ``release()`` to the blocked waiter's acquire returning.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import psycopg
from django.db import connection, connections
from django.test import override_settings

from benchmarks.bench_advisory import _measure
from benchmarks.common import Report
from leases import acquire, lease
from leases.backends import get_backend
from leases.backends.database import ACQUIRE_SQL, RELEASE_SQL, Backend

#: The floor proves ownership like the backend does (renew/release compare the secret's hash).
SECRET = "0" * 32

TITLE = "database leases: backend vs psycopg and Django's cursor; pglock, python-redis-lock"

TTL = 30.0
PROCESSES = 8
CONTENDED_SECONDS = 3.0
HANDOFFS = 40


def _floor(run: Callable[[str, dict[str, Any]], list[Any]]) -> Callable[[], None]:
    """Acquire + release with the backend's own statements through ``run``."""
    name = f"bench:floor:{uuid.uuid4().hex[:8]}"
    holder = "bench-floor"

    def op() -> None:
        grant = {"name": name, "holder": holder, "secret": SECRET}
        ((token, _),) = run(ACQUIRE_SQL, {**grant, "ttl": TTL})
        assert run(RELEASE_SQL, {**grant, "token": token})

    return op


def uncontended(raw: psycopg.Connection[Any]) -> dict[str, Any]:
    backend = get_backend("default")
    assert isinstance(backend, Backend)
    backend.inspect("bench:warm-up")
    own = backend.connection()
    assert own is not None

    def django_cursor(sql: str, params: dict[str, Any]) -> list[Any]:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall()

    def ours_backend() -> None:
        grant = backend.try_acquire(names["backend"], "bench-backend", TTL)
        assert grant is not None
        backend.release(grant)

    def ours_acquire() -> None:
        acquire(names["acquire"], ttl=TTL, keepalive=False).release()

    def ours_lease() -> None:
        with lease(names["lease"], ttl=TTL):
            pass

    names = {key: f"bench:{key}:{uuid.uuid4().hex[:8]}" for key in ("backend", "acquire", "lease")}
    return {
        "Django cursor, same 2 statements": (_floor(django_cursor), None),
        "psycopg, same 2 statements (floor)": (
            _floor(lambda sql, p: raw.execute(sql, p).fetchall()),
            raw.pgconn,
        ),
        "backend try_acquire + release": (ours_backend, own.pgconn),
        "acquire(keepalive=False) + release()": (ours_acquire, own.pgconn),
        "with lease() (keepalive on)": (ours_lease, own.pgconn),
    }


def _contend(kind: str, name: str, seconds: float, start: Any, counts: Any) -> None:
    """One contending process: acquire + release ``name`` in a loop until time is up."""
    connections.close_all()
    acquire_release = _contender(kind, name)
    start.wait()
    done, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        acquire_release()
        done += 1
    counts.put(done)


def _contender(kind: str, name: str) -> Callable[[], None]:
    if kind in ("default", "no-room"):
        return lambda: acquire(name, ttl=TTL, backend=kind, keepalive=False, timeout=30).release()
    if kind == "pglock":
        import pglock

        def pg() -> None:
            with pglock.advisory(name, xact=True):  # opens and commits its own transaction
                pass

        return pg
    import redis
    import redis_lock

    client = redis.Redis.from_url(os.environ["REDIS_URL"])

    def prl() -> None:
        held = redis_lock.Lock(client, name, expire=int(TTL))
        held.acquire(blocking=True)
        held.release()

    return prl


def contended(kind: str) -> tuple[float, int]:
    """Seconds per successful acquire + release across all processes, and the total count."""
    context = multiprocessing.get_context("fork")
    name = f"bench:contended:{kind}:{uuid.uuid4().hex[:8]}"
    start, counts = context.Event(), context.Queue()
    connections.close_all()
    procs = [
        context.Process(target=_contend, args=(kind, name, CONTENDED_SECONDS, start, counts))
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    time.sleep(1.0)  # every process connected
    start.set()
    try:
        total = sum(counts.get(timeout=CONTENDED_SECONDS + 20) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return CONTENDED_SECONDS / max(total, 1), total


def handoff(take: Callable[[], Callable[[], None]]) -> tuple[float, float]:
    """Median and p90 seconds from a release to the blocked waiter's acquire returning.

    ``take()`` blocks until it holds the lock and returns the function that releases it.
    """
    samples: list[float] = []
    for _ in range(HANDOFFS):
        release = take()
        got: list[float] = []

        def wait(got: list[float] = got) -> None:
            release_waiter = take()
            got.append(time.perf_counter())
            release_waiter()
            connections.close_all()

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.02)  # the waiter is blocked by now
        released = time.perf_counter()
        release()
        waiter.join(15)
        samples.append(got[0] - released)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.9)]


def _take_ours(name: str, backend: str = "default") -> Callable[[], None]:
    held = acquire(name, ttl=TTL, backend=backend, keepalive=False, timeout=10)
    return held.release


def _take_ours_without_room(name: str) -> Callable[[], None]:
    return _take_ours(name, "no-room")


def _take_pglock(name: str) -> Callable[[], None]:
    import pglock

    stack = ExitStack()
    stack.enter_context(pglock.advisory(name, xact=True))
    return stack.close


def _take_redis_lock(name: str) -> Callable[[], None]:
    import redis
    import redis_lock

    held = redis_lock.Lock(redis.Redis.from_url(os.environ["REDIS_URL"]), name, expire=int(TTL))
    held.acquire(blocking=True)
    return held.release


def main(report: Report) -> None:
    backends = {
        "default": {"ENGINE": "leases.backends.database"},
        "no-room": {"ENGINE": "leases.backends.database", "WAITING_ROOM": False},
    }
    with override_settings(DEBUG=False, LEASES={"BACKENDS": backends}):
        raw = psycopg.connect(autocommit=True, **connection.get_connection_params())
        try:
            _measure(report, "uncontended acquire + release", uncontended(raw))
        finally:
            raw.close()
        rows, totals = [], []
        for label, kind in (
            ("ours (database backend)", "default"),
            ("ours, WAITING_ROOM off", "no-room"),
            ("django-pglock advisory(xact=True)", "pglock"),
            ("python-redis-lock", "redis_lock"),
        ):
            per_op, total = contended(kind)
            rows.append((label, per_op))
            totals.append(f"{label} {total / CONTENDED_SECONDS:.0f}/s")
        report.table(f"contended: {PROCESSES} processes, one name (time per grant)", rows)
        report.note("throughput: " + "; ".join(totals))
        latencies = [
            (label, handoff(lambda take=take, key=key: take(f"bench:handoff:{key}")))
            for label, take, key in (
                ("ours (LISTEN/NOTIFY wake-up)", _take_ours, uuid.uuid4().hex[:8]),
                ("ours, WAITING_ROOM off", _take_ours_without_room, uuid.uuid4().hex[:8]),
                ("django-pglock (server lock queue)", _take_pglock, uuid.uuid4().hex[:8]),
                ("python-redis-lock (BLPOP signal)", _take_redis_lock, uuid.uuid4().hex[:8]),
            )
        ]
        report.table("hand-off latency, median", [(k, v[0]) for k, v in latencies], unit="ms")
        report.note("p90: " + "; ".join(f"{k} {v[1] * 1e3:.2f} ms" for k, v in latencies))
    report.note(
        "Targets (issue 3): uncontended within 1.1x of Django's cursor with exactly 1 round "
        "trip per statement; hand-off median under 5 ms on loopback."
    )
