"""Faults through the public API (``acquire``, keepalive, fenced writes) on servers the tests own.

Each test points a backend alias at its own ``redis-server`` processes, then stalls, kills or
restarts them, and proves with the shared fenced-register checker that no stale write got in.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from django.test import override_settings
from django.utils.module_loading import import_string

from devservers import RedisServer
from devservers.proxy import FaultProxy
from leases.backends import get_backend
from leases.errors import LeaseError, LeaseLost, LeaseUnavailable
from leases.lease import Lease, acquire
from tests import checker
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.fault]


def unique() -> str:
    return f"fault-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def configure() -> Iterator[Callable[[dict[str, object]], None]]:
    """Add backends to ``LEASES`` for this test only (backends are rebuilt on change)."""
    overrides: list[override_settings] = []

    def add(backends: dict[str, object]) -> None:
        override = override_settings(
            LEASES={"BACKENDS": {"default": {"ENGINE": "leases.backends.database"}, **backends}}
        )
        override.enable()
        overrides.append(override)

    yield add
    for override in reversed(overrides):
        override.disable()


def in_thread(fn: Callable[[], Lease]) -> Lease:
    """Acquire from another thread: this thread's lost lease still counts as held by it."""
    box: list[Lease | BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # handed back to the test
            box.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    (result,) = box
    if isinstance(result, BaseException):
        raise result
    return result


def test_stalled_redis_past_ttl_reports_the_old_holder_lost_and_fences_it(
    redis_server: RedisServer, configure: Callable[[dict[str, object]], None]
) -> None:
    url = redis_server.url
    configure({"stall": {"ENGINE": "leases.backends.redis", "URL": url, "SOCKET_TIMEOUT": 0.5}})
    name, register = unique(), checker.new_register()
    old = acquire(name, ttl=1.5, backend="stall")
    assert checker.record_write(register, old, "old")
    redis_server.pause()
    try:
        assert old.lost.wait(5), "the keepalive never reported the loss"
    finally:
        redis_server.resume()
    new = in_thread(lambda: acquire(name, ttl=10, backend="stall", timeout=5))
    assert get_backend("stall").try_acquire(name, "third", 10) is None  # exactly one proceeds
    assert new.token > old.token
    assert checker.record_write(register, new, "new")
    assert not checker.record_write(register, old, "old")  # refused: it knows it is lost
    assert not checker.record_write(register, old.token, "old")  # refused by the fence
    summary = checker.check_history(register, [old.token, new.token])
    assert (summary.lost, summary.stale) == (1, 1)
    with pytest.raises(LeaseLost):
        old.release()
    new.release()


def test_redis_killed_and_restarted_empty_never_reissues_a_token(
    redis_server: RedisServer, configure: Callable[[dict[str, object]], None]
) -> None:
    configure({"crash": {"ENGINE": "leases.backends.redis", "URL": redis_server.url}})
    name, register = unique(), checker.new_register()
    grants = []
    for round_ in range(3):
        held = acquire(name, ttl=10, backend="crash", keepalive=False)
        grants.append(held.token)
        assert checker.record_write(register, held, f"holder{round_}")
        redis_server.restart("kill")
        successor = in_thread(lambda: acquire(name, ttl=10, backend="crash", keepalive=False))
        grants.append(successor.token)
        assert checker.record_write(register, successor, f"successor{round_}")
        assert not checker.record_write(register, held.token, f"holder{round_}")
        successor.release()
        with pytest.raises(LeaseLost):
            held.release()
    checker.check_history(register, grants)


def test_redlock_three_of_five_killed_is_unavailable_promptly(
    redis_servers: Callable[[int], list[RedisServer]],
    configure: Callable[[dict[str, object]], None],
) -> None:
    servers = redis_servers(5)
    nodes = [s.url for s in servers]
    configure({"rl5": {"ENGINE": "leases.backends.redlock", "NODES": nodes}})
    name = unique()
    for server in servers[:2]:
        server.stop("kill")
    held = acquire(name, ttl=10, backend="rl5")  # 3 of 5 is a quorum
    held.release()
    servers[2].stop("kill")
    with pytest.raises(LeaseUnavailable):
        acquire(name, ttl=10, backend="rl5", timeout=0.5)


def script_calls(server: RedisServer) -> int:
    """How many scripts ``server`` has run (``EVAL`` and ``EVALSHA``)."""
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(
        stats.get(f"cmdstat_{command}", {}).get("calls", 0) for command in ("eval", "evalsha")
    )


@pytest.mark.parametrize("engine", ["redis", "redlock"])
def test_a_renewal_racing_close_fails_with_a_lease_error(
    engine: str, redis_servers: Callable[[int], list[RedisServer]]
) -> None:
    """A worker shutting down closes the backend while its keepalive waits for a renewal's
    reply: ``close()`` drops the connection under the read. The renewal must fail with a
    :class:`LeaseError` the keepalive handles, never redis-py's ``ValueError`` (its buffer closed
    mid-read) or ``AttributeError`` (its buffer already gone)."""
    servers = redis_servers(1 if engine == "redis" else 3)
    proxies = [FaultProxy(server.port) for server in servers]
    options: dict[str, object] = (
        {"URL": proxies[0].url(), "SOCKET_TIMEOUT": 30}
        if engine == "redis"
        else {"NODES": [proxy.url() for proxy in proxies], "NODE_TIMEOUT": 30}
    )
    backend = import_string(f"leases.backends.{engine}.Backend")("racing-close", options)
    try:
        grant = backend.try_acquire(unique(), "worker", 60)
        assert grant is not None
        before = [script_calls(server) for server in servers]
        for proxy in proxies:
            proxy.blackhole(replies_only=True)  # the renewal lands; its reply never comes
        outcome: list[BaseException | None] = []

        def renew() -> None:
            try:
                backend.renew(grant, 60)
                outcome.append(None)
            except BaseException as exc:  # handed back to the test
                outcome.append(exc)

        renewing = threading.Thread(target=renew, daemon=True)
        renewing.start()
        wait_until(
            lambda: all(script_calls(s) > n for s, n in zip(servers, before, strict=True)),
            20,
            "the renewal on every server",
        )
        backend.close()  # the renewal is now waiting for replies that will never come
        renewing.join(20)
        assert outcome, "the renewal outlived close()"
        assert isinstance(outcome[0], LeaseError), repr(outcome[0])
    finally:
        backend.close()
        for proxy in proxies:
            proxy.close()
