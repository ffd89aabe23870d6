"""A waiter on Redis or Redlock waits for the release, not for a poll's short delay.

Its wait is a ``BLPOP`` that the release ends at once; one that runs out instead ends on the
client's deadline and drops its connection (see ``_redis_io.BLPOP_SLACK``). The acquire loop
used to wait the backoff's delays, a few milliseconds at first, so a waiter of a name held
for a moment ran out, reconnected and tried again and again: with 32 threads on one name,
1.6 new connections and 28 commands per grant, and a quarter of the grants a second that
waiting for the release gives (``./scripts/bench contention``). Now each wait lasts at least
``BLPOP_WAIT`` (never past the caller's deadline). On servers of each test's own.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from leases import Lease, aacquire, acquire
from leases.backends import get_backend
from leases.backends._redis_io import BLPOP_WAIT
from leases.retry import Backoff
from tests.extra_backends import added_backend
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

#: How long the first holder keeps the name once the waiter waits: past two of its waits.
HOLD = 0.6


@pytest.fixture(params=["redis", "redlock"])
def waited(request: pytest.FixtureRequest, redis_servers: Any) -> Iterator[str]:
    """A Redis backend on a server of its own, or Redlock on three."""
    servers = redis_servers(1 if request.param == "redis" else 3)
    config: dict[str, Any]
    if request.param == "redis":
        config = {"ENGINE": "leases.backends.redis", "URL": servers[0].url, "SOCKET_TIMEOUT": 2.0}
    else:
        config = {"ENGINE": "leases.backends.redlock", "NODES": [s.url for s in servers]}
    with added_backend(f"waits-{request.param}", config) as alias:
        yield alias


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
