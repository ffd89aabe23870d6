"""ZooKeeper faults on an ensemble this module owns: a killed leader, a paused member.

Every write goes through the shared history checker, so "the lease was kept" and "the lease
was lost" are both judged by the fence: no two holders accepted with one token, tokens only
grow.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from devservers.zookeeper import ZooKeeperEnsemble, zookeeper_classpath
from leases import LeaseLost, acquire
from leases.backends import get_backend
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

    def configure(session: float = SESSION, **aliases: str) -> None:
        configured = dict(settings.LEASES["BACKENDS"])
        for alias, hosts in aliases.items():
            configured[alias] = {
                "ENGINE": "leases.backends.zookeeper",
                "HOSTS": hosts,
                "SESSION_TIMEOUT": session,
                "REQUEST_TIMEOUT": 1.0,
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
