"""Fencing on models and calls of less common shapes: positional save arguments, fenced
querysets asked to create, a renamed token column, a fenced base manager, database defaults,
async deletes, ``keep_parents``, and the fence below a plain parent (multi-table inheritance).
Each was a stale write accepted, a crash or a deadlock (an outside review, stop 37)."""

from __future__ import annotations

import asyncio
import threading
import warnings
from typing import Any

import pytest
from django.db import connections, transaction
from django.db.models.signals import post_save

from leases import FenceRequired, StaleFencingToken, acquire
from tests.test_fencing_concurrency import (
    _backend_pid,
    _blocked_on_a_lock,
    creators_race,
    run_together,
)
from tests.testapp.models_fencing import (
    ColumnDoc,
    CompositeDoc,
    DefaultedDoc,
    FencedDoc,
    FencedDocPart,
    FencedRegister,
    PlainBase,
    SavedLog,
    StrictBaseManaged,
    StrictDoc,
    TokenInChild,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db


def token_of(doc: Any) -> int:
    return int(type(doc)._base_manager.filter(pk=doc.pk).values_list("fencing_token").get()[0])


def test_a_fenced_save_refuses_positional_arguments() -> None:
    """``save(False, False, None, ["title"], fence=9)``: the update fields came positionally,
    so the fence never added the token to them; the write landed and the stored token stayed
    5, after which the stale token 6 was accepted over it."""
    doc = FencedDoc(title="first")
    doc.save(fence=5)
    doc.title = "holder 9"
    with warnings.catch_warnings(), pytest.raises(TypeError, match="keyword"):
        warnings.simplefilter("ignore")  # positional save() arguments are deprecated
        doc.save(False, False, None, ["title"], fence=9)
    assert token_of(doc) == 5 and FencedDoc.objects.get(pk=doc.pk).title == "first"


def test_a_fenced_save_of_no_fields_writes_nothing_as_djangos_does() -> None:
    doc = FencedDoc(title="first")
    doc.save(fence=5)
    doc.save(update_fields=[], fence=9)
    assert token_of(doc) == 5


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(
            lambda qs: qs.update_or_create(name="r", defaults={"value": "stale"}), id="upsert"
        ),
        pytest.param(lambda qs: qs.get_or_create(name="r"), id="get_or_create"),
        pytest.param(lambda qs: qs.create(name="r2"), id="create"),
        pytest.param(lambda qs: qs.bulk_create([FencedRegister(name="r3")]), id="bulk_create"),
        pytest.param(
            lambda qs: qs.bulk_create(
                [FencedRegister(name="r", value="stale")],
                update_conflicts=True,
                unique_fields=["name"],
                update_fields=["value"],
            ),
            id="bulk_upsert",
        ),
    ],
)
def test_a_fenced_queryset_refuses_what_its_fence_does_not_apply_to(call: Any) -> None:
    """``Model.objects.fenced(3).update_or_create(...)`` read as fenced and wrote token 3's
    value over a row token 9 had written, without a word."""
    FencedRegister(name="r", value="holder 9").save(fence=9)
    with pytest.raises(TypeError, match="fenced"):
        call(FencedRegister.objects.fenced(3))
    row = FencedRegister.objects.get(name="r")
    assert (row.value, row.fencing_token) == ("holder 9", 9)
    assert FencedRegister.objects.count() == 1


def test_a_renamed_token_column_is_fenced() -> None:
    """``db_column`` on ``fencing_token``: the upsert of a new row named the field, not the
    column (``column "fencing_token" does not exist``)."""
    doc = ColumnDoc(name="a", value="x")
    doc.save(fence=5)
    doc.value = "y"
    doc.save(fence=6)
    with pytest.raises(StaleFencingToken):
        ColumnDoc(name="a", value="stale").save(fence=4)
    assert ColumnDoc.objects.filter(name="a").fenced(7).update(value="z") == 1
    assert ColumnDoc.objects.values_list("value", "fencing_token").get() == ("z", 7)


