"""Fenced writes under database routers: always the write alias, and the right transaction."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import Permission
from django.db import connection, connections, transaction
from django.test import override_settings

from leases import StaleFencingToken, acquire, operations
from leases.revocation import _write
from tests.factories import UserFactory
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


TENANT_SCHEMA = "leases_test_tenant_b"


@pytest.fixture
def tenant_alias() -> Iterator[str]:
    """``other`` on the same server and database, but with its own ``search_path``: a schema
    per tenant, the leases app's tables (those the test needs) made there as `migrate` would."""
    with connection.cursor() as cursor:
        cursor.execute(f"DROP SCHEMA IF EXISTS {TENANT_SCHEMA} CASCADE")
        cursor.execute(f"CREATE SCHEMA {TENANT_SCHEMA}")
        for table in ("leases_revocation", "leases_fence", FencedRegister._meta.db_table):
            cursor.execute(
                f"CREATE TABLE {TENANT_SCHEMA}.{table} (LIKE public.{table} INCLUDING ALL)"
            )
    settings = connections["other"].settings_dict
    saved = copy.deepcopy(settings.get("OPTIONS", {}))
    connections["other"].close()
    settings["OPTIONS"] = {**saved, "options": f"-c search_path={TENANT_SCHEMA}"}
    try:
        yield "other"
    finally:
        connections["other"].close()
        settings["OPTIONS"] = saved
        with connection.cursor() as cursor:
            cursor.execute(f"DROP SCHEMA IF EXISTS {TENANT_SCHEMA} CASCADE")


def test_a_force_release_fences_the_holder_in_another_schema_of_the_same_database(
    tenant_alias: str,
) -> None:
    """Aliases were told apart by host, port and database name alone, so the revocation was
    written in the first schema's table only, and the evicted holder's fenced write through
    the tenant's alias was accepted after the force release returned."""
    name = f"tenant-{uuid.uuid4().hex[:8]}"
    held = acquire(name, ttl=60, keepalive=False)
    register = FencedRegister(name=name, value="first")
    register.save(using=tenant_alias, fence=held)
    operator = UserFactory(username=f"op-{uuid.uuid4().hex[:6]}")
    operator.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    operations.force_release(
        name, backend="default", token=held.token, user=operator, via="command"
    )
    register.value = "after the force release"
    with pytest.raises(StaleFencingToken):
        register.save(using=tenant_alias, fence=held)
    assert FencedRegister.objects.using(tenant_alias).get(name=name).value == "first"
