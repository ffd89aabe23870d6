"""The key admin: stored responses are readable only with their own permission, and keys cannot
be deleted from it (a deleted key lets the client's retry run the effect again)."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from idempotency.models import IdempotencyKey
from tests.factories import StaffUserFactory
from tests.test_idempotency import identified, post

pytestmark = pytest.mark.django_db

SECRET_AMOUNT = 918273645


@pytest.fixture
def key() -> IdempotencyKey:
    body = json.dumps({"amount": SECRET_AMOUNT})
    assert post(identified(Client()), "/idem/charge/", "k-admin", body=body).status_code == 201
    return IdempotencyKey.objects.get()


def staff_client(*codenames: str) -> Client:
    user = StaffUserFactory()
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def detail(client: Client, key: IdempotencyKey) -> bytes:
    response = client.get(f"/admin/idempotency/idempotencykey/{key.pk}/change/")
    assert response.status_code == 200 and b"k-admin" in response.content
    return response.content


def test_the_view_permission_alone_does_not_show_stored_responses(key: IdempotencyKey) -> None:
    page = detail(staff_client("view_idempotencykey"), key)
    assert str(SECRET_AMOUNT).encode() not in page and b"X-Charge" not in page


def test_the_response_permission_shows_them(key: IdempotencyKey) -> None:
    page = detail(staff_client("view_idempotencykey", "view_response_body"), key)
    assert str(SECRET_AMOUNT).encode() in page and b"X-Charge" in page


@pytest.mark.parametrize(
    "lookup",
    [
        "response_headers__icontains=X-Charge",
        f"response_body__contains={bytes(str(SECRET_AMOUNT), 'ascii').hex()}",
        "response_headers__0__0__startswith=X",
        "steps__has_key=charge",
        "response_body=x",
    ],
)
@pytest.mark.parametrize("codenames", [("view_idempotencykey",), ("view_response_body",)])
def test_the_changelist_refuses_filters_on_what_it_does_not_show(
    key: IdempotencyKey, lookup: str, codenames: tuple[str, ...]
) -> None:
    """Django's changelist takes a filter on any field from its URL: with the view permission
    alone, whether a key was listed for ``response_headers__icontains=...`` answered yes or
    no, and a header's value was read back one character at a time (``response_body=x``
    crashed the page). Filters on the stored response and steps are refused (400) for every
    user: the admin's own filters never use them, and the detail page shows them to those
    allowed."""
    client = staff_client("view_idempotencykey", *codenames)
    response = client.get(f"/admin/idempotency/idempotencykey/?{lookup}")
    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert (
        client.get("/admin/idempotency/idempotencykey/?state__exact=completed").status_code == 200
    )


def test_keys_cannot_be_deleted_from_the_admin_even_by_a_superuser(
    admin_client: Client, key: IdempotencyKey
) -> None:
    url = f"/admin/idempotency/idempotencykey/{key.pk}/delete/"
    assert admin_client.get(url).status_code == 403
    assert admin_client.post(url, {"post": "yes"}).status_code == 403
    changelist = admin_client.get("/admin/idempotency/idempotencykey/")
    assert changelist.status_code == 200 and b"delete_selected" not in changelist.content
    bulk = {"action": "delete_selected", "_selected_action": [key.pk], "post": "yes"}
    admin_client.post("/admin/idempotency/idempotencykey/", bulk)
    assert IdempotencyKey.objects.filter(pk=key.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_a_key_stored_expiring_past_the_year_9999_is_readable_after_migrating(
    admin_client: Client, key: IdempotencyKey
) -> None:
    """Keys written before TTLs were capped could expire past the year 9999, which Python
    cannot read: the admin's key list failed on them. Migration 0005 brings them within the
    cap; a key with a sane expiry keeps it."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    sane = IdempotencyKey.objects.get(pk=key.pk).expires_at
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("idempotency")
    executor.migrate([("idempotency", "0004_key_steps")])
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO idempotency_key (scope, key, fingerprint, state, response_status,"
                " response_headers, response_body, created_at, expires_at, steps)"
                " SELECT scope, key || '-ancient', fingerprint, state, response_status,"
                " response_headers, response_body, created_at, '10000-01-01 00:00:00+00', steps"
                " FROM idempotency_key WHERE id = %s",
                [key.pk],
            )
        with pytest.raises(Exception, match="year"):
            list(IdempotencyKey.objects.order_by("expires_at").values_list("expires_at"))
        executor = MigrationExecutor(connection)
        executor.migrate(latest)
    finally:
        MigrationExecutor(connection).migrate(latest)
    page = admin_client.get("/admin/idempotency/idempotencykey/")
    assert page.status_code == 200 and b"k-admin-ancient" in page.content
    ancient = IdempotencyKey.objects.get(key="k-admin-ancient")
    assert ancient.expires_at.year < 9999
    assert IdempotencyKey.objects.get(pk=key.pk).expires_at == sane
