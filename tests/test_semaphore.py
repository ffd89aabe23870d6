"""Counting semaphores on every lease backend: never more than ``limit`` holders, by the
resources' own accepted-write logs; tokens per slot strictly increase; a paused holder's write
to its slot's resource is rejected once its slot has a successor."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from django.db import connections

from leases import (
    InvalidLeaseName,
    InvalidLeaseOption,
    LeaseAlreadyHeld,
    LeaseUnavailable,
    acquire,
    lease,
)
from leases.aio_semaphore import aacquire_slot
from leases.backends import get_backend
from leases.keys import SEPARATOR
from leases.semaphore import MAX_LIMIT, Slot, acquire_slot, semaphore, slot_name
from tests.checker import STALE, Attempt, check_history, history, new_register, record_write
from tests.extra_backends import closed_port_backend
from tests.lease_backends import lease_backend, lease_name
from tests.test_lease_conformance import Interrupted, interrupting_the_first_grant
from tests.test_lease_faults import Workers, workers

__all__ = ["closed_port_backend", "lease_backend", "lease_name", "workers"]

#: A semaphore whose tries are slowed to ``SLOW_TRY`` seconds each: a pass over every slot
#: lasts 1.6 s, far past ``SLOW_TIMEOUT``, so an acquire that looks at its deadline only
#: after a whole pass shows against the bound by a second.
SLOW_LIMIT, SLOW_TRY, SLOW_TIMEOUT = 32, 0.05, 0.2


def max_concurrent(attempts: Iterable[Attempt]) -> int:
    """The most holders at once, by the accepted-write log: a holder (writer) spans from its
    first accepted write to its last, on the database's clock."""
    spans: dict[str, list[float]] = {}
    for a in attempts:
        if a.accepted and a.at is not None:
            at = a.at.timestamp()
            first, last = spans.get(a.writer, [at, at])
            spans[a.writer] = [min(first, at), max(last, at)]
    events = sorted([(s, 1) for s, _ in spans.values()] + [(e, -1) for _, e in spans.values()])
    # At equal instants, count the start before the end: a touching pair counts as overlapping.
    events.sort(key=lambda event: (event[0], -event[1]))
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


def check_slot_histories(register: str, grants: Mapping[int, list[int]], limit: int) -> None:
    """Each slot's register ``{register}/{slot}`` passes the checker with the slot's tokens in
    grant order, each holder wrote twice (on entry and exit: nobody lost its slot meanwhile),
    and by the accepted writes never more than ``limit`` held at once."""
    attempts: list[Attempt] = []
    for slot, tokens in grants.items():
        summary = check_history(f"{register}/{slot}", grants=tokens)
        assert summary.accepted == 2 * len(tokens), summary
        attempts += history(f"{register}/{slot}")
    assert 1 <= max_concurrent(attempts) <= limit


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "3", None, MAX_LIMIT + 1])
def test_a_bad_limit_is_refused_before_any_round_trip(
    closed_port_backend: str, limit: object
) -> None:
    """The backend's port is closed: a round trip would raise BackendUnavailable instead."""
    with pytest.raises(InvalidLeaseOption) as refused:
        acquire_slot("exports", limit=limit, backend=closed_port_backend)  # type: ignore[arg-type]
    assert refused.value.option == "limit"
    with pytest.raises(InvalidLeaseOption):
        semaphore("exports", limit=limit)  # type: ignore[call-overload]


def test_user_names_cannot_collide_with_slots(closed_port_backend: str) -> None:
    taken = slot_name("exports", 0)
    assert taken == f"exports{SEPARATOR}0"
    with pytest.raises(InvalidLeaseName):
        acquire(taken, backend=closed_port_backend)
    with pytest.raises(InvalidLeaseName):
        acquire_slot(taken, limit=2, backend=closed_port_backend)
    with pytest.raises(InvalidLeaseName):  # the longest slot name must fit in 255 characters
        acquire_slot("x" * 253, limit=100, backend=closed_port_backend)


