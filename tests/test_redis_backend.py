"""The Redis backend against real redis-server processes: grants, expiry, wake-ups, fencing.

Tests that kill, pause or fail over a server use servers of their own (``redis_server``,
``redis_servers``); the rest use the run's shared Redis with names no other test uses.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import redis
import redis.asyncio
from redis.crc import key_slot

from devservers import RedisServer
from leases import LeaseUnavailable, acquire, conf
from leases.acquiring import STOP_READERS_EVERY
from leases.backends._redis_io import SERVER_TICK
from leases.backends._redis_scripts import WAKE_TTL_MS
from leases.backends._redis_shared import STOP_READERS_LUA
from leases.backends.base import Grant
from leases.backends.redis import (
    ACQUIRE_LUA,
    COUNTER_BITS,
    RELEASE_LUA,
    Backend,
    LeaseKeys,
    Reply,
    owner_args,
)
from leases.errors import BackendUnavailable, LeaseLost, LeaseNotHeld, LeasesImproperlyConfigured
from tests import checker
from tests.extra_backends import added_backend
from tests.lease_backends import wait_overshoots
from tests.waiting import released_past_blocked_waits, stalled, stalled_handover, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

MakeBackend = Callable[..., Backend]


def unique(prefix: str = "r") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_backend() -> Iterator[MakeBackend]:
    """Backends on a URL (the shared Redis unless given), closed after the test."""
    made: list[Backend] = []

    def make(url: str | None = None, **options: object) -> Backend:
        backend = Backend(
            "redis-test", {"URL": url or os.environ["REDIS_URL"], "SOCKET_TIMEOUT": 1.0, **options}
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def stored_value(grant: Grant) -> str:
    """The lock value of ``grant``: its epoch, counter, the SHA-1 of its secret, its holder."""
    digest = hashlib.sha1(grant.secret.encode(), usedforsecurity=False).hexdigest()
    epoch, counter = grant.token >> COUNTER_BITS, grant.token & (2**COUNTER_BITS - 1)
    return f"{epoch}:{counter}:{digest}:{grant.holder}"


def test_redis_keeps_a_hash_of_the_secret_never_the_secret(make_backend: MakeBackend) -> None:
    backend, name = make_backend(), unique()
    grant = backend.try_acquire(name, "a", 5)
    assert grant is not None and len(grant.secret) == 32
    keys = LeaseKeys.of(backend.prefix, name)
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    # Without decode_responses, redis-py reads bytes.
    lock = cast("bytes | None", client.get(keys.lock))
    fence = cast("dict[bytes, bytes]", client.hgetall(keys.fence))
    stored = (lock or b"") + b"".join(fence.values())
    assert grant.secret.encode() not in stored
    assert client.get(keys.lock) == stored_value(grant).encode()
    backend.release(grant)


def test_tokens_increase_and_a_held_name_is_busy(make_backend: MakeBackend) -> None:
    backend, name = make_backend(), unique()
    first = backend.try_acquire(name, "a", 5)
    assert first is not None
    assert backend.try_acquire(name, "b", 5) is None
    backend.release(first)
    tokens = [first.token]
    for holder in ("b", "c", "d"):
        grant = backend.try_acquire(name, holder, 5)
        assert grant is not None and grant.holder == holder
        tokens.append(grant.token)
        backend.release(grant)
    checker.check_grants(tokens)
    assert [t & (2**COUNTER_BITS - 1) for t in tokens] == [1, 2, 3, 4]


def test_release_after_expiry_keeps_successor(make_backend: MakeBackend) -> None:
    backend, name = make_backend(), unique()
    old = backend.try_acquire(name, "old", 0.05)
    assert old is not None
    time.sleep(0.1)
    new = backend.try_acquire(name, "new", 5)
    assert new is not None and new.token > old.token
    with pytest.raises(LeaseLost):
        backend.release(old)
    with pytest.raises(LeaseLost):
        backend.renew(old, 5)
    keys = LeaseKeys.of(backend.prefix, name)
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    # The compare-and-delete itself answers "not yours" and leaves the key alone.
    script = client.register_script(RELEASE_LUA)
    assert (
        script(keys=[keys.lock, keys.wake], args=[*cast("list[str]", owner_args(old)), 1])
        == Reply.LOST
    )
    assert client.get(keys.lock) == stored_value(new).encode()
    info = backend.inspect(name)
    assert info is not None and info.held and info.holder == "new" and info.token == new.token
    backend.release(new)


def test_renew_extends_on_the_servers_clock(make_backend: MakeBackend) -> None:
    backend, name = make_backend(), unique()
    grant = backend.try_acquire(name, "a", 1)
    assert grant is not None
    for _ in range(3):  # 1.5 s in all: only the renewals keep the 1 s lease
        time.sleep(0.5)
        grant = backend.renew(grant, 1)
    assert backend.try_acquire(name, "b", 1) is None
    time.sleep(1.1)
    with pytest.raises(LeaseLost):
        backend.renew(grant, 1)


def test_every_release_leaves_one_wake_up_lasting_the_wake_ttl(make_backend: MakeBackend) -> None:
    """A waiter between its failed try and its ``BLPOP`` must find the release's wake-up for at
    least ``WAKE_TTL_MS``. A release that finds one still there pushes no second one (one
    release wakes one waiter), but renews it once less than that is left."""
    backend, name = make_backend(), unique()
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    wake = LeaseKeys.of(backend.prefix, name).wake
    for round_ in range(6):
        if round_ == 3:
            client.pexpire(wake, 50)  # a wake-up near the end of its life
        grant = backend.try_acquire(name, "a", 5)
        assert grant is not None
        backend.release(grant)
        assert client.llen(wake) == 1
        assert client.pttl(wake) > WAKE_TTL_MS - 1000  # (slack for a loaded machine)


def test_a_release_between_the_failed_try_and_the_wait_wakes_the_wait(
    make_backend: MakeBackend,
) -> None:
    backend, name = make_backend(), unique()
    holder = backend.try_acquire(name, "a", 30)
    assert holder is not None
    assert backend.try_acquire(name, "b", 30) is None  # the waiter's failed try
    backend.release(holder)
    assert backend.wait_for_release(name, 10) is True  # the wake-up waited for it


def test_a_wait_blocked_after_a_spent_wake_up_is_woken_by_the_next_release(
    make_backend: MakeBackend,
) -> None:
    """A release pushes a wake-up only when the list is missing: then it must, since a
    blocked waiter means an empty (so missing) list. A 30 s grant and a 10 s wait: only the
    release can end the wait with ``True``."""
    backend, name = make_backend(), unique()
    first = backend.try_acquire(name, "a", 30)
    assert first is not None
    backend.release(first)  # leaves a wake-up nobody takes yet
    second = backend.try_acquire(name, "a", 30)
    assert second is not None
    assert backend.wait_for_release(name, 5) is True  # that stale one, at once
    woken: list[bool] = []
    waiter = threading.Thread(target=lambda: woken.append(backend.wait_for_release(name, 10)))
    waiter.start()
    try:
        blocked = lambda: any(w.name == name for w in backend.waiters())  # noqa: E731
        wait_until(blocked, 10, "the wait blocked in BLPOP")
        backend.release(second)
    finally:
        waiter.join(15)
    assert woken == [True]


def test_wait_returns_false_on_timeout(make_backend: MakeBackend) -> None:
    backend, name = make_backend(), unique()
    assert backend.try_acquire(name, "a", 30) is not None
    assert backend.wait_for_release(name, 0.1) is False


def test_keys_of_a_name_share_one_cluster_slot() -> None:
    for name in ("plain", "with{braces}", "}{", "{", "%7B", "x" * 255, "ünï"):
        keys = LeaseKeys.of("leases:", name)
        slots = {key_slot(k.encode()) for k in (keys.lock, keys.fence, keys.wake)}
        assert len(slots) == 1, name
        assert LeaseKeys.name_of("leases:", keys.fence) == name
    assert LeaseKeys.of("leases:", "{").lock != LeaseKeys.of("leases:", "%7B").lock


def test_inspect_force_release_and_inspect_all(make_backend: MakeBackend) -> None:
    backend, name = make_backend(PREFIX=f"{unique('p')}:"), unique()
    assert backend.inspect(name) is None
    grant = backend.try_acquire(name, "a", 30)
    assert grant is not None
    info = backend.inspect(name)
    assert info is not None and info.held and (info.holder, info.token) == ("a", grant.token)
    after = backend.force_release(name, grant.token)
    assert after is not None and not after.held and after.token > grant.token
    with pytest.raises(LeaseLost):
        backend.renew(grant, 5)
    successor = backend.try_acquire(name, "b", 5)
    assert successor is not None and successor.token > after.token
    assert [i.name for i in backend.inspect_all()] == [name]


def test_a_grant_held_longer_than_its_counter_is_kept_is_listed_and_revoked(
    make_backend: MakeBackend,
) -> None:
    """Counters expire (a day after the latest grant) while a keepalive may hold a grant for
    longer: such a grant is still listed, and force release still frees it by its lock, and
    the next grant's token is above the revoked one."""
    backend, name = make_backend(PREFIX=f"{unique('p')}:"), unique()
    grant = backend.try_acquire(name, "a", 30)
    assert grant is not None
    backend.client.delete(LeaseKeys.of(backend.prefix, name).fence)  # as if it expired
    assert [i.name for i in backend.inspect_all()] == [name]
    with pytest.raises(LeaseNotHeld):
        backend.force_release(name, grant.token + 1)  # not the token it holds
    after = backend.force_release(name, grant.token)
    assert not after.held and after.token == grant.token + 1
    with pytest.raises(LeaseLost):
        backend.renew(grant, 5)
    successor = backend.try_acquire(name, "b", 5)
    assert successor is not None and successor.token > after.token


