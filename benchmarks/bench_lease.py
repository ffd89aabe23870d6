"""Database leases: our backend vs the naive statements through Django and psycopg, and peers.

1. Uncontended acquire + release per operation. The baseline is what one would write by hand
   (a naive upsert and a release conditional on holder and token) through Django's cursor;
   the backend's own two statements (``ACQUIRE_SQL`` then ``RELEASE_SQL``) through Django's
   cursor and psycopg show what the SQL itself costs sent as text, parsed and planned on every
   call (the project once reported 1.05-1.14x against that floor, which flattered the backend
   then; an outside check against the naive statements measured 1.38-1.41x). The backend
   sends them prepared, run by name without a cursor (``leases/backends/_pgprepared.py``), so
   it now beats both floors. Round trips are counted from libpq's trace. The ceiling for one
   name (round trip and ``fdatasync`` measured here) is printed after it.
2. Contended throughput: 8 processes acquiring and releasing one name as fast as they can,
   ours vs django-pglock (``advisory(xact=True)``: a transaction-scoped Postgres lock, which
   protects nothing outside its transaction and has no fencing token) vs python-redis-lock.
   Each run reports every process's share, how often the same process got the name twice in
   a row, how many later arrivals overtook a waiter, the wait's p99, and processes that never
   reported (stuck) instead of failing the run. Ours runs 10 s (the fairness goal's length).
3. Hand-off latency: from the holder's ``release()`` to the blocked waiter's acquire returning.
"""

from __future__ import annotations

import faulthandler
import itertools
import multiprocessing
import os
import queue
import signal
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
from django.db import connection, connections
from django.test import override_settings

from benchmarks.bench_advisory import _measure
from benchmarks.common import Report
from leases import acquire, lease
from leases.backends import get_backend
from leases.backends._waiting_room import room_key
from leases.backends.database import ACQUIRE_SQL, RELEASE_SQL, ROOM_GRACE, Backend

#: The floor proves ownership like the backend does (renew/release compare the secret's hash).
SECRET = "0" * 32

#: What someone would write by hand for a durable lease (the baseline an outside check used):
#: an upsert that takes a free or expired name and bumps its token, and a release conditional
#: on the holder and token. No secret, no ``NOTIFY``, no "a failed try writes nothing" probe.
NAIVE_ACQUIRE_SQL = """
INSERT INTO leases_lease AS l
    (name, holder, token, acquired_at, expires_at, renewed_at, meta, secret_hash)
VALUES (%(name)s, %(holder)s, 1, now(), now() + make_interval(secs => %(ttl)s), NULL, '{}', NULL)
ON CONFLICT (name) DO UPDATE
SET holder = EXCLUDED.holder, token = l.token + 1, acquired_at = EXCLUDED.acquired_at,
    expires_at = EXCLUDED.expires_at
WHERE l.holder = '' OR l.expires_at <= now()
RETURNING l.token, l.expires_at
"""
NAIVE_RELEASE_SQL = """
UPDATE leases_lease SET holder = '', expires_at = now()
WHERE name = %(name)s AND holder = %(holder)s AND token = %(token)s
"""

TITLE = "database leases: backend vs psycopg and Django's cursor; pglock, python-redis-lock"

TTL = 30.0
PROCESSES = 8
CONTENDED_SECONDS = 3.0
#: Ours runs longer: fairness (no process above 2x its fair share) is judged over 10 s.
FAIRNESS_SECONDS = 10.0
HANDOFFS = 60


def _floor(
    run: Callable[[str, dict[str, Any]], list[Any]], *, naive: bool = False
) -> Callable[[], None]:
    """Acquire + release with the backend's own statements (or the naive ones) through ``run``."""
    name = f"bench:floor:{uuid.uuid4().hex[:8]}"
    holder = "bench-floor"
    acquire_sql, release_sql = (
        (NAIVE_ACQUIRE_SQL, NAIVE_RELEASE_SQL) if naive else (ACQUIRE_SQL, RELEASE_SQL)
    )

    def op() -> None:
        grant: dict[str, Any] = {"name": name, "holder": holder, "secret": SECRET}
        if not naive:  # outside any waiting room, as the backend's first try
            grant |= {"room": room_key(name), "grace": ROOM_GRACE, "in_room": False}
        ((token, _),) = run(acquire_sql, {**grant, "ttl": TTL})
        run(release_sql, {**grant, "token": token})

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
            return cursor.fetchall() if cursor.description else []

    def psycopg_raw(sql: str, params: dict[str, Any]) -> list[Any]:
        cursor = raw.execute(sql, params)
        return cursor.fetchall() if cursor.description else []

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
        "Django cursor, naive upsert + release": (_floor(django_cursor, naive=True), None),
        "psycopg, naive upsert + release": (_floor(psycopg_raw, naive=True), raw.pgconn),
        "Django cursor, the backend's 2 statements": (_floor(django_cursor), None),
        "psycopg, the backend's 2 statements": (_floor(psycopg_raw), raw.pgconn),
        "backend try_acquire + release": (ours_backend, own.pgconn),
        "acquire(keepalive=False) + release()": (ours_acquire, own.pgconn),
        "with lease() (keepalive on)": (ours_lease, own.pgconn),
    }


