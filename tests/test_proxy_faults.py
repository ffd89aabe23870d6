"""Network faults between the library and its store, on every backend, through the fault proxy.

The holder talks to its servers through :class:`devservers.proxy.FaultProxy` (alias
``"proxied"``); successors and inspection go straight to the same servers (``"direct"``). Every
write goes through the shared fenced register, so "the old holder could not harm its successor"
is checked on the history, not only on the lease objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import pytest
import redis
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.utils import load_backend

from devservers.proxy import FaultProxy
from leases import (
    BackendUnavailable,
    LeaseError,
    LeaseLost,
    LeaseNotHeld,
    LeaseUnavailable,
    aacquire,
    acquire,
    elect,
    lease,
)
from leases.backends import Capability, get_backend
from leases.backends._pgconn import connect
from leases.backends._waiting_room import room_key
from leases.handle import Lease
from leases.keys import split_key
from tests import checker
from tests.lease_backends import lease_name, require
from tests.proxied_backends import Proxied, proxied
from tests.waiting import wait_until

if TYPE_CHECKING:
    from leases.backends.database import Backend as DatabaseBackend

__all__ = ["lease_name", "proxied"]

pytestmark = [pytest.mark.fault, pytest.mark.slow]


def in_thread(fn: Callable[[], Any], timeout: float = 30) -> Any:
    """Run ``fn`` in a thread, bounded: its result, or its exception re-raised here."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # handed back to the test
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert box, f"{fn} still running after {timeout}s: a call with no bound"
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def holder_of(name: str) -> tuple[str, int] | None:
    info = get_backend("direct").inspect(name)
    return (info.holder, info.token) if info is not None and info.held else None


def test_blackholed_renewal_reports_loss_within_the_ttl_and_is_fenced(
    proxied: Proxied, lease_name: str
) -> None:
    """Renewals vanish (no reply, no RST): ``on_lost`` fires within the TTL, the successor's
    write lands, the evicted holder's is refused, and the held renewal, delivered late, does
    not bring the old grant back."""
    ttl, register = 1.5, checker.new_register()
    fired: list[float] = []
    old = acquire(lease_name, ttl=ttl, backend="proxied", on_lost=lambda _: fired.append(0))
    assert checker.record_write(register, old, "old")
    blackholed_at = time.monotonic()
    proxied.each(FaultProxy.blackhole)
    assert old.lost.wait(ttl + 1.0), "on_lost never fired"
    assert time.monotonic() - blackholed_at <= ttl + 0.5
    wait_until(lambda: fired, 5, "on_lost to be called (lost is set just before)")
    assert old.remaining() == 0
    with pytest.raises(LeaseLost):
        old.ensure_held()
    new = acquire(lease_name, ttl=10, backend="direct", timeout=ttl + 5, holder="new")
    assert new.token > old.token
    assert checker.record_write(register, new, "new")
    assert not checker.record_write(register, old, "old")  # it knows it lost
    assert not checker.record_write(register, old.token, "old")  # the fence refuses it
    proxied.each(FaultProxy.pass_through)  # the held renewals reach the servers now
    time.sleep(0.3)
    assert holder_of(lease_name) == ("new", new.token)
    with pytest.raises((LeaseLost, BackendUnavailable)):
        old.release()
    assert holder_of(lease_name) == ("new", new.token)
    new.release()
    summary = checker.check_history(register, [old.token, new.token])
    assert (summary.lost, summary.stale) == (1, 1)


