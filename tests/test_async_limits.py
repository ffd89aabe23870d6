"""The async twins of the limits: ``asemaphore()``/``aacquire_slot()`` and
``aacquire(..., shared=True)``/``alease(..., shared=True)``, on every backend each applies to.

A semaphore's holders are counted by the resource's accepted-write log (the history checker),
not by the client's belief; cancelling a waiting task leaves nothing held; async readers
coexist and an async writer, waiting, stops new readers and then excludes them all with a
higher token.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from unittest import mock

import pytest
from django.db import connections

from devservers import free_port
from leases import (
    BackendNotSupported,
    InvalidLeaseOption,
    LeaseAlreadyHeld,
    LeaseUnavailable,
    aacquire,
    aacquire_slot,
    acquire_slot,
    alease,
    asemaphore,
    signals,
)
from leases.backends import Capability, LeaseBackend, get_backend
from leases.handle import Lease
from leases.semaphore import MAX_LIMIT, slot_name
from tests.checker import new_register, record_write
from tests.extra_backends import added_backend, closed_port_backend
from tests.lease_backends import lease_backend, lease_name, require
from tests.test_lease_async import Ticker, arun
from tests.test_semaphore import (
    SLOW_LIMIT,
    SLOW_TIMEOUT,
    assert_says_how_many_were_tried,
    check_slot_histories,
    slow_full_semaphore,
)

__all__ = ["closed_port_backend", "lease_backend", "lease_name"]


def logged_write(register: str, slot: Lease, writer: str) -> None:
    """:func:`record_write` on a worker thread of the loop, closing the thread's database
    connection after it (the executor's threads outlive the test otherwise, connections and
    all)."""
    try:
        record_write(register, slot, writer)
    finally:
        connections.close_all()


def held_slots(alias: str, name: str, limit: int) -> list[int]:
    backend = get_backend(alias)
    infos = [(k, backend.inspect(slot_name(name, k))) for k in range(limit)]
    return [k for k, info in infos if info is not None and info.held]


# -- semaphores -------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "3", None, MAX_LIMIT + 1])
def test_a_bad_limit_is_refused_before_any_round_trip(
    closed_port_backend: str, limit: object
) -> None:
    """The backend's port is closed: a round trip would raise BackendUnavailable instead."""

    async def main() -> None:
        with pytest.raises(InvalidLeaseOption) as refused:
            await aacquire_slot("exports", limit=limit, backend=closed_port_backend)  # type: ignore[arg-type]
        assert refused.value.option == "limit"

    asyncio.run(main())
    with pytest.raises(InvalidLeaseOption):
        asemaphore("exports", limit=limit)  # type: ignore[call-overload]


def test_twenty_tasks_never_exceed_three_holders(
    lease_backend: str, lease_name: str, transactional_db: None
) -> None:
    """20 coroutines of one loop contend for 3 slots; each writes its slot's fenced register
    on entry and exit (on a worker thread: the ORM is sync). By the registers' logs never more
    than 3 at once, and each slot's history passes the checker."""
    limit, tasks = 3, 20
    register = new_register("asem")
    grants: dict[int, list[int]] = defaultdict(list)

    async def contend(index: int) -> None:
        async with asemaphore(lease_name, limit=limit, ttl=10, backend=lease_backend) as slot:
            assert isinstance(slot, Lease)
            grants[slot.slot].append(slot.token)
            writer = f"task{index}/slot{slot.slot}@{slot.token}"
            where = f"{register}/{slot.slot}"
            await asyncio.to_thread(logged_write, where, slot, writer)
            await asyncio.sleep(0.05 + random.uniform(0, 0.05))  # long enough to overlap
            await asyncio.to_thread(logged_write, where, slot, writer)

    async def main() -> None:
        async with asyncio.timeout(60):
            await asyncio.gather(*(contend(i) for i in range(tasks)))

    arun(lease_backend, main)
    assert sum(len(tokens) for tokens in grants.values()) == tasks
    assert set(grants) <= set(range(limit))
    check_slot_histories(register, grants, limit)
    assert held_slots(lease_backend, lease_name, limit) == []


def test_cancelling_a_slot_wait_leaves_nothing_held(lease_backend: str, lease_name: str) -> None:
    """The semaphore is full (a sync holder in each slot); a task waits, is cancelled, stops
    at once; once the holders leave, no slot is held. Then a task cancelled while its first
    try is on the wire gives back what it won."""
    full = [
        acquire_slot(lease_name, limit=2, ttl=30, backend=lease_backend, holder=f"h{i}")
        for i in range(2)
    ]

    async def wait_then_cancel() -> tuple[float, int]:
        async with Ticker() as ticker:
            waiter = asyncio.create_task(
                aacquire_slot(lease_name, limit=2, ttl=5, backend=lease_backend, timeout=30)
            )
            # The wait has a 30 s timeout: had it blocked the loop, 10 turns would take that long.
            turned = await ticker.turned(10, within=5.0)
            waiting = not waiter.done()
            started = time.monotonic()
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            return time.monotonic() - started, turned and waiting

    stopped_after, kept_turning = arun(lease_backend, wait_then_cancel)
    assert stopped_after < 1.0, stopped_after
    assert kept_turning, "the loop did not keep turning while the task waited"
    assert sorted(held_slots(lease_backend, lease_name, 2)) == [0, 1]
    for held in full:
        held.release()
    assert held_slots(lease_backend, lease_name, 2) == []

    async def cancel_mid_try() -> None:
        attempt = asyncio.create_task(
            aacquire_slot(lease_name, limit=2, ttl=30, backend=lease_backend)
        )
        await asyncio.sleep(0)  # the first try is sent, its answer not yet read
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt

    arun(lease_backend, cancel_mid_try)
    assert held_slots(lease_backend, lease_name, 2) == []