def test_bad_options_are_configuration_errors() -> None:
    with pytest.raises(LeasesImproperlyConfigured):
        Backend("x", {})
    with pytest.raises(LeasesImproperlyConfigured):
        Backend("x", {"URL": "redis://127.0.0.1:1/0", "CACHE": "default"})
    with pytest.raises(LeasesImproperlyConfigured):
        Backend("x", {"URL": "redis://127.0.0.1:1/0", "NODES": []})
    with pytest.raises(LeasesImproperlyConfigured):
        Backend("x", {"URL": "redis://127.0.0.1:1/0", "PREFIX": "a*"})


def test_unreachable_server_is_backend_unavailable(make_backend: MakeBackend) -> None:
    server = RedisServer()  # never started: nothing listens on its port
    backend = make_backend(server.url)
    with pytest.raises(BackendUnavailable):
        backend.try_acquire(unique(), "a", 1)


@pytest.mark.fault
def test_eviction_policy_warns_only_when_asked(
    make_backend: MakeBackend, redis_server: RedisServer
) -> None:
    backend = make_backend(redis_server.url)
    assert backend.store_checks() == []
    redis.Redis.from_url(redis_server.url).config_set("maxmemory-policy", "allkeys-lru")
    (problem,) = backend.store_checks()
    assert "allkeys-lru" in problem
    assert backend.deploy_checks() == []  # reported once, by the plain check (leases.W004)


