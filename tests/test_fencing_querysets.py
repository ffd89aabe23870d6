"""Fenced querysets (all or nothing) and check_fence for resources that are not rows."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import NotSupportedError, connection, connections, transaction
from django.db.models import Count, F, Value
from django.db.models.functions import Concat
from django.test.utils import CaptureQueriesContext

from leases import InvalidFencingToken, InvalidLeaseName, StaleFencingToken, check_fence
from leases.fencing import FencedManager, FencedQuerySet
from leases.models import Fence
from leases.signals import fence_rejected
from tests.testapp.models_fencing import DocNote, ElsewhereDoc, FencedDoc, FencedDocPart

pytestmark = pytest.mark.django_db


def docs(*tokens: int) -> list[FencedDoc]:
    made = []
    for i, token in enumerate(tokens):
        doc = FencedDoc(title=f"doc{i}")
        doc.save(fence=token)
        made.append(doc)
    return made


def state(*objs: FencedDoc) -> list[tuple[str, int]]:
    rows = FencedDoc.objects.filter(pk__in=[o.pk for o in objs]).order_by("pk")
    return [(d.title, d.fencing_token) for d in rows]


def test_default_manager_is_fenced_and_combinable() -> None:
    assert isinstance(FencedDoc.objects, FencedManager)
    assert isinstance(FencedDoc.objects.all(), FencedQuerySet)

    class Mine(FencedQuerySet[FencedDoc]):
        def titled(self, title: str) -> Mine:
            return self.filter(title=title)

    qs = Mine(model=FencedDoc).fenced(3).titled("x")
    assert isinstance(qs, Mine) and qs._fence == 3
    manager = FencedManager.from_queryset(Mine)()
    manager.model = FencedDoc
    assert isinstance(manager.fenced(3), Mine)


def test_fenced_update_sets_the_token_on_every_row() -> None:
    a, b = docs(1, 3)
    qs = FencedDoc.objects.filter(pk__in=[a.pk, b.pk])
    assert qs.fenced(3).update(title="paid") == 2
    assert state(a, b) == [("paid", 3), ("paid", 3)]


def test_fence_survives_chaining_in_either_order() -> None:
    a, b = docs(1, 2)
    assert FencedDoc.objects.fenced(5).filter(pk=a.pk).update(title="x") == 1
    assert FencedDoc.objects.filter(pk=b.pk).fenced(6).order_by("pk").update(title="y") == 1
    assert state(a, b) == [("x", 5), ("y", 6)]


def test_fenced_update_is_all_or_nothing() -> None:
    low, high, higher, other = docs(1, 7, 9, 2)
    seen: list[dict[str, Any]] = []
    fence_rejected.connect(lambda sender, **kw: seen.append(kw), weak=False, dispatch_uid="t")
    try:
        with pytest.raises(StaleFencingToken) as info:
            FencedDoc.objects.filter(pk__in=[low.pk, high.pk, higher.pk]).fenced(5).update(
                title="late"
            )
    finally:
        fence_rejected.disconnect(dispatch_uid="t")
    assert (info.value.offered, info.value.stored) == (5, 9)
    assert f"pk in [{higher.pk}, {high.pk}]" in info.value.resource
    assert state(low, high, higher, other) == [
        ("doc0", 1),
        ("doc1", 7),
        ("doc2", 9),
        ("doc3", 2),
    ]
    assert seen and seen[0]["offered"] == 5


def test_fenced_update_rejection_inside_atomic_keeps_the_transaction_usable() -> None:
    low, high = docs(1, 9)
    with transaction.atomic():
        with pytest.raises(StaleFencingToken):
            FencedDoc.objects.all().fenced(5).update(title="late")
        FencedDoc.objects.filter(pk=low.pk).fenced(5).update(title="only low")
    assert state(low, high) == [("only low", 5), ("doc1", 9)]


def test_fenced_update_refuses_to_be_told_the_token() -> None:
    with pytest.raises(TypeError, match="sets fencing_token itself"):
        FencedDoc.objects.fenced(3).update(fencing_token=1)


def test_unfenced_queryset_update_is_plain_django() -> None:
    (a,) = docs(4)
    assert FencedDoc.objects.filter(pk=a.pk).update(title="plain") == 1
    assert state(a) == [("plain", 4)]


def test_fenced_bulk_update_writes_fields_and_tokens() -> None:
    a, b = docs(1, 2)
    a.title, b.title = "A", "B"
    assert FencedDoc.objects.fenced(4).bulk_update([a, b], ["title", "fencing_token"]) == 2
    assert state(a, b) == [("A", 4), ("B", 4)]
    assert (a.fencing_token, b.fencing_token) == (4, 4)


def test_fenced_bulk_update_undoes_earlier_batches_when_one_is_stale() -> None:
    a, b, c = docs(1, 2, 8)
    for doc in (a, b, c):
        doc.title = "late"
    with pytest.raises(StaleFencingToken) as info:
        FencedDoc.objects.fenced(5).bulk_update([a, b, c], ["title"], batch_size=1)
    assert info.value.stored == 8
    assert state(a, b, c) == [("doc0", 1), ("doc1", 2), ("doc2", 8)]
    assert a.fencing_token == 1


def test_fenced_queryset_rejects_bad_tokens_up_front() -> None:
    with pytest.raises(InvalidFencingToken):
        FencedDoc.objects.fenced(0)


def fence_of(resource: str) -> int | None:
    return Fence.objects.filter(resource=resource).values_list("token", flat=True).first()


def test_check_fence_advances_accepts_equal_and_rejects_lower() -> None:
    assert check_fence("file:/tmp/report.csv", 3) == 3
    assert check_fence("file:/tmp/report.csv", 3) == 3
    assert check_fence("file:/tmp/report.csv", 10) == 10
    with pytest.raises(StaleFencingToken) as info:
        check_fence("file:/tmp/report.csv", 9)
    assert (info.value.resource, info.value.offered, info.value.stored) == (
        "file:/tmp/report.csv",
        9,
        10,
    )
    assert fence_of("file:/tmp/report.csv") == 10


def test_check_fence_rejection_leaves_the_transaction_usable() -> None:
    check_fence("api:charge", 5)
    with transaction.atomic():
        with pytest.raises(StaleFencingToken):
            check_fence("api:charge", 4)
        check_fence("api:refund", 4)
    assert fence_of("api:refund") == 4


@pytest.mark.django_db(transaction=True)
def test_check_fence_commits_or_rolls_back_with_the_callers_effect() -> None:
    """The fence advances exactly when the effect it guards commits."""
    check_fence("ledger", 2)
    with transaction.atomic():
        check_fence("ledger", 5)
        FencedDoc(title="effect").save()
        transaction.set_rollback(True)
    assert fence_of("ledger") == 2
    assert not FencedDoc.objects.filter(title="effect").exists()
    assert check_fence("ledger", 3) == 3


@pytest.mark.django_db(transaction=True)
def test_a_stale_check_fence_waits_for_the_newer_holder_then_fails() -> None:
    """While a newer holder's transaction is open, an older one cannot slip past the fence."""
    check_fence("shared-file", 1)
    started, outcome = threading.Event(), []

    def stale_writer() -> None:
        try:
            started.set()
            check_fence("shared-file", 6)
            outcome.append("accepted")
        except StaleFencingToken as exc:
            outcome.append(f"rejected by {exc.stored}")
        finally:
            connections.close_all()

    with transaction.atomic():
        check_fence("shared-file", 7)
        thread = threading.Thread(target=stale_writer)
        thread.start()
        assert started.wait(10)
        time.sleep(0.3)
        assert outcome == []  # blocked on the row the newer holder has not committed
    thread.join(20)
    assert not thread.is_alive()
    assert outcome == ["rejected by 7"]