def test_a_full_semaphore_fails_within_the_timeout(lease_backend: str, lease_name: str) -> None:
    held = acquire_slot(lease_name, limit=1, ttl=30, backend=lease_backend, holder="h")

    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(LeaseUnavailable, match="all 1 slots are held"):
            await aacquire_slot(lease_name, limit=1, backend=lease_backend, timeout=0.5)
        return time.monotonic() - started

    took = arun(lease_backend, main)
    held.release()
    assert 0.4 <= took < 3.0, took


def test_a_full_semaphore_gives_up_by_its_timeout_whatever_its_limit(
    lease_name: str, db: None
) -> None:
    """As ``acquire_slot()`` (``test_semaphore``): the deadline is looked at before each
    slot's try, not after a pass over all of them (32 slowed tries, 1.6 s)."""

    async def main() -> tuple[float, str]:
        started = time.monotonic()
        with pytest.raises(LeaseUnavailable) as failed:
            await aacquire_slot(lease_name, limit=SLOW_LIMIT, timeout=SLOW_TIMEOUT)
        return time.monotonic() - started, str(failed.value)

    with slow_full_semaphore(lease_name) as tried:
        took, message = arun("default", main)
    assert SLOW_TIMEOUT <= took < SLOW_TIMEOUT + 1.0, f"gave up after {took:.2f}s"
    assert_says_how_many_were_tried(message, len(tried))


def test_a_slot_wait_announces_what_it_cost_like_acquire_slot(
    lease_backend: str, lease_name: str
) -> None:
    """``aacquire_slot`` goes through ``acquire_slot``'s announcements: a timed-out wait sends
    ``lease_acquire_failed`` with its elapsed and waited time, a won slot ``lease_acquired``
    with them (not ``None``)."""
    seen: list[tuple[str, float | None, float | None]] = []

    def on_acquired(sender: str, lease: Lease, elapsed: float | None, **kw: object) -> None:
        if lease.name.startswith(lease_name):
            seen.append(("acquired", elapsed, kw["waited"]))  # type: ignore[arg-type]

    def on_failed(sender: str, name: str, elapsed: float | None, **kw: object) -> None:
        if name == lease_name:
            seen.append(("failed", elapsed, kw["waited"]))  # type: ignore[arg-type]

    held = acquire_slot(lease_name, limit=1, ttl=30, backend=lease_backend, holder="h")

    async def main() -> None:
        with pytest.raises(LeaseUnavailable):
            await aacquire_slot(lease_name, limit=1, backend=lease_backend, timeout=0.3)
        held.release()
        won = await aacquire_slot(lease_name, limit=1, ttl=10, backend=lease_backend, timeout=10)
        await won.arelease()

    signals.lease_acquired.connect(on_acquired, weak=False)
    signals.lease_acquire_failed.connect(on_failed, weak=False)
    try:
        arun(lease_backend, main)
    finally:
        signals.lease_acquired.disconnect(on_acquired)
        signals.lease_acquire_failed.disconnect(on_failed)
    (failed, won) = seen[-2:]
    assert failed[0] == "failed" and failed[1] is not None and failed[2] is not None, seen
    # Waited: what the wait after the first try took, so the first try's own time is not in
    # it (on a loaded machine a Redlock try took 0.2 s of the 0.3 s timeout: waited 0.1 s).
    assert 0 < failed[2] <= failed[1] and 0.25 <= failed[1] < 10, failed
    assert won[0] == "acquired" and won[1] is not None and won[2] == 0.0, won


def test_block_decorator_forms_and_no_reentry_per_task(lease_backend: str, lease_name: str) -> None:
    async def main() -> None:
        async with asemaphore(lease_name, limit=2, ttl=10, backend=lease_backend) as slot:
            assert slot.semaphore == lease_name
            with pytest.raises(LeaseAlreadyHeld):  # the same task: one slot at a time
                await aacquire_slot(lease_name, limit=2, backend=lease_backend)
            other = await asyncio.create_task(  # another task takes the other slot
                aacquire_slot(lease_name, limit=2, ttl=10, backend=lease_backend, timeout=0)
            )
            assert other.slot != slot.slot
            await other.arelease()
        assert slot.done

        @asemaphore(limit=1, ttl=10, backend=lease_backend)
        async def unnamed() -> list[int]:
            return held_slots(lease_backend, f"{__name__}.{qualname}", 1)

        @asemaphore(lease_name, limit=1, ttl=10, backend=lease_backend)
        async def named(value: str) -> str:
            assert held_slots(lease_backend, lease_name, 1) == [0]
            return value

        qualname = (
            "test_block_decorator_forms_and_no_reentry_per_task.<locals>.main.<locals>.unnamed"
        )
        assert await unnamed() == [0]
        assert await named("done") == "done"

    arun(lease_backend, main)

    def plain() -> None: ...

    with pytest.raises(InvalidLeaseOption, match="coroutine functions"):
        asemaphore(limit=1)(plain)  # type: ignore[arg-type]


