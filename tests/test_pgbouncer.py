"""The database backend behind a real PgBouncer (``devservers.pgbouncer``), in session and in
transaction pooling, where each transaction may run on another server session, so that
session locks (its waiting rooms' and tenure locks) would not follow the client, nor do its
``LISTEN`` and named prepared statements (a lost statement is prepared again). The backend
finds the pooler out before its first session lock or ``LISTEN`` and sends none
(``_pgpooler``), unless its ``SESSION_POOLING`` option declares a session pooler.

Whatever the pooler does with sessions, the row decides: contenders are granted one at a time,
in token order, every wait ends, and what the backend leaves in the pooled server sessions is
bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import psycopg
import pytest
from django.db import connections
from django.test import override_settings

from devservers.pgbouncer import PgBouncer, pgbouncer_binary
from leases import aacquire, acquire, lease
from leases.backends import get_backend
from tests.lease_backends import lease_name

__all__ = ["lease_name"]

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(pgbouncer_binary() is None, reason="pgbouncer is not installed"),
]

T = TypeVar("T")

#: Threads contending for one name, and grants each takes.
THREADS, GRANTS = 4, 25


@contextlib.contextmanager
def _behind(
    fault_database: tuple[str, object], pool_mode: str, size: int, **options: object
) -> Iterator[PgBouncer]:
    """Lease backend ``"pooled"`` (with ``options``) on database alias ``"pooled"``: PgBouncer
    in front of this test's own server, in ``pool_mode`` with ``size`` server sessions."""
    alias, server = fault_database
    port = server.port  # type: ignore[attr-defined]
    with PgBouncer(port, pool_mode=pool_mode, pool_size=size) as bouncer:
        settings = dict(connections.settings[alias])
        settings["PORT"] = str(bouncer.port)
        settings["DISABLE_SERVER_SIDE_CURSORS"] = True  # as Django's docs ask behind a pooler
        connections.settings["pooled"] = settings
        backends = {
            "default": {"ENGINE": "leases.backends.database"},
            "pooled": {"ENGINE": "leases.backends.database", "DATABASE": "pooled", **options},
        }
        override = override_settings(LEASES={"BACKENDS": backends})
        override.enable()
        try:
            yield bouncer
        finally:
            override.disable()  # closes the backends first
            with contextlib.suppress(Exception):
                connections["pooled"].close()
            connections.settings.pop("pooled", None)


def _direct_url(fault_database: tuple[str, object]) -> str:
    return f"postgres://postgres@127.0.0.1:{fault_database[1].port}/postgres"  # type: ignore[attr-defined]


@pytest.fixture(params=["transaction", "session"])
def pooled(request: pytest.FixtureRequest, fault_database: tuple[str, object]) -> Iterator[str]:
    """Lease backend ``"pooled"`` behind PgBouncer in the parameter's pool mode. Yields the
    server's URL (direct)."""
    # Sessions enough for every client in session pooling; few in transaction pooling, so one
    # client's transactions land on sessions other clients' used.
    size = 4 if request.param == "transaction" else 40
    with _behind(fault_database, request.param, size):
        yield _direct_url(fault_database)


