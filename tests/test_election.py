"""Leader election: one leader at a time according to the fenced register, on every backend."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
from django.conf import settings

from leases import signals
from leases.backends import Capability, get_backend
from leases.election import Leadership, aelect, elect, election_lease_name, leader_of
from leases.errors import InvalidLeaseName, InvalidLeaseOption, LeaseUnavailable
from tests import checker
from tests.lease_backends import SETUP

BACKENDS: list[str] = sorted(cast("dict[str, Any]", settings.LEASES)["BACKENDS"])


def unique(prefix: str = "election") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(autouse=True)
def _store_ready(request: pytest.FixtureRequest) -> None:
    """Start what a test's ``backend`` needs (etcd, ZooKeeper: started on first use, see
    :mod:`tests.clusters`): run alone, this file's tests met a placeholder endpoint."""
    callspec = getattr(request.node, "callspec", None)
    setup = SETUP.get(callspec.params.get("backend", "")) if callspec is not None else None
    if setup is not None:
        setup(request)


@pytest.fixture
def resign_all() -> Iterator[list[Leadership]]:
    made: list[Leadership] = []
    try:
        yield made
    finally:
        for leadership in made:
            leadership.resign()


@pytest.mark.django_db(transaction=True)
def test_a_non_callable_on_lost_is_refused_before_campaigning() -> None:
    """It was accepted (the leader was elected) and failed only on the keepalive thread, when
    leadership was lost and the caller most needed to hear of it."""
    name = unique()
    with pytest.raises(InvalidLeaseOption, match="on_lost"):
        elect(name, ttl=5, on_lost=5)  # type: ignore[arg-type]
    assert leader_of(name) is None


@pytest.mark.django_db(transaction=True)
def test_an_election_name_too_long_for_its_lease_is_refused_in_its_own_words() -> None:
    """The election's lease is ``leader:<name>``: a name that fits the prefix is elected; one
    past it is refused naming it and the length it may have, not the derived lease name."""
    longest = "e" * 248
    with elect(longest, ttl=5) as leadership:
        assert leadership.is_leader
    with pytest.raises(InvalidLeaseName) as info:
        elect(longest + "e", ttl=5)
    assert str(info.value).startswith("invalid lease name 'eeee")
    assert "at most 248" in str(info.value)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", BACKENDS)
def test_new_leader_always_has_a_higher_token(backend: str, resign_all: list[Leadership]) -> None:
    name = unique()
    tokens = []
    for _ in range(3):
        leadership = elect(name, ttl=5, backend=backend, timeout=5)
        resign_all.append(leadership)
        assert leadership.is_leader
        tokens.append(leadership.token)
        leader = leader_of(name, backend=backend)
        assert leader is not None and leader.token == leadership.token
        assert leader.holder == leadership.holder
        leadership.resign()
        assert not leadership.is_leader
        assert leader_of(name, backend=backend) is None
    assert tokens == sorted(set(tokens)), tokens


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", BACKENDS)
def test_second_candidate_waits_until_the_leader_resigns(
    backend: str, resign_all: list[Leadership]
) -> None:
    name = unique()
    first = elect(name, ttl=5, backend=backend, timeout=5)
    resign_all.append(first)
    with ThreadPoolExecutor(1) as pool:  # another thread: leases are not reentrant per thread
        with pytest.raises(LeaseUnavailable):
            pool.submit(elect, name, ttl=5, backend=backend, timeout=0.3).result(10)
        waiting = pool.submit(elect, name, ttl=5, backend=backend, timeout=10)
        time.sleep(0.2)
        assert not waiting.done()
        first.resign()
        second = waiting.result(10)
        resign_all.append(second)
    assert second.token > first.token
    assert second.is_leader and not first.is_leader


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", BACKENDS)
def test_revoked_leader_learns_it_lost_and_signals_fire(
    backend: str, resign_all: list[Leadership]
) -> None:
    if Capability.FORCE_RELEASE not in get_backend(backend).capabilities:
        pytest.skip(f"backend {backend!r} does not declare force release")
    name = unique()
    events: list[tuple[str, Any]] = []
    lost_calls: list[Leadership] = []

    def on_elected(sender: str, leadership: Leadership, **kwargs: Any) -> None:
        events.append(("elected", leadership.token))

    def on_lost(sender: str, leadership: Leadership, reason: str, **kwargs: Any) -> None:
        events.append(("lost", reason))

    signals.leader_elected.connect(on_elected)
    signals.leader_lost.connect(on_lost)
    try:
        leadership = elect(name, ttl=0.9, backend=backend, timeout=5, on_lost=lost_calls.append)
        resign_all.append(leadership)
        get_backend(backend).force_release(election_lease_name(name), leadership.token)
        assert leadership.lost.wait(5), "keepalive never noticed the revoked leadership"
        assert not leadership.is_leader
        assert lost_calls == [leadership]
        leadership.resign()  # after a loss: nothing to give back, no second signal
    finally:
        signals.leader_elected.disconnect(on_elected)
        signals.leader_lost.disconnect(on_lost)
    assert events == [("elected", leadership.token), ("lost", "lost")]


