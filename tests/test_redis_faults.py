"""Faults through the public API (``acquire``, keepalive, fenced writes) on servers the tests own.

Each test points a backend alias at its own ``redis-server`` processes, then stalls, kills or
restarts them, and proves with the shared fenced-register checker that no stale write got in.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
from django.test import override_settings

from devservers import RedisServer
from leases.backends import get_backend
from leases.errors import LeaseLost, LeaseUnavailable
from leases.lease import Lease, acquire
from tests import checker

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
