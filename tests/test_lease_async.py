"""The async API's guarantees, run once per backend in ``LEASE_BACKENDS``.

``aacquire``/``alease``/``arenew``/``arelease`` keep the sync contract (tokens increase, a held
name cannot be taken, waits end at their deadline, a release wakes a waiter), and add their own:
waiting never blocks the event loop, cancelling leaves nothing held, coroutines of one loop
contend like threads, and a blocked loop cannot hide a lost lease.
"""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

import leases
from leases import (
    LeaseAlreadyHeld,
    LeaseLost,
    LeaseNotHeld,
    LeaseUnavailable,
    aacquire,
    alease,
    signals,
)
from leases.backends import get_backend
from leases.errors import InvalidLeaseOption
from leases.handle import Lease
from tests.lease_backends import lease_backend, lease_name

__all__ = ["lease_backend", "lease_name"]  # fixtures, re-exported for pytest

T = TypeVar("T")


def arun(alias: str, main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` on a fresh loop, closing the backend's async clients before it ends."""

    async def wrapped() -> T:
        try:
            return await main()
        finally:
            for used in {alias, "default"}:
                await get_backend(used).aclose()

    return asyncio.run(wrapped())


class Ticker:
    """Counts event-loop turns while a wait runs: a blocked loop counts none."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.ticks += 1

    async def turned(self, ticks: int, within: float) -> bool:
        """Whether the loop turned ``ticks`` times before ``within`` seconds passed.

        Waited for, not slept: a loaded machine may need many times the nominal 10 ms a tick,
        while a loop blocked by a synchronous wait stays blocked past ``within`` (the wait's
        own timeout is longer) and is caught by the clock read after it."""
        started = time.monotonic()
        while self.ticks < ticks:
            if time.monotonic() - started > within:
                return False
            await asyncio.sleep(0.01)
        return time.monotonic() - started <= within

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def test_async_names_are_exported() -> None:
    assert leases.aacquire is aacquire and leases.alease is alease
    assert {"aacquire", "alease"} <= set(leases.__all__)


def test_tokens_increase_and_arelease_frees(lease_backend: str, lease_name: str) -> None:
    async def main() -> list[int]:
        tokens = []
        for _ in range(3):
            held = await aacquire(lease_name, ttl=2, backend=lease_backend, timeout=0)
            tokens.append(held.token)
            held.ensure_held()
            assert held.remaining() > 0 and not held.lost.is_set()
            await held.arelease()
        return tokens

    tokens = arun(lease_backend, main)
    assert tokens == sorted(set(tokens)), tokens
    info = get_backend(lease_backend).inspect(lease_name)
    assert info is not None and not info.held


def test_alease_block_and_both_decorator_forms(lease_backend: str, lease_name: str) -> None:
    seen: list[str] = []

    @alease
    async def bare() -> str:
        return "bare"

    @alease(lease_name, ttl=2, backend=lease_backend, timeout=0)
    async def called(value: str) -> str:
        info = get_backend(lease_backend).inspect(lease_name)
        assert info is not None and info.held
        return value

    async def main() -> None:
        async with alease(lease_name, ttl=2, backend=lease_backend, timeout=0) as held:
            assert get_backend(lease_backend).try_acquire(lease_name, "other", 1.0) is None
            seen.append(held.name)
        seen.append(await called("called"))
        seen.append(await asyncio.wait_for(bare(), 30))

    arun(lease_backend, main)
    assert seen == [lease_name, "called", "bare"]
    assert bare.__name__ == "bare"


def test_alease_refuses_plain_functions_and_lease_points_to_it() -> None:
    with pytest.raises(InvalidLeaseOption, match="coroutine functions"):
        alease("x")(lambda: None)  # type: ignore[arg-type, return-value]

    async def job() -> None: ...

    with pytest.raises(InvalidLeaseOption, match="alease"):
        leases.lease("x")(job)


def test_arenew_extends_and_a_second_arelease_is_refused(
    lease_backend: str, lease_name: str
) -> None:
    async def main() -> None:
        held = await aacquire(lease_name, ttl=1, backend=lease_backend, keepalive=False)
        await asyncio.sleep(0.5)
        grant = await held.arenew(3)
        assert grant.ttl == 3 and held.remaining() > 2
        await asyncio.sleep(0.8)  # past the first TTL: the renewal is what holds it
        held.ensure_held()
        assert get_backend(lease_backend).try_acquire(lease_name, "other", 1.0) is None
        await held.arelease()
        with pytest.raises(LeaseNotHeld):
            await held.arelease()

    arun(lease_backend, main)


def test_arelease_after_expiry_reports_lost_and_keeps_successor(
    lease_backend: str, lease_name: str
) -> None:
    async def main() -> None:
        held = await aacquire(lease_name, ttl=0.5, backend=lease_backend, keepalive=False)
        await asyncio.sleep(0.8)
        successor = await aacquire(lease_name, ttl=5, backend=lease_backend, holder="next")
        with pytest.raises(LeaseLost):
            await held.arenew()
        with pytest.raises(LeaseLost):
            await held.arelease()
        info = get_backend(lease_backend).inspect(lease_name)
        assert info is not None and info.held and info.holder == "next"
        await successor.arelease()

    arun(lease_backend, main)


def test_a_task_cannot_reenter_but_another_task_waits(lease_backend: str, lease_name: str) -> None:
    async def main() -> float:
        async with alease(lease_name, ttl=5, backend=lease_backend):
            with pytest.raises(LeaseAlreadyHeld):
                await aacquire(lease_name, ttl=5, backend=lease_backend, timeout=0)
            other = asyncio.create_task(
                aacquire(lease_name, ttl=5, backend=lease_backend, timeout=10)
            )
            await asyncio.sleep(0.3)
            assert not other.done()
            released_at = time.monotonic()
        second = await other
        woken_after = time.monotonic() - released_at
        await second.arelease()
        return woken_after

    woken_after = arun(lease_backend, main)
    assert woken_after < 1.5, woken_after


@pytest.mark.django_db(transaction=True)
def test_a_task_at_the_address_of_a_finished_holder_does_not_already_hold(
    lease_name: str,
) -> None:
    """A lease taken in a task that then ended (``asyncio.wait_for`` on Python 3.11 runs its
    awaitable in a task of its own) is held by no task alive: a later task that CPython put
    at the freed task's address, keyed by ``id(task)``, was refused ``LeaseAlreadyHeld``
    (267 of a stress test's calls) instead of waiting like every other task."""

    async def main() -> type[BaseException] | None:
        helper = asyncio.create_task(aacquire(lease_name, ttl=30))
        held = await helper
        address, gone = id(helper), weakref.ref(helper)
        del helper
        for _ in range(3):  # the loop lets go of a finished task's last references
            await asyncio.sleep(0)
        gc.collect()
        assert gone() is None
        gates: list[asyncio.Future[None]] = []
        kept: list[asyncio.Task[type[BaseException] | None]] = []

        async def try_once(gate: asyncio.Future[None]) -> type[BaseException] | None:
            await gate
            try:
                await aacquire(lease_name, ttl=30, timeout=0)
            except (LeaseAlreadyHeld, LeaseUnavailable) as exc:
                return type(exc)
            return None

        try:
            for _ in range(20_000):  # CPython reuses a freed task's memory within a few
                gate = asyncio.get_running_loop().create_future()
                task = asyncio.create_task(try_once(gate))
                gates.append(gate)
                kept.append(task)  # alive: their addresses stay taken
                if id(task) == address:
                    gate.set_result(None)
                    return await task
            pytest.skip("no task of this test was put at the freed task's address")
        finally:
            for task in kept:
                task.cancel()
            await asyncio.gather(*kept, return_exceptions=True)
            await held.arelease()

    assert arun("default", main) is LeaseUnavailable


def test_a_failed_wait_ends_at_its_deadline_without_blocking_the_loop(
    lease_backend: str, lease_name: str
) -> None:
    timeout = 0.4
    holder = get_backend(lease_backend).try_acquire(lease_name, "holder", 30)
    assert holder is not None

    async def main() -> tuple[list[float], int]:
        overshoots = []
        async with Ticker() as ticker:
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(LeaseUnavailable):
                    await aacquire(lease_name, ttl=1, backend=lease_backend, timeout=timeout)
                overshoots.append(time.monotonic() - started - timeout)
        return sorted(overshoots), ticker.ticks

    try:
        overshoots, ticks = arun(lease_backend, main)
    finally:
        get_backend(lease_backend).release(holder)
    assert -0.01 <= overshoots[1] < 0.15, overshoots
    # 1.2 s of waiting: a loop that was free turned ~100 times (fewer on a loaded machine); a
    # blocked one 0 to 3 times.
    assert ticks >= 10, ticks


def test_cancelling_a_wait_stops_it_and_leaves_nothing_held(
    lease_backend: str, lease_name: str
) -> None:
    backend = get_backend(lease_backend)
    holder = backend.try_acquire(lease_name, "holder", 30)
    assert holder is not None

    async def main() -> float:
        waiter = asyncio.create_task(aacquire(lease_name, ttl=5, backend=lease_backend))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return time.monotonic() - started

    stopped_after = arun(lease_backend, main)
    backend.release(holder)
    assert stopped_after < 0.5, stopped_after
    info = backend.inspect(lease_name)
    assert info is not None and not info.held


def test_cancelling_mid_try_gives_back_what_it_won(lease_backend: str, lease_name: str) -> None:
    """Cancelled while the first try is on the wire: the try wins, then is given back."""

    async def main() -> None:
        attempt = asyncio.create_task(aacquire(lease_name, ttl=30, backend=lease_backend))
        await asyncio.sleep(0)  # the try is sent, its answer not yet read
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt

    arun(lease_backend, main)
    info = get_backend(lease_backend).inspect(lease_name)
    assert info is None or not info.held


def test_cancelling_mid_release_still_releases(lease_backend: str, lease_name: str) -> None:
    """Cancelled while ``arelease()``'s round trip is on the wire: the release runs to its end
    (the name is free, the lease released) and the cancellation is raised after it."""

    async def main() -> Lease:
        held = await aacquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
        releasing = asyncio.create_task(held.arelease())
        await asyncio.sleep(0)  # the release is sent, its answer not yet read
        releasing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        return held

    held = arun(lease_backend, main)
    info = get_backend(lease_backend).inspect(lease_name)
    assert info is None or not info.held
    assert held.remaining() == 0
    with pytest.raises(LeaseNotHeld):
        held.release()  # released once already: its outcome was known


def test_cancelling_mid_hold_releases(lease_backend: str, lease_name: str) -> None:
    async def main() -> None:
        inside = asyncio.Event()

        async def hold() -> None:
            async with alease(lease_name, ttl=30, backend=lease_backend):
                inside.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(hold())
        await inside.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    arun(lease_backend, main)
    info = get_backend(lease_backend).inspect(lease_name)
    assert info is not None and not info.held


def test_a_blocked_loop_cannot_hide_a_lost_lease(lease_backend: str, lease_name: str) -> None:
    """A loop blocked by ``time.sleep`` past the validity: the first check after it fails.

    Without keepalive nothing renews; the watchdog thread (not the loop) declares the loss on
    time, so ``lost`` is set while the loop is still blocked, and ``ensure_held()`` raises.
    """
    reports: list[str] = []

    async def main() -> None:
        held = await aacquire(
            lease_name,
            ttl=0.6,
            backend=lease_backend,
            keepalive=False,
            on_lost=lambda lost: reports.append(lost.lost_reason or ""),
        )
        time.sleep(1.0)  # the loop is blocked: no task, no callback runs
        assert held.lost.is_set() and reports, "the watchdog thread reports the loss"
        with pytest.raises(LeaseLost):
            held.ensure_held()
        assert held.remaining() == 0
        with pytest.raises(LeaseLost):
            await held.arelease()

    arun(lease_backend, main)


def test_keepalive_renews_while_the_loop_is_blocked(lease_backend: str, lease_name: str) -> None:
    """Renewal runs on the shared renewer thread, so a blocked loop does not lose the lease."""

    async def main() -> None:
        async with alease(lease_name, ttl=1, backend=lease_backend) as held:
            time.sleep(1.6)
            held.ensure_held()
            assert held.remaining() > 0

    arun(lease_backend, main)


def test_aacquire_reports_elapsed_and_waited_like_acquire(
    lease_backend: str, lease_name: str
) -> None:
    """``lease_acquired`` and ``lease_acquire_failed`` carry what the acquisition cost, as
    from ``acquire()``: nothing waited for a free name, the holder's time for a taken one."""
    seen: list[tuple[str, float | None, float | None]] = []

    def on_acquired(sender: str, elapsed: float | None, waited: float | None, **_: object) -> None:
        seen.append(("acquired", elapsed, waited))

    def on_failed(sender: str, elapsed: float | None, waited: float | None, **_: object) -> None:
        seen.append(("failed", elapsed, waited))

    async def main() -> None:
        first = await aacquire(lease_name, ttl=10, backend=lease_backend, keepalive=False)
        with pytest.raises(LeaseUnavailable):
            await aacquire(lease_name, ttl=10, backend=lease_backend, timeout=0, holder="c")
        # Release only once the waiter's first try was refused: a release that lands before
        # it (a slow try on a loaded machine) would make it an acquire that never waited.
        store, refused = get_backend(lease_backend), asyncio.Event()
        trying = store.atry_acquire

        async def spied(name: str, holder: str, ttl: float) -> Any:
            grant = await trying(name, holder, ttl)
            if grant is None and holder == "w":
                refused.set()
            return grant

        async def release_when_waited() -> None:
            await asyncio.wait_for(refused.wait(), 20)
            await asyncio.sleep(0.3)
            await first.arelease()

        store.atry_acquire = spied  # type: ignore[method-assign]
        try:
            releasing = asyncio.ensure_future(release_when_waited())
            second = await aacquire(
                lease_name, ttl=10, backend=lease_backend, timeout=20, holder="w"
            )
            await releasing
        finally:
            del store.atry_acquire
        await second.arelease()

    signals.lease_acquired.connect(on_acquired, weak=False)
    signals.lease_acquire_failed.connect(on_failed, weak=False)
    try:
        arun(lease_backend, main)
    finally:
        signals.lease_acquired.disconnect(on_acquired)
        signals.lease_acquire_failed.disconnect(on_failed)
    (free, refused, waited) = seen
    assert free[0] == "acquired" and free[2] == 0.0 and free[1] is not None and free[1] >= 0
    assert refused[0] == "failed" and refused[2] == 0.0 and refused[1] is not None
    assert waited[0] == "acquired" and waited[1] is not None and waited[2] is not None
    assert 0.2 <= waited[2] <= waited[1] < 15, waited


def test_the_wrong_with_names_the_right_one() -> None:
    """``with alease(...)`` and ``async with lease(...)`` raised Python's bare TypeError
    ("does not support the context manager protocol"); they now say which form to use, before
    any round trip (nothing is acquired: no backend is even looked up)."""
    with pytest.raises(InvalidLeaseOption, match="async with"), leases.alease("wrong-with"):
        pytest.fail("entered")

    async def main() -> None:
        async with leases.lease("wrong-async-with"):
            pytest.fail("entered")

    with pytest.raises(InvalidLeaseOption, match="use alease"):
        asyncio.run(main())


def test_blocking_acquisitions_are_refused_inside_a_running_event_loop(
    lease_backend: str, lease_name: str
) -> None:
    """``with lease()`` in an async view would freeze every task of the loop for its wait: it
    fails at once, like Django's ORM, and takes nothing (the name is free to ``aacquire``)."""
    from django.core.exceptions import SynchronousOnlyOperation

    from leases import BlockingInEventLoop, acquire, elect, lease, semaphore
    from leases.semaphore import acquire_slot

    async def main() -> list[str]:
        refused: list[str] = []
        calls: list[Callable[[], object]] = [
            lambda: acquire(lease_name, backend=lease_backend),
            lambda: lease(lease_name, backend=lease_backend).__enter__(),
            lambda: acquire_slot(lease_name, limit=2, backend=lease_backend),
            lambda: semaphore(lease_name, limit=2, backend=lease_backend).__enter__(),
            lambda: elect(lease_name, backend=lease_backend),
        ]
        for call in calls:
            with pytest.raises(BlockingInEventLoop) as caught:
                call()
            assert isinstance(caught.value, SynchronousOnlyOperation)
            refused.append(str(caught.value))
        with pytest.raises(InvalidLeaseOption):  # bad input still says what is wrong first
            acquire(lease_name, ttl=-1, backend=lease_backend)
        held = await aacquire(lease_name, timeout=0, backend=lease_backend)
        await held.arelease()
        return refused

    refused = arun(lease_backend, main)
    assert "acquire() blocks" in refused[0] and "aacquire()" in refused[0]
    assert "acquire_slot() blocks" in refused[2]
    assert "elect() blocks" in refused[4] and "aelect()" in refused[4]


def test_django_allow_async_unsafe_lifts_the_refusal(
    lease_backend: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

    async def main() -> int:
        held = leases.acquire(lease_name, timeout=0, backend=lease_backend, keepalive=False)
        held.release()
        return held.token

    assert arun(lease_backend, main) > 0