@pytest.mark.parametrize("fault", ["reset", "drop"])
def test_one_reset_or_dropped_reply_keeps_the_lease(
    proxied: Proxied, lease_name: str, fault: str
) -> None:
    """A single network hiccup with validity left is retried: same token, no false loss."""
    if fault == "drop" and proxied.kind == "zookeeper":
        pytest.skip(
            "ZooKeeper: a reply that vanishes from the TCP stream is noticed by kazoo only at its "
            "ping deadline (2/3 of the session timeout) or as an out-of-sequence reply, and either "
            "ends the connection; the lease's validity is bounded by the session timeout, so the "
            "reconnection can use it up and the lease is then (truthfully) reported lost"
        )
    ttl, register = 4.0, checker.new_register()
    lost: list[object] = []
    held = acquire(lease_name, ttl=ttl, backend="proxied", on_lost=lost.append)
    faulted_at = time.monotonic()
    if fault == "reset":
        proxied.each(FaultProxy.reset_all)
    else:
        proxied.each(FaultProxy.drop_next_reply)
    wait_until(
        lambda: held.grant.sent_at > faulted_at + ttl / 3 or held.lost.is_set(),
        3 * ttl,
        "a renewal sent after the fault to succeed",
    )
    assert not lost and not held.lost.is_set(), f"a {fault} with validity left lost the lease"
    held.ensure_held()
    assert holder_of(lease_name) is not None
    assert holder_of(lease_name) == (held.holder, held.token)
    assert checker.record_write(register, held, "holder")
    held.release()
    checker.check_history(register, [held.token])


@pytest.mark.parametrize("end", ["reset", "close"])
def test_a_wait_whose_connections_are_reset_keeps_waiting(
    proxied: Proxied, lease_name: str, end: str
) -> None:
    """A waiter's connections (its watch stream, its listening or blocking connection, its
    room) are reset, or closed cleanly, while it waits with time left: that is a wake-up and
    one failed round trip, not the end of the acquire. The waiter carries on and takes the
    lease when the holder releases. (Before: the database and Redis waiters raised
    ``BackendUnavailable`` from the next try; an etcd watch stream closed mid-way escaped as
    ``requests.ChunkedEncodingError``, past the package's exceptions.)"""
    ending = FaultProxy.reset_all if end == "reset" else FaultProxy.close_all
    holder = acquire(lease_name, ttl=30, backend="direct", keepalive=False, holder="holder")
    outcome: list[BaseException | Lease] = []

    def wait() -> None:
        try:
            outcome.append(acquire(lease_name, ttl=5, backend="proxied", timeout=30))
        except BaseException as exc:  # handed back to the test
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        wait_until(lambda: sum(p.connections for p in proxied.proxies) > 0, 15, "a waiter")
        time.sleep(0.5)  # let its first try fail and its wait begin
        for _ in range(3):
            proxied.each(ending)
            # The next reset only once the waiter is back (its failed round trip and the one
            # retry it allows): a loaded machine once spread that retry over the next reset 0.3 s
            # later, and two resets in one try end any acquire, by design.
            wait_until(lambda: sum(p.connections for p in proxied.proxies) > 0, 15, "its retry")
            time.sleep(0.3)
        assert not outcome, f"the wait ended on a {end}: {outcome}"
    finally:
        holder.release()
    waiter.join(30)
    assert outcome and isinstance(outcome[0], Lease), outcome
    assert outcome[0].token > holder.token
    outcome[0].release()


def test_acquire_reply_held_past_the_ttl_is_not_believed(proxied: Proxied, lease_name: str) -> None:
    """The server grants, the grant's reply arrives after the TTL: the client's validity is
    counted from its own send time, so it must not think it holds (Kleppmann's delayed packet
    on the way back)."""
    ttl = 1.0
    proxied.each(lambda p: p.blackhole(replies_only=True))
    result: list[Lease | BaseException] = []

    def try_it() -> None:
        try:
            result.append(acquire(lease_name, ttl=ttl, backend="proxied", timeout=0))
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=try_it, daemon=True)
    thread.start()
    time.sleep(1.5 * ttl)
    proxied.each(FaultProxy.pass_through)
    thread.join(30)
    assert result, "acquire never returned"
    (outcome,) = result
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, LeaseError), outcome
        return
    assert outcome.remaining() == 0, f"believes it holds for {outcome.remaining():.3f}s more"
    with pytest.raises(LeaseLost):
        outcome.ensure_held()


