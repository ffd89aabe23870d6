"""The replication id behind a connection: read per acquire by default, remembered only when
the backend is told to trust it (``TRUST_SERVER_ID``), and never carried too far.

The Redis backend's epochs need the replication id of the server that stamped a name's counter
(see ``leases/backends/redis.py``). These tests pin both modes: by default every acquire reads
it; with trust, a connection reads it once; and whatever could have changed the server behind a
connection (a restart, a demotion and promotion) still leads to a token higher than every one
before.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from devservers import RedisServer
from leases.backends.redis import Backend, LeaseKeys
from leases.errors import BackendUnavailable
from tests import checker
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def backend_on() -> Iterator[Callable[[RedisServer], Backend]]:
    made: list[Backend] = []

    def make(server: RedisServer, trust: float = 0) -> Backend:
        options = {"URL": server.url, "SOCKET_TIMEOUT": 2.0, "TRUST_SERVER_ID": trust}
        made.append(Backend("redis-run-test", options))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def info_calls(server: RedisServer) -> int:
    stats: dict[str, Any] = redis.Redis.from_url(server.url).info("commandstats")
    return int(stats.get("cmdstat_info", {}).get("calls", 0))


def cycle(backend: Backend, name: str, tokens: list[int] | None = None) -> int:
    grant = backend.try_acquire(name, "h", 5)
    assert grant is not None
    backend.release(grant)
    if tokens is not None:
        tokens.append(grant.token)
    return grant.token


def test_by_default_every_acquire_reads_the_replication_id(
    backend_on: Callable[..., Backend],
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    (server,) = redis_servers(1)
    backend, name = backend_on(server), f"run-{uuid.uuid4().hex[:8]}"
    cycle(backend, name)
    before = info_calls(server)
    for _ in range(20):
        cycle(backend, name)
    assert info_calls(server) - before == 20 + 1  # one per acquire (+ the count's own)


def test_a_trusting_connection_reads_the_replication_id_once_until_it_reconnects(
    backend_on: Callable[..., Backend],
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    (server,) = redis_servers(1)
    backend, name = backend_on(server, 3600.0), f"run-{uuid.uuid4().hex[:8]}"
    cycle(backend, name)  # the name's first grant: a new epoch
    before = info_calls(server)  # (counted too: + 1 below)
    for _ in range(20):
        cycle(backend, name)
    assert info_calls(server) - before == 1 + 0  # not one INFO per acquire
    backend.client.connection_pool.disconnect()
    cycle(backend, name)
    assert info_calls(server) - before == 2 + 1  # a new connection asks again


@pytest.mark.fault
def test_a_restart_from_an_older_snapshot_never_repeats_a_token(
    backend_on: Callable[..., Backend],
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    """The snapshot brings back a lower counter stamped with the old run's id; the trusted id
    must not outlive the connection, however young it is."""
    (server,) = redis_servers(1)
    tokens: list[int]
    backend, name, tokens = backend_on(server, 3600.0), f"run-{uuid.uuid4().hex[:8]}", []
    cycle(backend, name, tokens)
    redis.Redis.from_url(server.url).save()
    for _ in range(2):
        cycle(backend, name, tokens)
    server.restart("kill")  # loads the snapshot: counter 1 of 3, the old run's id
    stored = redis.Redis.from_url(server.url).hget(
        LeaseKeys.of(backend.prefix, name).fence, "counter"
    )
    assert stored == b"1"
    with contextlib.suppress(BackendUnavailable):  # the pooled connection died with it
        cycle(backend, name, tokens)
    cycle(backend, name, tokens)
    checker.check_grants(tokens)


@pytest.mark.fault
@pytest.mark.parametrize(
    "trust",
    [
        0,
        0.05,
        pytest.param(
            3600.0,
            marks=pytest.mark.xfail(
                strict=True,
                raises=AssertionError,
                reason="an id cached for the connection's life repeats a token here: the "
                "connection outlives the resync, so only time bounds what it may trust",
            ),
        ),
    ],
    ids=["default", "trusting", "cached-for-the-connection"],
)
def test_a_connection_idle_through_a_demotion_and_promotion_never_repeats_a_token(
    backend_on: Callable[..., Backend],
    redis_servers: Callable[[int], list[RedisServer]],
    trust: float,
) -> None:
    """The one change a live connection cannot see: its server resynced from a lagging replica
    and promoted again while the connection sat idle. By default the next acquire reads the id
    anyway; a trusting connection is safe only because what it learned expires first."""
    primary, other = redis_servers(2)
    for server in (primary, other):
        redis.Redis.from_url(server.url).config_set("repl-diskless-sync-delay", 0)
    tokens: list[int]
    backend, name, tokens = backend_on(primary, trust), f"run-{uuid.uuid4().hex[:8]}", []
    fence = LeaseKeys.of(backend.prefix, name).fence
    replica = redis.Redis.from_url(other.url)
    cycle(backend, name, tokens)
    replica.replicaof("127.0.0.1", primary.port)
    wait_until(lambda: replica.hget(fence, "counter") == b"1", 10, "the replica's copy")
    replica.replicaof("no", "one")  # promoted with counter 1; the primary grants 2 and 3
    for _ in range(2):
        cycle(backend, name, tokens)
    old = redis.Redis.from_url(primary.url)
    old.replicaof("127.0.0.1", other.port)  # demoted: its data replaced by the lagging copy
    link = lambda: old.info("replication").get("master_link_status") == "up"  # noqa: E731
    wait_until(link, 10, "the demoted primary's resync")
    assert old.hget(fence, "counter") == b"1"
    old.replicaof("no", "one")  # and promoted again, under the backend's idle connection
    time.sleep(trust * 2 if trust < 1 else 0)  # nothing for the default: it must hold at once
    cycle(backend, name, tokens)
    checker.check_grants(tokens)


def test_a_flushed_script_is_loaded_again_on_the_same_connection(
    backend_on: Callable[[RedisServer], Backend],
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    (server,) = redis_servers(1)
    backend, name = backend_on(server), f"run-{uuid.uuid4().hex[:8]}"
    first = cycle(backend, name)
    redis.Redis.from_url(server.url).script_flush()
    assert cycle(backend, name) > first  # NOSCRIPT: loaded again, then run


@pytest.mark.fault
@pytest.mark.parametrize("step", ["try_acquire", "release"])
def test_an_async_round_trip_to_a_hung_server_ends_at_the_socket_timeout(
    backend_on: Callable[[RedisServer], Backend],
    redis_servers: Callable[[int], list[RedisServer]],
    step: str,
) -> None:
    """The async client has no read timeout of its own (a socket timeout costs a task per
    command): the socket cut at ``SOCKET_TIMEOUT`` must end every round trip (the round trip
    runs in the caller's task, where ``asyncio.timeout`` would be a held-back cancellation)."""
    (server,) = redis_servers(1)
    backend = backend_on(server)  # SOCKET_TIMEOUT 2.0
    name = f"run-{uuid.uuid4().hex[:8]}"

    async def main() -> float:
        grant = await backend.atry_acquire(name, "h", 30)
        assert grant is not None
        server.pause()
        started = time.monotonic()
        try:
            with pytest.raises(BackendUnavailable):
                if step == "try_acquire":
                    await backend.atry_acquire(name + "-2", "h", 30)
                else:
                    await backend.arelease(grant)
            return time.monotonic() - started
        finally:
            server.resume()
            await backend.aclose()

    took = asyncio.run(main())
    assert 1.9 <= took < 10, took


def test_async_round_trips_keep_their_connection_and_never_use_one_the_server_closed(
    backend_on: Callable[[RedisServer], Backend],
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    """Async scripts run on connections kept between round trips (no pool checkout each);
    one the server closed while it sat idle is dropped unused, so the next try neither
    fails nor reads anything stale."""
    (server,) = redis_servers(1)
    backend = backend_on(server)
    name = f"kept-{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(server.url)

    async def cycles(count: int) -> list[int]:
        tokens = []
        for _ in range(count):
            grant = await backend.atry_acquire(name, "h", 30)
            assert grant is not None
            tokens.append(grant.token)
            await backend.arelease(grant)
        return tokens

    async def main() -> tuple[int, list[int]]:
        try:
            tokens = await cycles(3)
            before = int(admin.info("stats")["total_connections_received"])
            tokens += await cycles(20)
            opened = int(admin.info("stats")["total_connections_received"]) - before
            admin.client_kill_filter(_type="normal", skipme=True)  # ours, idle
            tokens += await cycles(3)
            return opened, tokens
        finally:
            await backend.aclose()

    try:
        opened, tokens = asyncio.run(main())
    finally:
        admin.close()
    assert opened <= 1, opened  # the admin's own INFO connection at most
    assert tokens == list(range(tokens[0], tokens[0] + 26)), tokens
