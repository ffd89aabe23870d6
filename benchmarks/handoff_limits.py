"""What bounds one name's hand-off and contended throughput: each hop alone, then a protocol
with one hop fewer. Not a ``bench_`` topic (issue 14's closing note quotes it).

``python -m benchmarks.handoff_limits [--fsync] [--rounds N] [--processes 2,4,8]`` (in the
worktree's environment):

1. ``fdatasync`` of an 8 kB write on this disk (``BENCH_FSYNC_DIR``, else the current
   directory): what a server that flushes pays per durable grant.
2. The hops of one hand-off on a throwaway server (``fsync=off`` as the benchmarks' own, or
   on with ``--fsync``), each timed alone: a round trip, a write's commit with
   ``synchronous_commit`` on and off, a ``NOTIFY`` from the sender's call to a listening
   thread's wake-up, and an advisory unlock to the waiter blocked on it returning.
3. Eight processes (or each count of ``--processes``) contending for one name, alternating
   rounds: the database backend
   (``acquire()`` + ``release()``), django-pglock's ``advisory(xact=True)``, and a prototype
   of a queue-lock protocol (:data:`QUEUE_GRANT_SQL`, :data:`QUEUE_RELEASE_SQL`), then the
   hand-off median of the backend and of the prototype.

The backend's hand-off is a chain of hops, one after the other: the release statement
reaches the server and commits; its ``NOTIFY`` wakes the waiter's session, which sends the
notification on to the waiter's process; the waiter sends its try, which commits the grant
(durably: one WAL flush) and replies. Two round trips, a wake-up of a client process, and a
flush. In the prototype the waiter is blocked server-side, in its grant statement, on a
lock the holder keeps for its tenure: the release statement frees it, and the waiter's session
goes on at once to take the name (its ``INSERT ... ON CONFLICT DO UPDATE`` waits on the row
for the release to commit and judges the newest row version). One round trip, a wake-up of a
server session, and a flush: what django-pglock's hand-off costs, plus the durable grant.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.arguments import at_least, listed, positive_seconds
from benchmarks.servers import DURABLE
from devservers import PostgresServer

PROCESSES = 8
SAMPLES = 300
#: The prototype's queue lock (any key no test or bench uses).
QUEUE_KEY = 7_340_014

#: Wait in the name's queue (the advisory lock the holder keeps), then take the name: the
#: upsert judges the newest row version and waits for an uncommitted release of it.
QUEUE_GRANT_SQL = """
INSERT INTO leases_lease AS l
    (name, holder, token, acquired_at, expires_at, renewed_at, meta, secret_hash)
SELECT %(name)s::text, %(holder)s::text, 1, clock_timestamp(),
       clock_timestamp() + make_interval(secs => 30), NULL, '{}', sha256(%(secret)s::bytea)
FROM (SELECT pg_advisory_lock(%(key)s::bigint)) AS queued
ON CONFLICT (name) DO UPDATE
SET holder = EXCLUDED.holder, token = l.token + 1, acquired_at = EXCLUDED.acquired_at,
    expires_at = EXCLUDED.expires_at, renewed_at = NULL, secret_hash = EXCLUDED.secret_hash