@pytest.mark.fault
def test_killed_and_restarted_empty_tokens_keep_increasing(
    make_backend: MakeBackend, redis_server: RedisServer
) -> None:
    backend, name, register = make_backend(redis_server.url), unique(), checker.new_register()
    grants = []
    for restart in range(3):
        for holder in ("a", "b"):
            grant = backend.try_acquire(name, f"{holder}{restart}", 5)
            assert grant is not None
            grants.append(grant.token)
            assert checker.record_write(register, grant.token, grant.holder)
            if holder == "a":
                backend.release(grant)
        stale = cast(Grant, grant)  # still "held" when the server dies with everything it knew
        redis_server.restart("kill")
        assert backend.inspect(name) is None  # the server really came back empty
    fresh = backend.try_acquire(name, "after", 5)
    assert fresh is not None
    grants.append(fresh.token)
    assert checker.record_write(register, fresh.token, "after")
    assert not checker.record_write(register, stale.token, stale.holder)
    summary = checker.check_history(register, grants)
    assert summary.stale == 1 and summary.highest == fresh.token


@pytest.mark.fault
def test_stalled_server_past_ttl_one_holder_proceeds(
    make_backend: MakeBackend, redis_server: RedisServer
) -> None:
    backend, name, register = make_backend(redis_server.url), unique(), checker.new_register()
    old = backend.try_acquire(name, "old", 0.5)
    assert old is not None and checker.record_write(register, old.token, "old")
    redis_server.pause()
    try:
        with pytest.raises(BackendUnavailable):  # the holder cannot renew while Redis hangs
            backend.renew(old, 0.5)
        time.sleep(0.6)
    finally:
        redis_server.resume()
    new = backend.try_acquire(name, "new", 5)
    assert new is not None and new.token > old.token
    assert backend.try_acquire(name, "third", 5) is None  # exactly one proceeds
    with pytest.raises(LeaseLost):
        backend.renew(old, 0.5)
    assert checker.record_write(register, new.token, "new")
    assert not checker.record_write(register, old.token, "old")
    checker.check_history(register, [old.token, new.token])