@pytest.mark.parametrize("resource", ["", "x" * 256, "nul\x00byte", 42])
def test_check_fence_validates_resource_names(resource: Any) -> None:
    with pytest.raises(InvalidLeaseName):
        check_fence(resource, 1)


@pytest.mark.parametrize("token", [0, -3, 2.0, "7", False])
def test_check_fence_validates_tokens(token: Any) -> None:
    with CaptureQueriesContext(connection) as queries, pytest.raises(InvalidFencingToken):
        check_fence("ok", token)
    assert len(queries) == 0


def test_a_fenced_write_through_a_multi_valued_relation_counts_each_row_once() -> None:
    """Filtering through a relation matches a row once per related row; the fenced write
    counted the duplicates as rows it failed to write and refused, naming no stale token."""
    (doc,) = docs(1)
    DocNote.objects.bulk_create([DocNote(doc=doc, text="a"), DocNote(doc=doc, text="b")])
    matched = FencedDoc.objects.filter(notes__text__in=["a", "b"])
    assert matched.fenced(2).update(title="paid") == 1
    assert state(doc) == [("paid", 2)]
    assert matched.fenced(3).delete() == (3, {"testapp.DocNote": 2, "testapp.FencedDoc": 1})
    assert not FencedDoc.objects.filter(pk=doc.pk).exists()


