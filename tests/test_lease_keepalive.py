"""Keepalive, the watchdog and backoff: renewal never dies silently, loss is always reported."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from leases import LeaseLost, acquire, keepalive, signals
from leases.backends import Capability, get_backend
from leases.checks import check_default_ttl
from leases.errors import BackendUnavailable
from leases.keepalive import Scheduler
from leases.retry import Backoff, FakeClock
from tests.lease_backends import lease_backend, lease_name, require
from tests.waiting import wait_until

__all__ = ["lease_backend", "lease_name"]


def test_backoff_is_full_jitter_capped_and_bounded_by_the_deadline() -> None:
    clock = FakeClock()
    backoff = Backoff(base=0.01, cap=0.08, deadline=clock.monotonic() + 1.0, clock=clock)
    delays = []
    while (delay := backoff.next_delay()) is not None:
        delays.append(delay)
        clock.sleep(delay)
        assert len(delays) < 10_000
    assert all(0 <= d <= 0.08 for d in delays)
    assert delays[0] <= 0.01 and max(delays) > 0.01
    assert clock.monotonic() == pytest.approx(1000.0 + sum(delays))
    assert clock.monotonic() == pytest.approx(1001.0)  # the last delay is clipped to the deadline


def test_backoff_without_deadline_never_gives_up() -> None:
    backoff = Backoff(base=1.0, cap=2.0, clock=FakeClock())
    assert all((backoff.next_delay() or -1) >= 0 for _ in range(100))
    assert backoff.remaining() is None


class Step:
    """A scheduler job that records its runs and can fail or be finished."""

    def __init__(self, label: str, order: list[str], *, fail: bool = False) -> None:
        self.label, self.order, self.fail = label, order, fail
        self.ran = threading.Event()
        self.done = False

    def __call__(self) -> float | None:
        self.order.append(self.label)
        self.ran.set()
        if self.fail:
            raise RuntimeError("job bug")
        return None

    def finished(self) -> bool:
        return self.done


def test_scheduler_survives_a_failing_job(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = Scheduler("leases-test-scheduler")
    order: list[str] = []
    boom, later = Step("boom", order, fail=True), Step("later", order)
    with caplog.at_level(logging.ERROR, logger="leases"):
        now = time.monotonic()
        scheduler.schedule(now + 0.05, later)
        scheduler.schedule(now, boom)
        assert later.ran.wait(5)
    assert order == ["boom", "later"]
    assert "job failed" in caplog.text


def test_scheduler_prunes_finished_jobs_so_memory_follows_live_leases() -> None:
    scheduler = Scheduler("leases-test-prune")
    far = time.monotonic() + 3600
    live = Step("live", [])
    scheduler.schedule(far, live)
    for _ in range(10_000):
        finished = Step("released", [])
        finished.done = True
        scheduler.schedule(far, finished)
    assert len(scheduler) < 600


def test_scheduler_drops_finished_jobs_without_running_them() -> None:
    """Jobs of released leases that come due are dropped when the thread looks, not run (and
    woken for) one by one; the live job due after them still runs."""
    scheduler = Scheduler("leases-test-drop")
    order: list[str] = []
    now = time.monotonic()
    finished = [Step(f"released{index}", order) for index in range(50)]
    for step in finished:
        step.done = True
        scheduler.schedule(now + 0.01, step)
    live = Step("live", order)
    scheduler.schedule(now + 0.05, live)
    assert live.ran.wait(5)
    assert order == ["live"]


def _renewer_jobs_of(lease: Any) -> int:
    """How many jobs of ``lease`` its alias's renewer holds (its private heap)."""
    renewer = keepalive._renewers.get(lease.backend)
    if renewer is None:
        return 0
    with renewer._cond:
        return sum(getattr(job, "lease", None) is lease for _, _, job in renewer._heap)


def test_a_lease_reaches_its_renewer_only_when_its_first_renewal_is_due(
    lease_backend: str, lease_name: str
) -> None:
    """The hot path (acquire, release long before a third of the TTL) never touches the
    renewer; a lease that lives to its first renewal is handed over by the watchdog and renewed
    (its validity moves on)."""
    short = acquire(lease_name, ttl=30, backend=lease_backend)
    try:
        assert _renewer_jobs_of(short) == 0
    finally:
        short.release()
    kept = acquire(lease_name, ttl=3, backend=lease_backend)
    try:
        first = kept.valid_until
        wait_until(lambda: kept.valid_until > first, 10, "the first renewal")
        kept.ensure_held()
    finally:
        kept.release()


def test_revoked_lease_is_reported_by_the_next_renewal(lease_backend: str, lease_name: str) -> None:
    store = require(lease_backend, Capability.FORCE_RELEASE)
    reasons: list[str] = []
    held = acquire(
        lease_name,
        ttl=2,
        backend=lease_backend,
        on_lost=lambda lost: reasons.append(lost.lost_reason or ""),
    )
    store.force_release(lease_name, held.token)
    assert held.lost.wait(3)
    deadline = time.monotonic() + 2
    while not reasons and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(reasons) == 1 and reasons[0].startswith("renewal refused: ")
    # The store's own words, not its exception's: the reason used to say "lease ... is no
    # longer held" inside a LeaseLost that says so itself.
    assert "no longer held" not in reasons[0], reasons[0]
    with pytest.raises(LeaseLost) as raised:
        held.release()
    assert str(raised.value).count("no longer held") == 1, raised.value


