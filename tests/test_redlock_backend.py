"""Redlock over five throwaway Redis servers: quorum, prompt failure, Kleppmann's scenario."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import redis
import redis.asyncio
from django.contrib.auth.models import Permission

from devservers import RedisServer
from devservers.proxy import FaultProxy
from leases import operations
from leases.backends import get_backend
from leases.backends._redis_io import SERVER_TICK
from leases.backends.base import Grant
from leases.backends.redis import LeaseKeys
from leases.backends.redlock import Backend, node_value
from leases.errors import (
    BackendUnavailable,
    LeaseLost,
    LeasesImproperlyConfigured,
    RevocationIncomplete,
)
from leases.models import ForceRelease
from tests import checker
from tests.extra_backends import added_backend
from tests.factories import UserFactory
from tests.lease_backends import wait_overshoots
from tests.waiting import released_past_blocked_waits, stalled, stalled_handover, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.fault]

Servers = Callable[[int], list[RedisServer]]


def unique() -> str:
    return f"rl-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def five(redis_servers: Servers) -> list[RedisServer]:
    return redis_servers(5)


@pytest.fixture
def make_backend() -> Iterator[Callable[..., Backend]]:
    made: list[Backend] = []

    def make(servers: list[RedisServer], **options: object) -> Backend:
        # Generous node timeouts unless a test asks: a loaded CI box can stall a live node.
        options = {"NODE_TIMEOUT": 0.5, **options}
        backend = Backend("redlock-test", {"NODES": [s.url for s in servers], **options})
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def holders(servers: list[RedisServer], name: str) -> list[bytes | None]:
    """The lock value on each live server (``None``: free or dead)."""
    values: list[bytes | None] = []
    for server in servers:
        try:
            client = redis.Redis.from_url(server.url, socket_timeout=0.5)
            # Without decode_responses, redis-py reads bytes.
            values.append(cast("bytes | None", client.get(LeaseKeys.of("leases:", name).lock)))
        except redis.RedisError:
            values.append(None)
    return values


def freed(servers: list[RedisServer], name: str) -> None:
    """Wait until no node holds ``name``. A release (and a failed try's give-back) returns once
    a quorum has answered: the last node's ``DEL`` was sent with the others, but on a loaded
    machine its server may run it a moment after the call returned."""
    everywhere = [None] * len(servers)
    wait_until(lambda: holders(servers, name) == everywhere, 10, "the release everywhere")


async def afreed(servers: list[RedisServer], name: str) -> None:
    """:func:`freed`, in a thread (the loop free meanwhile)."""
    await asyncio.to_thread(freed, servers, name)


def test_two_of_five_dead_still_acquires(
    five: list[RedisServer], make_backend: Callable[..., Backend]
) -> None:
    backend, name = make_backend(five), unique()
    for server in five[:2]:
        server.stop("kill")
    grant = backend.try_acquire(name, "a", 5)
    assert grant is not None
    assert backend.try_acquire(name, "b", 5) is None
    grant = backend.renew(grant, 5)
    backend.release(grant)
    freed(five, name)
    again = backend.try_acquire(name, "b", 5)
    assert again is not None and again.token > grant.token


def test_three_of_five_dead_is_refused_and_live_nodes_are_clean(
    five: list[RedisServer], make_backend: Callable[..., Backend]
) -> None:
    backend, name = make_backend(five), unique()
    for server in five[2:]:
        server.stop("kill")
    assert backend.try_acquire(name, "a", 5) is None
    # The two live nodes took the key; the failed attempt gave it back.
    freed(five, name)


def test_three_of_five_hung_fails_without_hanging(
    five: list[RedisServer], make_backend: Callable[..., Backend]
) -> None:
    backend, name = make_backend(five, NODE_TIMEOUT=0.05), unique()
    for server in five[2:]:
        server.pause()  # hung, not refused: only the node timeout bounds each request
    try:
        started = time.monotonic()
        assert backend.try_acquire(name, "a", 5) is None
        elapsed = time.monotonic() - started
    finally:
        for server in five[2:]:
            server.resume()
    # A hang detector, not a speed claim: redis-py's default 5 s timeout would take 30 s here.
    assert elapsed < 5, elapsed


@pytest.mark.parametrize("hung", [3, 5])
def test_a_try_with_hung_nodes_takes_about_one_node_timeout(
    five: list[RedisServer], make_backend: Callable[..., Backend], hung: int
) -> None:
    """Replies are awaited together, and a failed try's unlock does not wait for hung nodes:
    however many hang, a try costs one NODE_TIMEOUT (read node by node, 5 hung nodes cost 10).
    Twice: the first try reuses open connections, the second must open new ones to hung nodes.
    """
    timeout = 0.3
    backend, name = make_backend(five, NODE_TIMEOUT=timeout), unique()
    assert backend.inspect(name) is None  # a connection to every node is open now
    elapsed = []
    for server in five[:hung]:
        server.pause()
    try:
        for _ in range(2):
            started = time.monotonic()
            try:
                assert backend.try_acquire(name, "a", 5) is None
            except BackendUnavailable:
                assert hung == 5  # no node answered
            elapsed.append(time.monotonic() - started)
    finally:
        for server in five[:hung]:
            server.resume()
    # Read node by node, three hung nodes cost 3 x NODE_TIMEOUT; the bound leaves a loaded
    # machine a whole NODE_TIMEOUT of slack over the concurrent read's one.
    assert max(elapsed) < 2 * timeout, elapsed


def test_failed_attempt_unlocks_on_every_node_but_never_others_keys(
    five: list[RedisServer], make_backend: Callable[..., Backend]
) -> None:
    backend, name = make_backend(five), unique()
    key = LeaseKeys.of("leases:", name).lock
    for server in five[2:]:
        redis.Redis.from_url(server.url).set(key, "someone-else", px=10_000)
    assert backend.try_acquire(name, "a", 5) is None
    # Sent before try_acquire returns, run by the nodes in their own time.
    wait_until(lambda: holders(five, name)[:2] == [None, None], 5, "the give-back")
    assert holders(five, name) == [None, None] + [b"someone-else"] * 3
    for server in five[:2]:  # those that said yes; one that said no has nothing to undo
        stats = redis.Redis.from_url(server.url).info("commandstats")
        assert stats["cmdstat_eval"]["calls"] >= 1, server.url  # the unlock reached it


def test_every_node_dead_is_backend_unavailable(
    five: list[RedisServer], make_backend: Callable[..., Backend]
) -> None:
    backend = make_backend(five)
    for server in five:
        server.stop("kill")
    with pytest.raises(BackendUnavailable):
        backend.try_acquire(unique(), "a", 5)


def test_a_listing_that_too_few_nodes_answered_is_unavailable_not_empty(
    five: list[RedisServer], make_backend: Callable[..., Backend]
) -> None:
    """A held name is on a quorum (3 of 5), so any 3 nodes show it; with 2 answering it may be
    on none of them. ``inspect_all`` skipped nodes that failed and answered ``[]``: the admin
    and ``leases list`` showed "nothing held" for a store nobody could reach."""
    backend, name = make_backend(five), unique()
    grant = backend.try_acquire(name, "a", 30)
    assert grant is not None
    five[0].stop("kill")
    five[1].stop("kill")
    assert [info.name for info in backend.inspect_all()] == [name]  # 3 answer: all is seen
    five[2].stop("kill")
    with pytest.raises(BackendUnavailable, match="2 of 5 nodes"):
        backend.inspect_all()


def test_listing_reads_each_node_and_the_tokens_once_a_batch(
    redis_servers: Servers, make_backend: Callable[..., Backend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``inspect_all`` asked every node for each name in a fan-out of its own, and the
    database for each name's token: 300 names cost 300 round trips to each node and 300
    queries, a listing of a few thousand held names took seconds. One ``MGET`` to each node
    and one query a batch, and the same answers."""
    servers = redis_servers(3)
    backend = make_backend(servers)
    names = sorted(unique() for _ in range(300))
    grants = {name: backend.try_acquire(name, f"h{i}", 30) for i, name in enumerate(names)}
    clients = [redis.Redis.from_url(server.url) for server in servers]

    def reads() -> list[int]:
        stats = [client.info("commandstats") for client in clients]
        return [
            sum(found.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("get", "mget"))
            for found in stats
        ]

    queries: list[str] = []
    for method in ("current_lease", "current_leases"):
        real = getattr(backend.counter, method, None)
        if real is None:  # (code without the batched read)
            continue

        def counted(*args: object, _real: Any = real, _method: str = method) -> Any:
            queries.append(_method)
            return _real(*args)

        monkeypatch.setattr(backend.counter, method, counted)
    before = reads()
    listed = backend.inspect_all()
    after = reads()
    ours = [info for info in listed if info.name in grants]
    assert [info.name for info in ours] == names
    for info in ours:
        grant = grants[info.name]
        assert grant is not None and info.held
        assert (info.holder, info.token) == (grant.holder, grant.token)
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1]
    assert queries == ["current_leases"]