WHERE l.holder = '' OR l.expires_at <= clock_timestamp()
RETURNING l.token
"""
#: Free the name (not waiting for the flush, as the backend's release) and the queue lock.
QUEUE_RELEASE_SQL = """
WITH freed AS (
    UPDATE leases_lease SET holder = '', expires_at = clock_timestamp(), secret_hash = NULL
    WHERE name = %(name)s::text AND holder = %(holder)s::text AND token = %(token)s
      AND secret_hash = sha256(%(secret)s::bytea) AND expires_at > clock_timestamp()
    RETURNING name
)
SELECT set_config('synchronous_commit', 'off', true), pg_advisory_unlock(%(key)s::bigint)
FROM freed
"""


def _median_p90(seconds: list[float]) -> tuple[float, float]:
    ordered = sorted(seconds)
    return statistics.median(ordered) * 1e6, ordered[int(len(ordered) * 0.9)] * 1e6


def fdatasync() -> tuple[float, float]:
    """Median and p90 microseconds of an 8 kB ``pwrite`` + ``fdatasync`` here."""
    took = []
    with tempfile.NamedTemporaryFile(dir=os.environ.get("BENCH_FSYNC_DIR", ".")) as probe:
        block = b"\0" * 8192
        for index in range(SAMPLES):
            started = time.perf_counter()
            os.pwrite(probe.fileno(), block, (index % 16) * 8192)
            os.fdatasync(probe.fileno())
            took.append(time.perf_counter() - started)
    return _median_p90(took)


def hops(url: str) -> dict[str, tuple[float, float]]:
    """Each hop of a hand-off alone: median and p90 microseconds."""
    import psycopg

    one = psycopg.connect(url, autocommit=True)
    other = psycopg.connect(url, autocommit=True)
    name = f"hops:{uuid.uuid4().hex[:8]}"
    # A logged table, as the lease table is: a temporary one writes no WAL, so its commit
    # flushes nothing and the commit hop read the same on a server that flushes as on one that
    # does not (119 against 235 us for a logged table's, on a server with fsync on).
    table = f"leases_bench_hop_{uuid.uuid4().hex[:8]}"
    one.execute(f"CREATE TABLE {table} (name text PRIMARY KEY, token bigint)")
    try:
        return _hops(one, other, table, name)
    finally:
        one.execute(f"DROP TABLE IF EXISTS {table}")
        one.close()
        other.close()


def _hops(one: Any, other: Any, table: str, name: str) -> dict[str, tuple[float, float]]:
    one.execute(f"INSERT INTO {table} VALUES (%s, 1)", (name,))

    def timed(step: Callable[[], object]) -> tuple[float, float]:
        took = []
        for _ in range(SAMPLES):
            started = time.perf_counter()
            step()
            took.append(time.perf_counter() - started)
        return _median_p90(took)

    bump = f"UPDATE {table} SET token = token + 1 WHERE name = %s"
    found: dict[str, tuple[float, float]] = {
        "round trip (SELECT 1)": timed(lambda: one.execute("SELECT 1", prepare=True).fetchall())
    }
    one.execute("SET synchronous_commit = on")
    found["write + commit, synchronous_commit on"] = timed(
        lambda: one.execute(bump, (name,), prepare=True)
    )
    one.execute("SET synchronous_commit = off")
    found["write + commit, synchronous_commit off"] = timed(
        lambda: one.execute(bump, (name,), prepare=True)
    )

    def woken(block: Callable[[], object], free: Callable[[], object]) -> float:
        """From ``free()`` being called to the thread blocked in ``block()`` returning."""
        returned: list[float] = []

        def wait() -> None:
            block()
            returned.append(time.perf_counter())

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.005)  # blocked by now
        started = time.perf_counter()
        free()
        thread.join(10)
        return returned[0] - started

    def listen() -> None:
        for _ in other.notifies(timeout=5):
            break

    other.execute("LISTEN hop")
    notified = [
        woken(listen, lambda: one.execute("SELECT pg_notify('hop', 'x')").fetchall())
        for _ in range(SAMPLES // 3)
    ]
    found["NOTIFY sent -> listening thread woken"] = _median_p90(notified)
    other.execute("UNLISTEN *")
    unlocked = []
    for _ in range(SAMPLES // 3):
        one.execute("SELECT pg_advisory_lock(%s)", (QUEUE_KEY,))
        unlocked.append(
            woken(
                lambda: other.execute("SELECT pg_advisory_lock(%s)", (QUEUE_KEY,)).fetchall(),
                lambda: one.execute("SELECT pg_advisory_unlock(%s)", (QUEUE_KEY,)).fetchall(),
            )
        )
        other.execute("SELECT pg_advisory_unlock(%s)", (QUEUE_KEY,))
    found["advisory unlock sent -> blocked waiter returns"] = _median_p90(unlocked)
    return found


def _queue_lock(name: str, conn: Any) -> Callable[[], Callable[[], int]]:
    """The prototype's acquire on ``conn``: returns the release (which returns the token)."""
    params: dict[str, object] = {"name": name, "holder": f"proto-{os.getpid()}", "secret": "0" * 32}
    params["key"] = QUEUE_KEY

    def take() -> Callable[[], int]:
        rows = conn.execute(QUEUE_GRANT_SQL, params, prepare=True).fetchall()
        if not rows:  # only when a holder's session ended without releasing: not here
            raise RuntimeError("the queue lock came free while the name was held")
        token = int(rows[0][0])

        def release() -> int:
            freed = conn.execute(QUEUE_RELEASE_SQL, {**params, "token": token}, prepare=True)
            if freed.fetchall() != [("off", True)]:
                raise RuntimeError("the prototype's release was refused")
            return token

        return release

    return take


def _contender(kind: str, name: str, seconds: float, ready: Any, start: Any, results: Any) -> None:
    from django.db import connections

    connections.close_all()
    once: Callable[[], int]
    if kind == "backend":
        from leases import acquire

        def once() -> int:
            held = acquire(name, ttl=30, keepalive=False, timeout=30)
            held.release()
            return held.token

    elif kind == "pglock":
        import pglock

        def once() -> int:
            with pglock.advisory(name, xact=True):
                pass
            return 0

    else:
        import psycopg

        take = _queue_lock(name, psycopg.connect(os.environ["DATABASE_URL"], autocommit=True))

        def once() -> int:
            return take()()

    # Each kind's first call pays once for what a fresh process has not done yet: importing
    # the lock's modules (the backend's load on its first acquire), connecting, preparing
    # statements. Eight processes doing that at once on a loaded 2-core machine took 0.7 to
    # 1.1 s each of the timed window (load 10): rounds after fresh processes then read as
    # stalls of the hand-off itself. Paid here, before the start, the window times contention.
    once()
    ready.release()
    start.wait()
    tokens, longest = [], 0.0
    deadline = time.monotonic() + seconds
    while (now := time.monotonic()) < deadline:
        tokens.append(once())
        longest = max(longest, time.monotonic() - now)
    results.put((tokens, longest))