def exits(_: object) -> None:
    """An ``on_lost`` that asks to stop the process."""
    sys.exit(3)


@pytest.mark.django_db(transaction=True)
def test_an_on_lost_exiting_on_keepalives_thread_is_logged_as_unable_to_stop_the_process(
    resign_all: list[Leadership], caplog: pytest.LogCaptureFixture
) -> None:
    """``sys.exit()`` in ``on_lost`` ran on a thread of keepalive's: it ended nothing and the
    only trace was a traceback under the election's lease name, as for any bug of the
    callback's. It is logged as a request to stop the process that could not be honoured,
    naming the election and saying what to do, and keepalive goes on watching."""
    name = unique()
    with caplog.at_level(logging.WARNING, logger="leases"):
        leadership = elect(name, ttl=0.9, timeout=5, on_lost=exits)
        resign_all.append(leadership)
        get_backend().force_release(election_lease_name(name), leadership.token)
        assert leadership.lost.wait(5), "keepalive never noticed the revoked leadership"
    (record,) = [r for r in caplog.records if "on_lost callback" in r.getMessage()]
    message = record.getMessage()
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert f"election {name!r}" in message and "SystemExit(3)" in message, message
    assert "cannot stop the process" in message and "the process goes on" in message
    assert (record.threadName or "").startswith("leases-"), record.threadName
    after = elect(unique(), ttl=0.9, timeout=5)  # keepalive still renews
    resign_all.append(after)
    assert not after.lost.wait(2) and after.is_leader


@pytest.mark.django_db(transaction=True)
def test_an_on_lost_exiting_on_the_thread_that_found_the_loss_exits_there(
    resign_all: list[Leadership],
) -> None:
    """The loss found by this thread's own call (a ``resign()`` whose release is refused):
    ``on_lost`` runs here, and its ``sys.exit()`` was swallowed all the same, so the process
    went on. It is raised from that call, once the loss is reported."""
    name = unique()
    ended: list[str] = []

    def on_leader_lost(sender: str, leadership: Leadership, reason: str, **kw: Any) -> None:
        ended.append(reason)

    leadership = elect(name, ttl=30, timeout=5, on_lost=exits)
    resign_all.append(leadership)
    get_backend().force_release(election_lease_name(name), leadership.token)
    signals.leader_lost.connect(on_leader_lost)
    try:
        with pytest.raises(SystemExit) as stopped:
            leadership.resign()  # keepalive's next renewal is 10 s away: this finds the loss
    finally:
        signals.leader_lost.disconnect(on_leader_lost)
    assert stopped.value.code == 3
    assert leadership.lost.is_set() and not leadership.is_leader and ended == ["lost"]


