"""What every lease backend guarantees, run once per backend in ``LEASE_BACKENDS``.

Tests skip by declared capability. TTLs are small (0.3-1 s) so the suite stays fast; nothing
here asserts a duration except loose upper bounds on waits that would otherwise hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from typing import Any, cast

import pytest
from django.db import transaction
from django.test import override_settings

import leases
from leases import (
    Lease,
    LeaseAlreadyHeld,
    LeaseLost,
    LeaseNotHeld,
    LeaseUnavailable,
    acquire,
    alease,
    lease,
)
from leases.backends import Capability, Grant, get_backend
from leases.backends.base import new_secret
from leases.errors import BackendUnavailable, InvalidLeaseName, InvalidLeaseOption
from leases.signals import lease_acquired, lease_lost, lease_released, lease_renewed
from tests.checker import check_history, new_register, record_write
from tests.lease_backends import lease_backend, lease_name, require
from tests.waiting import wait_until

__all__ = ["lease_backend", "lease_name"]  # fixtures, re-exported for pytest


def test_public_lease_is_the_function() -> None:
    from leases.lease import Lease

    module = sys.modules["leases.lease"]
    assert Lease is module.Lease
    assert leases.lease is lease
    assert callable(leases.lease) and leases.lease is not cast(object, module)
    assert leases.acquire is acquire and leases.Lease is module.Lease


def test_tokens_strictly_increase_across_grants_and_releases(
    lease_backend: str, lease_name: str
) -> None:
    tokens = []
    for _ in range(5):
        with lease(lease_name, ttl=1, backend=lease_backend, timeout=0) as held:
            tokens.append(held.token)
            assert int(held) == held.token
    assert tokens == sorted(set(tokens)), tokens
    info = get_backend(lease_backend).inspect(lease_name)
    assert info is not None and not info.held and info.token >= tokens[-1]


def test_held_lease_cannot_be_taken(lease_backend: str, lease_name: str) -> None:
    with lease(lease_name, ttl=1, backend=lease_backend):
        grant = get_backend(lease_backend).try_acquire(lease_name, "someone-else", 1.0)
        assert grant is None
        started = time.monotonic()
        with pytest.raises(LeaseUnavailable) as info:
            acquire(lease_name, ttl=1, backend=lease_backend, timeout=0.2, holder="other")
        assert info.value.name == lease_name
        assert 0.15 <= time.monotonic() - started < 2.0


def test_a_failed_wait_gives_up_at_its_deadline(lease_backend: str, lease_name: str) -> None:
    """``timeout`` is a deadline, not a hint: redis-py's own blocking test allows 50 ms over.

    One sample can be late for reasons that are not ours (a loaded 2-core machine deschedules
    the thread), so the median of five decides; a wait that overshoots by design (a server
    timer firing on its ``hz`` tick, 55-90 ms late) is late every time and fails it.
    """
    timeout, overshoots = 0.4, []
    with lease(lease_name, ttl=30, backend=lease_backend, keepalive=False):
        for _ in range(5):
            started = time.monotonic()
            with pytest.raises(LeaseUnavailable):
                acquire(lease_name, ttl=1, backend=lease_backend, timeout=timeout, holder="w")
            overshoots.append(time.monotonic() - started - timeout)
    overshoots.sort()
    assert overshoots[0] > -0.005, overshoots  # never gives up early either
    assert overshoots[2] <= 0.05, overshoots


def test_expired_lease_is_taken_over_with_a_higher_token(
    lease_backend: str, lease_name: str
) -> None:
    first = acquire(lease_name, ttl=0.3, backend=lease_backend, keepalive=False)
    second = acquire(lease_name, ttl=1, backend=lease_backend, timeout=3, holder="successor")
    try:
        assert second.token > first.token
        assert first.remaining() == 0
        with pytest.raises(LeaseLost):
            first.ensure_held()
    finally:
        second.release()


def test_release_after_expiry_keeps_successor(lease_backend: str, lease_name: str) -> None:
    register = new_register()
    first = acquire(lease_name, ttl=0.3, backend=lease_backend, keepalive=False)
    assert record_write(register, first.token, "first")
    second = acquire(lease_name, ttl=2, backend=lease_backend, timeout=3, holder="successor")
    assert record_write(register, second.token, "second")
    with pytest.raises(LeaseLost):
        first.release()
    assert not record_write(register, first.token, "first")
    info = get_backend(lease_backend).inspect(lease_name)
    assert info is not None and info.held and info.holder == "successor"
    assert info.token == second.token
    second.release()
    check_history(register, grants=[first.token, second.token])


def test_non_owner_release_and_renew_are_refused(lease_backend: str, lease_name: str) -> None:
    store = get_backend(lease_backend)
    with lease(lease_name, ttl=1, backend=lease_backend) as held:
        forged = [
            Grant(lease_name, "intruder", held.token, 1.0, time.monotonic()),
            Grant(lease_name, held.holder, held.token - 1, 1.0, time.monotonic()),
        ]
        for grant in forged:
            with pytest.raises(LeaseLost):
                store.release(grant)
            with pytest.raises(LeaseLost):
                store.renew(grant, 1.0)
        info = store.inspect(lease_name)
        assert info is not None and info.held and info.holder == held.holder


def test_public_holder_and_token_neither_release_nor_renew(
    lease_backend: str, lease_name: str
) -> None:
    """Holder and token are public (``inspect()``, the admin); a grant built from them without
    the secret is refused as not held, and the real holder's lease is left untouched."""
    store = get_backend(lease_backend)
    with lease(lease_name, ttl=2, backend=lease_backend, keepalive=False) as held:
        info = store.inspect(lease_name)
        assert info is not None and (info.holder, info.token) == (held.holder, held.token)
        for secret in ("", "0" * 32, new_secret()):
            forged = Grant(
                lease_name, info.holder, info.token, 2.0, time.monotonic(), secret=secret
            )
            with pytest.raises(LeaseNotHeld, match="secret"):
                store.release(forged)
            with pytest.raises(LeaseNotHeld, match="secret"):
                store.renew(forged, 30.0)
        after = store.inspect(lease_name)
        assert after is not None and after.held
        assert (after.holder, after.token) == (held.holder, held.token)
        held.renew()
        held.ensure_held()


