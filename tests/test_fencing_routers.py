"""Fenced writes under database routers: always the write alias, and the right transaction."""

from __future__ import annotations

import pytest
from django.db import connections, transaction
from django.test import override_settings

from leases import StaleFencingToken
from leases.revocation import _write
from tests.testapp.models_fencing import FencedDoc, FencedRegister

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "replica", "other"])


@override_settings(DATABASE_ROUTERS=["tests.routers.ReadReplicaRouter"])
def test_fenced_queryset_update_uses_the_write_alias_in_autocommit() -> None:
    doc = FencedDoc(title="a")
    doc.save(fence=3)
    assert FencedDoc.objects.filter(pk=doc.pk).fenced(5).update(title="b") == 1
    assert FencedDoc.objects.using("default").get(pk=doc.pk).fencing_token == 5
    with pytest.raises(StaleFencingToken):
        FencedDoc.objects.filter(pk=doc.pk).fenced(4).update(title="c")


@override_settings(DATABASE_ROUTERS=["tests.routers.ReadReplicaRouter"])
def test_fenced_queryset_update_and_bulk_update_inside_a_transaction() -> None:
    doc = FencedDoc(title="a")
    doc.save(fence=3)
    with transaction.atomic():
        assert FencedDoc.objects.filter(pk=doc.pk).fenced(5).update(title="b") == 1
        doc.title = "bulk"
        assert FencedDoc.objects.fenced(6).bulk_update([doc], ["title"]) == 1
        FencedDoc.objects.filter(pk=doc.pk).fenced(7).delete()
    assert not FencedDoc.objects.using("default").filter(pk=doc.pk).exists()


@override_settings(DATABASE_ROUTERS=["tests.routers.OtherDatabaseRouter"])
def test_stale_save_of_a_new_routed_instance_keeps_the_routed_transaction_usable() -> None:
    FencedRegister(name="routed", value="first").save(fence=5)
    with transaction.atomic(using="other"):
        with pytest.raises(StaleFencingToken):
            FencedRegister(name="routed", value="stale").save(fence=4)
        assert not connections["other"].needs_rollback
        FencedRegister(name="routed-2", value="after").save(fence=1)
    assert FencedRegister.objects.get(name="routed").value == "first"
    assert FencedRegister.objects.filter(name="routed-2").exists()


def test_a_read_only_database_is_skipped_when_recording_a_revocation() -> None:
    """A hot standby refuses the insert (read-only); the revocation reaches it by replication."""
    assert _write("replica", ["default", "routers-read-only", 1]) is False
    assert _write("other", ["default", "routers-read-only", 1]) is True
