"""DRF function views and nested guards: where ``@idempotent`` may sit, and whose key space a
DRF-authenticated request uses."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.views.decorators.csrf import csrf_exempt
from rest_framework.authtoken.models import Token
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from idempotency import IdempotencyImproperlyConfigured, idempotent
from idempotency.models import IdempotencyKey
from tests.factories import UserFactory
from tests.test_idempotency import identified, post
from tests.testapp import views_idempotency
from tests.testapp.models_idempotency import Charge

pytestmark = pytest.mark.django_db

FUNCTION_VIEW = "/idem/drf-function/"


def _token(username: str) -> str:
    return "Token " + cast(str, Token.objects.create(user=UserFactory(username=username)).key)


def test_idempotent_under_api_view_stores_and_replays_the_rendered_response() -> None:
    alice = _token("alice")
    client = Client()
    first = post(client, FUNCTION_VIEW, "k-fn", HTTP_AUTHORIZATION=alice)
    again = post(client, FUNCTION_VIEW, "k-fn", HTTP_AUTHORIZATION=alice)
    assert first.status_code == again.status_code == 201
    assert json.loads(first.content)["owner"] == "alice"
    assert again.content == first.content and again["Idempotent-Replayed"] == "true"
    assert again["Content-Type"] == first["Content-Type"] == "application/json"
    assert Charge.objects.count() == 1


def test_token_users_get_key_spaces_of_their_own() -> None:
    """Bob sending Alice's key and body is a new operation of Bob's, never Alice's replay."""
    alice, bob = _token("alice"), _token("bob")
    first = post(Client(), FUNCTION_VIEW, "k-shared", HTTP_AUTHORIZATION=alice)
    second = post(Client(), FUNCTION_VIEW, "k-shared", HTTP_AUTHORIZATION=bob)
    assert "Idempotent-Replayed" not in second
    assert json.loads(first.content)["owner"] == "alice"
    assert json.loads(second.content)["owner"] == "bob"
    users = {Token.objects.get(key=token.split()[1]).user_id for token in (alice, bob)}
    assert set(IdempotencyKey.objects.values_list("scope", flat=True)) == {
        f"user:{pk}" for pk in users
    }


def test_session_users_of_a_drf_function_view_are_scoped_by_their_login() -> None:
    carol = UserFactory(username="carol")
    client = Client()
    client.force_login(carol)
    first = post(client, FUNCTION_VIEW, "k-session")
    again = post(client, FUNCTION_VIEW, "k-session")
    assert json.loads(first.content)["owner"] == "carol" and again["Idempotent-Replayed"] == "true"
    assert IdempotencyKey.objects.get().scope == f"user:{carol.pk}"


def _handler(request: Request) -> Response:
    return Response({})


def _refused(view: Any) -> str:
    with pytest.raises(IdempotencyImproperlyConfigured) as caught:
        idempotent(view)
    with pytest.raises(IdempotencyImproperlyConfigured):
        idempotent(on_conflict="wait")(view)
    return str(caught.value)


def test_idempotent_outside_a_drf_view_is_refused_when_decorating() -> None:
    """Outside, the guard would run before DRF authenticated the request and scope every token
    user as anonymous; the order that works is named in the error."""
    message = _refused(api_view(["POST"])(_handler))
    assert "api_view" in message and "IdempotentMixin" in message
    _refused(csrf_exempt(api_view(["POST"])(_handler)))
    _refused(views_idempotency.ChargeAPIView.as_view())
    _refused(views_idempotency.ChargeViewSet.as_view({"post": "create"}))


def _plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse()


def test_plain_django_views_are_still_accepted() -> None:
    idempotent(_plain)
    idempotent(views_idempotency.AsyncPlainView.as_view())


@pytest.mark.parametrize("url", ["/idem/nested/", "/idem/nested-outside/"])
def test_a_nested_guard_steps_aside_for_the_outer_one(url: str) -> None:
    """The mixin plus ``@idempotent`` on the handler (or around ``as_view()``): the inner guard
    must not find the key claimed by the outer one and answer the first request 409."""
    client = identified(Client())
    first = post(client, url, "k-nested")
    again = post(client, url, "k-nested")
    assert first.status_code == again.status_code == 201 and "Idempotent-Replayed" not in first
    assert again.content == first.content and again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1 and IdempotencyKey.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("url", ["/idem/drf/", "/idem/viewset/"])
def test_idempotent_mixin_on_drf_views_served_by_async_django(url: str) -> None:
    """DRF 3.18 has no async views (``APIView.dispatch`` is sync; an ``async def`` handler is
    not awaited by DRF), so what async Django offers DRF users is running its sync views under
    ASGI, in a thread. That is what is tested: the mixin's guard under the async stack, one
    effect, a byte-equal replay, keys scoped by DRF's user."""
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    from tests.test_idempotency import _basic

    UserFactory(username="carol"), UserFactory(username="dave")

    async def run() -> list[Any]:
        client = AsyncClient()
        answers = []
        for user in ("carol", "carol", "dave"):
            headers = {"Authorization": _basic(user), "Idempotency-Key": "k-async"}
            answers.append(await client.post(url, "{}", "application/json", headers=headers))
        return answers

    first, again, other = async_to_sync(run)()
    assert first.status_code == other.status_code == 201
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert Charge.objects.count() == 2
