"""The Idempotency-Key contract of ``@idempotent`` and ``IdempotentMixin``, in process."""

from __future__ import annotations

import base64
import json
import threading
from typing import Any, TypeVar

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import connection
from django.test import AsyncClient, Client, RequestFactory, override_settings
from django.test.client import FakePayload

from idempotency import (
    IdempotencyImproperlyConfigured,
    ResponseNotStorable,
    conf,
    idempotency_key,
    idempotent,
    scopes,
)
from idempotency.checks import check_settings
from idempotency.http import PROBLEM_TYPE_BASE, default_fingerprint, digest
from idempotency.models import IdempotencyKey
from idempotency.store import Outcome, begin, finish, release
from tests.factories import UserFactory
from tests.testapp import views_idempotency
from tests.testapp.models_idempotency import Charge

pytestmark = pytest.mark.django_db

BODY = json.dumps({"amount": 42})
ANONYMOUS_GUIDE = (
    "https://django-leases.readthedocs.io/en/stable/idempotency.html#anonymous-clients"
)

AnyClient = TypeVar("AnyClient", bound=Client | AsyncClient)


def identified(client: AnyClient) -> AnyClient:
    """``client`` with a session of its own: a keyed request from a client with no identity at
    all is refused (``test_idempotency_scopes``), so every client here has one."""
    client.session  # the test client saves a new session and sets its cookie
    return client


@pytest.fixture
def client() -> Client:
    """pytest-django's ``client``, identified by a session (see :func:`identified`)."""
    return identified(Client())


def scope_of(client: Client | AsyncClient) -> str:
    """The scope the default settings give this client's requests: its session's."""
    request = RequestFactory().post("/")
    request.session = client.session
    return scopes.by_session(request)


def post(client: Client, url: str, key: str | None, body: str = BODY, **extra: Any) -> Any:
    if key is not None:
        extra["HTTP_IDEMPOTENCY_KEY"] = key
    extra.setdefault("content_type", "application/json")
    return client.post(url, body, **extra)


def problem_type(response: Any) -> str:
    assert response["Content-Type"] == "application/problem+json"
    data = json.loads(response.content)
    assert data["status"] == response.status_code and data["detail"] and data["title"]
    return str(data["type"]).removeprefix(PROBLEM_TYPE_BASE).removesuffix(".html")


@pytest.fixture(autouse=True)
def _no_failures() -> Any:
    failures = views_idempotency.FAILURES
    failures.update(dict.fromkeys(failures, 0))
    yield
    failures.update(dict.fromkeys(failures, 0))


