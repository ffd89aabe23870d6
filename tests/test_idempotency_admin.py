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
