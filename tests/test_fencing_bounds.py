"""No ORM path lowers a stored fencing token, bad fences fail at ``fenced()``, and models can
require a fence for every write to a stored row."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext, isolate_apps

from leases import FenceRequired, InvalidFencingToken, StaleFencingToken
from tests.testapp.models_fencing import FencedDoc, StrictDoc

pytestmark = pytest.mark.django_db


def stored(doc: Any) -> int:
    return int(type(doc).objects.filter(pk=doc.pk).values_list("fencing_token", flat=True)[0])


@pytest.mark.parametrize("fence", [None, "7", 7.0, True, 0, -1, 2**63, object()])
def test_fenced_refuses_what_can_never_fence_at_the_call(fence: Any) -> None:
    with CaptureQueriesContext(connection) as queries, pytest.raises(InvalidFencingToken):
        FencedDoc.objects.fenced(fence)
    assert len(queries) == 0


def test_fenced_none_never_turns_into_an_unfenced_update() -> None:
    doc = FencedDoc(title="kept")
    doc.save(fence=5)
    with pytest.raises(InvalidFencingToken):
        FencedDoc.objects.fenced(None).update(title="unfenced")  # type: ignore[arg-type]
    doc.refresh_from_db()
    assert doc.title == "kept"


def test_unfenced_queryset_update_cannot_lower_the_token() -> None:
    doc = FencedDoc(title="t")
    doc.save(fence=7)
    FencedDoc.objects.filter(pk=doc.pk).update(fencing_token=1)
    assert stored(doc) == 7
    FencedDoc.objects.filter(pk=doc.pk).update(fencing_token=9)
    assert stored(doc) == 9


def test_unfenced_bulk_update_cannot_lower_the_token() -> None:
    docs = [FencedDoc(title=f"d{i}") for i in range(3)]
    for doc in docs:
        doc.save(fence=7)
    for doc in docs:
        doc.fencing_token = 1
        doc.title = "bulk"
    FencedDoc.objects.bulk_update(docs, ["title", "fencing_token"])
    assert {stored(doc) for doc in docs} == {7}
    assert set(
        FencedDoc.objects.filter(pk__in=[d.pk for d in docs]).values_list("title", flat=True)
    ) == {"bulk"}


def test_an_upserting_bulk_create_cannot_write_the_token() -> None:
    """``ON CONFLICT DO UPDATE SET fencing_token = EXCLUDED.fencing_token`` lowered a stored
    token 7 to 1 (then a stale token-1 ``save(fence=1)`` passed the fence again). An upsert
    cannot say ``GREATEST``, so naming the token among its ``update_fields`` is refused before
    any query; its other fields are written as any unfenced write's are."""
    doc = FencedDoc(title="t")
    doc.save(fence=7)
    stale = FencedDoc(pk=doc.pk, title="stale", fencing_token=1)
    with (
        CaptureQueriesContext(connection) as queries,
        pytest.raises(TypeError, match="fencing_token"),
    ):
        FencedDoc.objects.bulk_create(
            [stale],
            update_conflicts=True,
            unique_fields=["id"],
            update_fields=["title", "fencing_token"],
        )
    assert len(queries) == 0 and stored(doc) == 7
    FencedDoc.objects.bulk_create(
        [stale], update_conflicts=True, unique_fields=["id"], update_fields=["title"]
    )
    assert stored(doc) == 7 and FencedDoc.objects.get(pk=doc.pk).title == "stale"
    with pytest.raises(StaleFencingToken):
        FencedDoc(pk=doc.pk, title="still fenced").save(fence=1)


def test_a_lowered_token_would_let_a_stale_writer_through() -> None:
    """Why it matters: had the token been lowered, a stale token-1 write would succeed."""
    doc = FencedDoc(title="t")
    doc.save(fence=7)
    FencedDoc.objects.filter(pk=doc.pk).update(fencing_token=1)
    doc.title = "stale"
    with pytest.raises(StaleFencingToken):
        doc.save(fence=1)


def test_require_fence_refuses_unfenced_writes_to_stored_rows_before_any_query() -> None:
    doc = StrictDoc(title="new")
    doc.save()  # creating a row unfenced stays allowed
    doc.save(fence=3)
    doc.title = "unfenced"
    with CaptureQueriesContext(connection) as queries:
        with pytest.raises(FenceRequired):
            doc.save()
        with pytest.raises(FenceRequired):
            StrictDoc.objects.filter(pk=doc.pk).update(title="unfenced")
        with pytest.raises(FenceRequired):
            StrictDoc.objects.bulk_update([doc], ["title"])
        with pytest.raises(FenceRequired):
            StrictDoc.objects.filter(pk=doc.pk).delete()
        with pytest.raises(FenceRequired):
            doc.delete()
    assert len(queries) == 0
    assert StrictDoc.objects.get(pk=doc.pk).title == "new"