def test_replay_returns_the_stored_response_byte_for_byte(client: Client) -> None:
    first = post(client, "/idem/charge/", '"k-1"')
    again = post(client, "/idem/charge/", '"k-1"')
    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert again["X-Charge"] == first["X-Charge"]
    assert again["Content-Type"] == first["Content-Type"]
    assert again["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first
    assert "last_charge" in first.cookies and "last_charge" not in again.cookies
    assert "Connection" not in again
    assert Charge.objects.count() == 1


def test_quoted_and_bare_forms_name_the_same_key(client: Client) -> None:
    first = post(client, "/idem/charge/", '"stripe-style"')
    again = post(client, "/idem/charge/", "stripe-style")
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content


def test_escapes_in_an_sf_string_are_decoded(client: Client) -> None:
    post(client, "/idem/charge/", r'"a\"b\\c"')
    assert IdempotencyKey.objects.get().key == 'a"b\\c'


def test_requests_without_a_key_run_every_time_unless_required(client: Client) -> None:
    post(client, "/idem/charge/", None)
    post(client, "/idem/charge/", None)
    assert Charge.objects.count() == 2 and IdempotencyKey.objects.count() == 0


def test_unguarded_methods_pass_through(client: Client) -> None:
    response = client.get("/idem/charge/", HTTP_IDEMPOTENCY_KEY="x")
    assert response.status_code == 201 and IdempotencyKey.objects.count() == 0


BAD_INPUTS = [
    ("/idem/required/", None, 400, "idempotency-key-missing"),
    ("/idem/charge/", '""', 400, "idempotency-key-malformed"),
    ("/idem/charge/", '"unterminated', 400, "idempotency-key-malformed"),
    ("/idem/charge/", r'"bad\escape"', 400, "idempotency-key-malformed"),
    ("/idem/charge/", '"a" trailing', 400, "idempotency-key-malformed"),
    ("/idem/charge/", '"cl\xe9"', 400, "idempotency-key-malformed"),
    ("/idem/charge/", "tab\there", 400, "idempotency-key-malformed"),
    ("/idem/charge/", 'bare"quote', 400, "idempotency-key-malformed"),
    ("/idem/charge/", '"' + "k" * 256 + '"', 400, "idempotency-key-malformed"),
    ("/idem/charge/", "k" * 256, 400, "idempotency-key-malformed"),
    ("/idem/charge/", '"a", "b"', 400, "idempotency-key-multiple"),
    ("/idem/charge/", "a,b", 400, "idempotency-key-multiple"),
]


@pytest.mark.parametrize(("url", "header", "status", "slug"), BAD_INPUTS)
def test_bad_input_is_refused_and_nothing_is_stored(
    client: Client, url: str, header: str | None, status: int, slug: str
) -> None:
    response = post(client, url, header)
    assert response.status_code == status
    assert problem_type(response) == slug
    assert IdempotencyKey.objects.count() == 0 and Charge.objects.count() == 0


def test_a_255_character_key_works_and_256_does_not(client: Client) -> None:
    assert post(client, "/idem/charge/", "k" * 255).status_code == 201
    assert post(client, "/idem/charge/", "k" * 255)["Idempotent-Replayed"] == "true"
    assert post(client, "/idem/charge/", "k" * 256).status_code == 400
    assert IdempotencyKey.objects.get().key == "k" * 255


def test_same_key_for_a_different_request_is_422(client: Client) -> None:
    post(client, "/idem/charge/", "k-2")
    other_body = post(client, "/idem/charge/", "k-2", body=json.dumps({"amount": 43}))
    other_path = post(client, "/idem/charge/?x=1", "k-2")
    for response in (other_body, other_path):
        assert response.status_code == 422
        assert problem_type(response) == "idempotency-key-mismatch"
    assert Charge.objects.count() == 1 and IdempotencyKey.objects.count() == 1


@pytest.mark.parametrize("media_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_the_same_body_sent_as_another_media_type_is_422(client: Client, media_type: str) -> None:
    """The media type says what the bytes mean (``{"amount": 42}`` as JSON is a charge of 42,
    as a form it is one field with no value): the same key and the same bytes under another
    ``Content-Type`` replayed the first response instead of refusing the other request."""
    post(client, "/idem/charge/", "k-media")
    other = client.post("/idem/charge/", BODY, media_type, HTTP_IDEMPOTENCY_KEY="k-media")
    assert other.status_code == 422 and problem_type(other) == "idempotency-key-mismatch"
    assert Charge.objects.count() == 1


def test_the_media_type_counts_by_its_meaning_not_its_spelling(client: Client) -> None:
    """Type, subtype, parameter names and the charset's value are case-insensitive (RFC 9110
    section 8.3.1), a quoted value equals the bare one, whitespace and the order of parameters
    do not count; another charset is another request."""
    first = post(client, "/idem/charge/", "k-spelling", content_type="application/json; a=1")
    assert first.status_code == 201
    for spelling in ('Application/JSON;A="1"', "application/json ; a=1 "):
        again = post(client, "/idem/charge/", "k-spelling", content_type=spelling)
        assert again["Idempotent-Replayed"] == "true", spelling
    first = post(client, "/idem/charge/", "k-charset", content_type="text/plain; charset=utf-8")
    assert first.status_code == 201
    for spelling in ('TEXT/Plain; Charset="UTF-8"', "text/plain;charset=Utf-8"):
        again = post(client, "/idem/charge/", "k-charset", content_type=spelling)
        assert again["Idempotent-Replayed"] == "true", spelling
    for other in ("text/plain; charset=latin-1", "text/plain", "text/plain; charset=utf-8; x=1"):
        assert post(client, "/idem/charge/", "k-charset", content_type=other).status_code == 422
    assert Charge.objects.count() == 2


def test_a_key_stored_before_media_types_counted_still_replays_to_its_retry(
    client: Client,
) -> None:
    """A key completed by a version whose fingerprint was the method, the path and the body
    alone (``digest([method, path, body])``) still replays to its retry, under any media type
    as then; a key stored since is bound to its media type."""
    scope = scope_of(client)
    legacy = digest([b"POST", b"/idem/charge/", BODY.encode()])
    stored = begin(scope, "k-old", legacy, ttl=60, lock_timeout=60)
    assert stored.claim is not None
    finish(stored.claim, Outcome(201, [("Content-Type", "text/plain")], b"stored"), ttl=60)
    for media_type in ("application/json", "text/plain"):
        retry = post(client, "/idem/charge/", "k-old", content_type=media_type)
        assert retry["Idempotent-Replayed"] == "true" and retry.content == b"stored"
    other = post(client, "/idem/charge/", "k-old", body=json.dumps({"amount": 43}))
    assert other.status_code == 422
    assert Charge.objects.count() == 0
    assert IdempotencyKey.objects.get(key="k-old").fingerprint == legacy


def test_same_key_while_the_first_runs_is_409_with_retry_after(client: Client) -> None:
    request = RequestFactory().post(
        "/idem/charge/", BODY, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k-3"
    )
    scope = scope_of(client)
    running = begin(scope, "k-3", default_fingerprint(request), ttl=60, lock_timeout=60)
    assert running.claim is not None
    response = post(client, "/idem/charge/", "k-3")
    assert response.status_code == 409
    assert problem_type(response) == "idempotency-key-in-progress"
    # the first request's claim lapses in about 60 s: that, not a fixed 1, is when to retry
    assert 50 <= int(response["Retry-After"]) <= 60
    assert Charge.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_another_request_under_a_key_in_flight_is_422(client: Client) -> None:
    """A retry of the running request is 409; another request under its key is 422 as it is
    once the first completed, however the key was claimed (``test_idempotency_claim`` runs
    this with ``CLAIM_IN_TRANSACTION``, where the duplicate was told 409)."""
    request = RequestFactory().post("/idem/charge/", BODY, content_type="application/json")
    running = begin(
        scope_of(client),
        "k-4",
        default_fingerprint(request),
        ttl=60,
        lock_timeout=60,
        in_transaction=conf.get().claim_in_transaction,
    )
    assert running.claim is not None
    answers: dict[str, Any] = {}

    def duplicates() -> None:  # another connection: the gated claim's locks are the session's
        try:
            answers["other"] = post(client, "/idem/charge/", "k-4", body='{"amount": 43}')
            answers["same"] = post(client, "/idem/charge/", "k-4")
        finally:
            connection.close()

    thread = threading.Thread(target=duplicates)
    thread.start()
    thread.join(60)
    release(running.claim)
    assert answers["other"].status_code == 422
    assert problem_type(answers["other"]) == "idempotency-key-mismatch"
    assert answers["same"].status_code == 409
    assert Charge.objects.count() == 0


def test_one_users_key_never_replays_to_another_user(client: Client) -> None:
    alice, bob = UserFactory(username="alice"), UserFactory(username="bob")
    client.force_login(alice)
    first = post(client, "/idem/charge/", "shared")
    other = Client()
    other.force_login(bob)
    second = post(other, "/idem/charge/", "shared")
    assert "Idempotent-Replayed" not in second
    assert json.loads(first.content)["owner"] == "alice"
    assert json.loads(second.content)["owner"] == "bob"
    assert post(client, "/idem/charge/", "shared").content == first.content
    assert post(other, "/idem/charge/", "shared").content == second.content
    assert Charge.objects.count() == 2


def test_clients_with_no_identity_are_refused_not_put_in_one_key_space() -> None:
    """Neither user nor session: sharing one key space would replay one client's response to
    another, so the keyed request is refused with a problem that links to the guide."""
    first, second = (post(Client(), "/idem/charge/", "k-anon") for _ in range(2))
    for response in (first, second):
        assert response.status_code == 400 and "Idempotent-Replayed" not in response
        problem_type(response)
        assert json.loads(response.content)["type"] == ANONYMOUS_GUIDE
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
    assert post(Client(), "/idem/charge/", None).status_code == 201  # no key: nothing to scope


def test_a_keyed_request_with_no_identity_is_refused_before_its_body_is_read() -> None:
    """The scope is asked for first: hashing the body first had any anonymous client that adds
    the header make the server read its whole body and spool it to disk, only to refuse it."""
    body = b"x" * (settings.FILE_UPLOAD_MAX_MEMORY_SIZE + 1)
    payload = FakePayload(body)
    extra: dict[str, Any] = {"HTTP_IDEMPOTENCY_KEY": "k-anon-body", "wsgi.input": payload}
    request = RequestFactory().post(
        "/idem/charge/", body, content_type="application/octet-stream", **extra
    )
    response = views_idempotency.charge(request)
    assert response.status_code == 400
    assert json.loads(response.content)["type"] == ANONYMOUS_GUIDE
    assert not payload.read_started


def test_each_session_is_a_key_space_of_its_own() -> None:
    first = post(identified(Client()), "/idem/charge/", "k-visit")
    second = post(identified(Client()), "/idem/charge/", "k-visit")
    assert first.status_code == second.status_code == 201 and "Idempotent-Replayed" not in second
    assert first.content != second.content and Charge.objects.count() == 2


@override_settings(IDEMPOTENCY={"ANONYMOUS_SCOPE": "idempotency.scopes.anonymous"})
def test_the_shared_anonymous_key_space_is_an_explicit_opt_in() -> None:
    first = post(Client(), "/idem/charge/", "k-unguessable")
    again = post(Client(), "/idem/charge/", "k-unguessable")
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert IdempotencyKey.objects.get().scope == scopes.ANONYMOUS


def test_a_5xx_keeps_neither_response_nor_effect_and_the_retry_runs(client: Client) -> None:
    views_idempotency.FAILURES["status"] = 1
    assert post(client, "/idem/flaky/", "k-4").status_code == 503
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
    retry = post(client, "/idem/flaky/", "k-4")
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 1


def test_an_exception_keeps_nothing_and_the_retry_runs(client: Client) -> None:
    views_idempotency.FAILURES["raise"] = 1
    with pytest.raises(RuntimeError):
        post(client, "/idem/flaky/", "k-5")
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
    assert post(client, "/idem/flaky/", "k-5").status_code == 201
    assert Charge.objects.count() == 1


@override_settings(IDEMPOTENCY={"MAX_RESPONSE_BYTES": 100})
def test_an_oversized_response_is_refused_and_rolled_back(client: Client) -> None:
    with pytest.raises(ResponseNotStorable):
        post(client, "/idem/big/?size=101", "k-6")
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
    assert post(client, "/idem/big/?size=100", "k-7").status_code == 200
    assert Charge.objects.count() == 1


def test_a_streaming_response_is_refused_and_rolled_back(client: Client) -> None:
    with pytest.raises(ResponseNotStorable, match="streamed"):
        post(client, "/idem/stream/", "k-8")
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0


@pytest.mark.parametrize(
    ("url", "reason"),
    [("/idem/stream-not-atomic/", "streamed"), ("/idem/big-not-atomic/?size=101", "over")],
    ids=["streamed", "oversized"],
)
@override_settings(IDEMPOTENCY={"MAX_RESPONSE_BYTES": 100})
def test_a_not_atomic_view_whose_response_cannot_be_stored_never_runs_again(
    client: Client, url: str, reason: str
) -> None:
    """With ``atomic=False`` the view's writes have committed by the time its response turns
    out not to be storable. The key was freed all the same, so every retry ran the view and
    wrote again (and failed the same way). The key is recorded as run without a stored
    response: the first request fails as before, and every retry is answered the 500 problem
    (as Stripe replays a 500) instead of running the view; another request is still a 422."""
    with pytest.raises(ResponseNotStorable, match=rf"{reason}.*not run again"):
        post(client, url, "k-8-na")
    for _ in range(2):
        retry = post(client, url, "k-8-na")
        assert retry.status_code == 500, retry.content
        assert problem_type(retry) == "idempotency-response-not-storable"
        assert "not run again" in json.loads(retry.content)["detail"]
        assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1, "the view ran again under its key"
    assert post(client, url, "k-8-na", body='{"amount": 1}').status_code == 422
    assert IdempotencyKey.objects.get().state == "completed"


def test_an_expired_key_can_be_reused(client: Client) -> None:
    first = post(client, "/idem/charge/", "k-9")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE idempotency_key SET expires_at = clock_timestamp() - interval '1 second'"
        )
    again = post(client, "/idem/charge/", "k-9")
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert again.content != first.content and Charge.objects.count() == 2


@override_settings(IDEMPOTENCY={"REQUIRED": True})
def test_the_setting_makes_keys_required(client: Client) -> None:
    response = post(client, "/idem/charge/", None)
    assert response.status_code == 400 and problem_type(response) == "idempotency-key-missing"


def test_class_based_view_with_the_mixin(client: Client) -> None:
    assert post(client, "/idem/cbv/", None).status_code == 400
    first = post(client, "/idem/cbv/", "k-10")
    assert post(client, "/idem/cbv/", "k-10").content == first.content
    assert Charge.objects.count() == 1


ASYNC_CLASS_VIEWS = ["/idem/async-cbv/", "/idem/async-cbv-decorated/"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("url", ASYNC_CLASS_VIEWS)
@pytest.mark.parametrize("client_class", [Client, AsyncClient])
def test_async_class_based_views_are_guarded_like_async_function_views(
    url: str, client_class: type[Client | AsyncClient]
) -> None:
    """``IdempotentMixin`` on an async ``View``, and ``@idempotent`` around its ``as_view()``:
    the first request runs, a retry replays, a 5xx keeps nothing, and conflicts are refused."""
    client = identified(client_class())

    def send(key: str, body: dict[str, Any]) -> Any:
        args = (url, json.dumps(body), "application/json")
        if isinstance(client, AsyncClient):
            return async_to_sync(client.post)(*args, headers={"Idempotency-Key": key})
        return client.post(*args, HTTP_IDEMPOTENCY_KEY=key)

    assert send("c-1", {"amount": 1, "fail": True}).status_code == 500
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
    first = send("c-2", {"amount": 2})
    again = send("c-2", {"amount": 2})
    assert first.status_code == again.status_code == 201 and "Idempotent-Replayed" not in first
    assert again.content == first.content and again["Idempotent-Replayed"] == "true"
    mismatch = send("c-2", {"amount": 3})
    assert mismatch.status_code == 422 and problem_type(mismatch) == "idempotency-key-mismatch"
    request = RequestFactory().post(url, json.dumps({"amount": 4}), content_type="application/json")
    running = begin(scope_of(client), "c-3", default_fingerprint(request), ttl=60, lock_timeout=60)
    assert running.claim is not None
    busy = send("c-3", {"amount": 4})
    assert busy.status_code == 409 and problem_type(busy) == "idempotency-key-in-progress"
    assert Charge.objects.count() == 1


def _basic(username: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:password".encode()).decode()


@pytest.mark.parametrize("url", ["/idem/drf/", "/idem/viewset/"])
def test_drf_views_scope_keys_by_the_drf_authenticated_user(client: Client, url: str) -> None:
    users = [UserFactory(username="carol"), UserFactory(username="dave")]
    carol = post(client, url, "k-11", HTTP_AUTHORIZATION=_basic("carol"))
    dave = post(client, url, "k-11", HTTP_AUTHORIZATION=_basic("dave"))
    assert carol.status_code == dave.status_code == 201
    assert json.loads(carol.content)["owner"] == "carol"
    assert json.loads(dave.content)["owner"] == "dave"
    replay = post(client, url, "k-11", HTTP_AUTHORIZATION=_basic("carol"))
    assert replay.content == carol.content and replay["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 2
    scopes = set(IdempotencyKey.objects.values_list("scope", flat=True))
    assert scopes == {f"user:{user.pk}" for user in users}


def test_drf_authentication_runs_once_per_request(client: Client) -> None:
    UserFactory(username="erin")
    views_idempotency.CountingBasicAuthentication.runs = 0
    post(client, "/idem/drf/", "k-12", HTTP_AUTHORIZATION=_basic("erin"))
    post(client, "/idem/drf/", "k-12", HTTP_AUTHORIZATION=_basic("erin"))
    assert views_idempotency.CountingBasicAuthentication.runs == 2


@pytest.mark.django_db(transaction=True)
def test_async_views_are_guarded_atomically() -> None:
    client = identified(AsyncClient())

    def send(key: str, body: dict[str, Any]) -> Any:
        return async_to_sync(client.post)(
            "/idem/async/", json.dumps(body), "application/json", headers={"Idempotency-Key": key}
        )

    assert send("a-1", {"amount": 1, "fail": True}).status_code == 500
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
    first = send("a-2", {"amount": 2})
    again = send("a-2", {"amount": 2})
    assert first.status_code == 201 and again.content == first.content
    assert again["Idempotent-Replayed"] == "true" and Charge.objects.count() == 1


def test_decorator_options_are_checked_when_decorating() -> None:
    with pytest.raises(IdempotencyImproperlyConfigured):
        idempotent(on_conflict="maybe")
    with pytest.raises(IdempotencyImproperlyConfigured):
        idempotent(methods="POST")


@pytest.mark.parametrize(
    "option",
    [
        # An already expired key: the view ran, answered 201 and its retry ran it again.
        {"ttl": -5},
        {"ttl": 0},
        # Raw TypeError / the database's DataError at the first keyed request.
        {"ttl": "60"},
        {"lock_timeout": float("nan")},
        {"wait_timeout": -1},
        # An expiry past the year 9999: stored, then unreadable (the admin's list answered 500).
        {"ttl": 10**12},
    ],
)
def test_seconds_options_are_checked_when_decorating(option: dict[str, Any]) -> None:
    with pytest.raises(IdempotencyImproperlyConfigured, match=next(iter(option))):
        idempotent(**option)
    if "wait_timeout" not in option:
        with pytest.raises(IdempotencyImproperlyConfigured, match=next(iter(option))):
            idempotency_key("a-key", **option)
    assert not IdempotencyKey.objects.exists()


@pytest.mark.parametrize("wait", [None, "1", float("nan"), -1])
def test_an_operations_wait_is_checked_when_defined(wait: Any) -> None:
    """``wait=None`` passed the check (``None`` reads "unset" for the options that have a
    setting behind them, and ``wait`` has none), then failed with a bare ``TypeError`` inside
    the claim, at the first operation run; a Celery task's ``wait=None`` failed in the worker."""
    from idempotency.celery import idempotent_task

    with pytest.raises(IdempotencyImproperlyConfigured, match="wait"):
        idempotency_key("a-key", wait=wait)
    with pytest.raises(IdempotencyImproperlyConfigured, match="wait"):
        idempotent_task(wait=wait)
    assert not IdempotencyKey.objects.exists()


def test_a_guard_without_the_app_installed_says_so(client: Client) -> None:
    """Forgetting "idempotency" in INSTALLED_APPS: no check runs and migrate makes no key table,
    so the first keyed request died of the database's ProgrammingError inside the view."""
    without = [app for app in settings.INSTALLED_APPS if app != "idempotency"]
    with (
        override_settings(INSTALLED_APPS=without),
        pytest.raises(IdempotencyImproperlyConfigured, match="INSTALLED_APPS"),
    ):
        post(client, "/idem/charge/", "no-app-1")
    assert not Charge.objects.exists()


def test_a_bad_setting_is_reported_by_system_checks() -> None:
    bad = {"TTL": -1, "BOGUS": 1, "SCOPE": "no.such.scope", "METHODS": 5, "ON_CONFLICT": "x"}
    with override_settings(IDEMPOTENCY=bad):
        ids = [message.id for message in check_settings()]
        messages = " ".join(message.msg for message in check_settings())
    assert ids and set(ids) == {"idempotency.E001"}
    for word in ("TTL", "BOGUS", "no.such.scope", "METHODS", "ON_CONFLICT"):
        assert word in messages
    assert check_settings() == []


def test_the_admin_lists_keys_read_only_searchable_and_filtered(admin_client: Client) -> None:
    post(identified(Client()), "/idem/charge/", "findme-1")
    row = IdempotencyKey.objects.get()
    found = admin_client.get("/admin/idempotency/idempotencykey/?q=findme&state=completed")
    assert found.status_code == 200 and b"findme-1" in found.content
    assert (
        admin_client.get("/admin/idempotency/idempotencykey/?q=nothing").content.count(b"findme-1")
        == 0
    )
    assert admin_client.get("/admin/idempotency/idempotencykey/add/").status_code == 403
    detail = admin_client.get(f"/admin/idempotency/idempotencykey/{row.pk}/change/")
    assert detail.status_code == 200 and b'name="key"' not in detail.content


def test_a_header_with_a_nul_is_not_storable_rather_than_a_database_error() -> None:
    """Django lets a NUL through in a header value (an echoed ``X-Request-Id``); ``jsonb``
    refused it, and the store's write failed with a ``DataError``: a 500 only with a key."""
    from django.http import HttpResponse

    from idempotency.http import capture

    response = HttpResponse("ok")
    response["X-Request-Id"] = "a\x00b"
    with pytest.raises(ResponseNotStorable, match="NUL"):
        capture(response, 1000)


def test_a_refused_file_response_is_closed() -> None:
    import io

    from django.http import FileResponse

    from idempotency.http import capture

    stream = io.BytesIO(b"data")
    with pytest.raises(ResponseNotStorable, match="streamed"):
        capture(FileResponse(stream), 1000)
    assert stream.closed


def test_a_replayed_redirect_is_followed_as_the_first_was() -> None:
    """A replayed 3xx was a plain ``HttpResponse`` without ``url``: ``Client(follow=True)``
    and ``assertRedirects`` failed on it."""
    from django.http import HttpResponseRedirect

    from idempotency.http import capture, replay

    _, outcome = capture(HttpResponseRedirect("/orders/7/"), 1000)
    again = replay(outcome)
    assert again.status_code == 302 and again.url == "/orders/7/"  # type: ignore[attr-defined]