def test_a_fenced_base_manager_does_not_refuse_fenced_writes() -> None:
    """With ``base_manager_name`` naming the ``FencedManager`` of a ``require_fence`` model,
    fenced writes raised ``FenceRequired``: they wrote through the base manager's unfenced
    ``update()``/``delete()``."""
    doc = StrictBaseManaged(title="a")
    doc.save(fence=3)
    assert StrictBaseManaged.objects.filter(pk=doc.pk).fenced(5).update(title="b") == 1
    doc.title = "c"
    assert StrictBaseManaged.objects.fenced(6).bulk_update([doc], ["title"]) == 1
    with pytest.raises(FenceRequired):
        StrictBaseManaged.objects.filter(pk=doc.pk).update(title="unfenced")
    shelf = PlainBase.objects.create(title="shelf")
    with pytest.raises(FenceRequired):  # a related manager writes through the base manager
        shelf.strict_rows.add(doc)  # type: ignore[attr-defined]
    assert doc.delete(fence=7)[0] == 1


@pytest.mark.django_db(transaction=True)
def test_a_model_with_a_database_default_is_saved_under_a_lease() -> None:
    """``fence=lease`` (revocable) rewrote the insert as ``INSERT ... SELECT ... WHERE``,
    where a ``db_default``'s ``DEFAULT`` is a syntax error."""
    held = acquire("shapes-db-default", ttl=10)
    try:
        doc = DefaultedDoc(title="a")
        doc.save(fence=held)
        doc.refresh_from_db()
        assert doc.created is not None and doc.fencing_token == held.token
        with_check = DefaultedDoc(title="b")
        with_check.save(lease=held)
        assert DefaultedDoc.objects.filter(title="b").exists()
    finally:
        held.release()


@pytest.mark.django_db(transaction=True)
def test_a_receivers_insert_during_a_fenced_save_is_left_alone() -> None:
    """The insert rewrite applied to every ``INSERT`` on the connection during the save: an
    audit receiver's made every lease-fenced save of the audited model fail."""

    def log(sender: Any, instance: Any, **kwargs: Any) -> None:
        SavedLog.objects.create(message=f"saved {instance.pk}")

    post_save.connect(log, sender=FencedDoc)
    held = acquire("shapes-receiver", ttl=10)
    try:
        doc = FencedDoc(title="a")
        doc.save(fence=held)
        assert SavedLog.objects.filter(message=f"saved {doc.pk}").exists()
    finally:
        post_save.disconnect(log, sender=FencedDoc)
        held.release()


@pytest.mark.django_db(transaction=True)
def test_an_async_delete_takes_a_fence() -> None:
    doc = FencedDoc(title="a")
    doc.save(fence=5)
    with pytest.raises(StaleFencingToken):
        asyncio.run(doc.adelete(fence=4))
    assert asyncio.run(doc.adelete(fence=5))[0] == 1
    assert not FencedDoc.objects.filter(title="a").exists()


def test_a_fenced_delete_keeping_parents_is_refused_not_ignored() -> None:
    """``delete(fence=..., keep_parents=True)`` deleted the parents' rows too."""
    part = FencedDocPart(title="t", part="p")
    part.save(fence=5)
    with pytest.raises(TypeError, match="keep_parents"):
        part.delete(fence=5, keep_parents=True)
    assert FencedDocPart.objects.filter(pk=part.pk).exists()


def test_a_fenced_delete_of_an_unsaved_instance_is_refused_as_djangos_is() -> None:
    with pytest.raises(ValueError, match="None"):
        FencedDoc(title="never saved").delete(fence=5)


def test_a_fenced_delete_forgets_the_instances_primary_key_as_djangos_does() -> None:
    """It kept it, so a later fenced save of the instance quietly made the row again."""
    doc = FencedDoc(title="a")
    doc.save(fence=5)
    doc.delete(fence=5)
    assert doc.pk is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("operation", ["update", "delete"])