def test_at_most_limit_holders_and_tokens_increase_per_slot(
    lease_backend: str, lease_name: str, transactional_db: None
) -> None:
    """Five threads contend for two slots; each writes its slot's fenced register on entry and
    exit. By the registers' logs, never more than two held at once, and each slot's history
    passes the checker (tokens per slot strictly increase, one writer per token)."""
    limit, threads, seconds = 2, 5, 2.0
    register = new_register("sem")
    grants: dict[int, list[int]] = defaultdict(list)
    errors: list[BaseException] = []
    guard = threading.Lock()

    def contend(index: int) -> None:
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                try:
                    held = acquire_slot(
                        lease_name, limit=limit, ttl=5, backend=lease_backend, timeout=5
                    )
                except LeaseUnavailable:
                    continue
                with guard:
                    grants[held.slot].append(held.token)
                writer = f"t{index}/slot{held.slot}@{held.token}"
                record_write(f"{register}/{held.slot}", held, writer)
                time.sleep(random.uniform(0, 0.03))
                record_write(f"{register}/{held.slot}", held, writer)
                held.release()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            # The thread's Django connection (record_write's): left open until the garbage
            # collector freed it, it kept the test database from being dropped at teardown.
            connections.close_all()

    pool = [threading.Thread(target=contend, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=seconds + 30)
    assert not errors, errors
    assert sorted(grants) == list(range(limit)), "every slot was used, and no other"
    check_slot_histories(register, grants, limit)


def test_a_paused_holders_write_is_rejected_after_its_slot_moved_on(
    lease_backend: str, lease_name: str, workers: Workers
) -> None:
    """Slot A is ours; a child holds slot B, is paused past its TTL, and its slot goes to a
    successor that writes B's register. Resumed, the child's write to B's register is stale."""
    ttl, limit = 1.0, 2
    register = new_register("sem")
    ours = acquire_slot(lease_name, limit=limit, ttl=10, backend=lease_backend, timeout=5)
    paused = workers.spawn("hold-slot", lease_backend, lease_name, register, ttl, limit)
    first = workers.wait_for("acquired", paused.pid)
    assert first["accepted"] and first["name"] != ours.name
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        time.sleep(2 * ttl)
        successor = acquire_slot(
            lease_name, limit=limit, ttl=5, backend=lease_backend, timeout=5, holder="successor"
        )
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    assert successor.name == first["name"] and successor.token > first["token"]
    slot_register = f"{register}/{successor.slot}"
    assert record_write(slot_register, successor, "successor")
    assert paused.stdin is not None
    paused.stdin.write("go\n")
    paused.stdin.flush()
    resumed = workers.wait_for("resumed", paused.pid, timeout=30)
    assert resumed["write"] is False
    late = [a for a in history(slot_register) if a.writer == first["holder"]][-1]
    assert late.outcome == STALE and late.stored == successor.token
    assert resumed["ensure_held"] == "LeaseLost" and resumed["release"] == "LeaseLost"
    check_history(slot_register, grants=[first["token"], successor.token])
    successor.release()
    ours.release()


def test_a_full_semaphore_fails_within_the_timeout_and_wakes_on_a_release(
    lease_backend: str, lease_name: str
) -> None:
    held = [
        acquire_slot(lease_name, limit=2, ttl=10, backend=lease_backend, holder=who) for who in "ab"
    ]
    assert sorted(h.slot for h in held) == [0, 1]
    assert all(isinstance(h, Slot) and h.semaphore == lease_name for h in held)
    with pytest.raises(LeaseUnavailable):
        acquire_slot(lease_name, limit=2, backend=lease_backend, timeout=0)
    started = time.monotonic()
    with pytest.raises(LeaseUnavailable):
        acquire_slot(lease_name, limit=2, backend=lease_backend, timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 3.0
    threading.Timer(0.2, held[1].release).start()
    third = acquire_slot(lease_name, limit=2, ttl=10, backend=lease_backend, timeout=10)
    assert third.slot == held[1].slot and third.token > held[1].token
    third.release()
    held[0].release()


@contextmanager
def slow_full_semaphore(name: str) -> Iterator[list[str]]:
    """Every slot of ``name`` held on the database backend; inside, each sync and async try
    of that backend waits ``SLOW_TRY`` first (a slow network's round trip, on a real store).
    Yields the names tried, in order. The cause is the acquire loop's, the same on every
    backend, so one backend shows it."""
    store = get_backend("default")
    held = [store.try_acquire(slot_name(name, k), "holder", 30) for k in range(SLOW_LIMIT)]
    tried: list[str] = []
    try_acquire, atry_acquire = store.try_acquire, store.atry_acquire

    def slow(slot: str, *args: Any) -> Any:
        tried.append(slot)
        time.sleep(SLOW_TRY)
        return try_acquire(slot, *args)

    async def aslow(slot: str, *args: Any) -> Any:
        tried.append(slot)
        await asyncio.sleep(SLOW_TRY)
        return await atry_acquire(slot, *args)

    try:
        with (
            mock.patch.object(store, "try_acquire", slow),
            mock.patch.object(store, "atry_acquire", aslow),
        ):
            yield tried
    finally:
        for grant in held:
            assert grant is not None
            store.release(grant)


def test_a_full_semaphore_gives_up_by_its_timeout_whatever_its_limit(
    lease_name: str, db: None
) -> None:
    """Each slot's try is a round trip, so a pass over all of them before looking at the
    deadline made ``timeout=0.2`` last 32 slowed tries (1.6 s): the deadline is looked at
    before each try instead. ``timeout=0`` still tries every slot once. The failure says
    which: "all 32 slots are held" was said of a pass that had tried four of them."""
    with slow_full_semaphore(lease_name) as tried:
        with pytest.raises(LeaseUnavailable, match="all 2 slots are held"):
            acquire_slot(lease_name, limit=2, timeout=0)
        assert sorted(tried) == [slot_name(lease_name, k) for k in range(2)]
        started = time.monotonic()
        with pytest.raises(LeaseUnavailable) as failed:
            acquire_slot(lease_name, limit=SLOW_LIMIT, timeout=SLOW_TIMEOUT)
        took = time.monotonic() - started
    assert SLOW_TIMEOUT <= took < SLOW_TIMEOUT + 1.0, f"gave up after {took:.2f}s"
    assert_says_how_many_were_tried(str(failed.value), len(tried) - 2)


def assert_says_how_many_were_tried(message: str, tried: int) -> None:
    """A pass cut short by the deadline (one pass: the deadline passed during it) says how
    many of the ``SLOW_LIMIT`` slots it tried, not that all are held."""
    assert 1 <= tried < SLOW_LIMIT, tried
    assert f"all {SLOW_LIMIT} slots are held" not in message, message
    expected = f"after {tried} of its {SLOW_LIMIT} slots were tried in the last pass"
    assert expected in message and f"the other {SLOW_LIMIT - tried} were not tried" in message


def test_block_decorator_and_no_reentry(lease_backend: str, lease_name: str) -> None:
    with semaphore(lease_name, limit=3, ttl=10, backend=lease_backend) as slot:
        assert slot.semaphore == lease_name and 0 <= slot.slot < 3
        with pytest.raises(LeaseAlreadyHeld):
            acquire_slot(lease_name, limit=3, backend=lease_backend)
        with lease(lease_name, ttl=10, backend=lease_backend, timeout=0):
            pass  # the semaphore's name is not itself a lease: its slots are
    assert slot.done

    @semaphore(limit=1, ttl=10, backend=lease_backend)
    def export() -> str:
        info = get_backend(lease_backend).inspect(slot_name(f"{__name__}.{qualname}", 0))
        assert info is not None and info.held
        return "done"

    qualname = "test_block_decorator_and_no_reentry.<locals>.export"
    assert export() == "done"


def test_an_interrupt_between_a_slots_grant_and_its_handle_leaves_nothing_held(
    lease_backend: str, lease_name: str
) -> None:
    """The semaphore's twin of the lease conformance test: ``acquire_slot()`` and
    ``aacquire_slot()`` interrupted by a ``lease_acquired`` receiver leave neither the slot's
    grant (another holder takes the only slot at once) nor its registration (no
    ``LeaseAlreadyHeld`` for this thread or task) behind."""
    with interrupting_the_first_grant(Interrupted()), pytest.raises(Interrupted):
        acquire_slot(lease_name, limit=1, ttl=30, backend=lease_backend)
    other = acquire_slot(lease_name, limit=1, ttl=30, backend=lease_backend, timeout=0, holder="o")
    other.release()

    async def main() -> None:
        with interrupting_the_first_grant(Interrupted()), pytest.raises(Interrupted):
            await aacquire_slot(lease_name, limit=1, ttl=30, backend=lease_backend)
        again = await aacquire_slot(lease_name, limit=1, ttl=30, backend=lease_backend, timeout=0)
        assert again.token > other.token
        await again.arelease()

    asyncio.run(main())


def test_lowering_the_limit_never_admits_more_than_the_highest_in_use(
    lease_backend: str, lease_name: str
) -> None:
    """Holders of limit 3 keep slots 0-2; a caller with limit 2 waits until slot 0 or 1 frees,
    not slot 2: the name never has more holders than the highest limit any live holder used."""
    held = {
        h.slot: h
        for h in (
            acquire_slot(lease_name, limit=3, ttl=10, backend=lease_backend, holder=who)
            for who in "abc"
        )
    }
    assert sorted(held) == [0, 1, 2]
    held.pop(2).release()
    with pytest.raises(LeaseUnavailable):
        acquire_slot(lease_name, limit=2, backend=lease_backend, timeout=0)
    held.pop(0).release()
    lower = acquire_slot(lease_name, limit=2, ttl=10, backend=lease_backend, timeout=0)
    assert lower.slot == 0
    for h in [lower, *held.values()]:
        h.release()