@pytest.mark.django_db(transaction=True)
def test_leadership_fences_writes_and_logs_structured_records(
    resign_all: list[Leadership], caplog: pytest.LogCaptureFixture
) -> None:
    name, register = unique(), checker.new_register("leadership")
    with caplog.at_level(logging.INFO, logger="leases"):
        first = elect(name, ttl=5, timeout=5)
        resign_all.append(first)
        assert checker.record_write(register, first, "first")  # a Leadership is a fence
        first.resign()
        assert not checker.record_write(register, first, "first")  # refused: not leading
        second = elect(name, ttl=5, timeout=5)
        resign_all.append(second)
        assert checker.record_write(register, second, "second")
        assert not checker.record_write(register, first.token, "first")  # stale token
    checker.check_history(register, [first.token, second.token])
    events = [
        (r.event, r.token)  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "event", "").startswith("leader_")  # not the fence's own rejection record
    ]
    assert events == [
        ("leader_elected", first.token),
        ("leader_lost", first.token),
        ("leader_elected", second.token),
    ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", ["default", "redis"])
def test_a_cancelled_aresign_still_ends_the_leadership(backend: str) -> None:
    """The release ran to its end and re-raised the held-back cancellation, which skipped the
    end of the leadership: ``lost`` was never set (a waiter on it hung) and ``leader_lost``
    never sent."""
    name, told = unique(), []

    def on_lost(sender: str, leadership: Leadership, reason: str, **kwargs: Any) -> None:
        told.append(reason)

    async def resign_cancelled() -> Leadership:
        leadership = await aelect(name, ttl=10, backend=backend, timeout=5)
        resigning = asyncio.create_task(leadership.aresign())
        await asyncio.sleep(0)  # the release is on its way
        resigning.cancel()  # asyncio.run() shutting down, a TaskGroup, a timeout
        with pytest.raises(asyncio.CancelledError):
            await resigning
        return leadership

    signals.leader_lost.connect(on_lost)
    try:
        leadership = asyncio.run(resign_cancelled())
    finally:
        signals.leader_lost.disconnect(on_lost)
    assert leader_of(name, backend=backend) is None  # released all the same
    assert leadership.lost.is_set() and not leadership.is_leader
    assert told == ["resigned"]


@pytest.mark.django_db(transaction=True)
def test_a_resign_interrupted_after_the_release_does_not_leave_two_leaders(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C landing as the release's reply came back: the release's outcome was unknown, so
    ``is_leader`` stayed true for the whole TTL beside a successor's."""
    name, store = unique(), get_backend("default")
    old = elect(name, ttl=20, timeout=5)
    released = store.release

    def release_interrupted(grant: Any) -> None:
        released(grant)
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "release", release_interrupted)
    with pytest.raises(KeyboardInterrupt):
        old.resign()
    monkeypatch.undo()
    assert not old.is_leader and old.lost.is_set()
    with ThreadPoolExecutor(1) as pool:  # another thread: leases are not reentrant per thread
        new = pool.submit(elect, name, ttl=20, timeout=0).result(10)
    try:
        leader = leader_of(name)
        assert leader is not None and leader.token == new.token > old.token
        assert new.is_leader and not old.is_leader
    finally:
        new.resign()
        old.resign()


CONTENDER = """
import os, socket, sys, time
import django
django.setup()
from leases.election import elect
from leases.errors import LeaseError
from tests.checker import record_write

register, name, writer, until, ttl, backend = sys.argv[1:7]
until, ttl = float(until), float(ttl)
holder = f"{writer}@{socket.gethostname()}:{os.getpid()}:main"
while time.time() < until:
    try:
        leadership = elect(
            name, ttl=ttl, backend=backend, timeout=max(0.1, until - time.time()), holder=holder
        )
    except LeaseError:
        continue
    token = leadership.token
    print("elected", token, flush=True)
    while leadership.is_leader and time.time() < until:
        record_write(register, token, writer)
        time.sleep(0.03)
    if not leadership.is_leader:
        # The write that was in flight when this leader was paused: the fence must refuse it
        # once a successor has written.
        record_write(register, token, writer)
    leadership.resign()
"""


def wait_for_leader(name: str, backend: str, *, newer_than: int, deadline: float) -> Any:
    while time.monotonic() < deadline:
        leader = leader_of(name, backend=backend)
        if leader is not None and leader.token > newer_than and leader.pid is not None:
            return leader
        time.sleep(0.05)
    return None


@pytest.mark.fault
@pytest.mark.parametrize("backend", ["default", "redis"])
def test_five_contenders_with_paused_and_killed_leaders(
    child_env: dict[str, str], python: str, backend: str
) -> None:
    """SIGSTOP/SIGKILL the leader repeatedly; the register never accepts two leaders at once."""
    name, register, ttl, slack = unique(), checker.new_register("election"), 1.5, 5.0
    until = time.time() + 30
    procs = [
        subprocess.Popen(
            [python, "-c", CONTENDER, register, name, f"w{i}", str(until), str(ttl), backend],
            env=child_env,
            stdout=subprocess.DEVNULL,
        )
        for i in range(5)
    ]
    by_pid = {proc.pid: proc for proc in procs}
    grants: list[int] = []
    stale_expected = False
    try:
        leader = wait_for_leader(name, backend, newer_than=0, deadline=time.monotonic() + 20)
        assert leader is not None, "nobody was elected within 20 s"
        grants.append(leader.token)
        for fault in random.sample(["stop", "stop", "kill", "kill"], 4):
            proc = by_pid[leader.pid]
            time.sleep(0.3)  # let the leader write
            os.kill(proc.pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
            faulted_at = time.monotonic()
            deadline = faulted_at + ttl + 10
            new = wait_for_leader(name, backend, newer_than=leader.token, deadline=deadline)
            assert new is not None, f"no new leader after {fault} of the leader"
            took = time.monotonic() - faulted_at
            assert took <= ttl + slack, f"new leader after {took:.1f}s (> TTL {ttl} + {slack})"
            grants.append(new.token)
            if fault == "stop":
                time.sleep(0.4)  # the successor writes, then the old leader wakes up
                os.kill(proc.pid, signal.SIGCONT)
                stale_expected = True
            leader = new
        time.sleep(0.5)
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(5)
    summary = checker.check_history(register, grants)
    assert summary.accepted > 0 and len(summary.writers) >= 3
    if stale_expected:
        assert summary.stale >= 1, "a paused leader's late write was never refused"
