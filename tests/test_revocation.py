"""A force release fences the evicted grant at the resource at once, on every backend.

No successor writes in these tests: the resource must refuse the evicted lease's writes on the
strength of the recorded revocation alone, in the statement that would write.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission
from django.db import connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from leases import (
    FencingTokenRevoked,
    LeaseLost,
    LeaseNotHeld,
    StaleFencingToken,
    acquire,
    check_fence,
    revocation,
)
from leases.backends import Capability, get_backend
from leases.lease import Lease
from leases.models import ForceRelease, Revocation
from leases.operations import force_release
from leases.revocation import REVOKE_SQL
from tests.checker import check_history, history, new_register, record_write
from tests.factories import UserFactory
from tests.lease_backends import lease_backend, lease_name, require
from tests.testapp.models_fencing import FencedDoc, FencedDocPart, FencedRegister

__all__ = ["lease_backend", "lease_name"]  # fixtures, re-exported for pytest


@pytest.fixture
def operator(db: None) -> Any:
    user: Any = UserFactory(username="revoking-operator")
    user.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    return user


Evict = Callable[[Lease], None]


@pytest.fixture
def evict(operator: Any) -> Iterator[Evict]:
    """Force-release a lease as an operator. At the end each evicted holder gives its lease up
    and learns it was lost: left to the watchdog, its loss would be reported when its TTL ran
    out, in the middle of a later test (and its log capture)."""
    evicted: list[Lease] = []

    def evict_one(held: Lease) -> None:
        force_release(held.name, backend=held.backend, token=held.token, user=operator, via="test")
        evicted.append(held)

    yield evict_one
    for held in evicted:
        with pytest.raises(LeaseLost):
            held.release()
        assert held.done


def test_evicted_lease_cannot_write_although_nobody_newer_did(
    lease_backend: str, lease_name: str, evict: Evict
) -> None:
    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    doc = FencedDoc(title="before")
    doc.save(fence=held)
    check_fence(f"file:{lease_name}", held)
    evict(held)
    held.ensure_held()  # the holder does not know yet: only the resource can refuse

    doc.title = "after"
    with pytest.raises(FencingTokenRevoked) as refused:
        doc.save(fence=held)
    assert (refused.value.offered, refused.value.revoked_through) == (held.token, held.token)
    with pytest.raises(FencingTokenRevoked):
        FencedDoc.objects.filter(pk=doc.pk).fenced(held).update(title="after")
    with pytest.raises(FencingTokenRevoked):
        FencedDoc.objects.fenced(held).bulk_update([doc], ["title"])
    with pytest.raises(FencingTokenRevoked):
        doc.delete(fence=held)
    with pytest.raises(FencingTokenRevoked):
        check_fence(f"file:{lease_name}", held)
    with pytest.raises(FencingTokenRevoked):
        check_fence(f"other-file:{lease_name}", held)  # a resource it never wrote to
    doc.refresh_from_db()
    assert (doc.title, doc.fencing_token) == ("before", held.token)


def test_evicted_lease_cannot_insert_new_rows(
    lease_backend: str, lease_name: str, evict: Evict
) -> None:
    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    evict(held)
    with pytest.raises(FencingTokenRevoked):
        FencedDoc(title=f"auto pk {lease_name}").save(fence=held)  # plain INSERT
    with pytest.raises(FencingTokenRevoked):
        FencedRegister(name=lease_name, value="explicit pk").save(fence=held)  # the upsert
    # A multi-table save may have written a parent row before a refusal, so Django's mark for
    # rollback stays: the caller needs a savepoint of its own.
    with pytest.raises(FencingTokenRevoked), transaction.atomic():
        FencedDocPart(title=f"child {lease_name}").save(fence=held)  # parent row first
    assert not FencedDoc.objects.filter(title__endswith=lease_name).exists()
    assert not FencedRegister.objects.filter(name=lease_name).exists()


def test_revocation_survives_the_callers_rollback_and_keeps_its_transaction_usable(
    lease_backend: str, lease_name: str, evict: Evict
) -> None:
    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    doc = FencedDoc(title="before")
    doc.save(fence=held)
    with transaction.atomic():
        sid = transaction.savepoint()
        evict(held)
        transaction.savepoint_rollback(sid)
        doc.title = "after"
        with pytest.raises(FencingTokenRevoked):
            doc.save(fence=held)
        FencedDoc(title="the transaction still works").save(fence=1)
    assert Revocation.objects.filter(backend=lease_backend, name=lease_name).exists()


def test_successor_writes_normally_after_a_revocation(
    lease_backend: str, lease_name: str, evict: Evict
) -> None:
    register = new_register()
    first = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    assert record_write(register, first, "first")
    evict(first)
    assert not record_write(register, first, "first")  # refused by the resource
    second = acquire(lease_name, ttl=5, backend=lease_backend, timeout=5, holder="successor")
    try:
        assert second.token > first.token
        assert record_write(register, second, "second")
        assert not record_write(register, first, "first")
    finally:
        second.release()
    outcomes = [(a.writer, a.outcome) for a in history(register)]
    assert outcomes == [
        ("first", "accepted"),
        ("first", "revoked"),
        ("second", "accepted"),
        ("first", "stale"),  # both stale and revoked now: the greater stored token says so
    ]
    check_history(register, grants=[first.token, second.token], revoked=[first.token])


def test_bare_int_fences_name_no_lease_so_revocation_cannot_reach_them(
    lease_backend: str, lease_name: str, evict: Evict
) -> None:
    """The documented limit: ``fence=lease`` is the form revocation protects."""
    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    doc = FencedDoc(title="before")
    doc.save(fence=held)
    evict(held)
    doc.title = "by a bare token"
    doc.save(fence=int(held))
    doc.refresh_from_db()
    assert doc.title == "by a bare token"


def test_a_lease_that_changed_hands_is_not_released_or_revoked(
    lease_backend: str, lease_name: str, evict: Evict
) -> None:
    seen = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    seen.release()
    successor = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    try:
        with pytest.raises(LeaseNotHeld, match=f"now {successor.token}, not {seen.token}"):
            evict(seen)
        info = get_backend(lease_backend).inspect(lease_name)
        assert info is not None and info.held and info.token == successor.token
        assert not Revocation.objects.filter(backend=lease_backend, name=lease_name).exists()
        assert not ForceRelease.objects.filter(name=lease_name).exists()
        FencedDoc(title="successor").save(fence=successor)
    finally:
        successor.release()


def test_revocation_does_not_leak_into_another_backend_or_name(
    lease_backend: str, lease_name: str, evict: Evict
) -> None:
    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    other = acquire(f"{lease_name}-other", ttl=30, backend=lease_backend, keepalive=False)
    try:
        evict(held)
        FencedDoc(title="other name").save(fence=other)
        Revocation.objects.create(backend="not-this-backend", name=other.name, token=10**9)
        FencedDoc(title="other backend's revocation").save(fence=other)
    finally:
        other.release()


def test_an_unrevoked_fenced_update_costs_no_extra_statement(
    lease_backend: str, lease_name: str
) -> None:
    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    try:
        doc = FencedDoc(title="a")
        doc.save(fence=held)
        doc.title = "b"
        with CaptureQueriesContext(connection) as queries:
            doc.save(fence=held)
        assert len(queries) == 1 and "leases_revocation" in queries[0]["sql"]
    finally:
        held.release()


@pytest.mark.parametrize("token", [0, -1, "7", None, True])
def test_force_release_refuses_a_token_that_cannot_be_one(
    lease_name: str, operator: Any, token: Any
) -> None:
    held = acquire(lease_name, ttl=30, keepalive=False)
    try:
        with pytest.raises(ValueError):
            force_release(lease_name, backend="default", token=token, user=operator, via="test")
        assert get_backend().inspect(lease_name).held  # type: ignore[union-attr]
    finally:
        held.release()


def test_stale_and_revoked_are_both_stale_fencing_token() -> None:
    assert issubclass(FencingTokenRevoked, StaleFencingToken)


def test_a_revoked_holder_hears_it_was_revoked_not_that_it_expired(
    lease_backend: str, lease_name: str, evict: Evict
) -> None:
    """The store only knows its grant is gone; the holder's loss names the operator's act, so
    whoever reads the log or the metric does not go tuning TTLs after an eviction."""
    from leases import signals

    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    causes: list[str] = []

    def on_lost(sender: str, lease: Lease, reason: str, cause: str, **_: Any) -> None:
        causes.append(cause)

    signals.lease_lost.connect(on_lost)
    try:
        evict(held)
        with pytest.raises(
            LeaseLost, match=rf"revoked: .*\(through token {held.token}\): renewal refused"
        ):
            held.renew()
    finally:
        signals.lease_lost.disconnect(on_lost)
    assert causes == ["revoked"]
    assert held.lost_reason is not None and held.lost_reason.startswith("revoked")


def test_a_revoked_holders_release_says_revoked(
    lease_backend: str, lease_name: str, operator: Any
) -> None:
    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    force_release(held.name, backend=held.backend, token=held.token, user=operator, via="test")
    with pytest.raises(LeaseLost, match="revoked: an operator force-released it"):
        held.release()


def test_an_async_revoked_holder_hears_it_was_revoked(
    lease_backend: str, lease_name: str, operator: Any
) -> None:
    """``arenew``/``arelease`` learn it too (the database read on a worker thread)."""
    import asyncio

    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    other = acquire(f"{lease_name}-2", ttl=30, backend=lease_backend, keepalive=False)
    for one in (held, other):
        force_release(one.name, backend=one.backend, token=one.token, user=operator, via="test")

    async def scenario() -> tuple[str, str]:
        with pytest.raises(LeaseLost) as renewed:
            await held.arenew()
        with pytest.raises(LeaseLost) as released:
            await other.arelease()
        await get_backend(lease_backend).aclose()  # the loop's async clients end with it
        return str(renewed.value), str(released.value)

    renewal, release = asyncio.run(scenario())
    assert "revoked: an operator force-released it" in renewal
    assert "revoked: an operator force-released it" in release
    with pytest.raises(LeaseLost):
        held.release()


class HungLookup:
    """Revokes grants in a transaction that holds ``leases_revocation`` locked, so every
    revocation lookup waits on the lock (a database that does not answer) until :meth:`answer`
    commits, and then finds the revocations. Revoking here, not with ``force_release``, makes
    sure the store's refusal (and so the lookup) cannot come before the lock."""

    def __init__(self) -> None:
        self.connection = connections.create_connection("default")
        self.connection.set_autocommit(False)
        with self.connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '10s'")  # fail rather than hang
            cursor.execute("LOCK TABLE leases_revocation IN ACCESS EXCLUSIVE MODE")

    def revoke(self, held: Lease) -> None:
        with self.connection.cursor() as cursor:
            cursor.execute(REVOKE_SQL, [held.backend, held.name, held.token])
        get_backend(held.backend).force_release(held.name, held.token)

    def answer(self) -> None:
        if self.connection.connection is not None:
            self.connection.commit()
            self.connection.close()