def test_dropped_release_reply_is_never_reported_released_and_retry_is_safe(
    proxied: Proxied, lease_name: str
) -> None:
    ttl, register = 2.0, checker.new_register()
    held = acquire(lease_name, ttl=ttl, backend="proxied", keepalive=False)
    proxied.each(FaultProxy.drop_next_reply)
    outcome: list[object] = []

    def release() -> None:
        try:
            held.release()
            outcome.append("released")
        except LeaseError as exc:
            outcome.append(exc)

    in_thread(release, timeout=3 * ttl)
    (first,) = outcome
    if first == "released":
        # Claiming success is honest only if it is true.
        assert holder_of(lease_name) is None
    successor = acquire(lease_name, ttl=10, backend="direct", timeout=ttl + 5, holder="next")
    assert checker.record_write(register, successor, "next")
    with pytest.raises((LeaseLost, BackendUnavailable)):
        in_thread(held.release, timeout=3 * ttl)  # a retry never deletes the successor's
    assert holder_of(lease_name) == ("next", successor.token)
    assert not checker.record_write(register, held.token, "old")
    successor.release()
    checker.check_history(register, [held.token, successor.token])
    # A retry that got no answer leaves the loss to the watchdog (within the short TTL): let
    # it be reported in this test, not inside a later test's log capture.
    assert held.done or held.lost.wait(3 * ttl)


@pytest.mark.parametrize("proxied", ["redlock"], indirect=True)
def test_redlock_slow_nodes_fail_the_acquire_and_unlock_every_node(
    proxied: Proxied, lease_name: str
) -> None:
    """300 ms added each way on all 3 nodes, 1 s TTL: no quorum in time, and the client sends
    a compare-and-delete to every node (a timed-out ``SET`` may have landed)."""
    proxied.each(lambda p: p.delay(300))
    direct = [redis.Redis.from_url(server.url) for server in proxied.servers]
    evals_before = [
        client.info("commandstats").get("cmdstat_eval", {}).get("calls", 0) for client in direct
    ]
    with pytest.raises(LeaseError):
        acquire(lease_name, ttl=1, backend="proxied", timeout=0)

    def unlocked_everywhere() -> bool:
        stats = [client.info("commandstats").get("cmdstat_eval", {}) for client in direct]
        return all(s.get("calls", 0) > before for s, before in zip(stats, evals_before))

    wait_until(unlocked_everywhere, 5, "a compare-and-delete on every node")
    assert holder_of(lease_name) is None
    for client in direct:
        client.close()


def timed(fn: Callable[[], Any], bound: float) -> tuple[float, Any]:
    """How long ``fn`` took (at most ``bound``) and what it returned or raised."""
    started = time.monotonic()
    try:
        outcome = in_thread(fn, timeout=bound)
    except LeaseError as exc:
        outcome = exc
    return time.monotonic() - started, outcome


def test_calls_on_a_silent_live_connection_are_bounded(proxied: Proxied, lease_name: str) -> None:
    """The connection stays open and nothing answers (a NAT, a proxy, a paused server keep TCP
    alive, so keepalives never fire): renew, release and closing the backend each give up
    within the configured timeouts, and the release never claims success."""
    bound = proxied.call_bound + 3  # slack for a loaded machine
    held = acquire(lease_name, ttl=30, backend="proxied", keepalive=False)
    proxied.each(FaultProxy.blackhole)
    took, outcome = timed(held.renew, bound)
    assert isinstance(outcome, BackendUnavailable), outcome
    took, outcome = timed(held.release, bound)
    assert isinstance(outcome, BackendUnavailable), f"{outcome!r} after {took:.2f}s"

    def renew_while_closing() -> None:
        with contextlib.suppress(Exception):  # any outcome will do, as long as it ends
            held.renew()

    stuck = threading.Thread(target=renew_while_closing, daemon=True)
    stuck.start()  # a renewal in flight while the backend is closed
    took, outcome = timed(get_backend("proxied").close, bound)
    assert outcome is None, outcome
    stuck.join(bound)
    assert not stuck.is_alive()
    proxied.each(FaultProxy.pass_through)
    if proxied.kind == "zookeeper":
        # close() ended the kazoo session, and with it every grant made on it; a closed
        # ZooKeeper backend never opens a client again, so the retry is refused at once, and
        # the name is free once the ensemble has the session's end (or expires it).
        with pytest.raises(BackendUnavailable, match="closed"):
            held.release()
        wait_until(lambda: holder_of(lease_name) is None, 15, "the closed session's znode to go")
        return
    retry_safely(held, lease_name)


