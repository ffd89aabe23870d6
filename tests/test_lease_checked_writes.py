"""Lease-checked writes: the writing statement refuses a grant that is no longer current.

"Expired on the database clock while the holder still believes it holds" is made by moving the
lease row's expiry into the past on another connection: what a holder paused after its own
check (or whose clock runs slow) would meet. A fence lets that write through, since nobody
newer has written; a lease-checked write refuses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.models.signals import pre_delete
from django.test.utils import CaptureQueriesContext

from leases import (
    LeaseCheckFailed,
    LeaseCheckUnavailable,
    LeaseLost,
    acquire,
)
from leases.backends import get_backend
from leases.lease import Lease
from tests.lease_backends import lease_name
from tests.testapp.models_fencing import FencedDoc, FencedDocPart, FencedRegister

__all__ = ["lease_name"]

pytestmark = pytest.mark.django_db(transaction=True)


def expire_on_the_database_clock(held: Lease) -> None:
    """The row expires now, committed, while the handle still has its whole TTL left."""
    private = connections.create_connection("default")
    try:
        with private.cursor() as cursor:
            cursor.execute(
                "UPDATE leases_lease SET expires_at = clock_timestamp() WHERE name = %s",
                [held.name],
            )
    finally:
        private.close()
    assert held.remaining() > 10


@pytest.fixture
def held(lease_name: str) -> Iterator[Lease]:
    """A lease the test may let expire; given up at the end whatever became of it, so the
    watchdog does not report its loss inside a later test."""
    lease = acquire(lease_name, ttl=30, keepalive=False)
    yield lease
    if not lease.done:
        with contextlib.suppress(LeaseLost):
            lease.release()


def test_a_held_lease_writes_updates_and_inserts(held: Lease) -> None:
    doc = FencedDoc(title="new")
    doc.save(lease=held)  # insert
    doc.title = "edited"
    doc.save(lease=held)  # update
    assert FencedDoc.objects.filter(pk=doc.pk).under_lease(held).update(body="b") == 1
    assert FencedDoc.objects.filter(pk=-1).under_lease(held).update(body="b") == 0
    doc.refresh_from_db()
    assert (doc.title, doc.body, doc.fencing_token) == ("edited", "b", 0)
    doc.save(lease=held, fence=held)
    doc.refresh_from_db()
    assert doc.fencing_token == held.token
    held.release()


def test_an_expired_lease_is_refused_although_nobody_newer_exists(held: Lease) -> None:
    doc = FencedDoc(title="original")
    doc.save(fence=held)
    expire_on_the_database_clock(held)
    doc.title = "unprotected"
    with pytest.raises(LeaseCheckFailed) as refused:
        doc.save(lease=held)
    assert refused.value.name == held.name and refused.value.token == held.token
    with pytest.raises(LeaseCheckFailed):
        FencedDoc.objects.filter(pk=doc.pk).under_lease(held).update(title="unprotected")
    with pytest.raises(LeaseCheckFailed):  # fenced too: the check still refuses
        FencedDoc.objects.filter(pk=doc.pk).fenced(held).under_lease(held).update(title="x")
    with pytest.raises(LeaseCheckFailed):  # an insert is refused in its own statement
        FencedDoc(title="unprotected").save(lease=held)
    with pytest.raises(LeaseCheckFailed):
        FencedDocPart(title="unprotected", part="p").save(lease=held)
    assert isinstance(refused.value, LeaseLost)
    assert list(FencedDoc.objects.values_list("title", flat=True)) == ["original"]
    # The difference from a fence: the same write, fenced only, lands (nobody newer wrote).
    doc.save(fence=held)
    doc.refresh_from_db()
    assert doc.title == "unprotected"


def test_a_released_or_revoked_grant_is_refused(lease_name: str) -> None:
    first = acquire(lease_name, ttl=30, keepalive=False)
    # The backend's own revocation, without the revocation table: the lease row alone refuses.
    get_backend("default").force_release(lease_name, first.token)
    with pytest.raises(LeaseCheckFailed):
        FencedRegister(name=lease_name, value="x").save(lease=first)
    successor = acquire(lease_name, ttl=30, keepalive=False, holder="successor")
    FencedRegister(name=lease_name, value="y").save(lease=successor)
    assert FencedRegister.objects.get(name=lease_name).value == "y"
    successor.release()
    with pytest.raises(LeaseLost):
        first.release()


def test_a_refusal_leaves_the_callers_transaction_usable(held: Lease) -> None:
    doc = FencedDoc.objects.create(title="original")
    expire_on_the_database_clock(held)
    with transaction.atomic():
        doc.title = "unprotected"
        with pytest.raises(LeaseCheckFailed):
            doc.save(lease=held)
        FencedDoc.objects.create(title="after the refusal")
    assert FencedDoc.objects.count() == 2


def test_bulk_update_under_a_lost_lease_changes_nothing(held: Lease) -> None:
    docs = [FencedDoc.objects.create(title=f"d{i}") for i in range(4)]
    expire_on_the_database_clock(held)
    for doc in docs:
        doc.title = "unprotected"
    with pytest.raises(LeaseCheckFailed):
        FencedDoc.objects.under_lease(held).bulk_update(docs, ["title"], batch_size=2)
    assert set(FencedDoc.objects.values_list("title", flat=True)) == {"d0", "d1", "d2", "d3"}


def test_a_held_lease_deletes_and_a_lost_one_deletes_nothing(held: Lease) -> None:
    kept, gone = FencedDoc.objects.create(title="kept"), FencedDoc.objects.create(title="gone")
    assert FencedDoc.objects.filter(pk=gone.pk).under_lease(held).delete()[0] == 1
    assert FencedDoc.objects.filter(pk=-1).under_lease(held).delete()[0] == 0
    expire_on_the_database_clock(held)
    with pytest.raises(LeaseCheckFailed) as refused:
        FencedDoc.objects.filter(pk=kept.pk).under_lease(held).delete()
    assert refused.value.name == held.name and refused.value.token == held.token
    with pytest.raises(LeaseCheckFailed):  # fenced too: the check still refuses
        FencedDoc.objects.filter(pk=kept.pk).fenced(held).under_lease(held).delete()
    assert list(FencedDoc.objects.values_list("title", flat=True)) == ["kept"]


def test_a_delete_whose_lease_is_lost_midway_is_undone(held: Lease) -> None:
    """A child row of multi-table inheritance is deleted in several statements (the child's
    and the parent's rows, by primary key) after the rows were selected under the check; the
    lease expires in between, so the final check refuses and every statement is undone."""
    part = FencedDocPart.objects.create(title="kept", part="p")

    def expire_midway(sender: type[Any], instance: Any, **kwargs: Any) -> None:
        if instance.pk == part.pk:
            expire_on_the_database_clock(held)

    pre_delete.connect(expire_midway, sender=FencedDocPart)
    try:
        with transaction.atomic():
            with pytest.raises(LeaseCheckFailed):
                FencedDocPart.objects.filter(pk=part.pk).under_lease(held).delete()
            FencedDoc.objects.create(title="after the refusal")  # the transaction is usable
    finally:
        pre_delete.disconnect(expire_midway, sender=FencedDocPart)
    assert FencedDocPart.objects.filter(pk=part.pk).exists()
    assert FencedDoc.objects.filter(pk=part.pk).exists()


def test_a_lease_kept_elsewhere_is_refused_before_any_query(lease_name: str) -> None:
    """Redis keeps no lease rows: the statement cannot see the lease, so it is not attempted."""
    elsewhere = acquire(lease_name, ttl=30, backend="redis", keepalive=False)
    doc = FencedDoc.objects.create(title="kept")
    try:
        with CaptureQueriesContext(connection) as queries:
            with pytest.raises(LeaseCheckUnavailable):
                FencedDoc(title="x").save(lease=elsewhere)
            with pytest.raises(LeaseCheckUnavailable):
                FencedDoc.objects.under_lease(elsewhere).update(title="x")
            with pytest.raises(LeaseCheckUnavailable):
                FencedDoc.objects.under_lease(elsewhere).delete()
        assert len(queries) == 0
    finally:
        elsewhere.release()
    assert FencedDoc.objects.filter(pk=doc.pk).exists()
    assert get_backend("redis").inspect(lease_name) is not None


def test_a_lease_lost_locally_fails_before_any_query(lease_name: str) -> None:
    held = acquire(lease_name, ttl=30, keepalive=False)
    held.release()
    with CaptureQueriesContext(connection) as queries:
        with pytest.raises(LeaseLost):
            FencedDoc(title="x").save(lease=held)
        with pytest.raises(LeaseLost):
            FencedDoc.objects.under_lease(held).delete()
    assert len(queries) == 0