@pytest.fixture
def hung_lookup(lease_backend: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[HungLookup]:
    """A revocation lookup that hangs, bounded by a minute instead of a second (the renewer
    that waited for it missed every renewal meanwhile), and keepalive renewing every second
    with a validity of about 20: a lease missing its renewals is not lost within a test."""
    require(lease_backend, Capability.FORCE_RELEASE)
    monkeypatch.setattr(revocation, "LOOKUP_TIMEOUT", 60.0)
    hung = HungLookup()
    try:
        with override_settings(LEASES={**settings.LEASES, "RENEW_FRACTION": 0.05}):
            yield hung
    finally:
        hung.answer()


def test_a_hung_revocation_lookup_does_not_hold_up_other_leases_renewals(
    lease_backend: str, lease_name: str, hung_lookup: HungLookup
) -> None:
    """A revoked holder's refused renewal is worded after a database read; the alias's shared
    renewer thread does not wait for it, so the other leases of the alias renew on time."""
    from leases import signals

    lost_reasons: list[str] = []
    causes: list[str] = []
    reported, renewed_thrice = threading.Event(), threading.Event()
    evicted = acquire(
        lease_name,
        ttl=20,
        backend=lease_backend,
        on_lost=lambda lost: lost_reasons.append(lost.lost_reason or ""),
    )
    other = acquire(f"{lease_name}-other", ttl=20, backend=lease_backend)
    renewals = 0

    def renewed(sender: str, lease: Lease, **_: Any) -> None:
        nonlocal renewals
        if lease is other:
            renewals += 1
            if renewals == 3:
                renewed_thrice.set()

    def lost(sender: str, lease: Lease, reason: str, cause: str, **_: Any) -> None:
        if lease is evicted:
            causes.append(cause)
            reported.set()

    signals.lease_renewed.connect(renewed)
    signals.lease_lost.connect(lost)
    try:
        hung_lookup.revoke(evicted)
        # Renewals are due every second; the renewer that waited for the lookup (a minute
        # here) renewed the other lease at most once more, before it met the refusal.
        assert renewed_thrice.wait(15), f"{renewals} renewals of the other lease in 15 s"
        assert evicted.done, "the evicted lease's renewal, due before, was not refused"
        assert not reported.is_set(), "reported before the revocation could be read"
        hung_lookup.answer()
        assert reported.wait(15), "the loss was never reported"
        other.ensure_held()
    finally:
        signals.lease_renewed.disconnect(renewed)
        signals.lease_lost.disconnect(lost)
        hung_lookup.answer()
        other.release()
        with pytest.raises(LeaseLost):
            evicted.release()
    assert causes == ["revoked"]
    assert len(lost_reasons) == 1 and lost_reasons[0].startswith("revoked: an operator")


def test_a_refused_renewal_is_lost_at_once_while_the_revocation_lookup_hangs(
    lease_backend: str, lease_name: str, hung_lookup: HungLookup
) -> None:
    """The store's refusal is the verdict: ``lost`` is set and ``ensure_held()`` raises at
    once; only the wording waits for the database, and ``on_lost`` waits for the wording."""
    reasons: list[str] = []
    reported = threading.Event()

    def on_lost(lost: Lease) -> None:
        reasons.append(lost.lost_reason or "")
        reported.set()

    held = acquire(lease_name, ttl=20, backend=lease_backend, on_lost=on_lost)
    try:
        hung_lookup.revoke(held)
        assert held.lost.wait(15), "not lost while its revocation lookup hung"
        with pytest.raises(LeaseLost, match="renewal refused"):
            held.ensure_held()
        assert held.remaining() == 0 and not reported.is_set()
        hung_lookup.answer()
        assert reported.wait(15), "on_lost never ran"
    finally:
        hung_lookup.answer()
        with pytest.raises(LeaseLost, match="revoked"):
            held.release()
    assert len(reasons) == 1 and reasons[0].startswith("revoked: an operator force-released it")
    assert held.lost_reason == reasons[0]


def test_a_renew_call_marks_the_loss_before_its_revocation_lookup_answers(
    lease_backend: str, lease_name: str, hung_lookup: HungLookup
) -> None:
    """A caller's own ``renew()`` waits for the wording (its error says "revoked"), but the
    lease is lost for every other thread from the refusal on."""
    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    raised: list[LeaseLost] = []

    def renew() -> None:
        with pytest.raises(LeaseLost) as refused:
            held.renew()
        raised.append(refused.value)

    hung_lookup.revoke(held)
    renewing = threading.Thread(target=renew)
    renewing.start()
    try:
        assert held.lost.wait(15), "not lost while its revocation lookup hung"
        with pytest.raises(LeaseLost):
            held.ensure_held()
        assert renewing.is_alive(), "renew() did not wait for the revocation lookup"
    finally:
        hung_lookup.answer()
        renewing.join(15)
    assert len(raised) == 1
    assert "revoked: an operator force-released it" in str(raised[0])
    with pytest.raises(LeaseLost):
        held.release()