def _advisory_locks(url: str) -> int:
    """Advisory locks held by every session of the server (the pooler's included)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        ).fetchone()
    return int(row[0]) if row else 0


def test_contenders_through_pgbouncer_are_granted_one_at_a_time_in_token_order(
    pooled: str, lease_name: str
) -> None:
    sections: list[tuple[int, float, float]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def contend(index: int) -> None:
        try:
            for _ in range(GRANTS):
                with lease(
                    lease_name, ttl=30, backend="pooled", timeout=30, holder=f"thread-{index}"
                ) as held:
                    started = time.monotonic()
                    time.sleep(0.001)
                    with lock:
                        sections.append((held.token, started, time.monotonic()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(i,), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a contender never finished"
    assert not errors, errors
    assert len(sections) == THREADS * GRANTS
    sections.sort()
    tokens = [token for token, _, _ in sections]
    assert len(set(tokens)) == len(tokens), "a token was granted twice"
    for (_, _, ended), (token, started, _) in itertools.pairwise(sections):
        assert ended <= started, f"grant {token} began before the one before it ended"
    info = get_backend("pooled").inspect(lease_name)
    assert info is not None and not info.held
    get_backend("pooled").close()
    # Nothing left in the pooled server sessions: no session lock was taken through them.
    assert _advisory_locks(pooled) == 0


def _waiter(name: str) -> tuple[threading.Thread, list[int]]:
    """A thread started to acquire ``name`` on the pooled backend (waiting up to 30 s) and
    release it at once, and the list its token is put in."""
    got: list[int] = []

    def wait() -> None:
        waiter = acquire(name, ttl=30, backend="pooled", timeout=30, keepalive=False)
        got.append(waiter.token)
        waiter.release()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, got


def test_behind_a_pooler_no_session_lock_is_ever_taken(pooled: str, lease_name: str) -> None:
    """Taken on one server session and unlocked on another, a session lock would stay on a
    session the pooler keeps: the backend finds the pooler out (its connection's process id
    is the pooler's, not the server session's) before its first tenure lock or room visit,
    and takes none; its waiter is served all the same (woken by ``NOTIFY``, or its backoff)."""
    holder = acquire(lease_name, ttl=30, backend="pooled", keepalive=False, holder="holder")
    backend = get_backend("pooled")
    assert backend._room.probed and not backend._room.enabled  # type: ignore[attr-defined]
    thread, got = _waiter(lease_name)
    deadline = time.monotonic() + 1.0  # the waiter waits (and retries) meanwhile
    while time.monotonic() < deadline and thread.is_alive():
        assert _advisory_locks(pooled) == 0, "a session lock was taken through the pooler"
        time.sleep(0.05)
    holder.release()
    thread.join(30)
    assert got and got[0] > holder.token
    assert _advisory_locks(pooled) == 0


async def _while_a_task_waits(
    name: str, observe: Callable[[Any], Awaitable[T]]
) -> tuple[T, int, int]:
    """What ``observe(backend)`` returns while a task waits for ``name``, held by another,
    on the pooled backend; then the holder's and the waiter's tokens, once both released."""
    backend = get_backend("pooled")
    try:
        holder = await aacquire(name, ttl=30, backend="pooled", keepalive=False)
        waiter = asyncio.create_task(
            aacquire(name, ttl=30, backend="pooled", timeout=30, keepalive=False)
        )
        seen = await observe(backend)
        await holder.arelease()
        got = await waiter
        await got.arelease()
        return seen, holder.token, got.token
    finally:
        await backend.aclose()


def test_async_waiters_behind_a_pooler_take_no_session_lock(pooled: str, lease_name: str) -> None:
    """A task's room asks on its first connection, before its first room lock, and stays
    off behind the pooler; the waiting task is served all the same."""

    async def most_locks(backend: Any) -> int:
        most = 0
        for _ in range(20):  # the waiter waits (and retries) meanwhile
            await asyncio.sleep(0.05)
            most = max(most, await asyncio.to_thread(_advisory_locks, pooled))
        return most

    most, first, second = asyncio.run(_while_a_task_waits(lease_name, most_locks))
    assert most == 0, "a session lock was taken through the pooler"
    assert second > first
    assert _advisory_locks(pooled) == 0


@pytest.fixture
def one_session(fault_database: tuple[str, object]) -> Iterator[str]:
    """Lease backend ``"pooled"`` behind PgBouncer in transaction pooling with a single server
    session, which every client's transactions share: what one client leaves in the session
    (a ``LISTEN``) is what the others find there. Yields the pooler's URL."""
    with _behind(fault_database, "transaction", 1) as bouncer:
        yield f"postgres://postgres@127.0.0.1:{bouncer.port}/postgres"


def _listening(url: str) -> list[str]:
    """The channels the server session this query lands on listens to."""
    with psycopg.connect(url, autocommit=True) as conn:
        return [row[0] for row in conn.execute("SELECT pg_listening_channels()").fetchall()]


