"""ZooKeeper faults on an ensemble this module owns: a killed leader, a paused member.

Every write goes through the shared history checker, so "the lease was kept" and "the lease
was lost" are both judged by the fence: no two holders accepted with one token, tokens only
grow.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings
from kazoo.exceptions import NoNodeError  # type: ignore[import-untyped]

from devservers.proxy import FaultProxy
from devservers.zookeeper import ZooKeeperEnsemble, zookeeper_classpath
from leases import LeaseLost, LeaseUnavailable, acquire, acquire_slot
from leases.backends import get_backend, tries_until
from leases.backends._zookeeper_line import read_data
from leases.errors import BackendUnavailable
from tests.checker import check_history, new_register, record_write
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.fault,
    pytest.mark.slow,
    pytest.mark.skipif(zookeeper_classpath() is None, reason="ZooKeeper is not installed"),
]

#: Short, so a lost session shows within seconds; within the ensemble's 1-10 s bounds.
SESSION = 3.0


@pytest.fixture(scope="module")
def ensemble() -> Iterator[ZooKeeperEnsemble]:
    with ZooKeeperEnsemble() as servers:
        yield servers


@pytest.fixture
def backends(ensemble: ZooKeeperEnsemble) -> Iterator[Any]:
    """``backends(alias=hosts, ...)``: zookeeper aliases of this test's own, on given members
    (``session=`` seconds, default ``SESSION``)."""
    stack: list[Any] = []

    def configure(
        session: float = SESSION, request: float = 1.0, connect: float = 10.0, **aliases: str
    ) -> None:
        leases: dict[str, Any] = settings.LEASES
        configured = dict(leases["BACKENDS"])
        for alias, hosts in aliases.items():
            configured[alias] = {
                "ENGINE": "leases.backends.zookeeper",
                "HOSTS": hosts,
                "SESSION_TIMEOUT": session,
                "REQUEST_TIMEOUT": request,
                "CONNECT_TIMEOUT": connect,
            }
        override = override_settings(LEASES={**settings.LEASES, "BACKENDS": configured})
        override.enable()
        stack.append(override)

    try:
        yield configure
    finally:
        while stack:
            stack.pop().disable()
        for member in ensemble.ids:  # leave a whole, serving ensemble to the next test
            if member not in ensemble.live():
                ensemble.launch(member)
            ensemble.resume(member)
        ensemble.wait_ready()


def test_leader_killed_while_held_keeps_or_reports_the_lease(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    backends(zk_holder=ensemble.hosts, zk_next=ensemble.hosts)
    register, name = new_register(), f"zk-leader-{time.monotonic_ns()}"
    held = acquire(name, ttl=SESSION, backend="zk_holder")
    assert record_write(register, held, "holder")
    leader = ensemble.leader()
    assert leader is not None
    ensemble.kill(leader)
    wait_until(lambda: ensemble.leader() is not None, 30, "a new leader")
    time.sleep(SESSION)  # past the TTL: only renewals through the new leader can keep it
    kept = not held.lost.is_set()
    if kept:
        held.ensure_held()
        assert record_write(register, held, "holder")
        held.release()
    successor = acquire(name, ttl=SESSION, backend="zk_next", timeout=3 * SESSION)
    assert successor.token > held.token
    assert record_write(register, successor, "successor")
    assert not record_write(register, held, "holder")  # lost or released: refused either way
    successor.release()
    check_history(register, grants=[held.token, successor.token])
    print(f"leader {leader} killed: lease {'kept' if kept else 'reported lost'}")


def test_paused_member_past_the_session_timeout_reports_loss_and_successor_is_higher(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """The holder talks only to a follower that is then SIGSTOPped: its session cannot be
    renewed anywhere, the ensemble expires it, and the holder must say so before a successor
    is granted, not after."""
    follower = next(i for i in ensemble.live() if ensemble.mode(i) == "follower")
    others = ",".join(ensemble.host(i) for i in ensemble.ids if i != follower)
    backends(zk_holder=ensemble.host(follower), zk_next=others)
    register, name = new_register(), f"zk-paused-{time.monotonic_ns()}"
    lost_at: list[float] = []
    held = acquire(
        name, ttl=SESSION, backend="zk_holder", on_lost=lambda _: lost_at.append(time.monotonic())
    )
    assert record_write(register, held, "holder")
    ensemble.pause(follower)
    successor = acquire(name, ttl=SESSION, backend="zk_next", timeout=6 * SESSION)
    granted_at = time.monotonic()
    wait_until(held.lost.is_set, SESSION, "the paused holder to report its loss")
    assert lost_at and lost_at[0] <= granted_at, (lost_at, granted_at)
    assert successor.token > held.token
    assert record_write(register, successor, "successor")
    assert not record_write(register, held, "holder")
    ensemble.resume(follower)
    with pytest.raises((LeaseLost, BackendUnavailable)):
        get_backend("zk_holder").renew(held.grant, SESSION)
    successor.release()
    check_history(register, grants=[held.token, successor.token])


def test_member_restarted_within_the_session_timeout_resumes_the_session_and_keeps_the_lease(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """The holder knows only one member, which is SIGKILLed and started again well within the
    session timeout: while it is down the connection is SUSPENDED and the lease is not trusted
    (``ensure_held()`` refuses, a fenced write is refused before it is sent) but not lost;
    once the member serves again the same session resumes, and with it the same lease."""
    session = 10.0  # the ensemble's maximum (20 ticks): room for a JVM restart on a busy machine
    member = next(i for i in ensemble.live() if ensemble.mode(i) == "follower")
    backends(session=session, zk_holder=ensemble.host(member), zk_other=ensemble.hosts)
    register, name = new_register(), f"zk-restart-{time.monotonic_ns()}"
    held = acquire(name, ttl=session, backend="zk_holder")
    store = get_backend("zk_holder")
    before = store.client.client_id  # type: ignore[attr-defined]
    assert record_write(register, held, "holder")

    ensemble.kill(member)
    wait_until(lambda: held.remaining() == 0, session / 2, "the suspension to be noticed")
    with pytest.raises(LeaseLost, match="suspended"):
        held.ensure_held()
    assert not record_write(register, held, "holder")  # refused by ensure_held: never sent
    assert not held.lost.is_set()
    assert get_backend("zk_other").try_acquire(name, "intruder", session) is None

    ensemble.launch(member)
    wait_until(lambda: held.remaining() > 0, session / 2, "the session to resume")
    assert store.client.client_id == before  # type: ignore[attr-defined]
    held.ensure_held()
    assert record_write(register, held, "holder")
    held.renew()
    held.release()
    check_history(register, grants=[held.token])


def test_connection_lost_during_create_finds_its_own_node_and_leaves_no_orphan(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """The create reaches the ensemble but its reply is held, then the connection is reset:
    the outcome is unknown to the client. It must find the node it did create (by the GUID in
    its name) once reconnected and go on with it, rather than fail and leave a contender
    nobody owns at the head of the line, blocking the name for a whole TTL."""
    member = ensemble.ids[0]
    with FaultProxy(ensemble.ports[member]) as proxy:
        hosts = f"127.0.0.1:{proxy.port}"
        backends(session=10.0, request=5.0, zk_proxied=hosts, zk_direct=ensemble.host(member))
        store, direct = get_backend("zk_proxied"), get_backend("zk_direct")
        name = f"zk-orphan-{time.monotonic_ns()}"
        store.release(store.try_acquire(name, "warm-up", 10))  # type: ignore[arg-type]
        line = f"{direct.prefix}/names/{name}"  # type: ignore[attr-defined]

        proxy.blackhole(replies_only=True)
        outcome: list[Any] = []
        trying = threading.Thread(
            target=lambda: outcome.append(store.try_acquire(name, "holder", 10)), daemon=True
        )
        trying.start()
        wait_until(lambda: bool(direct.client.get_children(line)), 5, "the create to apply")  # type: ignore[attr-defined]
        assert proxy.reset_all() >= 1
        proxy.pass_through()
        trying.join(10)

        children = direct.client.get_children(line)  # type: ignore[attr-defined]
        assert len(children) == 1, children  # ours, and no orphan beside it
        grant = outcome[0]
        assert grant is not None and grant.holder == "holder"
        _, stat = direct.client.get(f"{line}/{children[0]}")  # type: ignore[attr-defined]
        assert grant.token == stat.czxid
        store.release(grant)
        assert direct.client.get_children(line) == []  # type: ignore[attr-defined]


def test_a_lost_create_of_a_new_name_is_made_again_not_failed(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """The first try on a name nobody used yet: the create's reply is held and the connection
    reset, so the client looks for its node by GUID, under a name node that does not exist.
    That means "not created" (create again), not a failed try: before, the look-up's
    ``NoNodeError`` escaped and failed the acquire."""
    member = ensemble.ids[0]
    with FaultProxy(ensemble.ports[member]) as proxy:
        backends(session=10.0, request=5.0, zk_proxied=f"127.0.0.1:{proxy.port}")
        store = get_backend("zk_proxied")
        store.inspect("zk-warm-up")  # connected before the network stalls
        name = f"zk-new-{time.monotonic_ns()}"
        proxy.blackhole(replies_only=True)
        outcome: list[Any] = []

        def try_it() -> None:
            try:
                outcome.append(store.try_acquire(name, "holder", 10))
            except BaseException as exc:  # handed back to the test
                outcome.append(exc)

        trying = threading.Thread(target=try_it, daemon=True)
        trying.start()
        wait_until(lambda: proxy.holding > 0, 5, "the create to be sent")
        assert proxy.reset_all() >= 1
        proxy.pass_through()
        trying.join(15)
        assert outcome and not isinstance(outcome[0], BaseException), outcome
        grant = outcome[0]
        assert grant is not None and grant.holder == "holder"
        store.release(grant)


def test_a_reply_out_of_sequence_is_a_connection_loss(backends: Any, ensemble: Any) -> None:
    """kazoo fails the request whose reply was lost with a bare ``RuntimeError`` when the next
    reply arrives out of sequence ("xids do not match"; seen in the nemesis soak, where it
    escaped ``acquire``). The session turns it into a connection loss, which the backend's
    edge reports as ``BackendUnavailable`` and the join's recovery handles. The failed
    request is made the way kazoo's connection thread fails it: on a real client's result."""
    from kazoo.exceptions import ConnectionLoss

    from leases.backends._zookeeper_session import Edge

    backends(zk=ensemble.host(ensemble.ids[0]))
    session = get_backend("zk").zk  # type: ignore[attr-defined]
    failed = session.client.handler.async_result()
    failed.set_exception(RuntimeError("xids do not match, expected %r received %r", 2, 3))
    with pytest.raises(ConnectionLoss):
        session.get(failed)
    with pytest.raises(BackendUnavailable, match="out of sequence"), Edge("zk", "acquire"):
        session.get(failed)


def test_a_closed_backend_never_opens_a_client_again(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """After ``close()`` (settings changed, interpreter exit) a renewal still in flight, or any
    later call, fails at once with the package's error: it must not open a new kazoo client
    (a new session nobody will close, and a wait of up to ``CONNECT_TIMEOUT``)."""
    backends(zk_closing=ensemble.hosts)
    store = get_backend("zk_closing")
    name = f"zk-closed-{time.monotonic_ns()}"
    held = acquire(name, ttl=SESSION, backend="zk_closing", keepalive=False)
    store.close()
    with pytest.raises(BackendUnavailable, match="closed"):
        store.renew(held.grant, SESSION)
    with pytest.raises(BackendUnavailable, match="closed"):
        store.inspect(name)
    with pytest.raises(BackendUnavailable, match="closed"):
        store.try_acquire(f"{name}-other", "other", SESSION)
    assert store.zk.opened is None  # type: ignore[attr-defined]


def _dead_client_behind_a_blackhole(
    ensemble: ZooKeeperEnsemble,
    backends: Any,
    proxy: FaultProxy,
    alias: str,
    session: float = SESSION,
) -> Any:
    """A backend on ``proxy`` whose kazoo client ended (as kazoo ends it on an unexpected
    error), with every byte to the ensemble then held: the next call must make a new client,
    and that client can never connect. ``CONNECT_TIMEOUT`` is long (20 s) so that a call that
    waits it out is told apart from one that stops at its own bound."""
    backends(**{alias: f"127.0.0.1:{proxy.port}"}, session=session, connect=20.0)
    store = get_backend(alias)
    store.inspect("warm-up")  # connected
    return store


def test_a_renewal_finding_its_client_dead_waits_no_longer_than_its_validity(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """The renewal finds its client ended and the network silent: it gives up within the
    grant's remaining validity (the holder must assume the lease gone then anyway), not after
    ``CONNECT_TIMEOUT``, and with the package's error."""
    with FaultProxy(ensemble.ports[ensemble.ids[0]]) as proxy:
        store = _dead_client_behind_a_blackhole(ensemble, backends, proxy, "zk_dead")
        name = f"zk-dead-renew-{time.monotonic_ns()}"
        held = acquire(name, ttl=SESSION, backend="zk_dead", keepalive=False)
        store.zk.opened.stop()
        proxy.blackhole()
        started = time.monotonic()
        outcome: list[BaseException | object] = []

        def renew() -> None:
            try:
                outcome.append(store.renew(held.grant, SESSION))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=renew, daemon=True)
        thread.start()
        thread.join(30)
        took = time.monotonic() - started
        assert outcome, "the renewal never returned"
        assert isinstance(outcome[0], BackendUnavailable), outcome
        # Its validity ends SESSION after it was sent (less by now); 3 s of slack for a loaded
        # machine stays far below the 20 s of CONNECT_TIMEOUT.
        assert took <= SESSION + 3.0, f"the renewal waited {took:.1f}s, validity {SESSION}s"
        proxy.pass_through()