def test_a_broken_on_lost_callback_is_logged_and_loss_still_reported(
    lease_backend: str, lease_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(_: Any) -> None:
        raise ZeroDivisionError("callback bug")

    with caplog.at_level(logging.WARNING, logger="leases"):
        held = acquire(lease_name, ttl=0.3, backend=lease_backend, keepalive=False, on_lost=broken)
        assert held.lost.wait(3)
        deadline = time.monotonic() + 2
        while "on_lost callback" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "on_lost callback" in caplog.text and "lost" in caplog.text


def test_too_short_ttl_is_flagged(lease_backend: str, lease_name: str) -> None:
    assert check_default_ttl() == []
    with override_settings(LEASES={**settings.LEASES, "DEFAULT_TTL": 0.12}):
        (warning,) = check_default_ttl()
        assert warning.id == "leases.W001"
    with pytest.warns(RuntimeWarning, match="to retry a failed renewal"):
        held = acquire(lease_name, ttl=0.12, backend=lease_backend)
    # What is tested is the warning. A loaded machine may let 0.12 s pass before the release
    # (a renewal that cannot keep up is what the warning is about): then it is truly lost.
    with contextlib.suppress(LeaseLost):
        held.release()


def test_a_renewal_to_a_shorter_ttl_is_kept_alive_at_the_new_pace(
    lease_backend: str, lease_name: str
) -> None:
    """``renew(ttl=2)`` on a lease kept alive at ttl=30: the renewer was due by the old TTL
    (10 s on), so the lease ran out at 2 s unrenewed, and the watchdog, due at the old
    validity, reported it seconds late. Renewals now follow the new TTL."""
    renewed = threading.Event()
    count = [0]

    def counting(sender: Any, lease: Any, **kwargs: Any) -> None:
        if lease.name == lease_name:
            count[0] += 1
            if count[0] >= 4:  # ours (1), then keepalive's, at a third of 2 s each
                renewed.set()

    signals.lease_renewed.connect(counting, weak=False)
    held = acquire(lease_name, ttl=30, backend=lease_backend)
    try:
        held.renew(ttl=2)
        assert renewed.wait(8), f"{count[0] - 1} keepalive renewals in 8 s at ttl=2"
        held.ensure_held()
    finally:
        signals.lease_renewed.disconnect(counting)
        held.release()


def test_a_lease_whose_release_outcome_is_unknown_is_still_watched(
    lease_backend: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release marked the lease released, so its watchdog job dropped out; a release
    that then failed (no reply: the outcome unknown) made it held again, but nothing watched
    it any more: its loss at expiry was never reported (``lost`` unset, no ``on_lost``)."""
    held = acquire(lease_name, ttl=1, backend=lease_backend, keepalive=False)
    store = get_backend(lease_backend)

    def unanswered(grant: Any) -> None:
        raise BackendUnavailable(lease_backend, "no reply: whether it took effect is unknown")

    monkeypatch.setattr(store, "release", unanswered)
    with pytest.raises(BackendUnavailable):
        held.release()
    monkeypatch.undo()
    assert held.lost.wait(10), "the loss at expiry was never reported"
    with pytest.raises(LeaseLost):
        held.ensure_held()


def test_an_on_lost_that_exits_leaves_the_watchdog_watching(
    lease_backend: str, lease_name: str
) -> None:
    """``sys.exit()`` in an ``on_lost`` ended the watchdog thread: no loss was reported
    again in the process, and no lease was handed to its renewer."""

    def exits(_: Any) -> None:
        sys.exit(3)

    first = acquire(lease_name, ttl=0.5, backend=lease_backend, keepalive=False, on_lost=exits)
    assert first.lost.wait(10)
    second = acquire(f"{lease_name}-2", ttl=0.5, backend=lease_backend, keepalive=False)
    assert second.lost.wait(10), "the watchdog no longer watched"


def test_an_on_lost_exiting_on_the_thread_that_found_the_loss_exits_there(
    lease_backend: str, lease_name: str
) -> None:
    """A renewal refused on the caller's own thread runs ``on_lost`` there: its ``sys.exit()``
    was swallowed (logged as a failed callback) and the process went on. It is raised from
    the call, once the loss is reported (``lost`` set, ``lease_lost`` sent)."""
    store = get_backend(lease_backend)
    if Capability.FORCE_RELEASE not in store.capabilities:
        pytest.skip(f"backend {lease_backend!r} does not declare force release")
    reported: list[str] = []

    def on_lease_lost(sender: str, lease: Any, reason: str, **kwargs: Any) -> None:
        reported.append(reason)

    def exits(_: Any) -> None:
        sys.exit(3)

    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False, on_lost=exits)
    store.force_release(lease_name, held.token)
    signals.lease_lost.connect(on_lease_lost)
    try:
        with pytest.raises(SystemExit) as stopped:
            held.renew()
    finally:
        signals.lease_lost.disconnect(on_lease_lost)
    assert stopped.value.code == 3
    assert held.lost.is_set() and len(reported) == 1
