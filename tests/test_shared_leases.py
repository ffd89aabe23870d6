"""Shared leases (readers/writer) on every backend that declares them; a typed refusal, before
any round trip, on the others.

Readers coexist; an exclusive lease excludes them all; a waiting writer stops new readers; and
tokens are one sequence per name, so a resource the writer fenced refuses a reader-era write
(through the history checker, with a reader paused by SIGSTOP).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import replace

import pytest

from devservers import free_port
from leases import (
    BackendNotSupported,
    LeaseCheckUnavailable,
    LeaseLost,
    LeaseNotHeld,
    LeaseUnavailable,
    aacquire,
    acquire,
    lease,
)
from leases.backends import Capability, LeaseBackend, get_backend
from leases.lease import Lease
from tests.checker import STALE, check_history, history, new_register, record_write
from tests.extra_backends import added_backend
from tests.lease_backends import lease_backend, lease_name, require
from tests.test_lease_faults import Workers, workers
from tests.testapp.models_fencing import FencedDoc
from tests.waiting import wait_until

__all__ = ["lease_backend", "lease_name", "workers"]


def shared(name: str, alias: str, holder: str, **options: object) -> Lease:
    return acquire(name, ttl=10, backend=alias, holder=holder, shared=True, **options)  # type: ignore[arg-type]


def test_backends_without_shared_leases_refuse_before_any_round_trip() -> None:
    """Redlock at a closed port: a round trip would raise BackendUnavailable instead."""
    nodes = [f"redis://127.0.0.1:{free_port()}/0"]
    with added_backend("closed-redlock", {"ENGINE": "leases.backends.redlock", "NODES": nodes}):
        assert Capability.SHARED_LEASES not in get_backend("closed-redlock").capabilities
        with pytest.raises(BackendNotSupported) as refused:
            acquire("x", backend="closed-redlock", shared=True)
        assert refused.value.capability == "shared leases"
        with pytest.raises(BackendNotSupported), lease("x", backend="closed-redlock", shared=True):
            pass
    for alias in ("etcd", "zookeeper"):  # declared, not connected: get_backend() makes no trip
        assert Capability.SHARED_LEASES not in get_backend(alias).capabilities


def test_readers_coexist_and_a_writer_excludes_them_all(
    lease_backend: str, lease_name: str
) -> None:
    require(lease_backend, Capability.SHARED_LEASES)
    first = shared(lease_name, lease_backend, "r1")
    second = shared(lease_name, lease_backend, "r2")
    assert first.shared and second.shared and second.token > first.token
    with pytest.raises(LeaseUnavailable):
        acquire(lease_name, backend=lease_backend, timeout=0, holder="w")
    info = get_backend(lease_backend).inspect(lease_name)
    assert info is not None and info.held
    assert "secret" not in repr(info.meta) and '"s"' not in repr(info.meta)
    assert all("s" not in entry for entry in info.meta.get("readers", {}).values())
    first.renew()
    first.release()
    with pytest.raises(LeaseUnavailable):  # one reader still holds
        acquire(lease_name, backend=lease_backend, timeout=0, holder="w")
    second.release()
    writer = acquire(lease_name, ttl=10, backend=lease_backend, timeout=0, holder="w")
    assert writer.token > second.token and not writer.shared
    with pytest.raises(LeaseUnavailable):
        shared(lease_name, lease_backend, "r3", timeout=0)
    writer.release()
    third = shared(lease_name, lease_backend, "r3", timeout=0)
    assert third.token > writer.token
    third.release()


def test_a_waiting_writer_stops_new_readers(lease_backend: str, lease_name: str) -> None:
    require(lease_backend, Capability.SHARED_LEASES)
    reader = shared(lease_name, lease_backend, "r1")
    got: list[Lease] = []
    waiting = threading.Thread(
        target=lambda: got.append(
            acquire(lease_name, ttl=10, backend=lease_backend, timeout=20, holder="w")
        )
    )
    waiting.start()

    def readers_stopped() -> bool:
        try:
            late = shared(lease_name, lease_backend, "late", timeout=0)
        except LeaseUnavailable:
            return True
        late.release()
        return False

    wait_until(readers_stopped, 10, "the waiting writer to stop new readers")
    reader.release()
    waiting.join(timeout=20)
    assert got and got[0].token > reader.token
    got[0].release()


class LoopHolder:
    """An exclusive holder whose grant was won on an event loop (a thread of its own), released
    when the test says. On the database such a grant keeps no tenure lock, so a writer waiting
    behind it waits in the name's room for the release's ``NOTIFY`` rather than on the server:
    a reader's try can then come between the release and the writer's next try."""

    def __init__(self, name: str, alias: str) -> None:
        self.name, self.alias = name, alias
        self.held: list[Lease] = []
        self._got, self._go = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._hold()))
        self._thread.start()
        assert self._got.wait(20) and self.held, "the holder never got the name"
        self.token = self.held[0].token

    async def _hold(self) -> None:
        held = await aacquire(self.name, ttl=10, backend=self.alias, holder="x", keepalive=False)
        self.held.append(held)
        self._got.set()
        await asyncio.to_thread(self._go.wait, 30)
        await held.arelease()

    def release(self) -> None:
        self._go.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the holder never released"


class HeldWait:
    """Holds a real store's ``wait_for_release`` at its start until the test lets it go: the
    caller is then waiting (its try since it began to wait was refused), and the test orders
    what happens next (the race, not a fake of it)."""

    def __init__(self, store: LeaseBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.waiting, self.go = threading.Event(), threading.Event()
        wait = store.wait_for_release

        def held(name: str, timeout: float) -> bool:
            self.waiting.set()
            assert self.go.wait(20), "the test never let the wait go"
            return wait(name, timeout)

        monkeypatch.setattr(store, "wait_for_release", held)


def test_a_writer_queued_behind_an_exclusive_holder_goes_before_later_readers(
    lease_backend: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer waits behind an exclusive holder of a name readers use; a reader comes; the
    holder leaves, and the reader's try comes before the writer's next one: it may not start a
    group ahead of the writer, which is granted next."""
    store = require(lease_backend, Capability.SHARED_LEASES)
    shared(lease_name, lease_backend, "r0").release()  # a name readers use
    holder = LoopHolder(lease_name, lease_backend)
    waits = HeldWait(store, monkeypatch)
    got: list[Lease] = []
    writer = threading.Thread(
        target=lambda: got.append(
            acquire(lease_name, ttl=10, backend=lease_backend, timeout=20, holder="w")
        )
    )
    writer.start()
    try:
        assert waits.waiting.wait(10), "the writer never waited"
        holder.release()
        with pytest.raises(LeaseUnavailable):
            shared(lease_name, lease_backend, "r", timeout=0).release()
    finally:
        waits.go.set()
        writer.join(timeout=30)
    assert got and got[0].token > holder.token
    got[0].release()


