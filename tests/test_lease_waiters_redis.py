"""Redis and Redlock waiters are listed (who waits for which name, since when) by the backends
themselves, and the admin's every-backend page shows them beside the database's."""

from __future__ import annotations

import os
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from django.test import Client, override_settings

from devservers import RedisServer
from leases.backends import get_backend
from leases.backends._redis_scripts import LeaseKeys
from leases.backends._redis_waiters import LABEL_PREFIX, WaitClock, distinct, label, waiters
from leases.backends.base import LeaseWaiter
from leases.lease import acquire
from leases.operations import backend_waiters
from tests.test_admin import EVERY_BACKEND, login
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("backend", ["redis", "redlock"])
def test_a_waiter_is_listed_while_it_waits_and_gone_after(backend: str, client: Client) -> None:
    name = f"waited-{{odd}} name-{uuid.uuid4().hex[:8]}"
    held = acquire(name, ttl=30, backend=backend, keepalive=False)
    got: list[Any] = []
    started = datetime.now(UTC)

    def wait_for_it() -> None:
        lease = acquire(name, ttl=30, timeout=20, backend=backend, keepalive=False, holder="w")
        got.append(lease)
        lease.release()

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()

    def listed() -> LeaseWaiter:
        """The one waiter, read while it is blocked (between two BLPOPs it tries again)."""
        found: list[LeaseWaiter] = []

        def one_listed() -> bool:
            found[:] = get_backend(backend).waiters()
            return [w.name for w in found] == [name]

        wait_until(one_listed, 10, f"the waiter to be listed by {backend}")
        return found[0]

    try:
        seen = listed()
        assert seen.backend == backend
        assert seen.who.split(":")[1:] == [str(os.getpid()), str(waiter.ident)]
        assert seen.since is not None
        assert started - timedelta(seconds=2) <= seen.since <= datetime.now(UTC)
        assert "client 127.0.0.1:" in seen.where
        # a wait is a loop of BLPOPs: "since" stays when the wait began
        wait_until(
            lambda: (datetime.now(UTC) - started).total_seconds() > 2.5, 5, "a few BLPOP loops"
        )
        assert listed().since == seen.since
        # read until caught waiting: at one instant the waiter may be between two BLPOPs
        wait_until(
            lambda: [w.name for w in backend_waiters() if w.backend == backend] == [name],
            10,
            f"backend_waiters() to list the {backend} waiter",
        )

        login(client, "view_lease")
        # The page reads the waiters once; the waiter may be between two BLPOPs at that instant
        # (and the page asks every backend first), so read it again until it is caught waiting.
        page = ""

        def page_lists_it() -> bool:
            nonlocal page
            page = client.get(EVERY_BACKEND).content.decode()
            return f'data-backend="{backend}"' in page

        wait_until(page_lists_it, 15, f"the every-backend page to list the {backend} waiter")
        assert f"waiting on {backend}" in page
    finally:
        held.release()
        waiter.join(30)
    assert len(got) == 1
    assert get_backend(backend).waiters() == []


def test_nobody_waiting_says_so(client: Client) -> None:
    """The stores are shared with the other xdist worker, whose tests wait on them for a
    bounded time: the page must say so once nobody waits, not at one chosen instant."""
    login(client, "view_lease")
    wait_until(
        lambda: "Nobody waits for a lease." in client.get(EVERY_BACKEND).content.decode(),
        60,
        "the page to say that nobody waits",
        interval=0.5,
    )


def test_only_blocked_connections_of_this_prefix_count() -> None:
    key = LeaseKeys.of("leases:", "a:{b} c").wake
    named = label(key, 1_700_000_000)
    other = label(LeaseKeys.of("other:", "a").wake, 1_700_000_000)
    listed = [
        {"name": named, "flags": "b", "addr": "127.0.0.1:1"},
        {"name": named, "flags": "N", "addr": "127.0.0.1:2"},  # its wait has ended
        {"name": other, "flags": "b", "addr": "127.0.0.1:3"},  # another backend's prefix
        {"name": "leases-wait:garbage", "flags": "b", "addr": "127.0.0.1:4"},
        {"name": "", "flags": "b", "addr": "127.0.0.1:5"},
    ]
    (found,) = waiters("redis", "leases:", listed, "redis here")
    assert found.name == "a:{b} c"
    assert found.since == datetime.fromtimestamp(1_700_000_000, UTC)
    assert found.where == "redis here (client 127.0.0.1:1)"
    assert " " not in named  # a client name may not hold spaces


@pytest.mark.parametrize("since", ["1e20", "nan", "1e12", "-5", "9" * 30, "1000000000000"])
def test_a_connection_named_like_a_waiter_with_an_impossible_start_is_not_one(since: str) -> None:
    """Any client of the server may name its connection ``leases-wait:...``: a ``since`` that
    ``float()`` took but no ``datetime`` holds raised OverflowError or ValueError here."""
    encoded = label(LeaseKeys.of("leases:", "n").wake, 0).rsplit(":", 1)[1]
    forged = f"{LABEL_PREFIX}{since}:evil:1:2:{encoded}"
    assert waiters("redis", "leases:", [{"name": forged, "flags": "b"}], "redis here") == []


