"""A waiter on Redis or Redlock waits for the release, not for a poll's short delay.

Its wait is a ``BLPOP`` that the release ends at once; one that runs out ends on the server's
timer and keeps its connection (see ``_redis_io.blpop_timing``). The acquire loop
used to wait the backoff's delays, a few milliseconds at first, so a waiter of a name held
for a moment ran out, reconnected and tried again and again: with 32 threads on one name,
1.6 new connections and 28 commands per grant, and a quarter of the grants a second that
waiting for the release gives (``./scripts/bench contention``). Now each wait lasts at least
``BLPOP_WAIT`` (never past the caller's deadline). On servers of each test's own.

A wait that ran out used to end on the client's deadline, which dropped its connection with
its ``BLPOP`` pending: with the name held for long, every waiter reconnected four times a
second (404 new connections in 5 s for 20 waiters).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from leases import Lease, aacquire, aacquire_slot, acquire, acquire_slot
from leases.backends import get_backend
from leases.backends._redis_io import BLPOP_WAIT
from leases.retry import Backoff
from tests.extra_backends import added_backend
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

#: How long the first holder keeps the name once the waiter waits: past two of its waits.
HOLD = 0.6


@pytest.fixture(params=["redis", "redlock"])
def waited_on(
    request: pytest.FixtureRequest, redis_servers: Any
) -> Iterator[tuple[str, list[str]]]:
    """A Redis backend on a server of its own, or Redlock on three; and their URLs."""
    servers = redis_servers(1 if request.param == "redis" else 3)
    config: dict[str, Any]
    if request.param == "redis":
        config = {"ENGINE": "leases.backends.redis", "URL": servers[0].url, "SOCKET_TIMEOUT": 2.0}
    else:
        # Tries whose reply misses NODE_TIMEOUT drop their connection (a node that did not
        # answer): generous, so a loaded machine's slow reply is not counted as a wait's.
        config = {
            "ENGINE": "leases.backends.redlock",
            "NODES": [s.url for s in servers],
            "NODE_TIMEOUT": 2.0,
        }
    with added_backend(f"waits-{request.param}", config) as alias:
        yield alias, [server.url for server in servers]


@pytest.fixture
def waited(waited_on: tuple[str, list[str]]) -> str:
    return waited_on[0]


def test_backoff_floor_is_the_shortest_delay_but_the_time_left() -> None:
    backoff = Backoff(floor=0.25, deadline=time.monotonic() + 60)
    assert [backoff.next_delay() for _ in range(12)] == [0.25] * 12
    short = Backoff(floor=0.25, deadline=time.monotonic() + 0.1)
    delay = short.next_delay()
    assert delay is not None and delay <= 0.1


def test_a_waiter_waits_for_the_release_not_a_poll(
    waited: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every wait asked for lasts ``BLPOP_WAIT`` (the deadline is far), so while the name is
    held a wait runs out (and drops its connection) at most once per ``BLPOP_WAIT``; on the
    old code the first waits asked for 0-5 ms, 0-10 ms... and each ran out. The release then
    wakes the waiter, which takes the name."""
    alias = waited
    store = get_backend(alias)
    asked: list[float] = []
    real = store.wait_for_release

    def recorded(name: str, timeout: float) -> bool:
        asked.append(timeout)
        return real(name, timeout)

    monkeypatch.setattr(store, "wait_for_release", recorded)
    name = f"waits-{uuid.uuid4().hex[:10]}"
    held = acquire(name, ttl=30, backend=alias, keepalive=False, holder="first")
    got: list[Lease] = []
    waiter = threading.Thread(
        target=lambda: got.append(
            acquire(name, ttl=30, backend=alias, keepalive=False, timeout=20, holder="second")
        )
    )
    waiter.start()
    wait_until(lambda: asked, 10, "the waiter's first wait")
    time.sleep(HOLD)  # the first holder's work
    held.release()
    waiter.join(20)
    assert got and got[0].holder == "second", "the release did not hand the name over"
    got[0].release()
    assert min(asked) >= BLPOP_WAIT, asked