def test_a_writer_that_gave_up_stops_readers_no_longer_than_its_stamp(
    lease_backend: str, lease_name: str
) -> None:
    """A writer refused behind an exclusive holder of a name readers use gives up; once the
    holder leaves, a reader is granted once the writer left the name's room (the database) or
    its stamp ran out (Redis: it is never refreshed again)."""
    require(lease_backend, Capability.SHARED_LEASES)
    shared(lease_name, lease_backend, "r0").release()  # a name readers use
    holder = acquire(lease_name, ttl=10, backend=lease_backend, holder="x")
    with pytest.raises(LeaseUnavailable):
        acquire(lease_name, ttl=10, backend=lease_backend, timeout=0.5, holder="w")
    holder.release()
    started = time.monotonic()
    reader = shared(lease_name, lease_backend, "r", timeout=20)
    assert time.monotonic() - started < 10  # the stamp lasts a second; slack for a slow host
    reader.release()


def test_a_forged_or_expired_reader_cannot_renew_or_release(
    lease_backend: str, lease_name: str
) -> None:
    require(lease_backend, Capability.SHARED_LEASES)
    store = get_backend(lease_backend)
    reader = acquire(lease_name, ttl=0.5, backend=lease_backend, holder="r1", shared=True,
                     keepalive=False)  # fmt: skip
    other = shared(lease_name, lease_backend, "r2")  # keeps the group alive meanwhile
    forged = replace(reader.grant, secret="0" * 32)
    with pytest.raises(LeaseNotHeld):
        store.renew(forged, 10)
    with pytest.raises(LeaseNotHeld):
        store.release(forged)
    wait_until(lambda: reader.remaining() == 0, 5, "the reader's validity to run out")
    time.sleep(0.3)  # past the store's expiry too (the client's view is pessimistic)
    with pytest.raises(LeaseLost):
        store.renew(reader.grant, 10)
    with pytest.raises(LeaseLost):
        store.release(reader.grant)
    other.release()
    writer = acquire(lease_name, ttl=10, backend=lease_backend, timeout=0, holder="w")
    writer.release()