def test_a_foreign_connection_named_like_a_waiter_does_not_break_the_page(
    client: Client, redis_server: RedisServer
) -> None:
    """A client blocked under the name ``leases-wait:1e20:...`` made the every-backend page
    answer 500 for as long as it stayed blocked."""
    backends = {
        "default": {"ENGINE": "leases.backends.database"},
        "redis": {"ENGINE": "leases.backends.redis", "CACHE": "own"},
    }
    caches = {"own": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_server.url}}
    encoded = label(LeaseKeys.of("leases:", "n").wake, 0).rsplit(":", 1)[1]
    forger = redis.Redis.from_url(redis_server.url)
    forger.client_setname(f"{LABEL_PREFIX}1e20:evil:1:2:{encoded}")
    forged = forger.client_id()
    blocked = threading.Thread(target=lambda: forger.blpop(["nothing-here"], timeout=10))
    blocked.start()
    observer = redis.Redis.from_url(redis_server.url)
    wait_until(
        lambda: any("b" in c.get("flags", "") for c in observer.client_list(_type="normal")),
        5,
        "the forged waiter to block",
    )
    login(client, "view_lease")
    try:
        with override_settings(CACHES=caches, LEASES={"BACKENDS": backends}):
            response = client.get(EVERY_BACKEND)
    finally:
        observer.client_unblock(forged)
        blocked.join(15)
        forger.close()
        observer.close()
    assert response.status_code == 200
    assert "Nobody waits for a lease." in response.content.decode()


def test_a_wait_is_listed_once_while_its_previous_blpop_is_not_reaped_yet() -> None:
    """A wait is a loop of ``BLPOP``s; the one dropped at its deadline can still be listed as
    blocked (the server has not read the close yet) beside the next one, on the same server or
    on another Redlock node: one thread, one wait, one entry."""
    named = label(LeaseKeys.of("leases:", "n").wake, 1_700_000_000)
    listed = [
        {"name": named, "flags": "b", "addr": "127.0.0.1:1"},  # dropped, not reaped yet
        {"name": named, "flags": "b", "addr": "127.0.0.1:2"},  # the next BLPOP
    ]
    assert [w.name for w in waiters("redis", "leases:", listed, "redis here")] == ["n"]
    one, other = (waiters("redlock", "leases:", [c], f"node {c['addr']}") for c in listed)
    assert len(distinct([*one, *other])) == 1


def test_a_wait_clock_keeps_a_loop_of_waits_as_one() -> None:
    clock = WaitClock()
    first = clock.since("x", 0.0)
    assert clock.since("x", 0.0) == first
    assert clock.since("y", 0.0) >= first


@pytest.mark.parametrize("engine", ["redis", "redlock"])
def test_a_woken_waiters_connection_goes_back_to_the_pool_under_its_own_name(
    engine: str, redis_server: RedisServer
) -> None:
    """A wait names its connection (``CLIENT SETNAME``) to be listed; on a django-redis cache
    the connection is the application's, and a woken wait gives it back to the pool. The name
    the application gave its connections must be back on it, so its later commands are not
    listed as a lease wait (``CLIENT LIST``) and ``CLIENT GETNAME`` says what it set."""
    import django_redis  # type: ignore[import-untyped]

    caches = {
        "shared": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": redis_server.url,
            "OPTIONS": {"CONNECTION_POOL_KWARGS": {"client_name": "shop-cache"}},
        }
    }
    store = (
        {"ENGINE": "leases.backends.redis", "CACHE": "shared"}
        if engine == "redis"
        else {"ENGINE": "leases.backends.redlock", "NODES": ["shared"]}
    )
    backends = {"default": {"ENGINE": "leases.backends.database"}, "shared-lease": store}
    name = f"pooled-{uuid.uuid4().hex[:8]}"
    direct = redis.Redis.from_url(redis_server.url)
    with override_settings(CACHES=caches, LEASES={"BACKENDS": backends}):
        held = acquire(name, ttl=30, backend="shared-lease", keepalive=False)
        got: list[Any] = []

        def wait_for_it() -> None:
            got.append(acquire(name, ttl=30, timeout=20, backend="shared-lease", keepalive=False))
            got[0].release()

        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        try:
            wait_until(
                lambda: [w.name for w in get_backend("shared-lease").waiters()] == [name],
                10,
                "the waiter blocked in its named BLPOP",
            )
        finally:
            held.release()  # wakes the BLPOP: its connection goes back to the cache's pool
            waiter.join(30)
        assert got, "the waiter never got the lease"
        user = django_redis.get_redis_connection("shared")
        assert user.client_getname() == "shop-cache"
        names = [str(entry.get("name", "")) for entry in direct.client_list()]
        assert not [n for n in names if n.startswith(LABEL_PREFIX)], names
        assert "shop-cache" in names
    direct.close()


@pytest.mark.parametrize("backend", ["redis", "redlock"])
def test_a_woken_wait_leaves_no_reply_behind_for_the_next_command(backend: str) -> None:
    """A wait names its connection and gives the name back in the same packet: two replies
    behind the wake-up's. A read that takes the wake-up's reply and keeps the connection must
    read the name's too, or the next command on that connection reads a stale ``OK`` and every
    reply after it is one late: a second holder was then granted a name already held."""
    store = get_backend(backend)
    for _ in range(12):  # Redlock waits on a random node: cover every node
        name = f"stale-{uuid.uuid4().hex[:8]}"
        held = store.try_acquire(name, "first", 30)
        assert held is not None
        woken: list[bool] = []
        waiter = threading.Thread(target=lambda: woken.append(store.wait_for_release(name, 10)))
        waiter.start()
        wait_until(
            lambda: any(w.name == name for w in store.waiters()), 10, "the wait to be blocked"
        )
        store.release(held)
        waiter.join(15)
        assert woken, "the wait outlived its timeout"
        for node in getattr(store, "nodes", ()):  # Redlock keeps connections between calls
            kept = list(node.connections._idle)
            assert not any(c.can_read(timeout=0) for c in kept), "a reply was left unread"
        again = store.try_acquire(name, "first", 30)
        assert again is not None, "the name was released"
        assert store.try_acquire(name, "second", 30) is None, "granted to two holders at once"
        store.release(again)