def test_require_fence_refuses_an_upserting_bulk_create_and_allows_inserting_ones() -> None:
    """``update_conflicts=True`` writes stored rows unfenced (it was let through); a plain or
    ``ignore_conflicts`` bulk_create only creates rows, which stays allowed."""
    doc = StrictDoc(title="stored")
    doc.save(fence=3)
    clash = StrictDoc(pk=doc.pk, title="clash")
    with CaptureQueriesContext(connection) as queries, pytest.raises(FenceRequired):
        StrictDoc.objects.bulk_create(
            [clash], update_conflicts=True, unique_fields=["id"], update_fields=["title"]
        )
    assert len(queries) == 0
    StrictDoc.objects.bulk_create([clash], ignore_conflicts=True)
    StrictDoc.objects.bulk_create([StrictDoc(title="new")])
    assert StrictDoc.objects.get(pk=doc.pk).title == "stored"
    assert StrictDoc.objects.count() == 2


def test_require_fence_refuses_an_unfenced_save_of_a_new_instance_over_a_stored_row() -> None:
    doc = StrictDoc(title="stored")
    doc.save(fence=3)
    clash = StrictDoc(pk=doc.pk, title="clash")
    with pytest.raises(FenceRequired):
        clash.save()
    assert StrictDoc.objects.get(pk=doc.pk).title == "stored"


def test_require_fence_allows_fenced_writes_and_deletes() -> None:
    doc = StrictDoc(title="a")
    doc.save(fence=3)
    doc.title = "b"
    doc.save(fence=4)
    assert StrictDoc.objects.filter(pk=doc.pk).fenced(4).update(title="c") == 1
    with pytest.raises(StaleFencingToken):
        doc.delete(fence=3)
    assert StrictDoc.objects.filter(pk=doc.pk).exists()
    doc.delete(fence=4)
    assert not StrictDoc.objects.filter(pk=doc.pk).exists()


def test_fenced_queryset_delete_is_all_or_nothing() -> None:
    low, high = FencedDoc(title="low"), FencedDoc(title="high")
    low.save(fence=2)
    high.save(fence=9)
    pks = [low.pk, high.pk]
    with pytest.raises(StaleFencingToken):
        FencedDoc.objects.filter(pk__in=pks).fenced(5).delete()
    assert FencedDoc.objects.filter(pk__in=pks).count() == 2
    assert FencedDoc.objects.filter(pk__in=pks).fenced(9).delete()[0] == 2


@isolate_apps("tests.testapp")
def test_a_fenced_model_whose_default_manager_is_plain_is_a_check_warning() -> None:
    """``class Order(Base, FencedModel)``: the concrete base's plain ``objects`` wins, so
    ``Order.objects`` had no ``fenced()`` and ``update(fencing_token=0)`` lowered the token,
    without a word. ``manage.py check`` now names it (``leases.W006``)."""
    from django.db import models

    from leases.checks import check_fenced_managers, fenced_manager_problems
    from leases.fencing import FencedManager, FencedModel

    class Base(models.Model):  # noqa: DJ008 - a throwaway model of the check
        class Meta:
            app_label = "testapp"

    class Order(Base, FencedModel):  # noqa: DJ008
        class Meta:
            app_label = "testapp"

    class FixedOrder(Base, FencedModel):  # noqa: DJ008
        objects = FencedManager()

        class Meta:
            app_label = "testapp"

    (warning,) = fenced_manager_problems([Base, Order, FixedOrder])
    assert warning.id == "leases.W006" and warning.obj is Order
    assert "testapp.Order's default manager 'objects' (Manager)" in warning.msg
    assert not check_fenced_managers()  # the project's own fenced models are fine


@isolate_apps("tests.testapp")
def test_a_require_fence_models_rows_written_by_another_models_deletion_is_a_check_warning() -> (
    None
):
    """Deleting a row that a ``require_fence`` model's foreign key cascades from deleted (or
    nulled) its rows through Django's collector, past the fence, without a word."""
    from django.db import models

    from leases.checks import check_fence_cascades, fence_cascade_problems
    from leases.fencing import FencedModel

    class Folder(models.Model):  # noqa: DJ008 - throwaway models of the check
        class Meta:
            app_label = "testapp"

    class Strict(FencedModel):
        require_fence = True
        folder = models.ForeignKey(Folder, on_delete=models.CASCADE, related_name="+")
        shelf = models.ForeignKey(Folder, models.SET_NULL, null=True, related_name="+")
        kept = models.ForeignKey(Folder, on_delete=models.PROTECT, related_name="+")
        safe = models.ForeignKey(Folder, on_delete=models.RESTRICT, related_name="+")

        class Meta:
            app_label = "testapp"

    class StrictPart(Strict):  # its parent link is fine: deleting a Strict is fenced
        class Meta:
            app_label = "testapp"

    class Loose(FencedModel):  # no require_fence: nothing is promised
        folder = models.ForeignKey(Folder, on_delete=models.CASCADE, related_name="+")

        class Meta:
            app_label = "testapp"

    class StrictKid(Loose):
        require_fence = True

        class Meta:
            app_label = "testapp"

    warnings = fence_cascade_problems([Folder, Strict, StrictPart, Loose, StrictKid])
    assert [(w.id, w.obj) for w in warnings] == [("leases.W007", Strict)] * 2 + [
        ("leases.W007", StrictKid)
    ]
    assert "its multi-table parent testapp.Loose does not" in warnings[2].msg
    assert "testapp.Strict.folder has on_delete=CASCADE: deleting a testapp.Folder" in (
        warnings[0].msg
    )
    assert "Strict.shelf has on_delete=SET_NULL" in warnings[1].msg
    assert not check_fence_cascades()  # the project's own fenced models are fine