def _listen_decided(url: str, decided: object) -> list[str]:
    """Poll (bounded) until the pooled session shows a ``LISTEN`` or ``decided()`` says the
    waiter's listener chose not to listen; the channels found last."""
    deadline = time.monotonic() + 10.0
    while True:
        found = _listening(url)
        if found or decided() or time.monotonic() > deadline:  # type: ignore[operator]
            return found
        time.sleep(0.02)


def test_a_waiter_behind_a_transaction_pooler_does_not_listen(
    one_session: str, lease_name: str
) -> None:
    """A ``LISTEN`` sent through a transaction pooler lands on a server session the pooler
    then hands to other clients: the listener never hears a release, and the pooler's other
    clients get the ``leases_released`` notifications (lease names) they never asked for.
    So a waiter behind such a pooler does not listen (its connection's process id is the
    pooler's) and retries after its backoff, and is served all the same."""
    holder = acquire(lease_name, ttl=30, backend="pooled", keepalive=False, holder="holder")
    backend = get_backend("pooled")
    thread, got = _waiter(lease_name)

    def decided() -> bool:
        listener = backend._listener  # type: ignore[attr-defined]
        return bool(getattr(listener, "deaf", False))

    assert _listen_decided(one_session, decided) == [], "a LISTEN was sent through the pooler"
    holder.release()
    thread.join(30)
    assert got and got[0] > holder.token
    assert _listening(one_session) == []


def test_an_async_waiter_behind_a_transaction_pooler_does_not_listen(
    one_session: str, lease_name: str
) -> None:
    """:func:`test_a_waiter_behind_a_transaction_pooler_does_not_listen`, for tasks: the
    loop's listening connection is not opened through the pooler either."""

    async def channels(backend: Any) -> list[str]:
        listener = backend._async.get().listener

        def decided() -> bool:
            return bool(getattr(listener, "deaf", False))

        return await asyncio.to_thread(_listen_decided, one_session, decided)

    found, first, second = asyncio.run(_while_a_task_waits(lease_name, channels))
    assert found == [], "a LISTEN was sent through the pooler"
    assert second > first
    assert _listening(one_session) == []


@pytest.fixture
def session_pooled(fault_database: tuple[str, object]) -> Iterator[str]:
    """Lease backend ``"pooled"`` behind PgBouncer in session pooling, declared so by its
    ``SESSION_POOLING`` option. Yields the server's URL (direct)."""
    with _behind(fault_database, "session", 40, SESSION_POOLING=True):
        yield _direct_url(fault_database)


def test_behind_a_declared_session_pooler_waiters_queue_on_the_server(
    session_pooled: str, lease_name: str
) -> None:
    """A session pooler keeps each client's server session, so with ``SESSION_POOLING`` the
    backend keeps its waiting rooms and tenure locks behind it (no warning): the waiter queues
    on the server, in its room, and the holder's grant keeps its tenure lock; all of them are
    gone once both released."""
    # The first grant asks whether a pooler is in the way (after it, so it keeps no tenure lock).
    acquire(lease_name, ttl=30, backend="pooled", keepalive=False).release()
    holder = acquire(lease_name, ttl=30, backend="pooled", keepalive=False, holder="holder")
    backend = get_backend("pooled")
    assert backend._room.probed and backend._room.enabled  # type: ignore[attr-defined]
    thread, got = _waiter(lease_name)
    deadline = time.monotonic() + 10.0
    # The holder's tenure lock, and the waiter's room lock once it queues.
    while _advisory_locks(session_pooled) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _advisory_locks(session_pooled) >= 2, "no room or tenure lock behind the pooler"
    holder.release()
    thread.join(30)
    assert got and got[0] == holder.token + 1
    backend.close()
    assert _advisory_locks(session_pooled) == 0


def test_session_pooling_option_must_be_a_bool() -> None:
    from leases.backends.database import Backend

    problems = Backend.check_options("x", {"SESSION_POOLING": "session"})
    assert problems == ['LEASES["BACKENDS"][\'x\']["SESSION_POOLING"] must be True or False']
    assert Backend.check_options("x", {"SESSION_POOLING": True}) == []