def test_an_async_waiter_waits_for_the_release_not_a_poll(
    waited: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for ``aacquire()``: its waits (``redis.asyncio``'s ``BLPOP``, cancelled at
    its deadline, which drops the connection too) last ``BLPOP_WAIT`` each."""
    alias = waited
    store = get_backend(alias)
    asked: list[float] = []
    real = store.await_for_release

    async def recorded(name: str, timeout: float) -> bool:
        asked.append(timeout)
        return await real(name, timeout)

    monkeypatch.setattr(store, "await_for_release", recorded)
    name = f"waits-{uuid.uuid4().hex[:10]}"

    async def scenario() -> str:
        held = await aacquire(name, ttl=30, backend=alias, keepalive=False, holder="first")
        waiter = asyncio.ensure_future(
            aacquire(name, ttl=30, backend=alias, keepalive=False, timeout=20, holder="second")
        )
        while not asked:
            await asyncio.sleep(0.01)
        await asyncio.sleep(HOLD)  # the first holder's work
        await held.arelease()
        lease = await asyncio.wait_for(waiter, 20)
        await lease.arelease()
        return lease.holder

    assert asyncio.run(scenario()) == "second", "the release did not hand the name over"
    assert min(asked) >= BLPOP_WAIT, asked


#: Waiters, and the waits each makes while the name stays held, in the tests below.
WAITERS, WAITS = 4, 4


class Connections:
    """Connections the servers at ``urls`` accepted so far (each asked on a connection made
    once, before the first count)."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [redis.Redis.from_url(url) for url in urls]
        for client in self.clients:
            client.ping()

    def made(self) -> int:
        return sum(int(c.info("stats")["total_connections_received"]) for c in self.clients)

    def close(self) -> None:
        for client in self.clients:
            client.close()


def _ran_out(waits: dict[int, int], since: dict[int, int]) -> bool:
    """Every waiter made :data:`WAITS` more waits than at ``since`` (each ran out: held)."""
    return len(waits) == WAITERS and all(waits[who] - since.get(who, 0) >= WAITS for who in waits)


#: What the waiters below wait for: a lease, or a slot of a full semaphore of two (its waits
#: are slices, never shorter than the store's waits: see ``leases.semaphore``).
KINDS = ["lease", "semaphore"]
SLOTS = 2


def _hold(kind: str, name: str, alias: str) -> list[Any]:
    if kind == "lease":
        return [acquire(name, ttl=30, backend=alias, keepalive=False, holder="first")]
    return [
        acquire_slot(name, limit=SLOTS, ttl=30, backend=alias, keepalive=False, holder=f"h{i}")
        for i in range(SLOTS)
    ]


def _take(kind: str, name: str, alias: str) -> Any:
    if kind == "lease":
        return acquire(name, ttl=30, backend=alias, keepalive=False, timeout=30)
    return acquire_slot(name, limit=SLOTS, ttl=30, backend=alias, keepalive=False, timeout=30)


async def _atake(kind: str, name: str, alias: str) -> Any:
    if kind == "lease":
        return await aacquire(name, ttl=30, backend=alias, keepalive=False, timeout=30)
    return await aacquire_slot(
        name, limit=SLOTS, ttl=30, backend=alias, keepalive=False, timeout=30
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_wait_that_runs_out_keeps_its_connection(
    kind: str, waited_on: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the name stays held, each waiter's waits run out one after another; each ends on
    the server's timer, with a reply, so its connection goes back to the pool. Ended on the
    client's deadline, each dropped its connection and the next try made a new one (a
    semaphore's waits, slices of a few milliseconds at first, always were). A loaded machine
    may still delay a reply past the client's deadline now and then (beside two CPU burners,
    5 of 16 once): at most half of the waits may have reconnected (on the old code, every
    one did, and more)."""
    alias, urls = waited_on
    store = get_backend(alias)
    waits: dict[int, int] = {}
    real = store.wait_for_release

    def counted(name: str, timeout: float) -> bool:
        who = threading.get_ident()
        waits[who] = waits.get(who, 0) + 1
        return real(name, timeout)

    monkeypatch.setattr(store, "wait_for_release", counted)
    name = f"waits-{uuid.uuid4().hex[:10]}"
    count = Connections(urls)
    held = _hold(kind, name, alias)
    served: list[int] = []

    def wait() -> None:
        _take(kind, name, alias).release()
        served.append(1)

    threads = [threading.Thread(target=wait) for _ in range(WAITERS)]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: _ran_out(waits, {}), 20, "each waiter's first waits")
        before, since = count.made(), dict(waits)
        wait_until(lambda: _ran_out(waits, since), 20, f"{WAITS} more waits each")
        made = count.made() - before
    finally:
        for lease in held:
            lease.release()
        for thread in threads:
            thread.join(30)
        count.close()
    assert len(served) == WAITERS
    assert made <= WAITERS * WAITS // 2, f"{made} connections made in {WAITERS * WAITS} waits"


@pytest.mark.parametrize("kind", KINDS)
def test_an_async_wait_that_runs_out_keeps_its_connection(
    kind: str, waited_on: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for tasks (``redis.asyncio``: a wait cancelled at the client's deadline drops
    its connection too)."""
    alias, urls = waited_on
    store = get_backend(alias)
    waits: dict[int, int] = {}
    real = store.await_for_release

    async def counted(name: str, timeout: float) -> bool:
        who = id(asyncio.current_task())
        waits[who] = waits.get(who, 0) + 1
        return await real(name, timeout)

    monkeypatch.setattr(store, "await_for_release", counted)
    name = f"waits-{uuid.uuid4().hex[:10]}"
    count = Connections(urls)
    held = _hold(kind, name, alias)

    async def until(done: Any) -> None:
        async with asyncio.timeout(20):
            while not done():
                await asyncio.sleep(0.01)

    async def scenario() -> tuple[int, int]:
        async def wait() -> None:
            await (await _atake(kind, name, alias)).arelease()

        tasks = [asyncio.ensure_future(wait()) for _ in range(WAITERS)]
        try:
            await until(lambda: _ran_out(waits, {}))
            before, since = await asyncio.to_thread(count.made), dict(waits)
            await until(lambda: _ran_out(waits, since))
            made = await asyncio.to_thread(count.made) - before
        finally:
            for lease in held:
                await asyncio.to_thread(lease.release)
            async with asyncio.timeout(30):
                done = await asyncio.gather(*tasks, return_exceptions=True)
        return made, sum(result is None for result in done)

    try:
        made, served = asyncio.run(scenario())
    finally:
        count.close()
    assert served == WAITERS
    assert made <= WAITERS * WAITS // 2, f"{made} connections made in {WAITERS * WAITS} waits"
