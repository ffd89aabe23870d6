"""The ZooKeeper backend's line of contenders, on the session ensemble (alias ``"zookeeper"``).

What the shared suites cannot see: that a release wakes the next contender and nobody else
(ZooKeeper's lock recipe, each contender watching only its predecessor).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import pytest
from kazoo.exceptions import NoNodeError  # type: ignore[import-untyped]

from leases import aacquire
from leases.backends import get_backend
from leases.backends._zookeeper_line import read_data
from tests.clusters import zookeeper_ready
from tests.lease_backends import lease_name
from tests.waiting import wait_until

if TYPE_CHECKING:
    from leases.backends.zookeeper import Backend as ZooKeeperBackend

__all__ = ["lease_name"]  # fixture, re-exported for pytest

pytestmark = [pytest.mark.django_db]


@pytest.fixture
def zookeeper() -> str:
    """The session ensemble's alias (started on first use), skipped without ZooKeeper."""
    return zookeeper_ready()


def test_a_release_wakes_only_the_next_in_line(zookeeper: str, lease_name: str) -> None:
    """Four waiters queue one after another behind a 30 s holder; the release wakes the first
    of them, which then holds the name, and leaves the other three asleep: no herd of failed
    tries. (With one watch on the name's children every waiter woke at once.)"""
    store = get_backend(zookeeper)
    holder = store.try_acquire(lease_name, "holder", 30)
    assert holder is not None
    woken: list[tuple[int, Any]] = []
    done = threading.Event()

    def wait_in_line(index: int, queued: threading.Event) -> None:
        with store.waiting_room(lease_name, 20):
            assert store.try_acquire(lease_name, f"w{index}", 30) is None
            queued.set()
            if store.wait_for_release(lease_name, 20):
                grant = store.try_acquire(lease_name, f"w{index}", 30)
                woken.append((index, grant))
                done.wait(20)
                if grant is not None:
                    store.release(grant)

    waiters = []
    for index in range(4):  # one at a time, so the line's order is known
        queued = threading.Event()
        waiter = threading.Thread(target=wait_in_line, args=(index, queued), daemon=True)
        waiter.start()
        waiters.append(waiter)
        assert queued.wait(10), f"waiter {index} never queued"
    try:
        store.release(holder)
        wait_until(lambda: bool(woken), 5, "the first waiter to wake")
        time.sleep(1.0)  # time enough for a herd to show itself
        assert [index for index, _ in woken] == [0], woken
        grant = woken[0][1]
        assert grant is not None and grant.token > holder.token
        info = store.inspect(lease_name)
        assert info is not None and info.held and info.holder == "w0"
    finally:
        done.set()
        for waiter in waiters:
            waiter.join(30)


def test_an_async_release_wakes_only_the_next_in_line(zookeeper: str, lease_name: str) -> None:
    """The async twin: four tasks queue (``awaiting_room``) one after another behind a 30 s
    holder; the release wakes the first, which then holds the name, and the other three stay
    asleep in the line. (Async waiters used to watch the head, so every one of them woke.)"""
    store = cast("ZooKeeperBackend", get_backend(zookeeper))
    holder = store.try_acquire(lease_name, "holder", 30)
    assert holder is not None
    woken: list[tuple[int, Any]] = []

    async def wait_in_line(index: int, queued: asyncio.Event, done: asyncio.Event) -> None:
        async with store.awaiting_room(lease_name, 20):
            assert await store.atry_acquire(lease_name, f"w{index}", 30) is None
            queued.set()
            if await store.await_for_release(lease_name, 20):
                grant = await store.atry_acquire(lease_name, f"w{index}", 30)
                woken.append((index, grant))
                await done.wait()
                if grant is not None:
                    await store.arelease(grant)

    async def main() -> None:
        done = asyncio.Event()
        waiters = []
        for index in range(4):  # one at a time, so the line's order is known
            queued = asyncio.Event()
            waiters.append(asyncio.create_task(wait_in_line(index, queued, done)))
            async with asyncio.timeout(10):
                await queued.wait()
        try:
            assert len(store.zk.line(lease_name)[0]) == 5  # the holder and four in line
            await store.arelease(holder)
            async with asyncio.timeout(5):
                while not woken:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)  # time enough for a herd to show itself
            assert [index for index, _ in woken] == [0], woken
            grant = woken[0][1]
            assert grant is not None and grant.token > holder.token
            info = store.inspect(lease_name)
            assert info is not None and info.held and info.holder == "w0"
        finally:
            done.set()
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(main())


def queued_in_line(store: Any, name: str) -> int:
    """How many of the name's line are queued waiters (a try's node says it is held). A node
    gone between the listing and its read (a refused try withdraws its own) is not counted:
    reading it raised ``NoNodeError`` in a loaded run."""
    path = store.zk.name_path(name)
    line, _ = store.zk.line(name)
    queued = 0
    for child in line:
        try:
            raw, _ = store.client.get(f"{path}/{child}")
        except NoNodeError:
            continue
        queued += not read_data(raw)["held"]
    return queued