def test_a_reader_era_write_is_rejected_once_the_writer_fenced_the_resource(
    lease_backend: str, lease_name: str, workers: Workers
) -> None:
    """A reader (a child process) writes, is paused past its TTL; a writer takes the name and
    writes; the resumed reader's write is rejected as stale, by the register's own log."""
    require(lease_backend, Capability.SHARED_LEASES)
    ttl = 1.0
    register = new_register("shared")
    before = shared(lease_name, lease_backend, "r0")
    assert record_write(register, before, "r0")
    paused = workers.spawn("hold-shared", lease_backend, lease_name, register, ttl)
    reader = workers.wait_for("acquired", paused.pid)
    assert reader["accepted"] and reader["token"] > before.token
    before.release()
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        writer = acquire(lease_name, ttl=10, backend=lease_backend, timeout=10, holder="w")
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    assert writer.token > reader["token"]
    assert record_write(register, writer, "writer")
    assert paused.stdin is not None
    paused.stdin.write("go\n")
    paused.stdin.flush()
    resumed = workers.wait_for("resumed", paused.pid, timeout=30)
    assert resumed["write"] is False
    late = [a for a in history(register) if a.writer == reader["holder"]][-1]
    assert late.outcome == STALE and late.stored == writer.token
    assert resumed["release"] == "LeaseLost"
    check_history(register, grants=[before.token, reader["token"], writer.token])
    writer.release()


def test_lease_checked_writes_refuse_a_shared_lease(lease_backend: str, lease_name: str) -> None:
    require(lease_backend, Capability.SHARED_LEASES, Capability.LEASE_ROWS)
    reader = shared(lease_name, lease_backend, "r1")
    with pytest.raises(LeaseCheckUnavailable):
        FencedDoc(title="x").save(lease=reader)
    reader.release()


def test_a_force_release_evicts_the_whole_group(lease_backend: str, lease_name: str) -> None:
    """An operator revokes the token they saw (the latest reader's): every reader loses."""
    store = require(lease_backend, Capability.SHARED_LEASES, Capability.FORCE_RELEASE)
    readers = [
        acquire(lease_name, ttl=10, backend=lease_backend, holder=f"r{i}", shared=True,
                keepalive=False)
        for i in (1, 2)
    ]  # fmt: skip
    info = store.inspect(lease_name)
    assert info is not None and info.held and info.token == readers[1].token
    store.force_release(lease_name, info.token)
    for reader in readers:
        with pytest.raises(LeaseLost):
            reader.renew()
    writer = acquire(lease_name, ttl=10, backend=lease_backend, timeout=0, holder="w")
    assert writer.token > readers[1].token
    writer.release()