def contended(
    kind: str, seconds: float, processes: int = PROCESSES
) -> tuple[float, list[int], float]:
    """Grants per second of ``processes`` processes on one name, their shares, and the
    longest any one call took (seconds); the tokens (where there are any) must all differ."""
    from django.db import connections

    context = multiprocessing.get_context("fork")
    name = f"limits:{kind}:{uuid.uuid4().hex[:8]}"
    ready, start, results = context.Semaphore(0), context.Event(), context.Queue()
    connections.close_all()
    procs = [
        context.Process(target=_contender, args=(kind, name, seconds, ready, start, results))
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:  # all warmed up (see _contender)
        if not ready.acquire(timeout=60):
            raise RuntimeError(f"{kind}: a contender did not get ready")
    start.set()
    found = [results.get(timeout=seconds + 60) for _ in procs]
    for proc in procs:
        proc.join(10)
    shares = [share for share, _ in found]
    tokens = [token for share in shares for token in share if token]
    if len(set(tokens)) != len(tokens):
        raise RuntimeError(f"{kind}: a token was granted twice")
    longest = max(wait for _, wait in found)
    return sum(map(len, shares)) / seconds, sorted(map(len, shares), reverse=True), longest


def handoff(kind: str, count: int = 40) -> float:
    """Median milliseconds from the holder's release to the blocked waiter's acquire returning."""
    import psycopg

    from benchmarks.bench_lease import handoff_once

    name = f"limits:handoff:{kind}:{uuid.uuid4().hex[:8]}"
    url = os.environ["DATABASE_URL"]
    takes: list[Callable[[], Callable[[], object]]]
    if kind == "backend":
        from leases import acquire

        def ours() -> Callable[[], object]:
            return acquire(name, ttl=30, keepalive=False, timeout=10).release

        takes = [ours, ours]
    else:
        takes = [_queue_lock(name, psycopg.connect(url, autocommit=True)) for _ in range(2)]
    samples = [handoff_once(takes[0], waiter_take=takes[1]) for _ in range(count)]
    return statistics.median(samples) * 1e3


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff_limits")
    parser.add_argument("--fsync", action="store_true", help="a server that flushes its WAL")
    parser.add_argument("--rounds", type=at_least(1), default=2)
    parser.add_argument("--seconds", type=positive_seconds, default=3.0)
    parser.add_argument(
        "--processes",
        type=listed(at_least(2)),
        default=str(PROCESSES),
        help="contending processes, comma-separated (2,4,8: with two, each grant is one bare "
        "hand-off; what each further process adds is what the waiters' own work costs it)",
    )
    args = parser.parse_args(argv)
    counts: list[int] = args.processes
    sync, sync_p90 = fdatasync()
    print(f"8 kB write + fdatasync here: median {sync:.0f} us, p90 {sync_p90:.0f} us")
    settings = DURABLE if args.fsync else None
    server = PostgresServer(settings=settings).start()
    try:
        os.environ["DATABASE_URL"] = server.url
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")
        os.environ.setdefault("DJANGO_DEBUG", "0")
        import django
        from django.core.management import call_command
        from django.test import override_settings

        django.setup()
        call_command("migrate", verbosity=0)
        found = hops(server.url)
        print(f"hops, server fsync={'on' if args.fsync else 'off'} (load {os.getloadavg()[0]:.1f})")
        for hop, (median, p90) in found.items():
            print(f"  {hop:48s} median {median:6.0f} us  p90 {p90:6.0f} us")
        trip = found["round trip (SELECT 1)"][0]
        commit = found["write + commit, synchronous_commit on"][0] - trip
        wake = found["NOTIFY sent -> listening thread woken"][0] - trip
        print(
            f"  bounds per hand-off, from these medians: backend 2 round trips + a client "
            f"wake-up + the grant's commit = {2 * trip + wake + commit:.0f} us; one round trip "
            f"fewer (a server-side wake) = {trip + wake + commit:.0f} us; "
            + (
                "the commit includes this server's WAL flush"
                if args.fsync
                else f"a server that flushes adds its WAL flush to each (an 8 kB fdatasync is "
                f"{sync:.0f} us here: 1 / (fdatasync + 2 round trips) = "
                f"{1e6 / (sync + 2 * trip):.0f} grants/s; --fsync measures the flush itself)"
            )
        )
        backends = {"default": {"ENGINE": "leases.backends.database"}}
        with override_settings(DEBUG=False, LEASES={"BACKENDS": backends}):
            for round_ in range(args.rounds):
                for count in counts:
                    for kind in ("backend", "queue-lock", "pglock"):
                        rate, shares, longest = contended(kind, args.seconds, count)
                        print(
                            f"round {round_}: {count} x {kind:10s} {rate:5.0f} grants/s "
                            f"({1e6 / rate:4.0f} us a grant), shares "
                            f"{'/'.join(map(str, shares))}, longest wait "
                            f"{longest * 1e3:.0f} ms (load {os.getloadavg()[0]:.1f})",
                            flush=True,
                        )
                for kind in ("backend", "queue-lock"):
                    print(
                        f"round {round_}: hand-off {kind:10s} median {handoff(kind):.2f} ms "
                        f"(load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
        return 0
    finally:
        server.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
