"""``IdempotencyMiddleware``: configured paths guarded without decorators, sync and async views,
DRF views scoped by DRF's user, and header names of another library's clients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, cast

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.conf import settings
from django.test import AsyncClient, Client, override_settings
from rest_framework.authtoken.models import Token

from idempotency import IdempotencyImproperlyConfigured, conf
from idempotency.models import IdempotencyKey
from tests.factories import UserFactory
from tests.test_idempotency import identified
from tests.testapp.models_idempotency import Charge

pytestmark = pytest.mark.django_db

MIDDLEWARE = [*settings.MIDDLEWARE, "idempotency.middleware.IdempotencyMiddleware"]
HEADER, REPLAYED = "X-Idempotency-Key", "X-Idempotent-Replayed"
META = "HTTP_X_IDEMPOTENCY_KEY"
BODY = json.dumps({"amount": 5})


@pytest.fixture(autouse=True)
def _middleware() -> Iterator[None]:
    options = {"MIDDLEWARE_PATHS": [r"^/idem/mw/"], "HEADER": HEADER, "REPLAYED_HEADER": REPLAYED}
    with override_settings(MIDDLEWARE=MIDDLEWARE, IDEMPOTENCY=options):
        yield


def _post(client: Any, url: str, key: str | None, **extra: Any) -> Any:
    if key is not None:
        extra[META] = key
    return client.post(url, BODY, content_type="application/json", **extra)


def test_a_listed_path_is_guarded_without_a_decorator() -> None:
    client = identified(Client())
    first = _post(client, "/idem/mw/charge/", "k-1")
    again = _post(client, "/idem/mw/charge/", "k-1")
    assert first.status_code == again.status_code == 201
    assert again[REPLAYED] == "true" and REPLAYED not in first
    assert again.content == first.content and Charge.objects.count() == 1


def test_paths_not_listed_methods_not_unsafe_and_requests_without_a_key_pass_through() -> None:
    client = identified(Client())
    for _ in range(2):
        _post(client, "/idem/mw-not-listed/", "k-2")
        _post(client, "/idem/mw/charge/", None)
    assert Charge.objects.count() == 4 and not IdempotencyKey.objects.exists()
    # A safe method: never guarded. (As META, not a keyword of get's own: hence the cast.)
    client.get("/idem/mw/charge/", **cast("dict[str, Any]", {META: "k-2"}))
    assert Charge.objects.count() == 5 and not IdempotencyKey.objects.exists()


def test_every_unsafe_method_is_guarded_by_default() -> None:
    client = identified(Client())
    for method in ("put", "patch", "delete"):
        call = getattr(client, method)
        first = call("/idem/mw/charge/", BODY, content_type="application/json", **{META: method})
        again = call("/idem/mw/charge/", BODY, content_type="application/json", **{META: method})
        assert first.status_code == 201 and again[REPLAYED] == "true", method
    assert Charge.objects.count() == 3


def test_the_configured_header_is_the_only_one_read() -> None:
    client = identified(Client())
    for _ in range(2):
        _post(client, "/idem/mw/charge/", None, HTTP_IDEMPOTENCY_KEY="standard")
    assert Charge.objects.count() == 2 and not IdempotencyKey.objects.exists()


def test_a_key_reused_for_another_body_is_refused_with_a_problem() -> None:
    client = identified(Client())
    _post(client, "/idem/mw/charge/", "k-3")
    body = json.dumps({"amount": 6})
    other = client.post(
        "/idem/mw/charge/",
        body,
        content_type="application/json",
        **cast("dict[str, Any]", {META: "k-3"}),
    )
    assert other.status_code == 422 and other["Content-Type"] == "application/problem+json"


def test_a_decorated_view_under_the_middleware_claims_its_key_once() -> None:
    """@idempotent on the view steps aside for the middleware's guard (the outer one)."""
    client = identified(Client())
    first = _post(client, "/idem/mw/nested/", "k-4")
    again = _post(client, "/idem/mw/nested/", "k-4")
    assert first.status_code == 201 and again[REPLAYED] == "true"
    assert IdempotencyKey.objects.count() == 1 and Charge.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_async_views_are_guarded_under_asgi() -> None:
    async def run() -> list[Any]:
        client = AsyncClient()
        await client.aforce_login(await sync_to_async(UserFactory)(username="mw-async"))
        return [await _apost(client, "/idem/mw/async/", "k-5") for _ in range(2)]

    first, again = async_to_sync(run)()
    assert first.status_code == again.status_code == 201
    assert again[REPLAYED] == "true" and again.content == first.content
    assert Charge.objects.count() == 1


async def _apost(client: AsyncClient, url: str, key: str) -> Any:
    return await client.post(url, BODY, content_type="application/json", headers={HEADER: key})


def _token(username: str) -> str:
    return "Token " + cast(str, Token.objects.create(user=UserFactory(username=username)).key)


def test_a_drf_view_is_scoped_by_drfs_user_not_pooled_as_anonymous() -> None:
    """Token clients have no session: the scope must come from DRF's authenticators, or every
    one of them would be refused (or share one key space)."""
    alice, bob = _token("alice"), _token("bob")
    client = Client()
    first = _post(client, "/idem/mw/drf/", "k-6", HTTP_AUTHORIZATION=alice)
    again = _post(client, "/idem/mw/drf/", "k-6", HTTP_AUTHORIZATION=alice)
    other = _post(client, "/idem/mw/drf/", "k-6", HTTP_AUTHORIZATION=bob)
    assert first.status_code == other.status_code == 201 and again[REPLAYED] == "true"
    assert json.loads(other.content)["owner"] == "bob"
    assert Charge.objects.count() == 2
    assert _post(client, "/idem/mw/drf/", "k-6", HTTP_AUTHORIZATION="Token nope").status_code == 401


@pytest.mark.django_db(transaction=True)
def test_a_drf_view_served_by_async_django_is_guarded() -> None:
    """DRF (3.18) has no async views: its APIView dispatch is sync, and Django runs it in a
    thread under ASGI. What exists is tested: a sync DRF view reached through the async stack,
    under the middleware and under IdempotentMixin."""
    alice = _token("alice-async")

    async def run(url: str, key: str) -> list[Any]:
        client, headers = AsyncClient(), {"Authorization": alice, HEADER: key}
        return [
            await client.post(url, BODY, content_type="application/json", headers=headers)
            for _ in range(2)
        ]

    first, again = async_to_sync(run)("/idem/mw/drf/", "k-7")
    assert first.status_code == 201 and again[REPLAYED] == "true"
    assert again.content == first.content and Charge.objects.count() == 1


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("HEADER", "Idempotency Key"),
        ("REPLAYED_HEADER", ""),
        ("MIDDLEWARE_PATHS", ["(unclosed"]),
        ("MIDDLEWARE_PATHS", "^/api/"),
        # Written as a re_path pattern: the path begins with "/", so it guarded nothing.
        ("MIDDLEWARE_PATHS", [r"^api/"]),
        ("MIDDLEWARE_PATHS", [r"api/payments/"]),
        ("MIDDLEWARE_METHODS", []),
        ("PREPARED_STATEMENTS", "yes"),
    ],
)
def test_bad_middleware_and_header_settings_are_reported(key: str, value: Any) -> None:
    with override_settings(IDEMPOTENCY={key: value}):
        assert any(key in problem for problem in conf.problems())
        with pytest.raises(IdempotencyImproperlyConfigured):
            conf.get()