def test_async_waiters_take_the_name_in_line(zookeeper: str, lease_name: str) -> None:
    """``aacquire`` waiters stand in the name's line while they wait (one node each, no tries
    between wake-ups) and take the name in the order they queued, each woken by the release of
    the one before."""
    store = cast("ZooKeeperBackend", get_backend(zookeeper))
    holder = store.try_acquire(lease_name, "holder", 30)
    assert holder is not None
    order: list[str] = []

    async def take(who: str) -> None:
        held = await aacquire(lease_name, ttl=30, backend=zookeeper, timeout=20, holder=who)
        order.append(who)
        await held.arelease()

    async def main() -> None:
        tasks = []
        for index in range(3):
            tasks.append(asyncio.create_task(take(f"w{index}")))
            async with asyncio.timeout(10):  # waiters 0..index queued in the line
                while await asyncio.to_thread(queued_in_line, store, lease_name) < index + 1:
                    await asyncio.sleep(0.02)
        await store.arelease(holder)
        async with asyncio.timeout(20):
            await asyncio.gather(*tasks)

    asyncio.run(main())
    assert order == ["w0", "w1", "w2"]
    assert store.zk.line(lease_name)[0] == []


def test_with_auth_an_anonymous_client_can_neither_release_nor_keep_a_lease(
    zookeeper: str,
) -> None:
    """``AUTH`` authenticated the backend's session, but its znodes were created with kazoo's
    default ACL (anyone, every permission): a client with no credential deleted a holder's
    node (releasing its lease) or wrote it (keeping a dead holder's lease alive). With
    ``AUTH`` the nodes are the credential's; anyone may still read them (holders are public)."""
    from django.conf import settings
    from kazoo.client import KazooClient  # type: ignore[import-untyped]
    from kazoo.exceptions import NoAuthError

    from leases.backends.zookeeper import Backend

    hosts = cast(dict[str, Any], settings.LEASES)["BACKENDS"][zookeeper]["HOSTS"]
    prefix = f"/acl-{time.monotonic_ns()}"
    auth = [("digest", "app:app-password")]
    backend = Backend("zk-auth", {"HOSTS": hosts, "PREFIX": prefix, "AUTH": auth})
    outsider = KazooClient(hosts=hosts)  # no credential
    outsider.start(timeout=15)
    try:
        grant = backend.try_acquire("payroll", "host:1:1", 5.0)
        assert grant is not None
        line = f"{prefix}/names/payroll"
        (child,) = outsider.get_children(line)  # readable: holders are public
        with pytest.raises(NoAuthError):
            outsider.delete(f"{line}/{child}")
        with pytest.raises(NoAuthError):
            outsider.set(f"{line}/{child}", b"")
        with pytest.raises(NoAuthError):
            outsider.create(f"{line}/c-intruder-", b"", sequence=True)
        backend.renew(grant, 5.0)
        backend.release(grant)
        assert backend.deploy_checks() == []
        open_prefix = f"{prefix}-open"
        outsider.ensure_path(open_prefix)  # made without AUTH: anyone may write there
        opened = Backend("zk-open", {"HOSTS": hosts, "PREFIX": open_prefix, "AUTH": auth})
        try:
            (problem,) = opened.deploy_checks()
            assert "lets anyone write" in problem
        finally:
            opened.close()
            outsider.delete(open_prefix, recursive=True)
    finally:
        backend.close()
        admin = KazooClient(hosts=hosts, auth_data=auth)
        admin.start(timeout=15)
        admin.delete(prefix, recursive=True)
        admin.stop()
        admin.close()
        outsider.stop()
        outsider.close()


def test_listing_reads_the_names_in_two_round_trips_a_batch(
    zookeeper: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``inspect_all`` read each name's line and then its head, waiting for each reply
    before the next request: two round trips a name, so a listing of a few thousand names
    took seconds. A batch's requests now go out together (kazoo pipelines them on its one
    connection): the client waits twice a batch. Counted as the client schedules them: a
    request sent after a wait starts a new round trip."""
    store = cast("ZooKeeperBackend", get_backend(zookeeper))
    names = [f"{lease_name}:{i:03d}" for i in range(60)]
    grants = {name: store.try_acquire(name, f"h{i}", 30) for i, name in enumerate(names)}
    for name in names[::3]:
        grant = grants.pop(name)
        assert grant is not None
        store.release(grant)
    events: list[str] = []
    # Other tests' names are listed too, and may change meanwhile (a head gone between the
    # two reads is looked at again alone): only the requests for this test's names count.
    ours = {store.zk.name_path(name) for name in names}
    for method in ("get_children_async", "get_async"):
        real = getattr(store.client, method)

        def sent(path: str, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if path in ours or path.rpartition("/")[0] in ours:
                events.append("send")
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(store.client, method, sent)
    real_get = store.zk.get

    def waited(result: Any) -> Any:
        events.append("wait")
        return real_get(result)

    monkeypatch.setattr(store.zk, "get", waited)
    listed = {info.name: info for info in store.inspect_all() if info.name in names}
    monkeypatch.undo()
    trips = 1 + sum(1 for a, b in itertools.pairwise(events) if (a, b) == ("wait", "send"))
    assert trips <= 3, f"{trips} round trips for {len(names)} names"
    assert set(listed) == set(names)
    for name in names:
        grant = grants.get(name)
        info = listed[name]
        if grant is None:
            assert not info.held
        else:
            assert info.held and (info.holder, info.token) == (grant.holder, grant.token)
            store.release(grant)