def _commit_limit(raw: psycopg.Connection[Any]) -> str:
    """The ceiling for one name: a critical section needs a durable grant (one WAL flush)
    and the round trips of the grant and the release, one after the other."""
    trips = []
    for _ in range(200):
        started = time.perf_counter()
        raw.execute("SELECT 1")
        trips.append(time.perf_counter() - started)
    syncs = []
    with tempfile.NamedTemporaryFile(dir=os.environ.get("BENCH_FSYNC_DIR")) as probe:
        block = b"\0" * 8192
        for _ in range(200):
            started = time.perf_counter()
            os.pwrite(probe.fileno(), block, 0)
            os.fdatasync(probe.fileno())
            syncs.append(time.perf_counter() - started)
    trip, sync = statistics.median(trips), statistics.median(syncs)
    (fsync,) = raw.execute("SHOW fsync").fetchone() or ("?",)
    return (
        f"one name's ceiling: round trip {trip * 1e6:.0f} us, 8 kB write + fdatasync "
        f"{sync * 1e6:.0f} us here; 1 / (fdatasync + 2 round trips) = "
        f"{1 / (sync + 2 * trip):.0f} CS/s on a server that flushes; this server has "
        f"fsync={fsync}, so 1 / (2 round trips) = {1 / (2 * trip):.0f} CS/s"
    )