def retry_safely(held: Lease, name: str) -> None:
    """After "no answer", the release may have landed late (Redlock's unlocks are sent and
    held in the proxy) or not at all: the retry either frees the name or says it was lost, and
    the name ends free either way."""
    time.sleep(0.5)  # let the proxy deliver what it held (as a late packet would arrive)
    before = holder_of(name)
    assert before in (None, (held.holder, held.token))
    try:
        held.release()
    except LeaseLost:
        assert before is None, "the retry called a lease it still held lost"
    assert holder_of(name) is None


def test_async_calls_on_a_silent_live_connection_are_bounded(
    proxied: Proxied, lease_name: str
) -> None:
    """The async twins of the test above: ``arenew`` and ``arelease`` give up in time too."""
    bound = proxied.call_bound + 3

    async def main() -> list[float]:
        held = await aacquire(lease_name, ttl=30, backend="proxied", keepalive=False)
        proxied.each(FaultProxy.blackhole)
        took = []
        try:
            for call in (held.arenew, held.arelease):
                started = time.monotonic()
                with pytest.raises(BackendUnavailable):
                    await asyncio.wait_for(call(), bound)
                took.append(time.monotonic() - started)
            proxied.each(FaultProxy.pass_through)
            await asyncio.sleep(0.5)  # the held bytes are delivered
            before = holder_of(lease_name)
            assert before in (None, (held.holder, held.token))
            try:
                await asyncio.wait_for(held.arelease(), bound)
            except LeaseLost:
                assert before is None, "the retry called a lease it still held lost"
        finally:
            proxied.each(FaultProxy.pass_through)
            await get_backend("proxied").aclose()
        return took

    took = asyncio.run(main())
    assert max(took) <= bound
    assert holder_of(lease_name) is None


def test_backend_recovers_after_a_dropped_reply(proxied: Proxied, lease_name: str) -> None:
    """A reply eaten by the network may fail the call it answered, but the backend must come
    back: a client whose connection machinery gave up for good (kazoo ends its connection
    thread on an out-of-sequence reply) would fail every later call until the process restarts."""
    backend = get_backend("proxied")
    assert backend.inspect(lease_name) is None  # connected, the session (if any) is open
    for proxy in proxied.proxies:
        if proxy.connections:  # an idle member's next connection must not lose its handshake
            proxy.drop_next_reply()
    with contextlib.suppress(LeaseError):
        in_thread(lambda: backend.inspect(lease_name), timeout=proxied.call_bound + 5)
    proxied.each(FaultProxy.pass_through)

    def acquired() -> bool:
        try:
            held = acquire(lease_name, ttl=5, backend="proxied", timeout=0, keepalive=False)
        except LeaseError:
            return False
        held.release()
        return True

    wait_until(acquired, 15, "the backend to serve again after one dropped reply")


@pytest.mark.parametrize("proxied", ["zookeeper"], indirect=True)
def test_a_reply_lost_from_a_pipelined_acquire_fails_it_with_a_lease_error(
    proxied: Proxied, lease_name: str
) -> None:
    """ZooKeeper's acquire pipelines two requests (create our node, read the line). When the
    first reply is lost, the second arrives out of sequence and kazoo fails the pending request
    with a bare ``RuntimeError`` ("xids do not match"). That must reach the caller as the
    package's ``BackendUnavailable`` (a failed try, retried within the deadline), never as an
    exception from outside the package's root. Found by the nemesis soak. The name is held
    elsewhere, so every try joins the line of an existing name node; replies can coalesce in
    one chunk (then nothing is out of sequence), so several tries, all checked."""
    holder = acquire(lease_name, ttl=120, backend="direct", keepalive=False, holder="holder")
    try:
        for _ in range(8):
            with contextlib.suppress(LeaseError):
                get_backend("proxied").inspect(lease_name)  # connected (a new session if need be)
            for proxy in proxied.proxies:
                if proxy.connections:
                    proxy.drop_next_reply()
            with pytest.raises(LeaseError):
                in_thread(
                    lambda: acquire(lease_name, ttl=5, backend="proxied", timeout=0),
                    timeout=proxied.call_bound + 10,
                )
            proxied.each(FaultProxy.pass_through)
    finally:
        holder.release()
    assert holder_of(lease_name) is None, "a try left a contender node behind"