def test_an_acquire_finding_its_client_dead_waits_no_longer_than_its_ttl(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """An acquisition's reconnection is bounded by its TTL: a grant whose reply came later
    would have no validity left."""
    with FaultProxy(ensemble.ports[ensemble.ids[0]]) as proxy:
        store = _dead_client_behind_a_blackhole(ensemble, backends, proxy, "zk_dead_acquire")
        store.zk.opened.stop()
        proxy.blackhole()
        ttl = 1.5
        for timeout in (0.0, 2.0):
            started = time.monotonic()
            with pytest.raises(BackendUnavailable):
                acquire(
                    f"zk-dead-acquire-{time.monotonic_ns()}",
                    ttl=ttl,
                    backend="zk_dead_acquire",
                    timeout=timeout,
                )
            took = time.monotonic() - started
            assert took <= ttl + 3.0, f"acquire(timeout={timeout}) waited {took:.1f}s"
        proxy.pass_through()


def test_a_connection_slower_than_one_calls_bound_serves_the_next_call(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """The ensemble's answers are held past what a 1 s acquisition may wait for a connection:
    that call fails, but its client goes on connecting, and once the answers come the next
    call uses it. Throwing it away would make every call start over, and on a network slower
    than the TTL none would ever succeed."""
    with FaultProxy(ensemble.ports[ensemble.ids[0]]) as proxy:
        backends(zk_slow=f"127.0.0.1:{proxy.port}", session=10.0, request=5.0)
        name = f"zk-slow-{time.monotonic_ns()}"
        proxy.blackhole()
        with pytest.raises(BackendUnavailable):
            acquire(name, ttl=1.0, backend="zk_slow", timeout=0)
        proxy.pass_through()
        held = acquire(name, ttl=10.0, backend="zk_slow", timeout=0, keepalive=False)
        assert proxy.accepted == 1, f"{proxy.accepted} connections: a client was thrown away"
        held.release()


def test_a_try_made_while_waiting_finds_its_client_dead_and_stops_at_the_deadline(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """A try the acquire loop makes while waiting (``tries_until``) reconnects no longer than
    the acquisition's deadline: bounded by its TTL (10 s) instead, an ``acquire(timeout=2)``
    whose client died between its wait and its next try overran its timeout by eight seconds
    (seen in a loaded CI run)."""
    with FaultProxy(ensemble.ports[ensemble.ids[0]]) as proxy:
        store = _dead_client_behind_a_blackhole(ensemble, backends, proxy, "zk_try", 10.0)
        store.zk.opened.stop()
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(BackendUnavailable), tries_until(started + 1.0):
            store.try_acquire(f"zk-dead-try-{time.monotonic_ns()}", "h", 10.0)
        took = time.monotonic() - started
        assert took <= 1.0 + 3.0, f"the try took {took:.1f}s, its acquisition's deadline 1.0s"
        proxy.pass_through()


def test_a_first_try_against_a_silent_ensemble_gives_up_by_the_acquisitions_deadline(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """``acquire(timeout=2)`` on a new client whose ensemble does not answer: its first try
    (made before any wait) connects no longer than the acquisition's deadline, not its TTL
    (10 s) nor ``CONNECT_TIMEOUT`` (10 s); once the answers come the next call is served."""
    with FaultProxy(ensemble.ports[ensemble.ids[0]]) as proxy:
        backends(zk_first=f"127.0.0.1:{proxy.port}", session=10.0, request=5.0)
        name = f"zk-first-try-{time.monotonic_ns()}"
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            acquire(name, ttl=10.0, backend="zk_first", timeout=2.0)
        took = time.monotonic() - started
        assert took <= 2.0 + 3.0, f"the first try took {took:.1f}s, the acquisition's timeout 2s"
        proxy.pass_through()
        wait_until(
            lambda: _acquired_once(name, "zk_first"), 30, "the ensemble serving once it answers"
        )


def test_a_semaphores_first_try_against_a_silent_ensemble_gives_up_by_its_deadline(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """The same for ``acquire_slot(timeout=1)``: its slots' tries are bounded as
    ``acquire()``'s are, not by the TTL (10 s), which is all a try without a bound has."""
    with FaultProxy(ensemble.ports[ensemble.ids[0]]) as proxy:
        backends(zk_slots=f"127.0.0.1:{proxy.port}", session=10.0, request=5.0)
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            acquire_slot(f"zk-slots-{time.monotonic_ns()}", limit=2, ttl=10.0, backend="zk_slots",
                         timeout=1.0)  # fmt: skip
        took = time.monotonic() - started
        assert took <= 1.0 + 3.0, f"the first try took {took:.1f}s, the acquisition's timeout 1s"
        proxy.pass_through()


def _acquired_once(name: str, alias: str) -> bool:
    try:
        held = acquire(name, ttl=10.0, backend=alias, timeout=0, keepalive=False)
    except (BackendUnavailable, LeaseUnavailable):
        return False
    held.release()
    return True


def test_a_waiter_finding_its_client_dead_waits_no_longer_than_its_deadline(
    ensemble: ZooKeeperEnsemble, backends: Any
) -> None:
    """A waiter queued in the name's line (the holder is elsewhere) finds its client ended and
    the network silent: its reconnection is bounded by the acquisition's deadline (4 s), not
    by its TTL (10 s) nor ``CONNECT_TIMEOUT`` (20 s)."""
    with FaultProxy(ensemble.ports[ensemble.ids[0]]) as proxy:
        backends(zk_holding=ensemble.hosts, session=10.0)
        store = _dead_client_behind_a_blackhole(ensemble, backends, proxy, "zk_waiting", 10.0)
        name = f"zk-dead-wait-{time.monotonic_ns()}"
        holder = acquire(name, ttl=10.0, backend="zk_holding", keepalive=False)
        outcome: list[BaseException | object] = []
        timeout = 4.0

        def wait() -> None:
            try:
                outcome.append(acquire(name, ttl=10.0, backend="zk_waiting", timeout=timeout))
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        started = time.monotonic()
        waiter.start()
        placed = f"{store.prefix}/names/{name}"
        looker = get_backend("zk_holding").client  # type: ignore[attr-defined]

        def queued() -> bool:
            """The waiter's place in the line (an unpromoted node) is there: its first try's
            node (``held``, left again at once) also makes two children, and a fault during
            that try is bounded by the try's TTL, not by this wait's deadline (a loaded run
            faulted it there and waited 10 s)."""
            try:
                children = looker.get_children(placed)
                data = [read_data(looker.get(f"{placed}/{child}")[0]) for child in children]
            except NoNodeError:
                return False
            return len(children) == 2 and any(not entry["held"] for entry in data)

        wait_until(queued, timeout - 1.0, "the waiter to queue behind the holder")
        # Stopping a live kazoo client closes its session on a server, which a loaded
        # ensemble can take seconds to answer; the waiter's calls on that client wait for the
        # stop inside kazoo. The fault is in place once it returned: the bound counts from then.
        store.zk.opened.stop()
        proxy.blackhole()
        faulted = time.monotonic()
        waiter.join(30)
        took = time.monotonic() - started
        assert outcome and isinstance(outcome[0], BackendUnavailable | LeaseUnavailable), outcome
        late = time.monotonic() - max(started + timeout, faulted)
        assert late <= 3.0, (
            f"the waiter gave up after {took:.1f}s, deadline {timeout}s, "
            f"the fault in place after {faulted - started:.1f}s"
        )
        proxy.pass_through()
        holder.release()


def test_a_hung_ensemble_costs_each_try_one_sweep_request_however_many_orphans_wait(
    ensemble: ZooKeeperEnsemble, backends: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every create whose outcome a hung ensemble left unknown is remembered for a sweep at
    the next join; the sweep read each one's line in turn, each failing after a full request
    timeout, so every acquire took one timeout more than the one before (2, 3, 4, 5, 6 s for
    five ``acquire(timeout=0)`` in a row). The sweep now stops at its first failure."""
    backends(zk_sweep=ensemble.host(ensemble.ids[0]), request=0.5)
    store = get_backend("zk_sweep")
    session = store.zk  # type: ignore[attr-defined]
    store.inspect("warm-up")  # connected before the member stops answering
    for index in range(4):
        session._orphans.add((f"orphan-{index}", f"guid{index}"))
    reads: list[str] = []
    line = session.line

    def counted(name: str) -> Any:
        reads.append(name)
        return line(name)

    monkeypatch.setattr(session, "line", counted)
    ensemble.pause(ensemble.ids[0])
    session.sweep()
    assert len(reads) == 1, reads
    assert len(session._orphans) == 4  # kept for a sweep that can reach the ensemble