def _contend(kind: str, name: str, seconds: float, start: Any, results: Any) -> None:
    """One contending process: acquire + release ``name`` in a loop until time is up.

    Reports every grant as (token or sequence number, arrived, granted) on the monotonic
    clock, which is one clock for every process on the machine, so the parent can tell who
    was served when and whether later arrivals overtook earlier ones. SIGUSR1 prints every
    thread's stack: the parent asks for it before it kills a process that did not report, so a
    stuck run says where it was stuck (a starved wait, a lock inherited over the fork).
    """
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    connections.close_all()
    acquire_release = _contender(kind, name)
    start.wait()
    grants: list[tuple[int, float, float]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        arrived = time.monotonic()
        token = acquire_release()
        grants.append((token, arrived, time.monotonic()))
    results.put((os.getpid(), grants))


def _contender(kind: str, name: str) -> Callable[[], int]:
    """Acquire + release once; returns the grant's token (0 for locks that have none)."""
    if kind in ("default", "no-room"):

        def ours() -> int:
            held = acquire(name, ttl=TTL, backend=kind, keepalive=False, timeout=30)
            held.release()
            return held.token

        return ours
    if kind == "pglock":
        import pglock

        def pg() -> int:
            with pglock.advisory(name, xact=True):  # opens and commits its own transaction
                pass
            return 0

        return pg
    import redis
    import redis_lock

    client = redis.Redis.from_url(os.environ["REDIS_URL"])

    def prl() -> int:
        held = redis_lock.Lock(client, name, expire=int(TTL))
        held.acquire(blocking=True)
        held.release()
        return 0

    return prl


@dataclass
class Contended:
    """What one contended run measured, per process and across them."""

    grants: int
    seconds: float
    #: Critical sections each process got, most first.
    shares: list[int]
    #: Processes that did not report in time (stuck, or dead): the run is not comparable.
    stuck: int
    #: Longest any single acquire waited, and the 99th percentile, seconds.
    longest_wait: float
    p99_wait: float
    #: Of the grants with a token, how often the previous grant went to the same process.
    repeats: float | None
    #: Grants that a later-arriving acquire overtook, on average (``None``: no tokens).
    overtaken: float | None

    @property
    def per_grant(self) -> float:
        return self.seconds / max(self.grants, 1)

    def summary(self, label: str) -> str:
        fair = self.grants / max(len(self.shares), 1)
        worst = max(self.shares, default=0) / fair if fair else 0.0
        parts = [
            f"{label}: {self.grants / self.seconds:.0f} grants/s",
            f"shares {'/'.join(map(str, self.shares))} (largest {worst:.2f}x fair)",
            f"wait p99 {self.p99_wait * 1e3:.0f} ms, longest {self.longest_wait * 1e3:.0f} ms",
        ]
        if self.repeats is not None:
            parts.append(f"same process twice in a row {self.repeats:.0%}")
        if self.overtaken is not None:
            parts.append(f"overtaken by later arrivals {self.overtaken:.2f} per grant")
        if self.stuck:
            parts.append(f"STUCK: {self.stuck} process(es) did not report")
        return "; ".join(parts)


def _order(per_process: dict[int, list[tuple[int, float, float]]]) -> tuple[float, float] | None:
    """(same-process repeat rate, mean overtakes per grant) from the grants' tokens."""
    flat = sorted(
        (token, arrived, pid)
        for pid, grants in per_process.items()
        for token, arrived, _ in grants
        if token
    )
    if len(flat) < 2:
        return None
    repeats = sum(a[2] == b[2] for a, b in itertools.pairwise(flat)) / (len(flat) - 1)
    # A grant is overtaken by each grant served before it whose acquire started after it did.
    # Waits are short (ms), so only nearby tokens can overtake: a bounded look-back suffices.
    overtakes = 0
    for index, (_, arrived, _) in enumerate(flat):
        overtakes += sum(1 for other in flat[max(0, index - 200) : index] if other[1] > arrived)
    return repeats, overtakes / len(flat)


def contended(kind: str, seconds: float = CONTENDED_SECONDS) -> Contended:
    """Run :data:`PROCESSES` contenders on one name for ``seconds``; a process that does not
    report in time is counted as stuck (and killed) instead of failing the whole run."""
    context = multiprocessing.get_context("fork")
    name = f"bench:contended:{kind}:{uuid.uuid4().hex[:8]}"
    start, results = context.Event(), context.Queue()
    connections.close_all()
    procs = [
        context.Process(target=_contend, args=(kind, name, seconds, start, results))
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    time.sleep(1.0)  # every process connected
    start.set()
    per_process: dict[int, list[tuple[int, float, float]]] = {}
    report_by = time.monotonic() + seconds + 20
    try:
        while len(per_process) < len(procs):
            try:
                pid, grants = results.get(timeout=max(0.1, report_by - time.monotonic()))
            except queue.Empty:
                break
            per_process[pid] = grants
    finally:
        for proc in procs:
            if proc.pid not in per_process and proc.is_alive() and proc.pid is not None:
                print(f"contender {proc.pid} ({kind}) did not report; its stacks:", flush=True)
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(0.5)
            proc.join(timeout=0 if proc.pid not in per_process else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    grants = [grant for done in per_process.values() for grant in done]
    order = _order(per_process)
    waits = sorted(granted - arrived for _, arrived, granted in grants)
    return Contended(
        grants=len(grants),
        seconds=seconds,
        shares=sorted((len(done) for done in per_process.values()), reverse=True),
        stuck=len(procs) - len(per_process),
        longest_wait=waits[-1] if waits else 0.0,
        p99_wait=waits[int(len(waits) * 0.99)] if waits else 0.0,
        repeats=None if order is None else order[0],
        overtaken=None if order is None else order[1],
    )


#: The rate ratio of the backend to django-pglock, 8 processes on one name, when issue 14 was
#: filed (799 against 3,561 grants/s in one run): the goal is twice it, in the same benchmark.
FILED_RATIO = 799 / 3561
#: Alternating blocks of the backend and django-pglock, each this many seconds: on a shared
#: machine the rate of one long run follows the neighbours' load; the ratio of two runs
#: moments apart, repeated, is what can be compared.
ALTERNATIONS, BLOCK_SECONDS = 3, 2.0
PGLOCK_HANDOFF = "django-pglock (server lock queue)"


def _alternating() -> str:
    """The backend's rate over django-pglock's, contended, in alternating blocks."""
    ratios = []
    for _ in range(ALTERNATIONS):
        ours, peer = contended("default", BLOCK_SECONDS), contended("pglock", BLOCK_SECONDS)
        ratios.append(peer.per_grant / ours.per_grant)
    median = statistics.median(ratios)
    return (
        f"ours / django-pglock, contended, {ALTERNATIONS} alternating {BLOCK_SECONDS:.0f} s "
        f"blocks each: {', '.join(f'{r:.2f}' for r in ratios)}; median {median:.2f} = "
        f"x{median / FILED_RATIO:.2f} the ratio when issue 14 was filed ({FILED_RATIO:.3f}; "
        "goal x2)"
    )


def handoff_once(
    take: Callable[[], Callable[[], object]],
    settle: float = 0.0,
    waiter_take: Callable[[], Callable[[], object]] | None = None,
) -> float:
    """Seconds from one release to the blocked waiter's acquire returning (see :func:`handoff`);
    the waiter takes with ``waiter_take`` when given (a connection of its own), else ``take``.
    No collection before it (:func:`~benchmarks.common.settle`): one sample is one event, a
    collection that lands in it is an outlier the median drops, and a collection first left
    the caches cold for the sample (django-pglock's hand-off 0.3 ms without, 0.4 ms with)."""
    time.sleep(settle)
    release = take()
    got: list[float] = []

    def wait() -> None:
        release_waiter = (waiter_take or take)()
        got.append(time.perf_counter())
        release_waiter()
        connections.close_all()

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.02)  # the waiter is blocked by now
    released = time.perf_counter()
    release()
    waiter.join(15)
    return got[0] - released


def _median_p90(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples), samples[int(len(samples) * 0.9)]


def handoff(take: Callable[[], Callable[[], object]], settle: float = 0.0) -> tuple[float, float]:
    """Median and p90 seconds from a release to the blocked waiter's acquire returning.

    ``take()`` blocks until it holds the lock and returns the function that releases it.
    ``settle``: seconds to wait before each holder takes it (past the database backend's
    ``ROOM_GRACE``, a holder whose last release handed the name on wins uncontended again).
    """
    return handoffs({"": (take, settle)})[""]


def handoffs(
    contenders: dict[str, tuple[Callable[[], Callable[[], object]], float]],
    count: int = HANDOFFS,
) -> dict[str, tuple[float, float]]:
    """:func:`handoff` of each contender (``take``, ``settle``), the contenders taking turns
    sample by sample (in an order rotated each round): this machine's speed drifts by up to
    two times within minutes, so rows measured one after the other did not compare."""
    samples: dict[str, list[float]] = {label: [] for label in contenders}
    labels = list(contenders)
    for round_ in range(count):
        shift = round_ % len(labels)
        for label in labels[shift:] + labels[:shift]:
            take, settle = contenders[label]
            samples[label].append(handoff_once(take, settle))
    return {label: _median_p90(found) for label, found in samples.items()}


def _key() -> str:
    return uuid.uuid4().hex[:8]


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
    release: Callable[[], None] = held.release
    return release


def main(report: Report) -> None:
    backends = {
        "default": {"ENGINE": "leases.backends.database"},
        "no-room": {"ENGINE": "leases.backends.database", "WAITING_ROOM": False},
    }
    with override_settings(DEBUG=False, LEASES={"BACKENDS": backends}):
        raw = psycopg.connect(autocommit=True, **connection.get_connection_params())
        try:
            _measure(report, "uncontended acquire + release", uncontended(raw))
            report.note(_commit_limit(raw))
        finally:
            raw.close()
        runs = [
            (label, contended(kind, seconds))
            for label, kind, seconds in (
                ("ours (database backend)", "default", FAIRNESS_SECONDS),
                ("ours, WAITING_ROOM off", "no-room", CONTENDED_SECONDS),
                ("django-pglock advisory(xact=True)", "pglock", CONTENDED_SECONDS),
                ("python-redis-lock", "redis_lock", CONTENDED_SECONDS),
            )
        ]
        report.table(
            f"contended: {PROCESSES} processes, one name (time per grant)",
            [(label, run.per_grant) for label, run in runs],
        )
        for label, run in runs:
            report.note(run.summary(label))
        report.note(_alternating())
        # The first row's holder took the name back within ROOM_GRACE of handing it on, so it
        # won it in the room and keeps its room connection; the second's won it uncontended,
        # on the backend's own connection. Both hold the grant's tenure lock.
        grace = ROOM_GRACE.total_seconds() * 1.5
        found = handoffs(
            {
                label: (partial(take, f"bench:handoff:{_key()}"), settle)
                for label, take, settle in (
                    ("ours (tenure lock, holder won in the room)", _take_ours, 0.0),
                    ("ours (tenure lock, holder won uncontended)", _take_ours, grace),
                    ("ours, WAITING_ROOM off", _take_ours_without_room, 0.0),
                    (PGLOCK_HANDOFF, _take_pglock, 0.0),
                    ("python-redis-lock (BLPOP signal)", _take_redis_lock, 0.0),
                )
            }
        )
        latencies = list(found.items())
        report.table(
            f"hand-off latency, median ({HANDOFFS} samples each, interleaved)",
            [(k, v[0]) for k, v in latencies],
            unit="ms",
        )
        report.note("p90: " + "; ".join(f"{k} {v[1] * 1e3:.2f} ms" for k, v in latencies))
        pglock = found[PGLOCK_HANDOFF][0]
        report.note(
            "hand-off / django-pglock's in the same rounds: "
            + "; ".join(f"{k} x{v[0] / pglock:.2f}" for k, v in latencies if k.startswith("ours"))
        )
    report.note(
        "Targets (issue 14): with lease() within 1.1x of the naive two statements through "
        "Django's cursor; contended 2x the last figure (674-863/s) with no process above 2x "
        "its fair share; hand-off median under 1 ms."
    )