#: The alias under which the late writer reaches the resource through a proxy.
LATE = "resource_late"


@pytest.fixture
def late_resource(proxied: Proxied) -> Iterator[tuple[FaultProxy, Callable[[], Any]]]:
    """The resource the holders write to: the shared fenced register in the test database,
    and a proxy of this test's own in front of its server, which delays only the writes sent
    that way (the server itself is never faulted). ``(proxy, connect)``: ``connect()`` gives
    the calling thread a connection :data:`LATE` through the proxy (a connection made at run
    time, as Django's test case allows a thread to open)."""
    resource = connections[DEFAULT_DB_ALIAS].settings_dict
    if resource["HOST"] not in ("127.0.0.1", "localhost") or not resource["PORT"]:
        pytest.skip(f"the test database ({resource['HOST']}) is not on loopback TCP")
    proxy = FaultProxy(int(resource["PORT"]))

    def connect() -> Any:
        wrapper = load_backend(resource["ENGINE"]).DatabaseWrapper(
            {**resource, "HOST": "127.0.0.1", "PORT": str(proxy.port)}, LATE
        )
        connections[LATE] = wrapper  # this thread's only
        wrapper.ensure_connection()
        return wrapper

    try:
        yield proxy, connect
    finally:
        proxy.pass_through()
        proxy.close()


def test_a_fenced_write_delayed_in_the_network_past_the_ttl_is_refused(
    proxied: Proxied, late_resource: tuple[FaultProxy, Callable[[], Any]], lease_name: str
) -> None:
    """Kleppmann's delayed packet on the way to the resource: the holder checks its lease and
    sends a fenced write, which the network holds past the TTL; meanwhile a successor acquires
    (a higher token) and writes. When the old write finally arrives, the resource refuses it,
    whatever the lease store: the fence, not the lease's own clock, is what protects it."""
    network, connect = late_resource
    ttl, register = 3.0, checker.new_register()
    old = acquire(lease_name, ttl=ttl, backend=proxied.direct, keepalive=False, holder="old")
    assert checker.record_write(register, old, "old")
    connected, send = threading.Event(), threading.Event()
    outcome: list[object] = []

    def write_late() -> None:
        try:
            connection = connect()  # connected before the network stalls
        except BaseException as exc:  # handed back to the test
            outcome.append(exc)
            return
        try:
            connected.set()
            send.wait(30)
            outcome.append(checker.record_write(register, old, "old-late", using=LATE))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            connection.close()

    writer = threading.Thread(target=write_late, daemon=True)
    writer.start()
    assert connected.wait(30), outcome
    network.blackhole()
    send.set()
    wait_until(lambda: network.holding > 0 or outcome, ttl, "the old write to be in the network")
    assert not outcome, f"the old write never left (lease checked too late?): {outcome}"
    new = acquire(lease_name, ttl=30, backend=proxied.direct, timeout=ttl + 10, holder="new")
    assert new.token > old.token
    assert old.remaining() == 0
    assert checker.record_write(register, new, "new")
    network.pass_through()  # the old write arrives now, after the successor's
    writer.join(30)
    assert outcome == [False], outcome
    late = [a for a in checker.history(register) if a.writer == "old-late"]
    assert [a.outcome for a in late] == [checker.STALE], late
    new.release()
    summary = checker.check_history(register, [old.token, new.token])
    assert (summary.accepted, summary.stale) == (2, 1)