@pytest.mark.fault
def test_failover_to_a_lagging_replica_never_repeats_a_token(
    make_backend: MakeBackend, redis_servers: Callable[[int], list[RedisServer]]
) -> None:
    primary, replica = redis_servers(2)
    redis.Redis.from_url(primary.url).config_set("repl-diskless-sync-delay", 0)  # sync now
    client = redis.Redis.from_url(replica.url)
    client.replicaof("127.0.0.1", primary.port)
    backend, name = make_backend(primary.url), unique()
    tokens = []
    for _ in range(2):
        grant = backend.try_acquire(name, "a", 5)
        assert grant is not None
        tokens.append(grant.token)
        backend.release(grant)
    keys = LeaseKeys.of(backend.prefix, name)
    deadline = time.monotonic() + 10
    while client.hget(keys.fence, "counter") != b"2" and time.monotonic() < deadline:
        time.sleep(0.02)
    # Promoted with counter 2 while the old primary goes on granting 3 and 4 (they are lost to
    # the replica, as the last writes are in an asynchronous failover).
    client.replicaof("no", "one")
    for _ in range(2):
        grant = backend.try_acquire(name, "a", 5)
        assert grant is not None
        tokens.append(grant.token)
        backend.release(grant)
    primary.stop("kill")
    assert client.hget(keys.fence, "counter") == b"2"
    promoted = make_backend(replica.url).try_acquire(name, "b", 5)
    assert promoted is not None
    tokens.append(promoted.token)
    checker.check_grants(tokens)


def test_acquire_script_asks_for_an_epoch_when_the_counter_is_missing() -> None:
    """A refused grant writes no lock and no counter, only its reservation, which expires."""
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    keys = LeaseKeys.of(f"{unique('p')}:", "n")
    script = client.register_script(ACQUIRE_LUA)
    args: list[str | int] = ["h", 1000, 0, 2**32 - 1, "secret", "source"]
    code, stored, run, nonce = script(keys=[keys.lock, keys.fence], args=args)
    assert (Reply(code), stored) == (Reply.NEED_EPOCH, b"0")
    assert client.exists(keys.lock) == 0
    assert client.hgetall(keys.fence) == {b"reserved": run + b":" + nonce}
    assert client.pttl(keys.fence) > 0