@pytest.mark.parametrize(
    "narrow",
    [
        pytest.param(lambda qs: qs.distinct(), id="distinct"),
        pytest.param(lambda qs: qs.annotate(notes_count=Count("notes")), id="aggregate"),
        pytest.param(
            lambda qs: qs.annotate(n=Count("notes")).filter(n__gte=1), id="aggregate-filter"
        ),
    ],
)
def test_a_distinct_or_aggregated_queryset_is_fenced_like_any_other(narrow: Any) -> None:
    """PostgreSQL refuses ``FOR UPDATE`` beside ``DISTINCT`` or ``GROUP BY``: a fenced write
    of such a queryset failed with a database error, one whose rows were all fresh."""
    a, b = docs(1, 4)
    DocNote.objects.bulk_create([DocNote(doc=a), DocNote(doc=a), DocNote(doc=b)])
    qs = narrow(FencedDoc.objects.filter(pk__in=[a.pk, b.pk]))
    with pytest.raises(StaleFencingToken) as refused:
        qs.fenced(3).update(title="late")
    assert refused.value.stored == 4 and state(a, b) == [("doc0", 1), ("doc1", 4)]
    assert qs.fenced(5).update(title="paid") == 2
    assert state(a, b) == [("paid", 5), ("paid", 5)]
    assert qs.fenced(5).delete()[1]["testapp.FencedDoc"] == 2


def test_a_distinct_multi_table_child_queryset_is_fenced() -> None:
    part = FencedDocPart(title="a")
    part.save(fence=2)
    rows = FencedDocPart.objects.filter(title="a").distinct()
    with pytest.raises(StaleFencingToken):
        rows.fenced(1).update(part="late")
    assert rows.fenced(3).update(part="x", body="y") == 1
    part.refresh_from_db()
    assert (part.part, part.body, part.fencing_token) == ("x", "y", 3)


def test_a_sliced_queryset_is_refused_before_any_query_as_django_refuses_it() -> None:
    docs(1)
    with CaptureQueriesContext(connection) as queries:
        with pytest.raises(TypeError, match="slice"):
            FencedDoc.objects.all()[:1].fenced(2).update(title="x")
        with pytest.raises(TypeError, match="limit"):
            FencedDoc.objects.all()[:1].fenced(2).delete()
        with pytest.raises(TypeError, match="distinct"):
            FencedDoc.objects.distinct("title").fenced(2).delete()
        with pytest.raises(TypeError, match="values"):
            FencedDoc.objects.values("pk").fenced(2).delete()  # type: ignore[attr-defined]
        union = FencedDoc.objects.union(FencedDoc.objects.all()).fenced(2)
        with pytest.raises(NotSupportedError, match=r"update\(\) after union"):
            union.update(title="x")
        with pytest.raises(NotSupportedError, match=r"delete\(\) after union"):
            union.delete()
    assert not queries.captured_queries


def test_a_table_in_another_schema_is_fenced() -> None:
    """``FOR UPDATE OF "schema"."table"`` is a syntax error: PostgreSQL wants the table's
    unqualified name there."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE SCHEMA leases_elsewhere")
    with connection.schema_editor() as editor:
        editor.create_model(ElsewhereDoc)
    doc = ElsewhereDoc(title="a")
    doc.save(fence=2)
    with pytest.raises(StaleFencingToken):
        ElsewhereDoc.objects.filter(title="a").fenced(1).update(title="late")
    assert ElsewhereDoc.objects.filter(title="a").fenced(3).update(title="b") == 1
    doc.refresh_from_db()
    assert (doc.title, doc.fencing_token) == ("b", 3)
    assert ElsewhereDoc.objects.fenced(3).delete()[0] == 1


def test_a_fenced_update_may_read_the_querysets_annotations() -> None:
    """``annotate(x=...).fenced(t).update(body=F("x"))`` raised ``FieldError`` (the decided
    write ran on a fresh queryset, without the annotation); Django's own update reads it."""
    (doc,) = docs(1)
    marked = FencedDoc.objects.annotate(x=Concat("title", Value("!")))
    assert marked.filter(pk=doc.pk).fenced(2).update(body=F("x")) == 1
    assert FencedDoc.objects.values_list("body", "fencing_token").get(pk=doc.pk) == ("doc0!", 2)
    with pytest.raises(StaleFencingToken):
        marked.filter(pk=doc.pk).fenced(1).update(body=F("x"))
