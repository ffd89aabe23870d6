"""The database backend behind a real PgBouncer (``devservers.pgbouncer``), in session and in
transaction pooling, where each transaction may run on another server session, so that
session locks (its waiting rooms' and tenure locks) would not follow the client, nor do its
``LISTEN`` and named prepared statements (a lost statement is prepared again). The backend
finds the pooler out before its first session lock and takes none (``_pgpooler``).

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
from collections.abc import Iterator

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

#: Threads contending for one name, and grants each takes.
THREADS, GRANTS = 4, 25


@pytest.fixture(params=["transaction", "session"])
def pooled(request: pytest.FixtureRequest, fault_database: tuple[str, object]) -> Iterator[str]:
    """Lease backend ``"pooled"`` on database alias ``"pooled"``: PgBouncer in front of this
    test's own server, in the parameter's pool mode (``request.param``). Yields the server's
    URL (direct)."""
    alias, server = fault_database
    port = server.port  # type: ignore[attr-defined]
    # Sessions enough for every client in session pooling; few in transaction pooling, so one
    # client's transactions land on sessions other clients' used.
    size = 4 if request.param == "transaction" else 40
    with PgBouncer(port, pool_mode=request.param, pool_size=size) as bouncer:
        settings = dict(connections.settings[alias])
        settings["PORT"] = str(bouncer.port)
        settings["DISABLE_SERVER_SIDE_CURSORS"] = True  # as Django's docs ask behind a pooler
        connections.settings["pooled"] = settings
        backends = {
            "default": {"ENGINE": "leases.backends.database"},
            "pooled": {"ENGINE": "leases.backends.database", "DATABASE": "pooled"},
        }
        override = override_settings(LEASES={"BACKENDS": backends})
        override.enable()
        try:
            yield f"postgres://postgres@127.0.0.1:{port}/postgres"
        finally:
            override.disable()  # closes the backends first
            with contextlib.suppress(Exception):
                connections["pooled"].close()
            connections.settings.pop("pooled", None)


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


def test_behind_a_pooler_no_session_lock_is_ever_taken(pooled: str, lease_name: str) -> None:
    """Taken on one server session and unlocked on another, a session lock would stay on a
    session the pooler keeps: the backend finds the pooler out (its connection's process id
    is the pooler's, not the server session's) before its first tenure lock or room visit,
    and takes none; its waiter is served all the same (woken by ``NOTIFY``, or its backoff)."""
    holder = acquire(lease_name, ttl=30, backend="pooled", keepalive=False, holder="holder")
    backend = get_backend("pooled")
    assert backend._room.probed and not backend._room.enabled  # type: ignore[attr-defined]
    got: list[int] = []

    def wait() -> None:
        waiter = acquire(lease_name, ttl=30, backend="pooled", timeout=30, keepalive=False)
        got.append(waiter.token)
        waiter.release()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    deadline = time.monotonic() + 1.0  # the waiter waits (and retries) meanwhile
    while time.monotonic() < deadline and thread.is_alive():
        assert _advisory_locks(pooled) == 0, "a session lock was taken through the pooler"
        time.sleep(0.05)
    holder.release()
    thread.join(30)
    assert got and got[0] > holder.token
    assert _advisory_locks(pooled) == 0


def test_async_waiters_behind_a_pooler_take_no_session_lock(pooled: str, lease_name: str) -> None:
    """A task's room asks on its first connection, before its first room lock, and stays
    off behind the pooler; the waiting task is served all the same."""

    async def main() -> tuple[int, int, int]:
        backend = get_backend("pooled")
        try:
            holder = await aacquire(lease_name, ttl=30, backend="pooled", keepalive=False)
            waiter = asyncio.create_task(
                aacquire(lease_name, ttl=30, backend="pooled", timeout=30, keepalive=False)
            )
            most = 0
            for _ in range(20):  # the waiter waits (and retries) meanwhile
                await asyncio.sleep(0.05)
                most = max(most, await asyncio.to_thread(_advisory_locks, pooled))
            await holder.arelease()
            got = await waiter
            await got.arelease()
            return most, holder.token, got.token
        finally:
            await backend.aclose()

    most, first, second = asyncio.run(main())
    assert most == 0, "a session lock was taken through the pooler"
    assert second > first
    assert _advisory_locks(pooled) == 0