# -- shared leases ------------------------------------------------------------------------


def test_async_shared_leases_are_refused_before_any_round_trip() -> None:
    """Redlock at a closed port: a round trip would raise BackendUnavailable instead."""
    nodes = [f"redis://127.0.0.1:{free_port()}/0"]

    async def main() -> None:
        with pytest.raises(BackendNotSupported) as refused:
            await aacquire("x", backend="closed-redlock", shared=True)
        assert refused.value.capability == "shared leases"
        with pytest.raises(BackendNotSupported):
            async with alease("x", backend="closed-redlock", shared=True):
                pass
        for alias in ("etcd", "zookeeper"):  # their clusters need not run: nothing is sent
            with pytest.raises(BackendNotSupported):
                await aacquire("x", backend=alias, shared=True)

    with added_backend("closed-redlock", {"ENGINE": "leases.backends.redlock", "NODES": nodes}):
        asyncio.run(main())


def test_backends_with_shared_leases_do_them_with_async_io() -> None:
    """No thread hop: each backend that declares shared leases overrides the async hooks."""
    for alias in ("default", "redis"):
        backend = type(get_backend(alias))
        assert Capability.SHARED_LEASES in backend.capabilities
        for hook in ("atry_acquire_shared", "astop_new_readers", "arenew", "arelease"):
            assert getattr(backend, hook) is not getattr(LeaseBackend, hook), (alias, hook)


def test_async_readers_coexist_and_an_async_writer_excludes_them(
    lease_backend: str, lease_name: str
) -> None:
    """Two async readers hold together; an async writer waits, stops new readers meanwhile,
    and wins once they leave, with a token above theirs; readers then wait for it."""
    require(lease_backend, Capability.SHARED_LEASES)

    async def reader(holder: str, **options: object) -> Lease:
        return await aacquire(
            lease_name,
            ttl=10,
            backend=lease_backend,
            holder=holder,
            shared=True,
            **options,  # type: ignore[arg-type]
        )

    async def readers_stopped() -> bool:
        try:
            late = await reader("late", timeout=0)
        except LeaseUnavailable:
            return True
        await late.arelease()
        return False

    async def main() -> None:
        first, second = await asyncio.gather(reader("r1"), reader("r2"))
        assert first.shared and second.shared and first.token != second.token
        await first.arenew()
        with pytest.raises(LeaseUnavailable):
            await aacquire(lease_name, backend=lease_backend, timeout=0, holder="w")
        writer = asyncio.create_task(
            aacquire(lease_name, ttl=10, backend=lease_backend, timeout=20, holder="w")
        )
        deadline = time.monotonic() + 10
        while not await readers_stopped():
            assert time.monotonic() < deadline, "the waiting writer never stopped new readers"
            await asyncio.sleep(0.05)
        assert not writer.done()
        await first.arelease()
        await second.arelease()
        won = await writer
        assert not won.shared and won.token > max(first.token, second.token)
        with pytest.raises(LeaseUnavailable):
            await reader("r3", timeout=0)
        await won.arelease()
        async with alease(lease_name, ttl=10, backend=lease_backend, shared=True) as third:
            assert third.shared and third.token > won.token

    arun(lease_backend, main)
    info = get_backend(lease_backend).inspect(lease_name)
    assert info is not None and not info.held


def test_failed_tries_no_wait_follows_are_not_kept_forever(lease_name: str, db: None) -> None:
    """The database backend remembers each task's failed try for the wait after it; tries no
    wait follows (``timeout=0``, the other slots of a full semaphore) must not pile up for the
    loop's life: past the bound, the oldest are forgotten."""
    backend = get_backend("default")
    held = backend.try_acquire(lease_name, "holder", 30)
    assert held is not None

    async def fail_in_a_new_task() -> None:
        with pytest.raises(LeaseUnavailable):
            await aacquire(lease_name, ttl=5, timeout=0)

    async def main() -> int:
        state = backend._async.get()  # type: ignore[attr-defined]
        with mock.patch("leases.backends._pgconn._RECENT_RELEASES", 5):
            for _ in range(12):  # each task its own entry (while it lives, its own id)
                await asyncio.gather(*(fail_in_a_new_task() for _ in range(3)))
            return len(state.failed_at)

    try:
        kept = arun("default", main)
    finally:
        backend.release(held)
    assert kept <= 5, kept