def test_blackholed_shared_renewal_reports_loss_within_the_ttl_and_is_fenced(
    proxied: Proxied, lease_name: str
) -> None:
    """A reader (``shared=True``) is renewed like an exclusive holder: its renewals vanish past
    the TTL, ``on_lost`` fires within it and ``ensure_held()`` raises; a writer then gets the
    name with a higher token and the fence refuses the lost reader's write after the writer's."""
    require(proxied.alias, Capability.SHARED_LEASES)
    ttl, register = 1.5, checker.new_register()
    fired: list[float] = []
    reader = acquire(
        lease_name,
        ttl=ttl,
        backend="proxied",
        shared=True,
        holder="reader",
        on_lost=lambda _: fired.append(0),
    )
    assert reader.shared
    assert checker.record_write(register, reader, "reader")
    blackholed_at = time.monotonic()
    proxied.each(FaultProxy.blackhole)
    assert reader.lost.wait(ttl + 1.0), "on_lost never fired"
    assert time.monotonic() - blackholed_at <= ttl + 0.5
    wait_until(lambda: fired, 5, "on_lost to be called (lost is set just before)")
    assert reader.remaining() == 0
    with pytest.raises(LeaseLost):
        reader.ensure_held()
    writer = acquire(lease_name, ttl=10, backend=proxied.direct, timeout=ttl + 5, holder="writer")
    assert writer.token > reader.token and not writer.shared
    assert checker.record_write(register, writer, "writer")
    assert not checker.record_write(register, reader, "reader")  # it knows it lost
    assert not checker.record_write(register, reader.token, "reader")  # the fence refuses it
    proxied.each(FaultProxy.pass_through)  # the held renewals reach the server now
    time.sleep(0.3)
    assert holder_of(lease_name) == ("writer", writer.token)
    writer.release()
    summary = checker.check_history(register, [reader.token, writer.token])
    assert (summary.lost, summary.stale) == (1, 1)


def room_sessions(name: str) -> dict[bool, int]:
    """Granted and waiting sessions on ``name``'s waiting-room lock, read on a connection of
    its own: the ``"direct"`` backend's connection belongs to its lock, and a waiter thread on
    that backend may be using it (two threads on one psycopg connection garble its replies)."""
    classid, objid = split_key(room_key(name))
    with contextlib.closing(
        connect(cast("DatabaseBackend", get_backend("direct")).db_alias)
    ) as conn:
        rows = conn.execute(
            "SELECT granted, count(*)::int FROM pg_locks WHERE locktype = 'advisory' "
            "AND classid = %s AND objid = %s AND objsubid = 1 GROUP BY granted",
            [classid, objid],
        ).fetchall()
    return dict(rows)


@pytest.mark.parametrize("proxied", ["database"], indirect=True)
@pytest.mark.parametrize("where", ["inside", "queued"])
def test_blackholed_waiting_room_connection_does_not_outlast_the_deadline(
    proxied: Proxied, lease_name: str, where: str
) -> None:
    """A waiter's room connection (``LISTEN``, the room lock, the tries inside) goes silent,
    whether its waiter is inside the room or queued for it: the waiter still gives up by its
    acquire deadline plus the reply timeouts, instead of waiting for a reply for ever."""
    timeout = 2.0
    holder = acquire(lease_name, ttl=60, backend="direct", keepalive=False, holder="holder")
    ahead: threading.Thread | None = None
    if where == "queued":  # a waiter on "direct" is inside the room: ours queues behind it

        def wait_ahead() -> None:
            acquire(lease_name, ttl=5, backend="direct", timeout=60, keepalive=False).release()

        ahead = threading.Thread(target=wait_ahead, daemon=True)
        ahead.start()
        wait_until(lambda: room_sessions(lease_name).get(True) == 1, 15, "ahead")
    outcome: list[BaseException | Lease] = []

    def wait() -> None:
        try:
            outcome.append(acquire(lease_name, ttl=5, backend="proxied", timeout=timeout))
        except BaseException as exc:  # handed back to the test
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    try:
        waiter.start()
        expected = {True: 1} if where == "inside" else {True: 1, False: 1}
        wait_until(lambda: room_sessions(lease_name) == expected, 15, f"the waiter {where}")
        proxied.each(FaultProxy.blackhole)
        # The deadline, a room statement's reply timeout, a try and a reconnection on the
        # backend's own connection, and slack for a loaded machine.
        waiter.join(timeout + 2 * proxied.call_bound + 5)
        assert not waiter.is_alive(), "the waiter outlived its deadline on a silent connection"
        assert isinstance(outcome[0], LeaseUnavailable | BackendUnavailable), outcome
    finally:
        proxied.each(FaultProxy.pass_through)
        holder.release()
        if ahead is not None:
            ahead.join(30)
    # A try held in the proxy may reach the server once it passes again, after the release:
    # granted to a waiter that gave up, it ends by its TTL.
    wait_until(lambda: holder_of(lease_name) is None, 15, "a lost grant to expire")


