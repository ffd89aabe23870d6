"""Properties of the database backend itself: round trips, writes, connections, fork."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import itertools
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import IO, Any
from unittest import mock

import psycopg
import pytest
from django.conf import settings
from django.db import connection, connections
from django.test import override_settings

from leases import (
    BackendUnavailable,
    LeaseLost,
    LeaseNotHeld,
    LeasesImproperlyConfigured,
    LeaseUnavailable,
    aacquire,
    acquire,
    acquire_slot,
)
from leases.backends import _waiting_room, get_backend
from leases.backends._tenure import PREPARED_QUEUED_ACQUIRE
from leases.backends.base import Grant, new_secret
from leases.backends.database import (
    ACQUIRE_SQL,
    RELEASE_SQL,
    RENEW_SQL,
    ROOM_CONNECTIONS,
    ROOM_GRACE,
    ROOM_TIMEOUT,
    Backend,
)
from leases.keys import advisory_key, split_key
from leases.semaphore import slot_name
from tests.lease_backends import lease_name
from tests.waiting import wait_until

__all__ = ["lease_name"]

pytestmark = pytest.mark.django_db

#: The same statement without the read-only probe, to show what the probe saves.
NAIVE_ACQUIRE_SQL = ACQUIRE_SQL.replace(
    """WHERE NOT EXISTS (
    SELECT 1 FROM leases_lease
    WHERE name = %(name)s::text AND holder <> '' AND expires_at > clock_timestamp()
)
""",
    "WHERE true\n",
)


@contextmanager
def own_connection() -> Iterator[psycopg.Connection[Any]]:
    """A psycopg connection of its own, in autocommit: what it writes is committed at once,
    outside the test's transaction, as the backend's own connection needs to see it."""
    wrapper = connections.create_connection("default")
    wrapper.ensure_connection()
    try:
        yield wrapper.connection
    finally:
        wrapper.close()


def database_backend() -> Backend:
    backend = get_backend("default")
    assert isinstance(backend, Backend)
    return backend


def round_trips(action: Callable[[], object], backend: Backend | None = None) -> int:
    """How many times ``action`` waited for the server on the connection of ``backend``
    (default: the ``default`` alias's).

    Counted from libpq's own protocol trace: every extended-protocol ``Sync`` and every simple
    ``Query`` the client sends ends a round trip.
    """
    backend = backend or database_backend()
    backend.inspect("warm-up")  # opens the connection
    conn = backend.connection()
    assert conn is not None
    with tempfile.TemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            action()
        finally:
            conn.pgconn.untrace()
        trace.seek(0)
        sent = [line.split("\t") for line in trace.read().splitlines()]
    return sum(1 for parts in sent if parts[0] == "F" and parts[2] in ("Sync", "Query"))


def test_acquire_renew_release_are_one_round_trip_each(lease_name: str) -> None:
    database_backend()._probe_pooler()  # a process's first grant asks that once (below)
    held: list[Any] = []
    assert round_trips(lambda: held.append(acquire(lease_name, ttl=2, keepalive=False))) == 1
    assert round_trips(held[0].renew) == 1
    assert round_trips(held[0].release) == 1
    assert round_trips(lambda: database_backend().try_acquire(lease_name, "x", 1)) == 1


def test_a_process_first_grant_asks_once_whether_a_pooler_is_in_the_way(lease_name: str) -> None:
    """Before its own connection's first tenure lock, a backend asks once (one round trip,
    after its first grant) whether its connections reach PostgreSQL through a pooler, where a
    session lock could outlive its unlock (``_pgpooler``; ``tests/test_pgbouncer.py``)."""
    backend = Backend("first-grant-test", {})
    try:
        grants: list[Any] = []
        assert (
            round_trips(lambda: grants.append(backend.try_acquire(lease_name, "a", 5)), backend)
            == 2
        )
        assert backend._room.probed and backend._room.enabled
        backend.release(grants[0])
        assert (
            round_trips(lambda: grants.append(backend.try_acquire(lease_name, "a", 5)), backend)
            == 1
        )
        backend.release(grants[1])
    finally:
        backend.close()


def test_a_refused_release_asks_why_in_a_second_statement(lease_name: str) -> None:
    """The release is one plain ``UPDATE``; only a refusal (rare) costs a second, read-only
    statement that tells a forged grant (the lease stays held) from a lost one, sync and
    async alike."""
    backend = database_backend()
    held = acquire(lease_name, ttl=5, keepalive=False)
    forged = Grant(lease_name, held.holder, held.token, 5.0, time.monotonic(), secret=new_secret())

    def release_forged() -> None:
        with pytest.raises(LeaseNotHeld, match="secret"):
            backend.release(forged)

    assert round_trips(release_forged) == 2

    async def arelease(grant: Grant) -> None:
        try:
            await backend.arelease(grant)
        finally:
            await backend.aclose()

    with pytest.raises(LeaseNotHeld, match="secret"):
        asyncio.run(arelease(forged))
    info = backend.inspect(lease_name)
    assert info is not None and info.held and info.token == held.token
    grant = held.grant
    held.release()
    successor = acquire(lease_name, ttl=5, keepalive=False, holder="successor")
    for late in (grant, replace(grant, token=successor.token)):
        with pytest.raises(LeaseLost):
            backend.release(late)
        with pytest.raises(LeaseLost):
            asyncio.run(arelease(late))
    info = backend.inspect(lease_name)
    assert info is not None and info.held and info.holder == "successor"
    successor.release()


def test_failed_try_assigns_no_transaction_id(lease_name: str) -> None:
    """A held lease makes a try write nothing: no xid, no WAL, no commit flush.

    The same upsert without the read-only probe locks the held row although its ``WHERE``
    is false, which assigns a transaction id (and so writes WAL and flushes at commit).
    """
    held = acquire(lease_name, ttl=5, keepalive=False)
    params = {"name": lease_name, "holder": "contender", "ttl": 5.0, "secret": "s"}
    params |= {"room": room_key(lease_name), "grace": ROOM_GRACE, "in_room": False}
    with own_connection() as probe:
        probe.autocommit = False
        for sql, assigned in ((ACQUIRE_SQL, False), (NAIVE_ACQUIRE_SQL, True)):
            assert probe.execute(sql, params).fetchall() == []
            (xid,) = probe.execute("SELECT pg_current_xact_id_if_assigned()").fetchone() or (0,)
            probe.rollback()
            assert (xid is not None) is assigned, sql
    held.release()


def test_failed_tries_no_wait_follows_are_not_kept_forever(lease_name: str) -> None:
    """Each thread remembers its failed tries for the wait after them; the tries no wait
    follows (``timeout=0``, the other slots of a full semaphore: here all eight) must not pile
    up for the thread's life. Past the bound (5 here) the oldest are forgotten, as on the
    async side (``test_async_limits``)."""
    backend = get_backend("default")
    held = [backend.try_acquire(slot_name(lease_name, k), "holder", 30) for k in range(8)]
    try:
        with mock.patch("leases.backends._pgconn._RECENT_RELEASES", 5):
            with pytest.raises(LeaseUnavailable):
                acquire_slot(lease_name, limit=8, ttl=5, timeout=0)
            kept = len(backend._failed)  # type: ignore[attr-defined]
    finally:
        for grant in held:
            assert grant is not None
            backend.release(grant)
    assert kept <= 5, kept


def test_failed_tries_are_bounded_per_process_not_per_thread(lease_name: str) -> None:
    """The bound was each thread's: 16 live threads that each failed a pass over a full
    semaphore of 8 slots kept 8 entries each, 128 in all (at the real bound, 4096 entries of
    about 200 bytes a thread: 0.8 MB a thread, 80 MB for a 100-thread server). Past the
    bound (5 here) the oldest are forgotten, whichever thread noted them."""
    backend = get_backend("default")
    held = [backend.try_acquire(slot_name(lease_name, k), "holder", 30) for k in range(8)]
    threads, all_failed = 16, threading.Barrier(16 + 1)
    errors: list[BaseException] = []

    def fail_a_pass() -> None:
        try:
            with pytest.raises(LeaseUnavailable):
                acquire_slot(lease_name, limit=8, ttl=5, timeout=0)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)
        finally:
            all_failed.wait(30)  # and stay alive until counted
            all_failed.wait(30)

    try:
        with mock.patch("leases.backends._pgconn._RECENT_RELEASES", 5):
            pool = [threading.Thread(target=fail_a_pass) for _ in range(threads)]
            for thread in pool:
                thread.start()
            all_failed.wait(30)
            kept = len(backend._failed)  # type: ignore[attr-defined]
            all_failed.wait(30)
            for thread in pool:
                thread.join(30)
    finally:
        for grant in held:
            assert grant is not None
            backend.release(grant)
    assert not errors, errors
    assert kept == 5, kept


def test_sql_never_deletes_rows() -> None:
    for sql in (ACQUIRE_SQL, RENEW_SQL, RELEASE_SQL):
        assert "DELETE" not in sql.upper()
        assert "holder = %(holder)s" in sql or "ON CONFLICT" in sql


def test_grants_commit_with_synchronous_commit_on() -> None:
    backend = database_backend()
    backend.inspect("warm-up")
    conn = backend.connection()
    assert conn is not None and conn.autocommit
    assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    assert backend.deploy_checks() == []


def test_lease_connection_is_not_the_callers(lease_name: str) -> None:
    held = acquire(lease_name, ttl=1, keepalive=False)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (django_pid,) = cursor.fetchone()
    own = database_backend().connection()
    assert own is not None and own.info.backend_pid != django_pid
    held.release()


@pytest.mark.django_db(transaction=True)
def test_terminated_lease_connection_reconnects_and_keeps_the_lease(lease_name: str) -> None:
    """Lease state is in the table, not the session: killing the session loses nothing."""
    held = acquire(lease_name, ttl=1)
    own = database_backend().connection()
    assert own is not None
    own_pid = own.info.backend_pid
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [own_pid])
    time.sleep(1.5)
    held.ensure_held()
    assert not held.lost.is_set()
    replacement = database_backend().connection()
    assert replacement is not None and replacement.info.backend_pid != own_pid
    held.release()


def test_forked_child_can_neither_renew_nor_release(lease_name: str) -> None:
    held = acquire(lease_name, ttl=2)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        code = 1
        try:
            results = {}
            for action in ("renew", "release", "ensure_held"):
                try:
                    getattr(held, action)()
                    results[action] = "ok"
                except (LeaseLost, LeaseNotHeld) as exc:
                    results[action] = type(exc).__name__
            get_backend("default")  # a fresh instance; the parent's is dropped
            gc.collect()  # ...and collected, without closing the parent's socket
            os.write(write, json.dumps(results).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        results = json.loads(pipe.read() or "{}")
    assert os.waitstatus_to_exitcode(status) == 0
    assert results == {
        "renew": "LeaseNotHeld",
        "release": "LeaseNotHeld",
        "ensure_held": "LeaseLost",
    }
    held.renew()  # the parent's connection survived the child
    held.release()


def test_misconfigured_backends_fail_at_configuration() -> None:
    cases = {
        "unknown": {"ENGINE": "leases.backends.database", "FLAVOUR": 1},
        "nodb": {"ENGINE": "leases.backends.database", "DATABASE": "missing"},
    }
    with override_settings(LEASES={"BACKENDS": {"default": {"ENGINE": "x"}, **cases}}):
        for alias in cases:
            with pytest.raises(LeasesImproperlyConfigured):
                get_backend(alias)


def test_lease_connection_ignores_django_pool_and_binding_options() -> None:
    """Django's pool and cursor options do not leak into the backend's own connection."""
    settings = dict(connections.settings["default"])
    settings["OPTIONS"] = {
        **settings.get("OPTIONS", {}),
        "pool": True,
        "server_side_binding": True,
        "options": "-c search_path=public",
    }
    connections.settings["pooled"] = settings
    backend = Backend("pooled-leases", {"DATABASE": "pooled"})
    try:
        backend.inspect("warm-up")  # opens the connection
        conn = backend.connection()
        assert conn is not None and conn.autocommit
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        assert conn.execute("SHOW search_path").fetchone() == ("public",)
    finally:
        backend.close()
        del connections.settings["pooled"]


def syncs_sent(trace: IO[str]) -> int:
    """Tries a room connection sent, from its libpq trace file: ``Sync`` messages (a try run
    by name, ``Bind``/``Execute``) and simple queries that ``EXECUTE`` a room statement (a
    session's first try: ``PREPARE`` and ``EXECUTE`` in one message, no ``Sync``). Counting
    ``Sync`` alone saw no first try, so a test whose room connection was new (run on its own)
    failed. The async room test once matched a backslash and a ``t`` instead of a tab: it
    counted nothing, and its "no try while the name was held" could not fail."""
    trace.seek(0)
    sent = ("\n" + trace.read()).split("\nF\t")[1:]  # a simple query's text spans lines
    return sum(1 for message in sent if _ROOM_TRY.match(message))


#: A frontend message that is a try: ``<length>\tSync`` or a ``Query`` that runs a room statement.
_ROOM_TRY = re.compile(r"\d+\t(Sync\b|Query\t.*\bEXECUTE leases_room_)", re.S)


def queued_tries_sent(trace: IO[str]) -> int:
    """A thread's tries in the room (each a queued try, see ``leases.backends._tenure``) its
    room connections sent, from their libpq trace file: the ``Bind`` of the queued statement.
    Other statements on those connections (a kept connection's release, the listen and look)
    are not tries."""
    trace.seek(0)
    return len(_QUEUED_TRY.findall(trace.read()))


_QUEUED_TRY = re.compile(rf'\tBind\t\s*""\s+"{PREPARED_QUEUED_ACQUIRE.name}"')


@contextmanager
def traced_room_connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[IO[str]]:
    """libpq's trace of every room connection a thread's visit takes from now on, in one file
    (idle ones from before are closed first, so none escapes it)."""
    connection_for = _waiting_room.WaitingRoom._connection
    traced_conns: list[psycopg.Connection[Any]] = []
    with tempfile.TemporaryFile("w+") as trace:

        def traced(room: Any) -> Any:
            conn = connection_for(room)
            conn.pgconn.trace(trace.fileno())
            conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
            traced_conns.append(conn)
            return conn

        monkeypatch.setattr(_waiting_room.WaitingRoom, "_connection", traced)
        database_backend()._room.close()
        try:
            yield trace
        finally:
            for conn in traced_conns:
                if not conn.closed:
                    conn.pgconn.untrace()


def room_locks(name: str) -> dict[bool, int]:
    """Granted and waiting sessions on ``name``'s waiting-room lock, from ``pg_locks``, read on
    a connection of its own (so it may also be called from a thread an event loop started)."""
    classid, objid = split_key(room_key(name))
    with own_connection() as conn:
        rows = conn.execute(
            "SELECT granted, count(*) FROM pg_locks WHERE locktype = 'advisory' "
            "AND classid = %s AND objid = %s AND objsubid = 1 GROUP BY granted",
            [classid, objid],
        ).fetchall()
    return dict(rows)


def waiting_inside(name: str) -> bool:
    """Whether the session inside ``name``'s room (holding its lock) waits for the release:
    idle after its ``LISTEN`` (its waiter's queued try was refused: the holder keeps no
    tenure lock), or blocked on a lock (queued on the holder's tenure lock). The room lock
    alone is taken by the first of the try's two statements: a release before the second
    lets that one take the name."""
    classid, objid = split_key(room_key(name))
    with own_connection() as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objid = %s "
            "AND l.objsubid = 1 AND l.granted AND (a.wait_event_type = 'Lock' "
            "OR (a.state = 'idle' AND a.query LIKE '%%LISTEN leases_released%%'))",
            [classid, objid],
        ).fetchone()
    return bool(row and row[0] == 1)


def room_key(name: str) -> int:
    key = advisory_key(f"leases:room:{name}")
    assert isinstance(key, int)
    return key


def queue_behind(
    name: str, count: int, expected: dict[bool, int]
) -> tuple[Any, list[int], list[threading.Thread]]:
    """Hold ``name``, start ``count`` threads that wait for it (take it, release it), and wait
    until the room's lock shows ``expected`` (granted -> sessions)."""
    holder = acquire(name, ttl=10)
    tokens: list[int] = []

    def wait() -> None:
        held = acquire(name, ttl=5, timeout=20)
        tokens.append(held.token)
        time.sleep(0.02)
        held.release()

    waiters = [threading.Thread(target=wait) for _ in range(count)]
    for thread in waiters:
        thread.start()
    deadline = time.monotonic() + 8
    while room_locks(name) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert room_locks(name) == expected
    return holder, tokens, waiters


@pytest.fixture
def patient_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters queue for the room long enough to be observed on a loaded machine."""
    monkeypatch.setattr(_waiting_room, "ROOM_TIMEOUT", 10.0)


def test_waiters_sleep_in_the_room_so_a_release_wakes_one(
    lease_name: str, patient_room: None
) -> None:
    holder, tokens, waiters = queue_behind(lease_name, 4, {True: 1, False: 3})
    holder.release()
    for thread in waiters:
        thread.join(timeout=15)
    assert len(tokens) == 4 and tokens == sorted(tokens) and tokens[0] > holder.token
    assert room_locks(lease_name) == {}


def test_room_connections_per_process_are_capped(lease_name: str, patient_room: None) -> None:
    expected = {True: 1, False: ROOM_CONNECTIONS - 1}
    holder, tokens, waiters = queue_behind(lease_name, ROOM_CONNECTIONS + 4, expected)
    holder.release()
    for thread in waiters:
        thread.join(timeout=25)
    assert len(tokens) == len(waiters) and len(set(tokens)) == len(tokens)


def test_a_stuck_waiting_room_does_not_block_takeover(lease_name: str) -> None:
    """A waiter paused inside the room holds its lock; others stop queueing after a while."""
    with own_connection() as paused_waiter:
        paused_waiter.execute("SELECT pg_advisory_lock(%s)", [room_key(lease_name)])
        first = acquire(lease_name, ttl=0.5, keepalive=False)
        started = time.monotonic()
        second = acquire(lease_name, ttl=1, timeout=5, holder="second")
        assert second.token > first.token
        assert time.monotonic() - started < 0.5 + ROOM_TIMEOUT + 1.5
        second.release()


def test_a_row_expiring_in_year_33715_breaks_no_read(lease_name: str) -> None:
    """Python's ``datetime`` ends at year 9999; PostgreSQL's does not. Such a row (written
    before TTLs were bounded) must not fail every ``inspect_all`` or its own revocation."""
    with own_connection() as own:  # committed: the backend reads on a connection of its own
        own.execute(
            "INSERT INTO leases_lease (name, holder, token, acquired_at, expires_at, meta) "
            "VALUES (%s, 'far-future', 7, now(), '33715-01-01 00:00:00+00', '{}')",
            [lease_name],
        )
    backend = database_backend()
    (far,) = [info for info in backend.inspect_all() if info.name == lease_name]
    assert far.held and far.token == 7 and far.expires_at is not None
    assert far.expires_at.year == 9999
    revoked = backend.force_release(lease_name, 7)
    assert revoked.token == 8 and not revoked.held


def test_the_table_keeps_a_hash_of_the_secret_never_the_secret(lease_name: str) -> None:
    held = acquire(lease_name, ttl=5, keepalive=False)
    with own_connection() as own:
        row = own.execute("SELECT * FROM leases_lease WHERE name = %s", [lease_name]).fetchone()
        (stored,) = own.execute(
            "SELECT secret_hash FROM leases_lease WHERE name = %s", [lease_name]
        ).fetchone() or (None,)
    assert row is not None and not [v for v in row if held.grant.secret in str(v)]
    assert bytes(stored or b"") == hashlib.sha256(held.grant.secret.encode()).digest()
    held.release()


def test_a_releaser_cannot_take_the_name_back_from_the_waiter_in_the_room(
    lease_name: str, patient_room: None
) -> None:
    """The room is a queue: a process that releases and tries again at once goes behind the
    waiter already inside (it used to win most of the time: the waiter was still waking).

    The releaser uses a second alias of the same database, so it has its own connection, as
    another process would (one process's threads share a connection, which hides the race).
    """
    leases: dict[str, Any] = settings.LEASES
    backends = {**leases["BACKENDS"], "other": {"ENGINE": "leases.backends.database"}}
    with override_settings(LEASES={**leases, "BACKENDS": backends}):
        holder = acquire(lease_name, ttl=10, keepalive=False, backend="other")
        got: list[int] = []

        def wait() -> None:
            held = acquire(lease_name, ttl=5, timeout=20, keepalive=False)
            got.append(held.token)
            held.release()

        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_until(lambda: room_locks(lease_name) == {True: 1}, 10, "the waiter inside the room")
        for _ in range(3):  # the waiter's first tries may fail: it entered before the release
            holder.release()
            released = time.monotonic()
            try:
                holder = acquire(lease_name, ttl=10, timeout=0, keepalive=False, backend="other")
            except LeaseUnavailable:
                break
            assert time.monotonic() - released > ROOM_GRACE.total_seconds(), "overtook the room"
        waiter.join(timeout=15)
        assert len(got) == 1 and got[0] > holder.token


def test_contending_threads_are_served_in_turn(lease_name: str, patient_room: None) -> None:
    """Four threads take and release one name in a loop: with the room as a queue each gets
    about a quarter, never more than twice its share, and no one takes it twice in a row
    most of the time. Bounded by count and time; only counts are asserted."""
    threads, rounds = 4, 25
    order: list[int] = []
    order_lock = threading.Lock()
    stop_at = time.monotonic() + 30

    def contend(index: int) -> None:
        for _ in range(rounds):
            if time.monotonic() > stop_at:
                return
            held = acquire(lease_name, ttl=5, timeout=10, keepalive=False)
            with order_lock:
                order.append(index)
            held.release()

    workers = [threading.Thread(target=contend, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=40)
    total = len(order)
    assert total == threads * rounds
    # Each thread does exactly `rounds`, so shares are equal by construction; what the queue
    # shows is the order: while all four contend, grants rotate instead of repeating.
    contended = order[: total - 2 * threads]  # the tail has fewer contenders left
    repeats = sum(a == b for a, b in itertools.pairwise(contended))
    assert repeats <= len(contended) // 2, f"{repeats} repeats in {order}"


def acquire_keeping_no_tenure(name: str, **options: Any) -> Any:
    """``acquire(name)`` on the default backend's own connection, its session taking no
    tenure lock (as past its cap, or on another process's connection that keeps none): its
    waiters wait for the release's ``NOTIFY``."""
    tenures = get_backend("default")._tenures  # type: ignore[attr-defined]
    enabled, tenures.enabled = tenures.enabled, False
    try:
        return acquire(name, **options)
    finally:
        tenures.enabled = enabled


def waiting_behind_a_holder(name: str) -> tuple[Any, threading.Thread, list[int]]:
    """Hold ``name`` (keeping no tenure lock) and start one thread that waits for it (then
    releases it); returns once that waiter is inside the name's room, its first try refused
    (the holder keeps no tenure lock) and listening for the release. Returning once the room
    lock was held, a loaded machine let the holder release between the try's two statements,
    and the first try took the name (``test_the_waiters_try_in_the_room_runs_prepared``
    counted one queued try instead of two, beside two CPU burners)."""
    holder = acquire_keeping_no_tenure(name, ttl=30, keepalive=False, holder="holder")
    tokens: list[int] = []

    def wait() -> None:
        held = acquire(name, ttl=5, timeout=30, keepalive=False)
        tokens.append(held.token)
        held.release()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    wait_until(lambda: waiting_inside(name), 15, "the waiter waiting inside the room")
    return holder, waiter, tokens


def test_the_waiter_in_the_room_is_woken_by_the_release_not_by_polling(
    lease_name: str, patient_room: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the name stays held, the waiter inside the room sends no try (each would fail);
    the release's NOTIFY wakes it, and its one try then takes the name. (The holder here won
    its grant outside the room, so it keeps no tenure lock: the waiter's first try, queued on
    it, is refused at once, and the waiter listens.) Tries are counted from libpq's trace of
    the room connection."""
    with traced_room_connections(monkeypatch) as trace:

        def tries() -> int:
            return queued_tries_sent(trace)

        holder, waiter, tokens = waiting_behind_a_holder(lease_name)
        before = tries()
        time.sleep(1.0)  # room for a polling waiter to show itself (backoff starts at 5 ms)
        assert tries() == before, f"{tries() - before} tries while the name was held"
        holder.release()
        waiter.join(15)
        assert len(tokens) == 1 and tokens[0] > holder.token
        assert tries() == before + 1


def test_an_exclusive_waiter_does_not_stop_readers_of_a_name_no_reader_holds(
    lease_name: str, patient_room: None
) -> None:
    """Stopping new readers is a round trip on the backend's connection; while one exclusive
    holder keeps the name, the waiter inside the room knows no reader holds it and sends none
    (it used to every 0.4 s)."""
    holder, waiter, tokens = waiting_behind_a_holder(lease_name)
    assert round_trips(lambda: time.sleep(1.0)) == 0
    holder.release()
    waiter.join(15)
    assert len(tokens) == 1


def test_async_waiters_queue_in_the_room_in_arrival_order_and_are_woken_by_the_release(
    lease_name: str, patient_room: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aacquire`` waiters queue in the same room as sync ones (one inside, the others in
    the server's lock queue), are served in the order they arrived, and the one inside sends
    no try while the name stays held: the release's NOTIFY wakes it. Tries (the only
    statements with parameters on a room connection) are counted from libpq's trace."""
    connection_for = _waiting_room.AsyncWaitingRoom._connection
    traced_conns: list[Any] = []
    holder = acquire(lease_name, ttl=30, keepalive=False, holder="holder")
    with tempfile.TemporaryFile("w+") as trace, own_connection() as own:

        async def traced(room: Any) -> Any:
            conn = await connection_for(room)
            conn.pgconn.trace(trace.fileno())
            conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
            traced_conns.append(conn)
            return conn

        def tries() -> int:
            return syncs_sent(trace)

        def in_room() -> int:
            classid, objid = split_key(room_key(lease_name))
            (count,) = own.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                "AND classid = %s AND objid = %s AND objsubid = 1",
                [classid, objid],
            ).fetchone() or (0,)
            return int(count)

        monkeypatch.setattr(_waiting_room.AsyncWaitingRoom, "_connection", traced)

        async def main() -> list[tuple[int, int]]:
            served: list[tuple[int, int]] = []

            async def wait(index: int) -> None:
                held = await aacquire(lease_name, ttl=5, timeout=30, keepalive=False)
                served.append((index, held.token))
                await held.arelease()

            tasks = []
            for index in range(3):
                tasks.append(asyncio.create_task(wait(index)))
                for _ in range(750):  # bounded: 15 s
                    if in_room() == index + 1:
                        break
                    await asyncio.sleep(0.02)
                assert in_room() == index + 1, f"waiter {index} never queued in the room"
            before = tries()
            await asyncio.sleep(1.0)  # room for a polling waiter to show itself
            assert tries() == before, f"{tries() - before} tries while the name was held"
            await asyncio.to_thread(holder.release)
            async with asyncio.timeout(30):
                await asyncio.gather(*tasks)
            await get_backend("default").aclose()
            return served

        try:
            served = asyncio.run(main())
        finally:
            for conn in traced_conns:
                if not conn.closed:
                    conn.pgconn.untrace()
    assert [index for index, _ in served] == [0, 1, 2]
    tokens = [token for _, token in served]
    assert tokens == sorted(tokens) and tokens[0] > holder.token


def test_an_async_release_between_the_failed_try_and_the_wait_wakes_the_wait(
    lease_name: str,
) -> None:
    """The wait that follows a failed async try (here a reader's, which waits on the
    listener) counts releases from when that try was sent: one that came in between wakes it
    at once. The try runs in ``aacquire``'s never-abandoned step (``_try``): what the backend
    remembers of it must be remembered for the task that waits next, not lost with a task the
    step ran in (the wait then missed the release and slept out its whole delay)."""
    from leases.aio import _try

    backend = database_backend()
    holder = backend.try_acquire(lease_name, "writer", 30)
    assert holder is not None
    warm = f"{lease_name}:warm"

    async def listening() -> None:
        """Until the loop's listener hears releases (it connects on the first wait)."""
        for _ in range(100):
            waiting = asyncio.create_task(backend.await_for_release(warm, 0.5))
            await asyncio.sleep(0.05)
            freed = await asyncio.to_thread(backend.try_acquire, warm, "warm", 30)
            assert freed is not None
            await asyncio.to_thread(backend.release, freed)
            if await waiting:
                return
        raise AssertionError("the async listener never heard a release")

    async def main() -> bool:
        try:
            await listening()
            assert await _try(backend, lease_name, "reader", 30, None, shared=True) is None
            # Another task hears the release first: the listener has recorded it by then.
            heard = asyncio.create_task(backend.await_for_release(lease_name, 10.0))
            await asyncio.sleep(0.05)
            await asyncio.to_thread(backend.release, holder)  # after the try, before the wait
            assert await heard
            return await backend.await_for_release(lease_name, 5.0)
        finally:
            await backend.aclose()

    assert asyncio.run(main()) is True


#: Takes the room's lock, then fails as a lock timeout does: the server's timeout can fire just
#: as the lock is granted (PostgreSQL keeps a lock granted while its wait was being cancelled),
#: and the statement fails although the session holds the lock.
GRANTED_THEN_TIMED_OUT_SQL = """
CREATE OR REPLACE FUNCTION pg_temp.leases_test_granted_then_timed_out(key bigint)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_lock(key);
    RAISE EXCEPTION 'canceling statement due to lock timeout' USING ERRCODE = '55P03';
END $$
"""
#: The room's queueing, replaced by one that always takes the lock and then times out.
RACING_ROOM_ENTER_SQL = (
    "SELECT set_config('lock_timeout', {timeout_ms}, false), "
    "pg_temp.leases_test_granted_then_timed_out({key}), {name}::text, {group}::text"
)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_queueing_that_times_out_as_the_lock_is_granted_leaves_no_lock_behind(
    lease_name: str, monkeypatch: pytest.MonkeyPatch, flavour: str
) -> None:
    """A session-level lock outlives the failed statement that took it. Held unknowingly, the
    waiter's next queueing took it a second time and its leave released it once: the room
    stayed locked by an idle pooled connection, whose next visitor always got in at once
    while every other waiter queued in vain (one process took 99 % of the grants, and a
    contender once starved for 20 s). A timed-out queueing now unlocks what it may hold."""
    real_sync = _waiting_room.WaitingRoom._connection
    real_async = _waiting_room.AsyncWaitingRoom._connection

    def connection_(room: Any) -> Any:
        conn = real_sync(room)
        conn.execute(GRANTED_THEN_TIMED_OUT_SQL)
        return conn

    async def aconnection(room: Any) -> Any:
        conn = await real_async(room)
        await conn.execute(GRANTED_THEN_TIMED_OUT_SQL)
        return conn

    monkeypatch.setattr(_waiting_room.WaitingRoom, "_connection", connection_)
    monkeypatch.setattr(_waiting_room.AsyncWaitingRoom, "_connection", aconnection)
    monkeypatch.setattr(_waiting_room, "ROOM_ENTER_SQL", RACING_ROOM_ENTER_SQL)
    holder = acquire(lease_name, ttl=30, keepalive=False, holder="holder")
    timer = threading.Timer(1.5, holder.release)  # after a queueing or two timed out
    left: list[dict[bool, int]] = []
    timer.start()
    try:
        if flavour == "sync":
            acquire(lease_name, ttl=5, timeout=30, keepalive=False).release()
            left.append(room_locks(lease_name))
        else:

            async def main() -> None:
                await (await aacquire(lease_name, ttl=5, timeout=30, keepalive=False)).arelease()
                # Looked at while the loop (and its idle room connections) still lives.
                left.append(await asyncio.to_thread(room_locks, lease_name))

            asyncio.run(main())
    finally:
        timer.join()
    assert left == [{}], "a waiter's idle connection still holds the room"


#: Holds up the commit of any grant to ``holder = 'first-waiter'`` until the test's session
#: frees advisory key ``{gate}``: a deferred trigger runs at commit, after the statement.
_GATE_FUNCTION_SQL = """
CREATE OR REPLACE FUNCTION leases_test_commit_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.holder = 'first-waiter' THEN
        PERFORM pg_advisory_xact_lock_shared({gate});
    END IF;
    RETURN NULL;
END $$"""
_GATE_TRIGGER_SQL = """
CREATE CONSTRAINT TRIGGER leases_test_commit_gate AFTER UPDATE ON leases_lease
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION leases_test_commit_gate()"""


def test_the_next_waiter_reads_the_name_only_after_the_grant_before_it_committed(
    lease_name: str, patient_room: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter's try queues for the room, then at the name's grant gate, then reads the name
    and queues on its holder's tenure lock. A granted try leaves the room in its statement,
    before its commit, so the next waiter gets in at once; it waits at the gate until that
    grant committed, then finds the name held and waits for its release, still in its one
    try. Without the gate it read the name as its snapshot had it (free, or an older grant),
    queued on nothing, and its try was refused by the grant it did not see (a second try for
    every hand-off). The first waiter's commit is held up here by a deferred trigger until
    the second could have read the name; tries are counted from libpq's trace of the room
    connections, as in the test above."""
    gate = advisory_key(f"test-gate:{lease_name}")
    assert isinstance(gate, int)  # a name's key is one int64
    backend = database_backend()
    monkeypatch.setattr(backend._room, "timeout", 60.0)  # the held-up commit is no dead server
    with traced_room_connections(monkeypatch) as trace, own_connection() as gatekeeper:

        def gate_waiters() -> int:
            classid, objid = split_key(gate)
            (count,) = gatekeeper.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND classid = %s AND objid = %s",
                [classid, objid],
            ).fetchone() or (0,)
            return int(count)

        gatekeeper.execute(_GATE_FUNCTION_SQL.format(gate=gate).encode())
        gatekeeper.execute(_GATE_TRIGGER_SQL.encode())
        gatekeeper.execute("SELECT pg_advisory_lock(%s)", [gate])
        tokens: dict[str, int] = {}
        first_may_release = threading.Event()

        def wait(holder: str) -> None:
            held = acquire(lease_name, ttl=30, timeout=40, keepalive=False, holder=holder)
            tokens[holder] = held.token
            if holder == "first-waiter":
                first_may_release.wait(30)
            held.release()

        waiters = [
            threading.Thread(target=wait, args=(holder,), daemon=True)
            for holder in ("first-waiter", "second-waiter")
        ]
        try:
            holder = acquire_keeping_no_tenure(lease_name, ttl=30, keepalive=False, holder="holder")
            waiters[0].start()
            wait_until(lambda: room_locks(lease_name) == {True: 1}, 15, "the first waiter inside")
            waiters[1].start()
            wait_until(
                lambda: room_locks(lease_name) == {True: 1, False: 1}, 15, "the second queued"
            )
            before = queued_tries_sent(trace)  # each waiter's first; the second's still waits
            holder.release()
            wait_until(lambda: gate_waiters() == 1, 15, "the first waiter's grant at its commit")
            # Room for the second waiter to get in while that grant is uncommitted, look and
            # try (it did, when the grant statement unlocked the room): not asserted, waited.
            settle_by = time.monotonic() + 2.0
            while room_locks(lease_name) != {True: 1} and time.monotonic() < settle_by:
                time.sleep(0.05)
            time.sleep(0.5)
            gatekeeper.execute("SELECT pg_advisory_unlock(%s)", [gate])
            wait_until(lambda: "first-waiter" in tokens, 15, "the first waiter's grant")
            wait_until(lambda: room_locks(lease_name) == {True: 1}, 15, "the second inside")
            time.sleep(0.5)  # room for a try the second waiter should not send
            assert queued_tries_sent(trace) == before + 1, "the second waiter tried again"
            first_may_release.set()
            for thread in waiters:
                thread.join(30)
            assert tokens["second-waiter"] > tokens["first-waiter"] > holder.token
            # The second waiter's first try was granted: no other try was sent.
            assert queued_tries_sent(trace) == before + 1
        finally:
            first_may_release.set()
            gatekeeper.execute("SELECT pg_advisory_unlock_all()")
            for thread in waiters:
                thread.join(30)
            gatekeeper.execute("DROP TRIGGER leases_test_commit_gate ON leases_lease")
            gatekeeper.execute("DROP FUNCTION leases_test_commit_gate()")


def test_a_left_room_whose_unlock_found_no_lock_disables_the_room(lease_name: str) -> None:
    """A granted waiter's leave is sent without waiting for its reply; the reply is read when
    the connection is next taken, and an unlock that found no lock there (it ran on another
    server session than the lock: a transaction-pooling proxy) turns the room off, as the
    waited leave does, rather than leak a room lock on every grant."""
    room = _waiting_room.WaitingRoom("default", "default")
    try:
        conn = room._connection()
        leave = _waiting_room.ROOM_LEAVE_SQL.format(key=room_key(lease_name))
        assert _waiting_room._send(conn, leave)  # this session never took that lock
        with room._lock:
            room._idle.append(conn)
            room._unsettled.add(conn)
        other = room._connection()
        assert other is not conn and conn.closed and not room.enabled
        other.close()
    finally:
        room.close()


def test_settling_a_left_room_waits_for_no_reply_past_its_bound() -> None:
    """The replies to what was sent without waiting are read within ``_SETTLE_TIMEOUT``: a
    statement still running then leaves the connection unfit (``None``: dropped), rather
    than holding the thread that took the connection until it ends."""
    room = _waiting_room.WaitingRoom("default", "default")
    try:
        conn = room._connection()
        # The server sends the replies when the last statement ends: after the bound.
        late = _waiting_room._SETTLE_TIMEOUT + 2
        assert _waiting_room._send(conn, f"SELECT true; SELECT pg_sleep({late})")
        started = time.monotonic()
        settled = _waiting_room._settle(conn)
        took = time.monotonic() - started
        conn.close()
        assert settled is None  # not fit for use: its statement still runs
        assert took < _waiting_room._SETTLE_TIMEOUT + 1, took
    finally:
        room.close()


def test_a_database_that_cannot_be_reached_is_reported_for_the_lease_backend_asked(
    fault_database: tuple[str, Any],
) -> None:
    """The error names the lease backend the caller used (and the database it is on): a
    failed connect named the Django database alias as if it were the lease backend ("lease
    backend 'fault' is unavailable" for a backend called ``elsewhere``)."""
    db_alias, server = fault_database
    leases: dict[str, Any] = settings.LEASES
    backends = {**leases["BACKENDS"]}
    backends["elsewhere"] = {"ENGINE": "leases.backends.database", "DATABASE": db_alias}
    server.stop("fast")
    with override_settings(LEASES={**leases, "BACKENDS": backends}):
        try:
            with pytest.raises(BackendUnavailable) as sync:
                acquire("unreachable", backend="elsewhere", timeout=0, keepalive=False)

            async def main() -> BackendUnavailable:
                try:
                    await aacquire("unreachable", backend="elsewhere", timeout=0, keepalive=False)
                except BackendUnavailable as exc:
                    return exc
                raise AssertionError("acquired on a stopped server")

            failures = [sync.value, asyncio.run(main())]
        finally:
            get_backend("elsewhere").close()
    for failure in failures:
        assert failure.backend == "elsewhere", failure
        assert str(failure).startswith("lease backend 'elsewhere' is unavailable"), failure
        assert f"database {db_alias!r}" in str(failure), failure


@pytest.mark.django_db(transaction=True)
def test_an_async_waiter_cancelled_as_it_leaves_the_room_with_a_grant_holds_nothing(
    lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task's try in the room wins; leaving the room is a round trip of its own, and a
    cancellation (the caller's ``asyncio.timeout``) landing there ended the acquire with the
    grant in nobody's hands: the name stayed held for its whole TTL. The grant is now
    released before the cancellation is raised, as for a try cancelled on the wire."""
    room = _waiting_room.AsyncWaitingRoom
    real_leave, real_wait = room._leave, room.wait

    async def main() -> None:
        inside = asyncio.Event()

        async def waiting(self: Any, name: str, timeout: float) -> bool | None:
            inside.set()
            return await real_wait(self, name, timeout)

        async def leaving_cancelled(self: Any, visit: Any) -> None:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # the caller's deadline passes just now
            await real_leave(self, visit)

        monkeypatch.setattr(room, "wait", waiting)
        holder = await aacquire(lease_name, ttl=30, keepalive=False)
        waiter = asyncio.create_task(aacquire(lease_name, ttl=30, keepalive=False, timeout=30))
        async with asyncio.timeout(20):
            await inside.wait()
        monkeypatch.setattr(room, "_leave", leaving_cancelled)
        await holder.arelease()
        async with asyncio.timeout(20):
            await asyncio.wait([waiter])
        monkeypatch.setattr(room, "_leave", real_leave)
        assert waiter.cancelled()
        info = await asyncio.to_thread(get_backend("default").inspect, lease_name)
        assert info is not None and not info.held, info
        again = await aacquire(lease_name, ttl=5, timeout=0, keepalive=False)
        assert again.token > holder.token + 1  # the cancelled waiter's grant came between
        await again.arelease()
        await get_backend("default").aclose()

    asyncio.run(main())


@pytest.mark.django_db(transaction=True)
def test_an_async_waiter_cancelled_as_it_enters_the_room_leaves_no_session_behind(
    lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled once its queueing for the room lock was granted: the connection was neither
    closed nor given back, so its session kept the room's lock for as long as the cancelled
    task was referenced, and every later waiter of the name queued behind it in vain."""
    room = _waiting_room.AsyncWaitingRoom
    real_lock_room = room._lock_room

    async def main() -> None:
        entered = asyncio.Event()

        async def lock_room_then_cancelled(self: Any, visit: Any) -> None:
            await real_lock_room(self, visit)
            entered.set()
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)  # delivered here, with the room's lock held

        monkeypatch.setattr(room, "_lock_room", lock_room_then_cancelled)
        holder = await aacquire(lease_name, ttl=30, keepalive=False)
        waiter = asyncio.create_task(aacquire(lease_name, ttl=30, keepalive=False, timeout=30))
        async with asyncio.timeout(20):
            await asyncio.wait([waiter])
        monkeypatch.setattr(room, "_lock_room", real_lock_room)
        assert entered.is_set() and waiter.cancelled()
        # The task (and the frames its exception keeps) is still referenced here.
        await asyncio.to_thread(
            wait_until, lambda: not room_locks(lease_name), 10, "the room's lock let go"
        )
        await holder.arelease()
        again = await aacquire(lease_name, ttl=5, timeout=0, keepalive=False)
        await again.arelease()
        await get_backend("default").aclose()
        assert waiter.cancelled()

    asyncio.run(main())