def test_names_granted_and_released_leave_no_key_that_never_expires(
    make_backend: MakeBackend, redis_server: RedisServer
) -> None:
    """Every name ever granted used to leave its ``:fence`` counter forever, so names made of
    ever-changing things (``invoice:81723``) grew Redis without bound (under ``noeviction``,
    until writes failed); now each grant keeps it a day, or ten TTLs, longer."""
    backend = make_backend(redis_server.url)
    for i in range(5):
        grant = backend.try_acquire(f"invoice:{i}", "worker", 5)
        assert grant is not None
        backend.release(grant)
    client = redis.Redis.from_url(redis_server.url)
    keys = list(client.scan_iter(count=1000))
    assert keys and all(client.pttl(key) > 0 for key in keys)
    fence = LeaseKeys.of(backend.prefix, "invoice:0").fence
    assert 86_400_000 - 60_000 < client.pttl(fence) <= 86_400_000


def _count_sends(backend: Any) -> list[object]:
    """What ``backend``'s client sends from now on, one entry per round trip (a command or a
    pipeline), on connections it makes from now on (make none before: a connection already
    made keeps its class)."""
    sent: list[object] = []
    pool = backend.client.connection_pool

    class Counting(pool.connection_class):  # type: ignore[name-defined,misc]
        def send_packed_command(self, command: object, *args: object, **kwargs: object) -> None:
            sent.append(command)
            super().send_packed_command(command, *args, **kwargs)

    pool.disconnect()
    pool.connection_class = Counting
    return sent


def test_one_round_trip_each_for_acquire_renew_release(make_backend: MakeBackend) -> None:
    backend, name = make_backend(), unique()
    sent = _count_sends(backend)
    first = backend.try_acquire(name, "warm-up", 5)  # a new name: + epoch, + script loads
    assert first is not None
    backend.release(backend.renew(first, 5))
    counts = []
    for step in ("acquire", "renew", "release"):
        sent.clear()
        if step == "acquire":
            grant = cast(Grant, backend.try_acquire(name, "a", 5))  # the name is free
        elif step == "renew":
            grant = backend.renew(grant, 5)
        else:
            backend.release(grant)
        counts.append(len(sent))
    assert counts == [1, 1, 1]


def _packed(command: object) -> bytes:
    """The bytes of a command as redis-py sends it (bytes, or a list of chunks)."""
    if isinstance(command, (bytes, bytearray, memoryview)):
        return bytes(command)
    assert isinstance(command, (list, tuple))
    return b"".join(bytes(chunk) for chunk in command)


def test_listing_scans_once_and_inspects_in_batches(make_backend: MakeBackend) -> None:
    """``inspect_all`` (the admin's page, ``leases list``) scanned the keyspace twice, once
    for counters and once for grants (the whole database both times: ``SCAN MATCH`` filters
    after reading), then inspected each name in a round trip of its own: 300 names cost 302
    round trips, which on a Redis shared with a cache of millions of keys is a page that
    takes seconds. One scan, and the names inspected in pipelined batches."""
    backend = make_backend(PREFIX=f"{unique('p')}:")
    names = [f"listed:{i:03d}" for i in range(300)]
    grants = {name: backend.try_acquire(name, "a", 30) for name in names}
    for name in names[::2]:  # half free again: listed by their counters alone
        grant = grants[name]
        assert grant is not None
        backend.release(grant)
    backend.client.delete(LeaseKeys.of(backend.prefix, names[1]).fence)  # a lock alone
    lister = make_backend(PREFIX=backend.prefix)  # no connection made yet: all are counted
    sent = _count_sends(lister)
    lister.client.ping()  # the connection's handshake, not the listing's
    sent.clear()
    listed = lister.inspect_all()
    assert [info.name for info in listed] == names
    assert [info.held for info in listed] == [i % 2 == 1 for i in range(300)]
    assert all(info.token == grants[info.name].token for info in listed)  # type: ignore[union-attr]
    scans = [_packed(c) for c in sent if b"SCAN" in _packed(c)[:40]]
    passes = [c for c in scans if b"SCAN\r\n$1\r\n0\r\n" in c]  # from cursor 0: a new pass
    assert len(passes) == 1, f"{len(passes)} passes over the keyspace"
    assert len(sent) - len(scans) <= 1, f"{len(sent) - len(scans)} round trips for 300 names"