@pytest.mark.parametrize("proxied", ["database"], indirect=True)
def test_a_retried_release_whose_first_landed_is_a_release_not_a_loss(
    proxied: Proxied, lease_name: str
) -> None:
    """The release landed and its reply was lost; the caller retries, as the error invites.
    The row shows the name freed by this very grant (holder cleared, token unchanged: an expiry
    keeps the holder, a take-over or a revocation advances the token), yet the retry raised
    ``LeaseLost`` ("expired or taken over") and reported a loss of work that ended in time."""
    ttl = max(10.0, 3 * proxied.call_bound)
    held = acquire(lease_name, ttl=ttl, backend="proxied", keepalive=False)
    proxied.each(FaultProxy.drop_next_reply)
    with pytest.raises(BackendUnavailable):
        in_thread(held.release, timeout=ttl)
    assert holder_of(lease_name) is None  # it landed
    in_thread(held.release, timeout=ttl)
    assert not held.lost.is_set()
    with pytest.raises(LeaseNotHeld):
        held.release()  # released now, for the handle too


@pytest.mark.parametrize("proxied", ["database", "redis"], indirect=True)
def test_a_with_block_whose_release_got_no_answer_lets_its_grant_expire(
    proxied: Proxied, lease_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The block finished in time and its release got no answer: ``lease()`` logs that the
    grant "will expire", and nobody holds the handle any more. But the unknown outcome put the
    lease back under keepalive, whose renewals then kept the name held for as long as the
    process lived."""
    ttl = max(4.0, 2 * proxied.call_bound)

    def block() -> Lease:
        with lease(lease_name, ttl=ttl, backend="proxied") as held:
            proxied.each(FaultProxy.blackhole)  # the release's request goes nowhere
        return held

    held = in_thread(block, timeout=ttl)
    assert "could not release" in caplog.text and holder_of(lease_name) is not None
    proxied.each(FaultProxy.reset_all)  # the held release never reaches the store
    proxied.each(FaultProxy.pass_through)
    wait_until(lambda: holder_of(lease_name) is None, 3 * ttl, "the abandoned grant to end")
    assert not held.lost.is_set()  # the block gave it up: no loss to report


@pytest.mark.parametrize("proxied", ["database"], indirect=True)
def test_a_resignation_that_got_no_answer_lets_another_candidate_lead(
    proxied: Proxied, lease_name: str
) -> None:
    """``resign()`` logged "it will expire", but the unknown release put the leadership's
    lease back under keepalive: renewed forever, no other candidate was ever elected."""
    ttl = max(4.0, 2 * proxied.call_bound)
    leading = elect(lease_name, ttl=ttl, backend="proxied")
    proxied.each(FaultProxy.blackhole)
    in_thread(leading.resign, timeout=ttl)
    proxied.each(FaultProxy.reset_all)  # the held release never reaches the store
    proxied.each(FaultProxy.pass_through)
    successor = in_thread(lambda: elect(lease_name, ttl=ttl, backend="direct", timeout=3 * ttl))
    assert successor.token > leading.token and not leading.is_leader
    successor.resign()