def test_a_fenced_write_below_a_plain_parent_queues_behind_a_fenced_save(operation: str) -> None:
    """The fence lives in the child's table, below a plain parent. A fenced save writes the
    parent's row, then the child's; a fenced queryset write locked the child's first, then
    wrote the parent's: each waited for the other (``deadlock detected``)."""
    row = TokenInChild(title="t", part="p")
    row.save(fence=5)
    saver_wrote_parent, writer_started = threading.Event(), threading.Event()
    writer_pid: list[int] = []
    outcome: dict[str, object] = {}

    def between_the_saves_statements(execute: Any, sql: str, *args: Any) -> Any:
        result = execute(sql, *args)
        if sql.startswith(f'UPDATE "{PlainBase._meta.db_table}"'):
            saver_wrote_parent.set()
            assert writer_started.wait(20)
            wait_until(lambda: _blocked_on_a_lock(writer_pid[0]), 20, "the write to queue")
        return result

    def saver() -> None:
        try:
            mine = TokenInChild.objects.get(pk=row.pk)
            mine.title = "saver"
            with (
                transaction.atomic(),
                connections["default"].execute_wrapper(between_the_saves_statements),
            ):
                mine.save(fence=7)
            outcome["saver"] = "saved"
        except Exception as exc:  # reported below
            outcome["saver"] = exc
        finally:
            connections.close_all()

    def writer() -> None:
        try:
            assert saver_wrote_parent.wait(20)
            writer_pid.append(_backend_pid())
            writer_started.set()
            rows = TokenInChild.objects.filter(pk=row.pk).fenced(8)
            if operation == "update":
                outcome["writer"] = rows.update(title="writer", part="writer")
            else:
                outcome["writer"] = rows.delete()[0]
        except Exception as exc:  # reported below
            outcome["writer"] = exc
        finally:
            connections.close_all()

    run_together(saver, writer)
    assert outcome["saver"] == "saved", outcome
    assert outcome["writer"] in (1, 2), outcome
    if operation == "update":
        assert TokenInChild.objects.values_list("title", "part", "fencing_token").get() == (
            "writer",
            "writer",
            8,
        )
    else:
        assert not TokenInChild.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_racing_creators_below_a_plain_parent_end_with_the_greater_tokens_row() -> None:
    """The plain parent's insert came first and was not an upsert: the greater token's save
    failed with ``IntegrityError`` and the lower token's row stayed."""
    outcome = creators_race(lambda token, title: TokenInChild(pk=77, title=title, part=title))
    assert outcome == ["saved"], outcome
    assert TokenInChild.objects.values_list("title", "part", "fencing_token").get() == (
        "greater",
        "greater",
        2,
    )
    assert PlainBase.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_racing_creators_of_a_composite_key_end_with_the_greater_tokens_row() -> None:
    """A composite primary key was never "in the inserted fields", so the insert was not an
    upsert: ``IntegrityError`` for the greater token."""
    outcome = creators_race(lambda token, title: CompositeDoc(tenant="t", number=7, title=title))
    assert outcome == ["saved"], outcome
    assert CompositeDoc.objects.values_list("title", "fencing_token").get() == ("greater", 2)
    with pytest.raises(StaleFencingToken):
        CompositeDoc(tenant="t", number=7, title="stale").save(fence=1)


def test_an_unfenced_save_of_a_new_row_with_its_own_key_is_a_creation() -> None:
    """``StrictDoc(pk=999).save()`` raised ``FenceRequired`` although no row 999 existed
    (Django tries an ``UPDATE`` first): creating rows unfenced is allowed. A new instance
    whose key is a stored row's is still refused."""
    StrictDoc(pk=999, title="new").save()
    assert StrictDoc.objects.get(pk=999).title == "new"
    with pytest.raises(FenceRequired):
        StrictDoc(pk=999, title="over the stored one").save()
    assert StrictDoc.objects.get(pk=999).title == "new"