def test_node_restarted_empty_after_a_grant_cannot_let_a_stale_write_in(
    five: list[RedisServer], make_backend: Callable[..., Backend]
) -> None:
    """Kleppmann's scenario: A holds nodes 0-2; node 2 restarts empty; B wins nodes 2-4."""
    backend, name, register = make_backend(five), unique(), checker.new_register()
    for server in five[3:]:
        # Down, not hung: a SET sent to a hung node would still land once it resumes.
        server.stop("kill")
    try:
        a = backend.try_acquire(name, "A", 10)
    finally:
        for server in five[3:]:
            server.start()
    assert a is not None
    assert checker.record_write(register, a.token, "A")
    five[2].restart("kill")
    b = backend.try_acquire(name, "B", 10)
    assert b is not None, holders(five, name)  # both "hold" it now: Redlock alone is unsafe
    assert b.token > a.token
    assert checker.record_write(register, b.token, "B")
    assert not checker.record_write(register, a.token, "A")  # the fence rejects A from now on
    checker.check_history(register, [a.token, b.token])
    with pytest.raises(LeaseLost):
        backend.release(a)  # A is on 2 nodes only: no quorum, reported lost


def test_release_after_expiry_keeps_successor(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    servers = redis_servers(3)
    backend, name = make_backend(servers), unique()
    old = backend.try_acquire(name, "old", 1)
    assert old is not None
    time.sleep(1.05)
    new = backend.try_acquire(name, "new", 5)
    assert new is not None and new.token > old.token
    with pytest.raises(LeaseLost):
        backend.release(old)
    with pytest.raises(LeaseLost):
        backend.renew(old, 5)
    assert holders(servers, name) == [node_value(new.holder, new.secret).encode()] * 3
    info = backend.inspect(name)
    assert info is not None and info.held and (info.holder, info.token) == ("new", new.token)
    assert [i.name for i in backend.inspect_all()] == [name]


def test_grant_expiring_before_the_quorum_is_refused(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    servers = redis_servers(3)
    backend, name = make_backend(servers), unique()
    # 2 ms of TTL minus the drift (1% + 2 ms) leaves no validity at all, however fast the
    # nodes answer: the quorum it won must be given back on every node.
    assert backend.try_acquire(name, "a", 0.002) is None
    freed(servers, name)


def test_bad_nodes_are_configuration_errors() -> None:
    with pytest.raises(LeasesImproperlyConfigured):
        Backend("x", {"NODES": []})
    with pytest.raises(LeasesImproperlyConfigured):
        Backend("x", {"NODES": ["redis://127.0.0.1:1/0"], "URL": "x"})


def test_nodes_may_be_django_redis_cache_aliases(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    from django.test import override_settings

    servers = redis_servers(3)
    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        **{
            f"node{i}": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": server.url}
            for i, server in enumerate(servers)
        },
    }
    with override_settings(CACHES=caches):
        backend = Backend("redlock-caches", {"NODES": ["node0", "node1", "node2"]})
        try:
            name = unique()
            grant = backend.try_acquire(name, "a", 5)
            assert grant is not None
            assert holders(servers, name) == [node_value(grant.holder, grant.secret).encode()] * 3
            backend.release(backend.renew(grant, 5))
            freed(servers, name)
        finally:
            backend.close()


def test_a_wait_ends_at_its_deadline_on_idle_nodes(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    """Like the Redis backend's: the node's timer tick must not decide when a wait ends."""
    backend = make_backend(redis_servers(3))
    late = wait_overshoots(backend, unique())
    assert late[0] > -(SERVER_TICK + 0.005) and late[3] <= 0.05, late


def test_a_quorum_decides_without_waiting_for_a_hung_node(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    """A grant, a renewal and a release need a quorum's answers, not every node's: the replies
    are read as they arrive until a quorum settles it, and a hung node's are left to the drain
    thread (each step used to wait for it until NODE_TIMEOUT). Once the node resumes, the
    replies it owed are read off its connections, so no later command there reads one late."""
    servers = redis_servers(3)
    timeout = 5.0
    backend, name = make_backend(servers, NODE_TIMEOUT=timeout), unique()
    assert backend.inspect(name) is None  # a connection to every node is open now
    servers[0].pause()  # the first node: replies are not read in the nodes' order either
    try:
        started = time.monotonic()
        grant = backend.try_acquire(name, "a", 30)
        assert grant is not None
        backend.release(backend.renew(grant, 30))
        elapsed = time.monotonic() - started
    finally:
        servers[0].resume()
    assert elapsed < timeout, elapsed  # waiting for the hung node took 3 x NODE_TIMEOUT
    # The node had no scripts yet: the drain thread loads them there and runs the renewal
    # and the release again, once it has read their NOSCRIPT, one round trip later.
    wait_until(lambda: holders(servers, name) == [None] * 3, 10, "the release on every node")
    tokens = [grant.token]
    for _ in range(5):
        grant = backend.try_acquire(name, "a", 30)
        assert grant is not None
        tokens.append(grant.token)
        value = node_value(grant.holder, grant.secret).encode()
        wait_until(lambda: holders(servers, name) == [value] * 3, 10, "the grant on every node")
        backend.release(backend.renew(grant, 30))
        freed(servers, name)
    checker.check_grants(tokens)


def test_a_try_refused_by_a_quorum_does_not_wait_for_hung_nodes(
    five: list[RedisServer], make_backend: Callable[..., Backend]
) -> None:
    """Three live nodes of five saying no settle a try: no quorum can say yes any more. The
    two hung nodes are not waited for (that took a whole NODE_TIMEOUT), yet the try's unlock
    still goes to them, and it never touches the holder's keys."""
    timeout = 5.0
    backend, name = make_backend(five, NODE_TIMEOUT=timeout), unique()
    holder = backend.try_acquire(name, "holder", 30)
    assert holder is not None
    for server in five[:2]:
        server.pause()
    try:
        started = time.monotonic()
        assert backend.try_acquire(name, "a", 30) is None
        elapsed = time.monotonic() - started
    finally:
        for server in five[:2]:
            server.resume()
    assert elapsed < timeout, elapsed
    value = node_value(holder.holder, holder.secret).encode()
    wait_until(lambda: holders(five, name) == [value] * 5, 10, "the holder's keys, untouched")
    backend.release(holder)
    freed(five, name)


def test_async_round_trips_keep_each_nodes_connection_and_never_reuse_a_dead_or_late_one(
    redis_servers: Servers, make_backend: Callable[..., Backend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each node's async round trips (acquire, renew, release) run on one connection kept
    between them, not one checked out of the node's pool each time. A connection the server
    closed while idle (``CLIENT KILL``) is never used: the next try is granted on every node.
    One whose reply came too late (a paused node) is dropped: after the node resumes, its late
    reply is never read as the answer to a later command (every node answers every command
    right, again on one kept connection)."""
    servers = redis_servers(3)
    backend, name = make_backend(servers), unique()  # the paused node costs it once
    checkouts: dict[int, int] = {server.port: 0 for server in servers}
    get_connection = redis.asyncio.ConnectionPool.get_connection

    async def counted(pool: Any) -> Any:
        checkouts[int(pool.connection_kwargs["port"])] += 1
        return await get_connection(pool)  # type: ignore[no-untyped-call]  # unannotated in redis-py

    monkeypatch.setattr(redis.asyncio.ConnectionPool, "get_connection", counted)
    tokens: list[int] = []

    async def cycle(holder: str) -> None:
        grant = await backend.atry_acquire(name, holder, 30)
        assert grant is not None
        tokens.append(grant.token)
        held = holders(servers, name)  # every node answered the SET NX: none on a dead connection
        assert all(value is not None for value in held), (holder, held)
        grant = await backend.arenew(grant, 30)
        await backend.arelease(grant)
        await afreed(servers, name)

    async def main() -> dict[str, dict[int, int]]:
        seen = {}
        try:
            await cycle("warm")
            seen["warm"] = dict(checkouts)
            for index in range(10):
                await cycle(f"h{index}")
            seen["kept"] = dict(checkouts)
            killer = redis.Redis.from_url(servers[0].url)
            try:  # ours, idle; the killer's own connection survives
                assert killer.client_kill_filter(_type="normal", skipme=True) >= 1
            finally:
                killer.close()
            await cycle("after-kill")
            seen["killed"] = dict(checkouts)
            servers[1].pause()
            try:  # servers[1] cannot answer: its reply comes once it resumes, too late
                grant = await backend.atry_acquire(name, "late", 30)
            finally:
                servers[1].resume()
            assert grant is not None  # two of three
            wait_until(lambda: holders(servers, name)[1] is not None, 10, "the late SET")
            grant = await backend.arenew(grant, 30)
            await backend.arelease(grant)
            await afreed(servers, name)
            for index in range(5):
                await cycle(f"after-late-{index}")
            seen["late"] = dict(checkouts)
            return seen
        finally:
            await backend.aclose()

    seen = asyncio.run(main())
    first, second, third = (server.port for server in servers)
    assert seen["warm"] == {first: 1, second: 1, third: 1}, seen
    assert seen["kept"] == seen["warm"], seen  # 30 round trips per node, no checkout
    assert seen["killed"] == {first: 2, second: 1, third: 1}, seen
    assert seen["late"] == {first: 2, second: 2, third: 1}, seen
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens


def test_an_async_try_with_hung_nodes_costs_one_node_timeout_and_counts_them_refused(
    five: list[RedisServer], make_backend: Callable[..., Backend]
) -> None:
    """Four of five nodes hung: each async try is refused (unanswered is not a yes) after one
    node timeout, not one per hung node, twice (the first on the kept connections, the second
    on new ones: the timed-out ones were dropped). Once the nodes resume, their late replies
    are never read as answers: a try is granted on every node and released everywhere. (A
    late ``SET`` may land after its unlock: the tries' short TTL bounds what it holds.)"""
    timeout = 0.5
    backend, name = make_backend(five, NODE_TIMEOUT=timeout), unique()

    async def main() -> list[float]:
        elapsed = []
        try:
            grant = await backend.atry_acquire(name, "warm", 30)  # a kept connection per node
            assert grant is not None
            await backend.arelease(grant)
            for server in five[1:]:
                server.pause()
            try:
                for _ in range(2):
                    started = time.monotonic()
                    assert await backend.atry_acquire(name, "a", 1) is None
                    elapsed.append(time.monotonic() - started)
            finally:
                for server in five[1:]:
                    server.resume()
            for _ in range(500):  # on the loop: the failed tries' unlocks run meanwhile
                if holders(five, name) == [None] * 5:  # unlocked, or a late SET expired
                    break
                await asyncio.sleep(0.02)
            grant = await backend.atry_acquire(name, "b", 30)
            assert grant is not None
            assert all(value is not None for value in holders(five, name))
            await backend.arelease(grant)
            await afreed(five, name)
            return elapsed
        finally:
            await backend.aclose()

    elapsed = asyncio.run(main())
    # A hang detector with slack for a loaded machine: concurrent, a try costs one timeout for
    # its SETs and one for the unlocks of the silent nodes (1 s); node by node, the four hung
    # nodes' SETs alone cost 2 s, their unlocks 2 s more.
    assert max(elapsed) < 4 * timeout, elapsed


def test_an_async_round_trip_on_a_stalled_event_loop_reads_the_replies_that_came_in_time(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    """The event loop blocks (a synchronous call in some coroutine, GIL-heavy worker threads)
    right after every node ran the command, for longer than NODE_TIMEOUT but well within the
    TTL. The nodes answered in time, their replies waiting in the sockets: the try is granted,
    the renewal renews and the release releases (each used to count every node silent: "no
    Redlock node answered"). The fence still orders the grants: a later holder's higher token
    shuts the stalled holder's writes out."""
    servers = redis_servers(3)
    timeout, stall = 0.3, 1.0
    backend, name = make_backend(servers, NODE_TIMEOUT=timeout), unique()
    lock = LeaseKeys.of("leases:", name).lock

    def ttls() -> list[int]:
        return [redis.Redis.from_url(server.url).pttl(lock) for server in servers]

    async def main() -> tuple[Grant, Grant]:
        held = lambda: all(value is not None for value in holders(servers, name))  # noqa: E731
        freed = lambda: holders(servers, name) == [None] * 3  # noqa: E731
        renewed = lambda: all(ttl > 10_000 for ttl in ttls())  # noqa: E731
        try:
            return await stalled_handover(
                backend, name, stall, held=held, renewed=renewed, freed=freed
            )
        finally:
            await backend.aclose()

    a, b = asyncio.run(main())
    checker.check_handover(a.token, b.token)


def test_an_async_try_whose_event_loop_stalls_past_its_ttl_is_not_granted(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    """The loop stalls longer than the TTL right after every node ran the ``SET``: the
    replies say yes, but the validity counts from when the ``SET`` was sent, so nothing is
    granted (the keys may already have expired on the nodes, and another holder be in). The
    next try is granted as usual."""
    servers = redis_servers(3)
    backend, name = make_backend(servers, NODE_TIMEOUT=0.3), unique()

    async def main() -> Grant | None:
        try:
            warm = await backend.atry_acquire(name, "warm", 30)
            assert warm is not None
            await backend.arelease(warm)
            held = lambda: all(value is not None for value in holders(servers, name))  # noqa: E731
            late = await stalled(backend.atry_acquire(name, "A", 0.5), held, 1.0, "the SETs")
            assert late is None
            return await backend.atry_acquire(name, "B", 10)
        finally:
            await backend.aclose()

    b = asyncio.run(main())
    assert b is not None and holders(servers, name) == [node_value("B", b.secret).encode()] * 3
    backend.release(b)


def test_async_renewals_and_releases_send_their_scripts_by_sha1_loading_them_where_missing(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    """Async renewals and releases run their scripts by SHA1 (``EVALSHA``), never with their
    text each time (``EVAL``): the text crosses the network once per script and server, on
    the connection that found it missing, and once more after a node lost its scripts
    (``SCRIPT FLUSH``, as a restart would), the renewal and release answering as before."""
    servers = redis_servers(3)
    backend, name = make_backend(servers), unique()
    clients = [redis.Redis.from_url(server.url) for server in servers]

    def calls(prefix: str) -> list[int]:
        """Calls per node of the commands ``prefix`` starts (``script`` counts ``script|load``
        and ``script|flush``, or one ``script`` before Redis 7)."""
        stats = [client.info("commandstats") for client in clients]
        return [sum(int(v["calls"]) for k, v in s.items() if k.startswith(prefix)) for s in stats]

    async def cycles(count: int) -> None:
        for index in range(count):
            grant = await backend.atry_acquire(name, f"h{index}", 30)
            assert grant is not None
            grant = await backend.arenew(grant, 30)
            await backend.arelease(grant)
            await afreed(servers, name)

    async def main() -> None:
        try:
            await cycles(3)
            clients[0].script_flush()
            await cycles(2)
        finally:
            await backend.aclose()

    asyncio.run(main())
    assert calls("cmdstat_eval") == calls("cmdstat_evalsha")  # no EVAL
    assert all(count >= 10 for count in calls("cmdstat_evalsha")), calls("cmdstat_evalsha")
    # Renew's and release's loads; on node 0 the flush, and both loads again after it.
    assert calls("cmdstat_script") == [5, 2, 2]


def test_renewals_and_releases_send_their_scripts_by_sha1_loading_them_where_missing(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    """The blocking twin of the async test above: renewals and releases run their scripts by
    SHA1 (``EVALSHA``), never with their text each time (``EVAL``); a node that lacks a script
    (``SCRIPT FLUSH``, as a restart would) loads it on the connection that found it missing,
    including the node whose reply is left to the drain thread once a quorum decided."""
    servers = redis_servers(3)
    backend, name = make_backend(servers), unique()
    clients = [redis.Redis.from_url(server.url) for server in servers]
    lock = LeaseKeys.of("leases:", name).lock
    # The one script sent by its text: a give-back (see Backend.give_back), which a loaded
    # machine brings about (a release that finds a node's connection busy, or one made before
    # the drain read a SET's reply). Each is counted per node, and only those may be EVALs.
    given_back = [0] * len(servers)
    send_give_back = backend._send_give_back

    def counted(grant: Grant, nodes: list[Any]) -> Any:
        for node in nodes:
            given_back[backend.nodes.index(node)] += 1
        return send_give_back(grant, nodes)

    backend._send_give_back = counted  # type: ignore[method-assign]

    def calls(prefix: str) -> list[int]:
        stats = [client.info("commandstats") for client in clients]
        return [sum(int(v["calls"]) for k, v in s.items() if k.startswith(prefix)) for s in stats]

    def cycles(count: int) -> None:
        # A quorum decides; the last node's reply is read (and its script loaded and run
        # again) by the drain thread: each step waits until every node ran it.
        for index in range(count):
            grant = backend.try_acquire(name, f"h{index}", 10)
            assert grant is not None
            wait_until(lambda: None not in holders(servers, name), 10, "the SET on every node")
            grant = backend.renew(grant, 30)
            renewed = lambda: all(client.pttl(lock) > 10_000 for client in clients)  # noqa: E731
            wait_until(renewed, 10, "the renewal on every node")
            backend.release(grant)
            freed(servers, name)

    cycles(3)
    clients[0].script_flush()
    cycles(2)
    evals = [a - b for a, b in zip(calls("cmdstat_eval"), calls("cmdstat_evalsha"), strict=True)]
    assert evals == given_back  # no EVAL but the give-backs (none on a quiet machine)
    assert all(count >= 10 for count in calls("cmdstat_evalsha")), calls("cmdstat_evalsha")
    # Renew's and release's loads; on node 0 the flush, and both loads again after it.
    assert calls("cmdstat_script") == [5, 2, 2]


@pytest.mark.parametrize("phase", ["tcp", "handshake"])
def test_async_connects_on_a_stalled_event_loop_are_not_counted_silent(
    redis_servers: Servers,
    make_backend: Callable[..., Backend],
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
) -> None:
    """The event loop blocks for longer than NODE_TIMEOUT (a blocking call in a callback of
    its own) while new connections to every live node are being made: queued as the last
    node's TCP connect starts, or as it ends (the handshakes then in flight). The connects
    completed in time, while the loop was not looking: the try, the renewal and the release,
    each on new connections (the kept ones killed before it), are answered by every node.
    They used to count the nodes silent ("no Redlock node answered"). The fence still orders
    A's grant before B's."""
    servers = redis_servers(3)
    timeout, stall = 0.3, 1.0
    backend, name = make_backend(servers, NODE_TIMEOUT=timeout), unique()
    connect = redis.asyncio.Connection._connect
    connects: list[object] = []

    def stall_after_the_last_of_three(connection: object) -> None:
        connects.append(connection)
        if len(connects) % 3 == 0:  # the loop's next turn blocks, all three connects under way
            asyncio.get_running_loop().call_soon(time.sleep, stall)

    async def stalling(connection: Any) -> None:
        if phase == "tcp":
            stall_after_the_last_of_three(connection)
        await connect(connection)  # type: ignore[no-untyped-call]  # unannotated in redis-py
        if phase == "handshake":
            stall_after_the_last_of_three(connection)

    monkeypatch.setattr(redis.asyncio.Connection, "_connect", stalling)

    def kill_kept_connections() -> None:
        for server in servers:
            killer = redis.Redis.from_url(server.url)
            try:  # ours, idle; the killer's own connection survives
                assert killer.client_kill_filter(_type="normal", skipme=True) >= 1
            finally:
                killer.close()

    async def main() -> tuple[Grant, Grant]:
        try:
            a = await backend.atry_acquire(name, "A", 10)
            assert a is not None
            assert None not in holders(servers, name)
            kill_kept_connections()
            a = await backend.arenew(a, 30)
            kill_kept_connections()
            await backend.arelease(a)
            await afreed(servers, name)
            b = await backend.atry_acquire(name, "B", 10)
            assert b is not None
            await backend.arelease(b)
            return a, b
        finally:
            await backend.aclose()

    a, b = asyncio.run(main())
    assert len(connects) == 9, connects  # three stalls, each with every node connecting
    checker.check_handover(a.token, b.token)


def test_more_waiters_than_redis_py_pools_allow_leave_room_for_the_release(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    """redis-py (6.0 on) caps a pool at 100 connections by default. A process with that many
    waits blocked on a node must still reach it: a release (or a failed try's give-back) that
    gets no connection leaves the key there for a whole TTL (the contention collapse)."""
    (server,) = redis_servers(1)
    backend, name = make_backend([server]), unique()
    grant = backend.try_acquire(name, "holder", 30)
    assert grant is not None
    waits = 110
    woken: list[bool] = []
    threads = [
        threading.Thread(target=lambda: woken.append(backend.wait_for_release(name, 3)))
        for _ in range(waits)
    ]
    for thread in threads:
        thread.start()
    client = redis.Redis.from_url(server.url)
    try:
        wait_until(
            lambda: sum(c["cmd"] == "blpop" for c in client.client_list()) >= waits,
            5,
            f"{waits} waits blocked on the node",
        )
        backend.release(grant)  # BackendUnavailable when the pool had no connection left
        assert holders([server], name) == [None]
    finally:
        for thread in threads:
            thread.join(10)
    assert len(woken) == waits and any(woken)


def test_more_async_waiters_than_redis_py_pools_allow_leave_room_for_the_release(
    redis_servers: Servers, make_backend: Callable[..., Backend]
) -> None:
    """The async twin of the test above: redis.asyncio caps a pool at 100 connections too. An
    event loop with that many waits blocked on a node must still reach it: the waits past the
    cap failed at once, and a release that got no connection left the key on the node for a
    whole TTL."""
    (server,) = redis_servers(1)
    backend, name = make_backend([server]), unique()
    client = redis.Redis.from_url(server.url)
    grant = backend.try_acquire(name, "holder", 30)  # the sync client: none of the loop's
    assert grant is not None

    async def main() -> list[object]:
        try:
            return await released_past_blocked_waits(
                backend, name, grant, lambda: sum(c["cmd"] == "blpop" for c in client.client_list())
            )
        finally:
            await backend.aclose()

    woken = asyncio.run(main())
    assert holders([server], name) == [None]
    assert all(type(outcome) is bool for outcome in woken), woken
    assert any(woken)


#: The operator's alias in :func:`proxied`: configured, so the audited operator path
#: (:func:`leases.operations.force_release`, the admin's and ``manage.py leases``') finds it.
OPERATOR = "redlock-operator"


@pytest.fixture
def proxied(redis_servers: Servers) -> Iterator[tuple[Backend, Backend, list[FaultProxy]]]:
    """A holder's backend on three nodes, and an operator's on the same nodes through proxies
    (which the test can silence for the operator alone), configured as :data:`OPERATOR`."""
    servers = redis_servers(3)
    proxies = [FaultProxy(server.port) for server in servers]
    prefix = f"{unique()}:"
    options = {"PREFIX": prefix, "NODE_TIMEOUT": 0.5}
    holder = Backend("redlock-test", {"NODES": [s.url for s in servers], **options})
    nodes = [p.url() for p in proxies]
    operator = {"ENGINE": "leases.backends.redlock", "NODES": nodes, **options}
    try:
        with added_backend(OPERATOR, operator):
            yield holder, cast(Backend, get_backend(OPERATOR)), proxies
    finally:
        for proxy in proxies:
            proxy.pass_through()
        holder.close()
        for proxy in proxies:
            proxy.close()


def silence_once_the_token_moved(
    operator: Backend, proxies: list[FaultProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``proxies`` go silent between the operator's revocation of the token and its deletions
    on the nodes (after its read of who holds the name)."""
    revoke_token = operator._revoke_token

    def then_silence(name: str, token: int) -> tuple[int | None, int | None]:
        moved = revoke_token(name, token)
        for proxy in proxies:
            proxy.blackhole()
        return moved

    monkeypatch.setattr(operator, "_revoke_token", then_silence)


def test_force_release_that_cannot_tell_the_holder_revokes_nothing(
    proxied: tuple[Backend, Backend, list[FaultProxy]],
) -> None:
    """With two of three nodes silent to the operator, the token was bumped, nothing deleted,
    and the revocation reported done, while the holder went on renewing on its quorum."""
    holder, operator, proxies = proxied
    grant = holder.try_acquire(unique(), "worker", 30.0)
    assert grant is not None
    proxies[1].blackhole()
    proxies[2].blackhole()
    with pytest.raises(BackendUnavailable, match="nothing was revoked"):
        operator.force_release(grant.name, grant.token)
    assert holder.counter.current_lease(grant.name) == grant.token  # the token did not move
    holder.renew(grant, 30.0)


def test_inspect_that_cannot_tell_the_holder_says_unavailable_not_free(
    proxied: tuple[Backend, Backend, list[FaultProxy]],
) -> None:
    """A node restarted empty, and another is silent to the operator: of the two answers one
    shows the holder's value, which with the silent node is a quorum (the holder renews on
    it). ``inspect`` called the name free (the listing and the admin too), where the force
    release's own read refuses to tell."""
    holder, operator, proxies = proxied
    grant = holder.try_acquire(unique(), "worker", 30.0)
    assert grant is not None
    redis.Redis(port=proxies[0].target[1]).delete(LeaseKeys.of(holder.prefix, grant.name).lock)
    proxies[1].blackhole()
    with pytest.raises(BackendUnavailable, match="not enough to tell who holds"):
        operator.inspect(grant.name)
    holder.renew(grant, 30.0)  # it was held all along
    proxies[1].pass_through()
    info = operator.inspect(grant.name)
    assert info is not None and info.held and info.holder == "worker"


def test_force_release_whose_deletions_miss_a_quorum_says_it_is_incomplete(
    proxied: tuple[Backend, Backend, list[FaultProxy]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes went silent between the operator's read and its deletions: the holder kept
    its quorum and renewals, yet the revocation was reported done (its answers never read)."""
    holder, operator, proxies = proxied
    grant = holder.try_acquire(unique(), "worker", 30.0)
    assert grant is not None
    silence_once_the_token_moved(operator, proxies[1:], monkeypatch)
    with pytest.raises(RevocationIncomplete) as raised:
        operator.force_release(grant.name, grant.token)
    assert raised.value.token == holder.counter.current_lease(grant.name)
    assert raised.value.token > grant.token
    holder.force_release(grant.name, raised.value.token)  # again, with the new token
    with pytest.raises(LeaseLost):
        holder.renew(grant, 30.0)


@pytest.mark.parametrize("silenced", [1, 2])
def test_operator_force_release_is_audited_complete_or_not(
    proxied: tuple[Backend, Backend, list[FaultProxy]],
    monkeypatch: pytest.MonkeyPatch,
    silenced: int,
) -> None:
    """One node of three silent for the deletions still takes the quorum away: audited as a
    release. Two silent leave the holder its quorum (``RevocationIncomplete``): the token had
    moved and the revocation was recorded, yet the audited operator path left no audit row,
    so a partial revocation by an operator left no trace of who did it."""
    holder, operator, proxies = proxied
    grant = holder.try_acquire(unique(), "worker", 30.0)
    assert grant is not None
    user: Any = UserFactory(username=f"operator-{silenced}")
    user.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    silence_once_the_token_moved(operator, proxies[3 - silenced :], monkeypatch)

    def revoke() -> None:
        operations.force_release(
            grant.name, backend=OPERATOR, token=grant.token, user=user, via="command"
        )

    if silenced == 1:
        revoke()
    else:
        with pytest.raises(RevocationIncomplete):
            revoke()
    (record,) = ForceRelease.objects.filter(name=grant.name)  # one audit row either way
    assert (record.backend, record.holder, record.by) == (OPERATOR, "worker", user)
    complete = ForceRelease.Action.RELEASE if silenced == 1 else ForceRelease.Action.INCOMPLETE
    assert record.action == complete
    assert record.token == grant.token
    assert record.new_token == holder.counter.current_lease(grant.name)
    assert record.new_token is not None and record.new_token > grant.token