def test_a_forked_child_never_ends_the_parents_database_session(make_backend: MakeBackend) -> None:
    backend = make_backend()
    assert backend.try_acquire(unique(), "parent", 5) is not None  # the epoch counter connected
    pid = os.fork()
    if pid == 0:  # the child: take its own epoch, then close everything, as at shutdown
        code = 1
        try:
            code = 0 if backend.try_acquire(unique(), "child", 5) is not None else 3
            backend.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert backend.try_acquire(unique(), "parent", 5) is not None  # its session still works


@pytest.mark.fault
def test_a_wait_ends_at_its_deadline_on_an_idle_server(
    make_backend: MakeBackend, redis_server: RedisServer
) -> None:
    """An idle Redis fires a ``BLPOP`` timeout only at its next timer tick (up to 100 ms
    late); the wait must end by the caller's deadline all the same. It is told to time out a
    tick early, so it ends on the server (keeping its connection: see
    ``tests/test_redis_waits.py``) between a tick before the deadline and the deadline. Median
    of seven, so one descheduled sample on a loaded machine does not decide; the tick's
    lateness would."""
    backend, name = make_backend(redis_server.url), unique()
    late = wait_overshoots(backend, name)
    assert late[0] > -(SERVER_TICK + 0.005) and late[3] <= 0.05, late


@pytest.mark.fault
def test_a_kept_connection_the_server_closed_is_reconnected_before_its_next_use(
    make_backend: MakeBackend, redis_server: RedisServer
) -> None:
    """The backend keeps its connections between round trips; one the server closed while it
    sat idle (a restart) is noticed and replaced before anything is sent on it, so the restart
    costs no failed acquire, and the next token is still higher (a new epoch)."""
    backend, name = make_backend(redis_server.url), unique()
    first = backend.try_acquire(name, "a", 5)
    assert first is not None
    backend.release(first)
    redis_server.restart("kill")
    second = backend.try_acquire(name, "a", 5)  # no BackendUnavailable
    assert second is not None and second.token > first.token
    backend.release(second)


def test_text_arguments_reach_the_server_as_utf8(make_backend: MakeBackend) -> None:
    """Commands are packed by the backend itself: non-ASCII names and holders arrive intact."""
    backend, name, holder = make_backend(), unique("ключ-☃"), "держатель-✓"
    grant = backend.try_acquire(name, holder, 5)
    assert grant is not None
    info = backend.inspect(name)
    assert info is not None and info.holder == holder and info.token == grant.token
    backend.release(grant)
    assert backend.try_acquire(name, holder, 5) is not None


def stop_signs_sent(client: redis.Redis) -> int:
    """How many stop-readers scripts the server ran, from its slow log (every command logged)."""
    sha = hashlib.sha1(STOP_READERS_LUA.encode(), usedforsecurity=False).hexdigest().encode()
    logged = client.slowlog_get(100_000)
    return sum(1 for entry in logged if entry["command"].split()[:2] == [b"EVALSHA", sha])


def test_a_writer_waiting_behind_a_writer_sends_no_stop_sign_for_readers(
    redis_server: RedisServer,
) -> None:
    """A waiting writer sends a stop sign of its own only while readers hold the name: behind
    another writer its tries are all it sends, however long it waits, and on a name readers
    never used they write nothing either; behind readers it stops them at once. Behind a
    writer on a name readers use, its refused tries stamp ``:writer`` themselves, so readers
    that come after it cannot start a group when that writer leaves (test_shared_leases)."""
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 100_000)
    config = {"ENGINE": "leases.backends.redis", "URL": redis_server.url, "SOCKET_TIMEOUT": 2.0}
    name = unique()
    writer_key = LeaseKeys.of("leases:", name).writer
    with added_backend("redis-stop-signs", config) as alias:
        held = acquire(name, ttl=10, backend=alias, holder="w1", keepalive=False)
        client.slowlog_reset()
        with pytest.raises(LeaseUnavailable):  # waits past two STOP_READERS_EVERY periods
            acquire(name, ttl=10, backend=alias, timeout=3 * STOP_READERS_EVERY, holder="w2")
        assert stop_signs_sent(client) == 0
        assert client.exists(writer_key) == 0  # a stamp lasts a second: none was written
        held.release()
        reader = acquire(name, ttl=10, backend=alias, holder="r1", shared=True, keepalive=False)
        with pytest.raises(LeaseUnavailable):
            acquire(name, ttl=10, backend=alias, timeout=STOP_READERS_EVERY / 2, holder="w2")
        assert stop_signs_sent(client) >= 1
        reader.release()
        held = acquire(name, ttl=10, backend=alias, holder="w1", keepalive=False)
        client.delete(writer_key)
        client.slowlog_reset()
        with pytest.raises(LeaseUnavailable):
            acquire(name, ttl=10, backend=alias, timeout=3 * STOP_READERS_EVERY, holder="w2")
        assert stop_signs_sent(client) == 0
        assert client.pttl(writer_key) > 0  # stamped by its refused tries, a name readers use
        held.release()


