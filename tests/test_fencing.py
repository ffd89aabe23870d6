"""Fenced model saves: equal tokens pass, lower ones never, in one conditional statement."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models.signals import post_save
from django.test.utils import CaptureQueriesContext

from leases import FencedModel, InvalidFencingToken, LeaseLost, StaleFencingToken
from leases.fencing import FenceHolder
from leases.signals import fence_rejected
from tests.testapp.models_fencing import FencedDoc, FencedDocPart, FencedRegister, FencedUUIDDoc

pytestmark = pytest.mark.django_db


def make_doc(token: int, title: str = "first") -> FencedDoc:
    doc = FencedDoc(title=title)
    doc.save(fence=token)
    return doc


def stored_token(doc: FencedModel) -> int:
    return int(type(doc).objects.values_list("fencing_token", flat=True).get(pk=doc.pk))


def test_fenced_model_is_importable_from_the_package() -> None:
    assert FencedDoc._meta.get_field("fencing_token").default == 0


def test_equal_token_is_accepted() -> None:
    doc = make_doc(4)
    doc.title = "again"
    doc.save(fence=4)
    doc.refresh_from_db()
    assert (doc.title, doc.fencing_token) == ("again", 4)


def test_greater_token_advances_the_fence() -> None:
    doc = make_doc(4)
    doc.title = "newer"
    doc.save(fence=9)
    assert stored_token(doc) == 9


def test_lower_token_is_rejected_and_nothing_changes() -> None:
    doc = make_doc(7, title="kept")
    stale = FencedDoc.objects.get(pk=doc.pk)
    stale.title = "late write"
    with pytest.raises(StaleFencingToken) as info:
        stale.save(fence=6)
    assert (info.value.offered, info.value.stored) == (6, 7)
    assert info.value.resource == f"testapp.FencedDoc(pk={doc.pk!r})"
    assert stale.fencing_token == 7  # the instance keeps what it loaded
    doc.refresh_from_db()
    assert (doc.title, doc.fencing_token) == ("kept", 7)


def test_accepted_update_is_one_statement_and_rejection_reads_once() -> None:
    doc = make_doc(3)
    with CaptureQueriesContext(connection) as accepted:
        doc.save(fence=3)
    assert len(accepted) == 1
    sql = accepted[0]["sql"]
    assert sql.startswith("UPDATE") and '"fencing_token" <= 3' in sql
    with CaptureQueriesContext(connection) as rejected, pytest.raises(StaleFencingToken):
        doc.save(fence=2)
    assert [q["sql"].split()[0] for q in rejected] == ["UPDATE", "SELECT"]


def test_rejection_sends_fence_rejected_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    doc = make_doc(5)
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append({"sender": sender, **kwargs})

    fence_rejected.connect(receiver)
    try:
        with caplog.at_level(logging.WARNING, "leases"), pytest.raises(StaleFencingToken):
            doc.save(fence=1)
    finally:
        fence_rejected.disconnect(receiver)
    assert len(seen) == 1
    assert seen[0]["sender"] is FencedDoc
    assert (seen[0]["offered"], seen[0]["stored"]) == (1, 5)
    assert "rejected" in caplog.text and "offered token 1" in caplog.text


def test_post_save_is_sent_only_for_accepted_writes() -> None:
    doc = make_doc(5)
    saves: list[int] = []

    def receiver(sender: Any, instance: FencedDoc, **kwargs: Any) -> None:
        saves.append(instance.fencing_token)

    post_save.connect(receiver, sender=FencedDoc)
    try:
        doc.save(fence=6)
        with pytest.raises(StaleFencingToken):
            doc.save(fence=2)
    finally:
        post_save.disconnect(receiver, sender=FencedDoc)
    assert saves == [6]


def test_insert_with_auto_pk_stores_the_token() -> None:
    doc = make_doc(11)
    assert doc.pk is not None
    assert stored_token(doc) == 11


def test_insert_with_explicit_pk_creates_then_fences() -> None:
    FencedRegister(name="r1", value="a").save(fence=5)
    with pytest.raises(StaleFencingToken) as info:
        FencedRegister(name="r1", value="late").save(fence=3)
    assert (info.value.offered, info.value.stored) == (3, 5)
    FencedRegister(name="r1", value="b").save(fence=8)
    row = FencedRegister.objects.get(name="r1")
    assert (row.value, row.fencing_token) == ("b", 8)


def test_racing_creators_go_through_the_upsert_fence() -> None:
    """A pk with a default makes Django skip the UPDATE: the insert itself must fence."""
    first = FencedUUIDDoc(title="first")
    first.save(fence=5)
    late = FencedUUIDDoc(id=first.id, title="late")
    with CaptureQueriesContext(connection) as queries, pytest.raises(StaleFencingToken) as info:
        late.save(fence=4)
    assert queries[0]["sql"].startswith("INSERT") and "ON CONFLICT" in queries[0]["sql"]
    assert (info.value.offered, info.value.stored) == (4, 5)
    newer = FencedUUIDDoc(id=first.id, title="newer")
    with CaptureQueriesContext(connection) as queries:
        newer.save(fence=5)
    assert len(queries) == 1
    row = FencedUUIDDoc.objects.get(pk=first.id)
    assert (row.title, row.fencing_token) == ("newer", 5)


def test_force_insert_with_a_fence_still_refuses_an_existing_row() -> None:
    doc = make_doc(2)
    copy = FencedDoc(pk=doc.pk, title="dup")
    with pytest.raises(IntegrityError), transaction.atomic():
        copy.save(fence=9, force_insert=True)
    assert stored_token(doc) == 2


def test_update_fields_writes_only_those_fields_and_the_token() -> None:
    doc = make_doc(2, title="t")
    doc.title, doc.body = "new title", "not saved"
    with CaptureQueriesContext(connection) as queries:
        doc.save(fence=3, update_fields=["title"])
    assert '"body"' not in queries[0]["sql"]
    doc.refresh_from_db()
    assert (doc.title, doc.body, doc.fencing_token) == ("new title", "", 3)
    with pytest.raises(StaleFencingToken):
        doc.save(fence=1, update_fields=["title"])


def test_forced_update_of_a_missing_row_fails_as_in_django() -> None:
    with pytest.raises(DatabaseError, match="did not affect any rows"):
        FencedDoc(pk=987654, title="ghost").save(fence=3, force_update=True)


def test_unfenced_save_works_and_never_lowers_the_fence() -> None:
    doc = FencedDoc(title="plain")
    doc.save()
    assert stored_token(doc) == 0
    stale_copy = FencedDoc.objects.get(pk=doc.pk)
    doc.save(fence=7)
    stale_copy.title = "unfenced edit"
    stale_copy.save()
    doc.refresh_from_db()
    assert (doc.title, doc.fencing_token) == ("unfenced edit", 7)


def test_unfenced_save_named_token_can_raise_but_never_lower_it() -> None:
    doc = make_doc(7)
    doc.fencing_token = 1
    doc.save(update_fields=["fencing_token"])
    assert stored_token(doc) == 7
    doc.fencing_token = 9
    doc.save(update_fields=["fencing_token"])
    assert stored_token(doc) == 9


def test_rejection_inside_atomic_keeps_the_transaction_usable() -> None:
    doc = make_doc(5)
    with transaction.atomic():
        with pytest.raises(StaleFencingToken):
            doc.save(fence=4)
        FencedDoc(title="after the rejection").save(fence=1)
    assert FencedDoc.objects.filter(title="after the rejection").exists()


class _HeldLease:
    """A lease-shaped value: the protocol FencedModel relies on (token + ensure_held)."""

    def __init__(self, token: int, lost: bool) -> None:
        self.token, self.lost, self.checked = token, lost, 0

    def ensure_held(self) -> None:
        self.checked += 1
        if self.lost:
            raise LeaseLost("invoice", self.token, "expired while paused")


def test_a_lease_is_checked_before_the_write() -> None:
    held = _HeldLease(4, lost=False)
    assert isinstance(held, FenceHolder)
    doc = FencedDoc(title="by lease")
    doc.save(fence=held)
    assert held.checked == 1 and stored_token(doc) == 4


def test_a_lease_that_knows_it_is_lost_fails_before_writing() -> None:
    """Nobody newer has written yet, so only the lease itself can stop this write."""
    doc = make_doc(3, title="original")
    lost = _HeldLease(3, lost=True)
    doc.title = "unprotected"
    with CaptureQueriesContext(connection) as queries, pytest.raises(LeaseLost):
        doc.save(fence=lost)
    assert len(queries) == 0
    doc.refresh_from_db()
    assert doc.title == "original"


@pytest.mark.parametrize("token", [True, 1.5, "3", None, 0, -1, 2**63])
def test_bad_tokens_are_refused_before_any_query(token: Any) -> None:
    doc = FencedDoc(title="x")
    with CaptureQueriesContext(connection) as queries, pytest.raises(InvalidFencingToken):
        doc.save(fence=token) if token is not None else doc.save(fence=object())  # type: ignore[arg-type]
    assert len(queries) == 0
    assert isinstance(InvalidFencingToken(token, "x"), ValueError)


def test_asave_is_fenced_too() -> None:
    from asgiref.sync import async_to_sync

    doc = make_doc(5)
    doc.title = "async"
    async_to_sync(doc.asave)(fence=6)
    with pytest.raises(StaleFencingToken):
        async_to_sync(doc.asave)(fence=2)
    doc.refresh_from_db()
    assert (doc.title, doc.fencing_token) == ("async", 6)


def test_multi_table_child_is_fenced_through_its_parent_table() -> None:
    part = FencedDocPart(title="parent", part="child")
    part.save(fence=4)
    part.part, part.title = "late child", "late parent"
    with transaction.atomic():
        with pytest.raises(StaleFencingToken):
            part.save(fence=3)
        assert transaction.get_rollback()  # a parent table may have changed: do not go on
    part.refresh_from_db()
    assert (part.title, part.part, part.fencing_token) == ("parent", "child", 4)
    part.part = "newer"
    part.save(fence=5)
    part.refresh_from_db()
    assert (part.part, part.fencing_token) == ("newer", 5)
