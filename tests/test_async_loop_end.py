"""A loop that ends without ``backend.aclose()`` (``asyncio.run(main())`` in a script, Django's
``async_to_sync``) ends the server sessions its backends opened on it as it ends: not whenever
the garbage collector happens to run (the collector is off while the test waits), and without
psycopg's ``ResourceWarning: AsyncConnection deleted while still open``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import psycopg
import pytest
import redis

from leases import LeaseUnavailable, aacquire, aacquire_slot
from leases.backends import get_backend
from leases.backends._pgconn import LISTEN_SQL, connect
from tests.test_redlock_token import until
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db


def pg_sessions(query: str | None = None) -> set[int]:
    """The test database's other sessions (those running ``query`` only, if given)."""
    with connect("default") as probe:
        rows = probe.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND (%(query)s::text IS NULL OR query = %(query)s)",
            {"query": query},
        ).fetchall()
    return {int(row[0]) for row in rows}


def redis_clients(url: str, command: str | None = None) -> set[int]:
    """The ids of the clients of the Redis at ``url`` but this probe's (running ``command``
    only, if given)."""
    with redis.Redis.from_url(url) as probe:
        own = probe.client_id()
        return {
            int(client["id"])
            for client in probe.client_list()
            if client["id"] != own and command in (None, client["cmd"])
        }


def ended_without_aclose(
    main: Callable[[], Coroutine[Any, Any, None]], gone: Callable[[], bool]
) -> None:
    """Run ``main`` in ``asyncio.run`` (no ``aclose()``), then wait until ``gone()`` with the
    garbage collector off; no ``ResourceWarning`` meanwhile, nor when it collects after."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.disable()  # closed as the loop ends, not when the collector finds the loop
        try:
            asyncio.run(main())
            wait_until(gone, 10, "the loop's server sessions to end")
        finally:
            gc.enable()
        gc.collect()
    left = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert left == []


def test_a_loop_ended_without_aclose_ends_its_database_sessions() -> None:
    """The loop's statement connection, its listener, and the idle room connection a contended
    wait left behind: every session it opened ends with it."""
    name = f"loop-end-{uuid.uuid4().hex[:10]}"
    backend: Any = get_backend("default")
    before = pg_sessions()
    opened: set[int] = set()

    async def take() -> None:
        held = await aacquire(name, ttl=30, timeout=30, keepalive=False, holder="waiter")
        await held.arelease()

    async def main() -> None:
        held = await aacquire(name, ttl=30, keepalive=False, holder="holder")
        waiter = asyncio.create_task(take())
        room = backend._aroom.get()
        await until(lambda: room._visits[name] > 0, "the waiter in the name's room")
        await held.arelease()
        await waiter
        assert room._idle, "the waiter's room connection is kept idle"
        assert not await backend.await_for_release(f"{name}-other", 0.001)  # starts the listener
        await until(lambda: bool(pg_sessions(LISTEN_SQL) - before), "the loop's listener")
        opened.update(await asyncio.to_thread(pg_sessions) - before)
        assert len(opened) >= 3  # statements, room, listener

    ended_without_aclose(main, lambda: not opened & pg_sessions())


@pytest.mark.parametrize("alias", ["redis", "redlock"])
def test_a_loop_ended_without_aclose_ends_its_redis_connections(alias: str) -> None:
    """The loop's pools (a contended wait's ``BLPOP`` connection among them) and its token or
    epoch counter's database session end with it."""
    name = f"loop-end-{uuid.uuid4().hex[:10]}"
    nodes = os.environ["LEASES_REDLOCK_URLS"] if alias == "redlock" else os.environ["REDIS_URL"]
    urls = nodes.split(",")  # the servers of tests/settings.py
    sessions_before = pg_sessions()
    clients_before = {url: redis_clients(url) for url in urls}
    opened: dict[str, set[int]] = {}
    sessions: set[int] = set()

    def blocked() -> bool:
        return any(redis_clients(url, "blpop") - clients_before[url] for url in urls)

    async def take() -> None:
        held = await aacquire(name, ttl=30, timeout=30, keepalive=False, backend=alias)
        await held.arelease()

    async def main() -> None:
        held = await aacquire(name, ttl=30, keepalive=False, backend=alias, holder="holder")
        waiter = asyncio.create_task(take())
        await until(blocked, "the waiter blocked on the name's wake key")
        await held.arelease()
        await waiter
        for url in urls:
            opened[url] = await asyncio.to_thread(redis_clients, url) - clients_before[url]
        sessions.update(await asyncio.to_thread(pg_sessions) - sessions_before)
        assert all(opened.values()) and sessions  # the pools, the counter's session

    def gone() -> bool:
        return not sessions & pg_sessions() and not any(
            opened[url] & redis_clients(url) for url in urls
        )

    ended_without_aclose(main, gone)