def test_an_async_round_trip_on_a_stalled_event_loop_reads_the_reply_that_came_in_time(
    make_backend: MakeBackend,
) -> None:
    """The event loop blocks right after the server ran the script, for longer than the
    round trip's timeout but well within the TTL: the reply came in time and waits in the
    socket, so the try is granted, the renewal renews and the release releases. A stall past
    the TTL gives a grant with no validity left (counted from when the script was sent: the
    lease layer holds it as lost at once). The round trip is bounded by cutting its socket on
    a timer of the loop, which runs after the loop read what the socket holds."""
    backend, name = make_backend(SOCKET_TIMEOUT=0.3), unique()
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    lock = LeaseKeys.of(backend.prefix, name).lock
    stall, drift = 0.8, (conf.get().drift_factor, conf.get().drift_min)

    async def main() -> tuple[Grant, Grant]:
        held = lambda: client.exists(lock)  # noqa: E731
        freed = lambda: not client.exists(lock)  # noqa: E731
        renewed = lambda: client.pttl(lock) > 10_000  # noqa: E731
        try:
            a, b = await stalled_handover(
                backend, name, stall, held=held, renewed=renewed, freed=freed
            )
            late = await stalled(backend.atry_acquire(name, "L", 0.5), held, 1.0, "the acquire")
            assert late is not None  # granted, but the loop ran again past its TTL: no validity
            assert time.monotonic() >= late.valid_until(*drift), late
            return a, b
        finally:
            await backend.aclose()

    a, b = asyncio.run(main())
    checker.check_handover(a.token, b.token)


@pytest.mark.parametrize("phase", ["tcp", "handshake"])
def test_an_async_connect_on_a_stalled_event_loop_leaves_the_round_trip_its_full_bound(
    make_backend: MakeBackend,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
) -> None:
    """The event loop blocks for longer than SOCKET_TIMEOUT (a blocking call in a callback of
    its own) while a new connection is being made: queued as its TCP connect starts, or as it
    ends (the handshake then in flight). The connect completed in time, while the loop was not
    looking, and the server answers the script at once: the try, the renewal and the release,
    each on a new connection (the kept one killed before it), succeed. The stall used to be
    charged to the script's reply, whose bound was what the connect had left of one timeout:
    none, so its socket was cut before the reply was read ("no reply")."""
    timeout, stall = 0.3, 1.0
    backend, name = make_backend(redis_server.url, SOCKET_TIMEOUT=timeout), unique()
    client = redis.Redis.from_url(redis_server.url)
    connect = redis.asyncio.Connection._connect
    connects: list[object] = []

    async def stalling(connection: Any) -> None:
        connects.append(connection)
        if phase == "tcp":  # the loop's next turn blocks, the connect under way
            asyncio.get_running_loop().call_soon(time.sleep, stall)
        await connect(connection)  # type: ignore[no-untyped-call]  # unannotated in redis-py
        if phase == "handshake":
            asyncio.get_running_loop().call_soon(time.sleep, stall)

    monkeypatch.setattr(redis.asyncio.Connection, "_connect", stalling)

    def kill_kept_connection() -> None:  # ours, idle; the test's own client survives
        assert client.client_kill_filter(_type="normal", skipme=True) >= 1

    async def main() -> tuple[Grant, Grant]:
        try:
            a = await backend.atry_acquire(name, "A", 10)
            assert a is not None
            kill_kept_connection()
            a = await backend.arenew(a, 30)
            kill_kept_connection()
            await backend.arelease(a)
            assert not client.exists(LeaseKeys.of(backend.prefix, name).lock)
            b = await backend.atry_acquire(name, "B", 10)
            assert b is not None
            await backend.arelease(b)
            return a, b
        finally:
            await backend.aclose()

    a, b = asyncio.run(main())
    assert len(connects) == 3, connects  # one stall for each new connection
    checker.check_handover(a.token, b.token)