def test_the_grant_secret_never_shows(
    lease_backend: str, lease_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = get_backend(lease_backend)
    shown: list[str] = []

    def record(sender: str, **kwargs: Any) -> None:
        shown.append(repr(kwargs))

    for signal in (lease_acquired, lease_renewed, lease_released):
        signal.connect(record)
    try:
        with (
            caplog.at_level("DEBUG"),
            lease(lease_name, ttl=30, backend=lease_backend, keepalive=False) as held,
        ):
            secret = held.grant.secret
            held.renew()
            assert held.grant.secret == secret  # a renewed grant keeps its secret
            shown += [repr(held), repr(held.grant), repr(store.inspect(lease_name))]
            shown.append(repr([i for i in store.inspect_all() if i.name == lease_name]))
    finally:
        for signal in (lease_acquired, lease_renewed, lease_released):
            signal.disconnect(record)
    assert len(secret) == 32 and int(secret, 16) >= 0
    assert len(shown) == 7 and caplog.text is not None
    assert not [text for text in [*shown, caplog.text] if secret in text]
    with lease(lease_name, ttl=30, backend=lease_backend, keepalive=False) as again:
        assert again.grant.secret != secret


def test_keepalive_holds_the_lease_past_its_ttl(lease_backend: str, lease_name: str) -> None:
    """Held past its TTL by renewals alone. A 2 s TTL, not 1 s: a renewal is a quorum write
    on etcd and ZooKeeper, and on a loaded 2-core machine one that took longer than a 1 s
    lease's margin truly lost the lease (a fresh-clone CI run, ZooKeeper)."""
    lost = threading.Event()
    with lease(lease_name, ttl=2, backend=lease_backend, on_lost=lambda _: lost.set()) as held:
        time.sleep(2.5)
        held.ensure_held()
        assert held.remaining() > 0
        assert not lost.is_set()
        with pytest.raises(LeaseUnavailable):
            acquire(lease_name, ttl=1, backend=lease_backend, timeout=0, holder="other")
        info = get_backend(lease_backend).inspect(lease_name)
        assert info is not None and info.holder == held.holder and info.token == held.token


def test_without_keepalive_loss_is_reported_at_expiry(lease_backend: str, lease_name: str) -> None:
    reasons: list[str] = []
    received: list[Any] = []

    def on_lost_signal(sender: str, lease: Any, reason: str, **kwargs: Any) -> None:
        received.append((sender, lease, reason))

    lease_lost.connect(on_lost_signal)
    try:
        held = acquire(
            lease_name,
            ttl=0.3,
            backend=lease_backend,
            keepalive=False,
            # lost_reason is set before on_lost runs.
            on_lost=lambda lost: reasons.append(cast(str, lost.lost_reason)),
        )
        wait_until(held.lost.is_set, 3, "the lease to be reported lost")
        wait_until(lambda: received, 1, "lease_lost to be received")
    finally:
        lease_lost.disconnect(on_lost_signal)
    assert len(reasons) == 1 and "expired" in reasons[0]
    assert received == [(lease_backend, held, reasons[0])]
    with pytest.raises(LeaseLost):
        held.ensure_held()
    with pytest.raises(LeaseLost):
        held.release()


def test_explicit_renew_extends_and_reports(lease_backend: str, lease_name: str) -> None:
    held = acquire(lease_name, ttl=0.5, backend=lease_backend, keepalive=False)
    before = held.valid_until
    time.sleep(0.1)
    grant = held.renew(ttl=1)
    assert held.valid_until > before and grant.token == held.token and grant.ttl == 1
    time.sleep(0.6)
    held.ensure_held()
    held.release()
    with pytest.raises(LeaseLost):
        held.renew()
    with pytest.raises(LeaseNotHeld):
        held.release()


def test_release_wakes_a_waiter(lease_backend: str, lease_name: str) -> None:
    holder = acquire(lease_name, ttl=5, backend=lease_backend)
    got: list[Any] = []

    def wait() -> None:
        got.append(acquire(lease_name, ttl=5, backend=lease_backend, timeout=10))

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    assert not got
    holder.release()
    waiter.join(timeout=10)
    assert got and got[0].token > holder.token
    got[0].release()


def test_wait_for_release_is_woken_by_the_release(lease_backend: str, lease_name: str) -> None:
    """Backends that wait without polling are woken by the release itself: a 30 s grant and a
    5 s wait, so only the release's wake-up can make the wait return ``True``. Four rounds,
    since a Redlock waiter watches a node picked at random."""
    store = require(lease_backend, Capability.WAIT_WITHOUT_POLLING)
    store.wait_for_release(lease_name, 0.3)  # sets up what a wait listens on (LISTEN, pools)

    def wait(name: str, woken: list[bool]) -> None:
        woken.append(store.wait_for_release(name, 5))

    for round_ in range(4):
        name = f"{lease_name}-{round_}"
        grant = store.try_acquire(name, "a", 30)
        assert grant is not None
        woken: list[bool] = []
        waiter = threading.Thread(target=wait, args=(name, woken))
        waiter.start()
        time.sleep(0.2)
        assert woken == []
        store.release(grant)
        waiter.join(10)
        assert woken == [True]
    again = store.try_acquire(name, "b", 5)
    assert again is not None
    store.release(again)


def test_a_failing_wait_does_not_fail_the_acquisition(
    lease_backend: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting only saves round trips: a wait that errors (a socket timeout on a loaded
    machine) is slept out and the next try decides."""
    store = get_backend(lease_backend)
    waits: list[float] = []
    waiting = threading.Event()

    def broken_wait(name: str, timeout: float) -> bool:
        waits.append(timeout)
        waiting.set()
        raise BackendUnavailable(store.alias, "wait: TimeoutError: Timeout reading from socket")

    monkeypatch.setattr(store, "wait_for_release", broken_wait)
    holder = acquire(lease_name, ttl=5, backend=lease_backend)
    got: list[Any] = []
    waiter = threading.Thread(
        target=lambda: got.append(acquire(lease_name, ttl=5, backend=lease_backend, timeout=10))
    )
    waiter.start()
    # Released only once the waiter has failed a wait: a fixed sleep let a slow first try (a
    # fresh ZooKeeper session on a loaded machine) come after the release and never wait.
    assert waiting.wait(10), "the waiter never waited"
    holder.release()
    waiter.join(timeout=10)
    assert waits and got and got[0].token > holder.token
    got[0].release()


def test_leases_are_not_reentrant(lease_backend: str, lease_name: str) -> None:
    with lease(lease_name, ttl=1, backend=lease_backend) as outer:
        with pytest.raises(LeaseAlreadyHeld) as info, lease(lease_name, backend=lease_backend):
            pass  # pragma: no cover - never entered
        assert info.value.name == lease_name
        outer.ensure_held()
    info2 = get_backend(lease_backend).inspect(lease_name)
    assert info2 is not None and not info2.held


@pytest.mark.django_db(transaction=True)
def test_a_thread_with_the_ident_of_a_finished_holder_does_not_already_hold(
    lease_name: str,
) -> None:
    """A lease taken in a thread that then ended is held by no thread alive: a later thread
    with the same ``threading.get_ident()`` (reused at once by CPython) was refused
    ``LeaseAlreadyHeld`` instead of waiting like every other thread."""
    taken: list[Lease] = []
    first = threading.Thread(target=lambda: taken.append(acquire(lease_name, ttl=30)))
    first.start()
    first.join(10)
    ident = first.ident
    outcome: list[type[BaseException]] = []

    def try_once() -> None:
        if threading.get_ident() != ident:
            return
        try:
            acquire(lease_name, ttl=30, timeout=0)
        except (LeaseAlreadyHeld, LeaseUnavailable) as exc:
            outcome.append(type(exc))

    try:
        for _ in range(500):  # CPython gives a new thread a finished one's ident, mostly at once
            later = threading.Thread(target=try_once)
            later.start()
            later.join(10)
            if later.ident == ident:
                break
        else:
            # Another thread of this process (a keepalive or reply-deadline thread starting
            # just then) took the freed ident first: there is no such thread to ask.
            pytest.skip("no thread of this test got the finished holder's ident")
    finally:
        taken[0].release()
    assert outcome == [LeaseUnavailable]


def test_another_thread_waits_instead_of_reentering(lease_backend: str, lease_name: str) -> None:
    outcome: list[BaseException] = []

    def other() -> None:
        try:
            acquire(lease_name, ttl=1, backend=lease_backend, timeout=0.2)
        except BaseException as exc:
            outcome.append(exc)

    with lease(lease_name, ttl=1, backend=lease_backend):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=5)
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseUnavailable)


def test_decorator_bare_and_called_forms_exclude_each_other(lease_backend: str) -> None:
    inside = []
    overlaps = []

    def body() -> None:
        inside.append(1)
        if len(inside) > 1:
            overlaps.append(len(inside))
        time.sleep(0.02)
        inside.pop()

    @lease
    def bare() -> str:
        body()
        return "bare"

    @lease(f"called-{time.monotonic_ns()}", ttl=1, backend=lease_backend, timeout=10)
    def called() -> str:
        body()
        return "called"

    assert bare() == "bare"
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(called())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert results == ["called"] * 4
    assert not overlaps


def test_exit_never_hides_the_body_exception(lease_backend: str, lease_name: str) -> None:
    with (
        pytest.raises(KeyError) as info,
        lease(lease_name, ttl=0.3, backend=lease_backend, keepalive=False),
    ):
        time.sleep(0.5)
        raise KeyError("body")
    assert any("could not be released" in note for note in info.value.__notes__)


def test_body_that_outlived_its_lease_raises_lost(lease_backend: str, lease_name: str) -> None:
    with (
        pytest.raises(LeaseLost),
        lease(lease_name, ttl=0.3, backend=lease_backend, keepalive=False),
    ):
        time.sleep(0.5)


def test_caller_rollback_neither_unacquires_nor_unreleases(
    lease_backend: str, lease_name: str
) -> None:
    store = get_backend(lease_backend)
    with pytest.raises(RuntimeError), transaction.atomic():
        held = acquire(lease_name, ttl=2, backend=lease_backend)
        raise RuntimeError("caller rolls back")
    info = store.inspect(lease_name)
    assert info is not None and info.held and info.token == held.token
    with pytest.raises(RuntimeError), transaction.atomic():
        held.release()
        raise RuntimeError("caller rolls back again")
    info = store.inspect(lease_name)
    assert info is not None and not info.held


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": ""}, InvalidLeaseName),
        ({"name": "x" * 256}, InvalidLeaseName),
        ({"name": "nul\x00"}, InvalidLeaseName),
        ({"ttl": 0}, InvalidLeaseOption),
        ({"ttl": -1}, InvalidLeaseOption),
        ({"ttl": True}, InvalidLeaseOption),
        ({"ttl": 0.001}, InvalidLeaseOption),
        ({"ttl": float("inf")}, InvalidLeaseOption),
        ({"ttl": float("nan")}, InvalidLeaseOption),
        ({"timeout": -1}, InvalidLeaseOption),
        ({"timeout": float("nan")}, InvalidLeaseOption),
        ({"holder": ""}, InvalidLeaseOption),
        ({"holder": "h" * 256}, InvalidLeaseOption),
        ({"ttl": 1e12}, InvalidLeaseOption),
        ({"ttl": 86400.5}, InvalidLeaseOption),
        ({"holder": "h\x00x"}, InvalidLeaseOption),
        ({"holder": "h\nx"}, InvalidLeaseOption),
        ({"holder": "\x7f"}, InvalidLeaseOption),
        # The package's group mark: on Redis such a writer was taken for a group of readers,
        # and a reader was granted beside it.
        ({"holder": "x::\u241fshared"}, InvalidLeaseOption),
        # keepalive="no" is truthy: the lease was kept alive against the caller's wish.
        ({"keepalive": "no"}, InvalidLeaseOption),
        # 1 == True: it would have been taken as a reader's lease (or refused as unsupported).
        ({"shared": 1}, InvalidLeaseOption),
        # Accepted, then the keepalive thread failed to call it when the lease was lost.
        ({"on_lost": 5}, InvalidLeaseOption),
    ],
)
def test_bad_input_is_refused_before_any_round_trip(
    lease_backend: str, lease_name: str, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    arguments: dict[str, Any] = {"name": lease_name, "ttl": 1, "backend": lease_backend, **kwargs}
    name = arguments.pop("name")
    with pytest.raises(error) as info:
        acquire(name, **arguments)
    assert isinstance(info.value, ValueError)
    if isinstance(name, str) and name and "\x00" not in name and len(name) <= 255:
        assert get_backend(lease_backend).inspect(name) is None  # nothing reached the store


def test_a_name_of_the_longest_length_is_held_waited_for_and_handed_on(
    lease_backend: str, lease_name: str
) -> None:
    """255 characters is a valid name on every backend, for a waiter too: the database
    backend's waiting room, whose key is derived from the name, refused names past 243 as
    if the user's name were too long (sync and async)."""
    name = (lease_name + "-" + "x" * 255)[:255]
    held = acquire(name, ttl=30, backend=lease_backend)
    got: list[Lease] = []
    waiter = threading.Thread(
        target=lambda: got.append(acquire(name, ttl=30, backend=lease_backend, timeout=20))
    )
    waiter.start()
    time.sleep(0.3)  # the waiter fails its first try and waits
    held.release()
    waiter.join(25)
    assert got and got[0].token > held.token
    got[0].release()

    async def main() -> int:
        async with alease(name, ttl=30, backend=lease_backend) as again:
            token = again.token
        await get_backend(lease_backend).aclose()
        return token

    assert asyncio.run(main()) > got[0].token


def test_renewal_beyond_the_max_ttl_is_refused_before_any_round_trip(
    lease_backend: str, lease_name: str
) -> None:
    with lease(lease_name, ttl=30, backend=lease_backend, keepalive=False) as held:
        before = held.grant
        with pytest.raises(InvalidLeaseOption, match="MAX_TTL"):
            held.renew(ttl=1e12)
        assert held.grant is before
        info = get_backend(lease_backend).inspect(lease_name)
        assert info is not None and (info.expires_at is None or info.expires_at.year < 3000)
    with override_settings(LEASES={"BACKENDS": _backends(), "MAX_TTL": 2, "DEFAULT_TTL": 1}):
        with pytest.raises(InvalidLeaseOption, match="MAX_TTL"):
            acquire(lease_name, ttl=3, backend=lease_backend)
        assert get_backend(lease_backend).inspect(lease_name) is not None  # the earlier grant
        acquire(lease_name, ttl=2, backend=lease_backend, keepalive=False).release()


def test_force_release_revokes_the_holder(lease_backend: str, lease_name: str) -> None:
    store = require(lease_backend, Capability.FORCE_RELEASE)
    held = acquire(lease_name, ttl=1, backend=lease_backend, keepalive=False)
    revoked = store.force_release(lease_name, held.token)
    assert revoked.token > held.token and not revoked.held
    with pytest.raises(LeaseLost):
        held.renew()
    with lease(lease_name, ttl=1, backend=lease_backend, timeout=0) as successor:
        assert successor.token > revoked.token


def test_force_release_of_a_stale_token_changes_nothing(
    lease_backend: str, lease_name: str
) -> None:
    """An operator who inspected the name before it changed hands must not evict the new
    holder: the compare and the revocation are one step."""
    store = require(lease_backend, Capability.FORCE_RELEASE)
    with lease(lease_name, ttl=2, backend=lease_backend, keepalive=False) as held:
        for stale in (held.token - 1, held.token + 1):
            with pytest.raises(LeaseNotHeld, match=rf"current token is {held.token}.*nothing"):
                store.force_release(lease_name, stale)
        info = store.inspect(lease_name)
        assert info is not None and info.held
        assert (info.holder, info.token) == (held.holder, held.token)
        held.renew()  # still the holder's, on the store too
    with pytest.raises(LeaseNotHeld, match=r"never granted.*nothing"):
        store.force_release(f"{lease_name}-never", 1)
    assert store.inspect(f"{lease_name}-never") is None


def test_reads_and_revocation_survive_an_absurd_expiry(lease_backend: str, lease_name: str) -> None:
    """A grant that expires in year 33715 (written before TTLs were bounded, or by hand) must
    not break the operators' views of every other lease, nor its own revocation."""
    store = require(lease_backend, Capability.FORCE_RELEASE)
    with contextlib.suppress(Exception):  # today's code writes the grant, then fails to read it
        store.try_acquire(lease_name, "far-future", 1e12)
    far = store.inspect(lease_name)
    assert far is not None and far.held and far.holder == "far-future"
    with lease(f"{lease_name}-other", ttl=1, backend=lease_backend):
        names = {info.name for info in store.inspect_all()}
        assert {lease_name, f"{lease_name}-other"} <= names
    revoked = store.force_release(lease_name, far.token)
    assert revoked.token > far.token and not revoked.held
    with lease(lease_name, ttl=1, backend=lease_backend, timeout=0) as successor:
        assert successor.token > revoked.token


def test_inspect_all_lists_known_names(lease_backend: str, lease_name: str) -> None:
    with lease(lease_name, ttl=1, backend=lease_backend) as held:
        infos = {info.name: info for info in get_backend(lease_backend).inspect_all()}
        assert infos[lease_name].held and infos[lease_name].holder == held.holder
    assert get_backend(lease_backend).inspect(f"{lease_name}-never") is None


def test_signals_report_the_lifecycle(lease_backend: str, lease_name: str) -> None:
    seen: list[str] = []
    receivers = {
        "acquired": lease_acquired,
        "renewed": lease_renewed,
        "released": lease_released,
    }
    handlers = {}
    for label, signal in receivers.items():

        def handler(sender: str, lease: Any, label: str = label, **kwargs: Any) -> None:
            assert sender == lease_backend and lease.name == lease_name
            seen.append(label)
            raise RuntimeError("a broken receiver must not break the lease")

        handlers[label] = handler
        signal.connect(handler)
    try:
        with lease(lease_name, ttl=30, backend=lease_backend, keepalive=False) as held:
            held.renew()
    finally:
        for label, signal in receivers.items():
            signal.disconnect(handlers[label])
    assert seen == ["acquired", "renewed", "released"]


class Interrupted(BaseException):
    """What a signal handler or a task runner raises (KeyboardInterrupt's kind): no
    ``Exception``, so ``send_robust`` lets it through a ``lease_acquired`` receiver."""


@contextlib.contextmanager
def interrupting_the_first_grant(error: BaseException) -> Any:
    """A ``lease_acquired`` receiver that raises ``error`` once: after the store granted the
    lease, before ``acquire()`` handed it over."""
    raised: list[BaseException] = []

    def receiver(sender: str, lease: Any, **kwargs: Any) -> None:
        if not raised:
            raised.append(error)
            raise error

    lease_acquired.connect(receiver)
    try:
        yield
    finally:
        lease_acquired.disconnect(receiver)
    assert raised, "the receiver never ran"


@pytest.mark.parametrize("error", [KeyboardInterrupt(), Interrupted()], ids=type)
def test_an_interrupt_between_the_grant_and_its_handle_leaves_nothing_held(
    lease_backend: str, lease_name: str, error: BaseException
) -> None:
    """Neither the grant (another holder gets the name at once, not after the TTL) nor the
    registration (this thread acquires it again, no ``LeaseAlreadyHeld``) is left behind."""
    with interrupting_the_first_grant(error), pytest.raises(type(error)):
        acquire(lease_name, ttl=30, backend=lease_backend)
    other = acquire(lease_name, ttl=30, backend=lease_backend, timeout=0, holder="other")
    other.release()
    with (
        interrupting_the_first_grant(error),
        pytest.raises(type(error)),
        lease(lease_name, ttl=30, backend=lease_backend),
    ):
        pytest.fail("the block ran")
    again = acquire(lease_name, ttl=30, backend=lease_backend, timeout=0)
    assert again.token > other.token
    again.release()


def test_an_interrupt_between_an_async_grant_and_its_handle_leaves_nothing_held(
    lease_backend: str, lease_name: str
) -> None:
    """:func:`test_an_interrupt_between_the_grant_and_its_handle_leaves_nothing_held`, for
    ``aacquire()`` and ``alease()``."""

    async def main() -> None:
        with interrupting_the_first_grant(Interrupted()), pytest.raises(Interrupted):
            await leases.aacquire(lease_name, ttl=30, backend=lease_backend)
        other = await leases.aacquire(
            lease_name, ttl=30, backend=lease_backend, timeout=0, holder="other"
        )
        await other.arelease()
        with interrupting_the_first_grant(Interrupted()), pytest.raises(Interrupted):
            async with alease(lease_name, ttl=30, backend=lease_backend):
                pytest.fail("the block ran")
        again = await leases.aacquire(lease_name, ttl=30, backend=lease_backend, timeout=0)
        assert again.token > other.token
        await again.arelease()

    asyncio.run(main())


def test_holder_identity_names_host_process_thread_and_label(
    lease_backend: str, lease_name: str
) -> None:
    import os
    import socket

    with (
        override_settings(LEASES={"BACKENDS": _backends(), "HOLDER_LABEL": "billing"}),
        lease(lease_name, ttl=1, backend=lease_backend) as held,
    ):
        label, ident = held.holder.split("@", 1)
        host, pid, thread, random_part = ident.split(":")
        assert label == "billing" and host == socket.gethostname()[:100]
        assert int(pid) == os.getpid() and int(thread) == threading.get_ident()
        assert len(random_part) == 8


def _backends() -> dict[str, Any]:
    from django.conf import settings

    configured: dict[str, Any] = settings.LEASES
    return dict(configured["BACKENDS"])


def test_decorating_async_or_generator_functions_is_refused() -> None:
    async def coroutine() -> None:
        pass

    def generator() -> Any:
        yield 1

    for func in (coroutine, generator):
        with pytest.raises(InvalidLeaseOption, match="coroutine or generator"):
            lease(func)
        with pytest.raises(InvalidLeaseOption):
            lease("name", ttl=1)(func)


@pytest.mark.parametrize(
    ("name", "options", "field"),
    [
        ("job", {"ttl": "60"}, "ttl"),
        ("job", {"ttl": float("nan")}, "ttl"),
        ("job", {"timeout": -1}, "timeout"),
        ("job", {"keepalive": "no"}, "keepalive"),
        ("job", {"shared": 1}, "shared"),
        ("job", {"on_lost": 5}, "on_lost"),
        ("", {}, None),
    ],
)
def test_a_decorators_bad_arguments_fail_where_it_is_applied(
    name: str, options: dict[str, Any], field: str | None
) -> None:
    """``@lease(...)`` and ``@alease(...)`` run at import: a bad argument fails there, at the
    line that wrote it, not at the decorated function's first call. Nothing reaches a store
    (the backend named does not exist, and no call is made)."""
    calls: list[str] = []

    def job() -> None:
        calls.append("ran")

    async def ajob() -> None:
        calls.append("ran")

    expected = InvalidLeaseName if field is None else InvalidLeaseOption
    with pytest.raises(expected) as sync_refusal:
        lease(name, backend="no-such-backend", **options)(job)
    with pytest.raises(expected) as async_refusal:
        leases.alease(name, backend="no-such-backend", **options)(ajob)
    if field is not None:
        assert f"{field}" in str(sync_refusal.value) and f"{field}" in str(async_refusal.value)
    assert calls == []


def test_a_decorator_leaves_setting_dependent_checks_to_the_call() -> None:
    """The backend's alias and the TTL against ``MAX_TTL`` are the settings' business, and a
    decorator applied at import may run under other settings than its calls: those wait."""

    @lease("job", ttl=10**9, backend="no-such-backend")
    def job() -> None:
        raise AssertionError("must not run")

    with pytest.raises(InvalidLeaseOption, match="MAX_TTL"):
        job()