def test_loops_closed_by_hand_do_not_keep_their_sessions(
    recwarn: pytest.WarningsRecorder,
) -> None:
    """A loop closed by hand (``run_until_complete`` then ``close()``, no
    ``shutdown_asyncgens()``) cannot close its connections, but must not keep them either:
    once another loop uses the backend, the garbage collector ends their sessions. Kept for
    the life of the process, each such loop held its statement connection open: a worker
    running every job on a new loop would run the server out of connections."""
    name = f"loop-end-{uuid.uuid4().hex[:10]}"
    before = pg_sessions()
    opened: set[int] = set()

    async def use() -> None:
        await (await aacquire(name, ttl=30, keepalive=False)).arelease()
        opened.update(await asyncio.to_thread(pg_sessions) - before)

    for _ in range(3):
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(use())
        finally:
            loop.close()
    by_hand = set(opened)
    assert by_hand
    asyncio.run(use())  # a new loop: the closed loops' entries are let go

    def ended() -> bool:
        gc.collect()
        return not by_hand & pg_sessions()

    wait_until(ended, 10, "the sessions of the loops closed by hand to end")


def test_a_forked_child_ending_the_parents_loop_leaves_its_sessions_open() -> None:
    """A child forked between two runs of the parent's loop shuts that loop down (leaving an
    ``asyncio.Runner`` block does): the parent's values are its sessions, so the child closes
    none, and the parent's next statement runs on the same session."""
    name = f"loop-end-{uuid.uuid4().hex[:10]}"
    backend: Any = get_backend("default")

    async def session() -> int:
        await (await aacquire(name, ttl=30, keepalive=False)).arelease()
        conn = backend._async.get().conn.conn
        assert conn is not None
        return int(conn.info.backend_pid)

    with asyncio.Runner() as runner:
        before = runner.run(session())
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                runner.close()  # the loop's shutdown, in the child
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert before in pg_sessions()
        assert runner.run(session()) == before


def test_closing_ends_a_listener_whose_wait_ignores_its_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``aclose()`` cancels the listener's task and waited for it with no bound: psycopg 3.3.0
    waits for a cancelled wait's query to end without one (its issue #1371), and an async
    acquire's ``aclose()`` hung until the test's timeout (one run in four on that release).
    Here the wait ignores cancellation as that release's did, until its connection is closed
    under it."""
    ignoring: list[psycopg.AsyncConnection[Any]] = []
    gives_up = time.monotonic() + 40  # never forever, or the loop's own end would hang too

    real = psycopg.AsyncConnection.notifies

    async def deaf_to_cancellation(
        self: psycopg.AsyncConnection[Any], **options: Any
    ) -> AsyncIterator[psycopg.Notify]:
        task = asyncio.current_task()
        if task is None or not task.get_name().startswith("leases-alisten"):
            async for note in real(self, **options):  # a waiting room's: left alone
                yield note
            return
        ignoring.append(self)
        while time.monotonic() < gives_up:
            # What a driver's wait that outlives its cancellation does:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.05)
            if self.closed:
                raise psycopg.OperationalError("the connection is closed")
        yield psycopg.Notify("", "", 0)  # an async generator, as notifies() is; never reached

    monkeypatch.setattr(psycopg.AsyncConnection, "notifies", deaf_to_cancellation)
    backend = get_backend("default")
    took: list[float] = []

    async def main() -> None:
        name = f"listener-{uuid.uuid4().hex[:8]}"
        held = await aacquire_slot(name, limit=1, ttl=10)
        with pytest.raises(LeaseUnavailable):  # a slot's wait starts the listener
            await aacquire_slot(name, limit=1, ttl=10, timeout=0.3, holder="other")
        await held.arelease()
        assert ignoring, "the listener never waited"
        started = time.monotonic()
        await backend.aclose()
        took.append(time.monotonic() - started)

    asyncio.run(main())
    assert ignoring[0].closed
    assert took[0] < 15, f"aclose() took {took[0]:.1f} s: it waited on the listener unbounded"