def test_more_async_waiters_than_redis_py_pools_allow_leave_room_for_the_release(
    make_backend: MakeBackend, redis_server: RedisServer
) -> None:
    """redis.asyncio (like redis-py, 6.0 on) caps a pool at 100 connections by default. An
    event loop with that many waits blocked on the server must still reach it: the waits past
    the cap failed at once, and a release that got no connection left the name held for a
    whole TTL (every waiter timing out meanwhile)."""
    backend, name = make_backend(redis_server.url), unique()
    client = redis.Redis.from_url(redis_server.url)
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
    assert not client.exists(LeaseKeys.of(backend.prefix, name).lock)
    assert all(type(outcome) is bool for outcome in woken), woken
    assert any(woken)


def test_more_waiters_than_redis_py_pools_allow_leave_room_for_the_release(
    make_backend: MakeBackend, redis_server: RedisServer
) -> None:
    """redis-py (6.0 on) caps a pool at 100 connections by default. A process with that many
    threads waiting on the server must still reach it: the waits past the cap failed at once,
    and a release that got no connection left the name held for a whole TTL."""
    backend, name = make_backend(redis_server.url), unique()
    client = redis.Redis.from_url(redis_server.url)
    grant = backend.try_acquire(name, "holder", 30)
    assert grant is not None
    waits = 110
    woken: list[object] = []

    def wait() -> None:
        try:
            woken.append(backend.wait_for_release(name, 3))
        except BackendUnavailable as exc:
            woken.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(waits)]
    for thread in threads:
        thread.start()
    try:
        wait_until(
            lambda: sum(c["cmd"] == "blpop" for c in client.client_list()) + len(woken) >= waits,
            10,
            f"{waits} waits blocked on the server or ended",
        )
        backend.release(grant)  # BackendUnavailable when the pool had no connection left
        assert not client.exists(LeaseKeys.of(backend.prefix, name).lock)
    finally:
        for thread in threads:
            thread.join(10)
    assert len(woken) == waits and all(type(outcome) is bool for outcome in woken), woken
    assert any(woken)


def test_the_deploy_advice_reads_its_sample_in_one_round_trip(make_backend: MakeBackend) -> None:
    """``check --deploy``'s look for another project's counters under ``PREFIX`` read its
    sample of up to 100 counters with one ``HGET`` round trip each (and scanned ten keys a
    call, Redis's default, through a database shared with a cache). One pipelined round trip
    for the sample now, and a thousand keys a scan."""
    backend = make_backend(PREFIX=f"{unique('p')}:")
    for i in range(120):
        grant = backend.try_acquire(f"advice:{i:03d}", "a", 30)
        assert grant is not None
        backend.release(grant)
    adviser = make_backend(PREFIX=backend.prefix)  # no connection made yet: all are counted
    sent = _count_sends(adviser)
    adviser.client.ping()  # the connection's handshake, not the look's
    sent.clear()
    assert adviser.deploy_advice() == []
    scans = [_packed(c) for c in sent if b"SCAN" in _packed(c)[:40]]
    assert all(b"COUNT\r\n$4\r\n1000" in scan for scan in scans), scans[:1]
    assert len(sent) - len(scans) <= 1, f"{len(sent) - len(scans)} round trips for the sample"
