"""Redis's own warnings, played against the library on servers the tests own.

``CLIENT PAUSE`` freezes every client's commands (and key expiry) while the server stays up and
its connections open; eviction (``maxmemory`` with an ``allkeys-*`` policy) deletes the key of a
held lease. Neither may leave a holder believing it holds what it lost, and both end with the
shared fenced register: the successor's write lands, the old holder's is refused.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import cast

import pytest
import redis
from django.core.checks import run_checks
from django.test import override_settings

from devservers import RedisServer
from leases import LeaseLost, acquire
from leases.backends._redis_scripts import LeaseKeys
from leases.handle import Lease
from tests import checker
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.fault]


@pytest.fixture
def on_server(redis_server: RedisServer) -> Iterator[Callable[..., None]]:
    """Point backend ``"store"`` (URL, no retries) at this test's own Redis."""
    overrides: list[override_settings] = []

    def configure(**options: object) -> None:
        backends = {
            "default": {"ENGINE": "leases.backends.database"},
            "store": {"ENGINE": "leases.backends.redis", "URL": redis_server.url, **options},
        }
        override = override_settings(LEASES={"BACKENDS": backends})
        override.enable()
        overrides.append(override)

    yield configure
    for override in reversed(overrides):
        override.disable()


def successor(name: str) -> Lease:
    """Acquire ``name`` from another thread (this one still counts as the old holder)."""
    box: list[Lease | BaseException] = []

    def run() -> None:
        try:
            box.append(acquire(name, ttl=10, backend="store", timeout=10, holder="successor"))
        except BaseException as exc:  # handed back to the test
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert box, "the successor's acquire never returned"
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def test_client_pause_past_the_ttl_never_lets_the_holder_believe_it_holds(
    redis_server: RedisServer, on_server: Callable[..., None]
) -> None:
    """``CLIENT PAUSE`` for 2 x TTL: the renewals sent meanwhile wait in the server (the
    socket timeout is longer than the pause), yet the holder gives the lease up when its own
    validity ends, not when the server answers; the late renewal revives nothing."""
    on_server(SOCKET_TIMEOUT=5.0)
    ttl, register, name = 1.0, checker.new_register(), f"pause-{uuid.uuid4().hex[:8]}"
    lost_at: list[float] = []
    old = acquire(
        name, ttl=ttl, backend="store", on_lost=lambda _: lost_at.append(time.monotonic())
    )
    assert checker.record_write(register, old, "old")
    admin = redis.Redis.from_url(redis_server.url)
    paused_at = time.monotonic()
    admin.execute_command("CLIENT", "PAUSE", int(2 * ttl * 1000), "ALL")  # type: ignore[no-untyped-call]
    believed_until = paused_at
    while time.monotonic() < paused_at + 2 * ttl:  # bounded: the pause's length
        now, left = time.monotonic(), old.remaining()
        if left > 0:
            believed_until = max(believed_until, now + left)
        time.sleep(0.005)
    # No renewal can complete during the pause, so no belief outlives the last one sent before.
    assert believed_until <= paused_at + ttl + 0.05, believed_until - paused_at
    wait_until(lambda: lost_at, 5, "on_lost")
    assert lost_at[0] - paused_at <= ttl + 0.5, "the loss was learnt from the server, late"
    with pytest.raises(LeaseLost):
        old.ensure_held()
    new = successor(name)
    assert new.token > old.token
    assert checker.record_write(register, new, "new")
    assert not checker.record_write(register, old.token, "old")
    time.sleep(0.2)  # any renewal still queued from the pause has been answered by now
    assert old.remaining() == 0 and new.remaining() > 0
    # Without decode_responses, redis-py reads bytes.
    info = cast(
        "bytes | None",
        redis.Redis.from_url(redis_server.url).get(LeaseKeys.of("leases:", name).lock),
    )
    assert info is not None and info.endswith(b":successor")
    new.release()
    summary = checker.check_history(register, [old.token, new.token])
    assert summary.stale == 1


def fill_until_gone(client: redis.Redis, key: str, seconds: float = 30) -> int:
    """Write junk until ``key`` is evicted; how many junk keys it took (bounded in time)."""
    junk, value = 0, b"x" * 8192
    deadline = time.monotonic() + seconds
    while client.exists(key):
        assert time.monotonic() < deadline, f"{key} survived {junk} junk keys"
        pipe = client.pipeline(transaction=False)
        for _ in range(64):
            pipe.set(f"junk:{junk}", value)
            junk += 1
        pipe.execute()
    return junk


def test_an_evicted_lease_is_reported_lost_and_fenced(
    redis_server: RedisServer, on_server: Callable[..., None]
) -> None:
    """``allkeys-lru`` under memory pressure evicts the lease's key: the next renewal finds it
    gone and reports the loss; the successor's token is higher (an evicted counter costs a
    new epoch, never a repeated token) and the old holder's write is refused."""
    on_server(SOCKET_TIMEOUT=1.0)
    admin = redis.Redis.from_url(redis_server.url)
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", used + 4 * 1024 * 1024)
    admin.config_set("maxmemory-policy", "allkeys-lru")
    ttl, register, name = 3.0, checker.new_register(), f"evict-{uuid.uuid4().hex[:8]}"
    old = acquire(name, ttl=ttl, backend="store")
    assert checker.record_write(register, old, "old")
    fill_until_gone(admin, LeaseKeys.of("leases:", name).lock)
    assert old.lost.wait(ttl + 1), "the eviction was never reported"
    assert old.lost_reason is not None and old.lost_reason.startswith("renewal refused")
    new = successor(name)
    assert new.token > old.token
    assert checker.record_write(register, new, "new")
    assert not checker.record_write(register, old.token, "old")
    new.release()
    checker.check_history(register, [old.token, new.token])


def test_plain_check_warns_about_an_evicting_policy(
    redis_server: RedisServer, on_server: Callable[..., None]
) -> None:
    """Not only ``--deploy``: the policy is the server's, invisible in the settings."""
    on_server(SOCKET_TIMEOUT=1.0)
    assert not [m for m in run_checks() if m.id == "leases.W004"]
    redis.Redis.from_url(redis_server.url).config_set("maxmemory-policy", "allkeys-lru")
    (warning,) = [m for m in run_checks() if m.id == "leases.W004"]
    assert "'store'" in warning.msg and "allkeys-lru" in warning.msg
    assert "noeviction" in (warning.hint or "")
