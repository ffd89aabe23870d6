"""Views the idempotency tests call, in process and on a live server (URLconf: ``idem/``).

Every view applies one visible side effect, a ``Charge`` row, so a test can count how often a
view's effects really committed.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import viewsets
from rest_framework.authentication import (
    BasicAuthentication,
    SessionAuthentication,
    TokenAuthentication,
)
from rest_framework.decorators import api_view, authentication_classes
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import BaseThrottle
from rest_framework.views import APIView

from idempotency import IdempotentMixin, idempotent
from idempotency.models import IdempotencyKey
from tests.testapp import views_async
from tests.testapp.models_idempotency import Charge

if TYPE_CHECKING:
    from django.core.files.uploadedfile import UploadedFile

# Failures the flaky views still have to produce, by kind: "status" -> 503, "raise" -> exception,
# "refuse" -> 429 from the view, "throttle" -> DRF's 429, "forbid" -> DRF's permission 403,
# "invalid" -> 400 after rolling the view's writes back (``set_rollback``; DRF: a validation error).
FAILURES: dict[str, int] = {
    "status": 0,
    "raise": 0,
    "refuse": 0,
    "throttle": 0,
    "forbid": 0,
    "invalid": 0,
}


def _fail(kind: str) -> bool:
    """Whether a failure of ``kind`` is still due (and count it as produced)."""
    if FAILURES[kind] > 0:
        FAILURES[kind] -= 1
        return True
    return False


CRASH_MARKER_ENV = "IDEMPOTENCY_TEST_CRASH_MARKER"


def _charge(request: Any) -> Charge:
    raw = request.body if isinstance(request, HttpRequest) else request._request.body
    data = json.loads(raw or b"{}")
    user = getattr(request, "user", None)
    charge = Charge.objects.create(
        key=request.META.get("HTTP_IDEMPOTENCY_KEY", ""),
        amount=int(data.get("amount", 0)),
        owner=user.get_username() if user is not None and user.is_authenticated else "",
    )
    time.sleep(float(data.get("sleep", 0)))
    return charge


def _answer(charge: Charge) -> JsonResponse:
    response = JsonResponse(
        {"charge": charge.pk, "amount": charge.amount, "owner": charge.owner}, status=201
    )
    response["X-Charge"] = str(charge.pk)
    response["Connection"] = "keep-alive"
    response.set_cookie("last_charge", str(charge.pk))
    return response


@csrf_exempt
@idempotent
def charge(request: HttpRequest) -> HttpResponse:
    return _answer(_charge(request))


@csrf_exempt
@idempotent(required=True, methods=["POST", "PUT"])
def charge_required(request: HttpRequest) -> HttpResponse:
    return _answer(_charge(request))


@csrf_exempt
@idempotent(on_conflict="wait", wait_timeout=30)
def charge_wait(request: HttpRequest) -> HttpResponse:
    return _answer(_charge(request))


# What the flaky view's on_commit callbacks saw: (charge pk, completed keys visible) per run.
COMMITTED: list[tuple[int, int]] = []


def _on_commit(charge: Charge) -> None:
    completed = IdempotencyKey.objects.filter(state="completed").count()
    COMMITTED.append((charge.pk, completed))


def _flaky(request: HttpRequest) -> HttpResponse:
    made = _charge(request)
    transaction.on_commit(lambda: _on_commit(made))
    if _fail("status"):
        return HttpResponse("upstream unavailable", status=503)
    if _fail("raise"):
        raise RuntimeError("the view failed after writing")
    if _fail("refuse"):
        return HttpResponse("slow down", status=429, headers={"Retry-After": "30"})
    if _fail("invalid"):
        # Django's way to undo a transaction's writes and still answer (no exception).
        transaction.set_rollback(True)
        return JsonResponse({"amount": ["invalid"]}, status=400)
    return _answer(made)


@csrf_exempt
@idempotent
def charge_flaky(request: HttpRequest) -> HttpResponse:
    return _flaky(request)


@csrf_exempt
@idempotent(atomic=False)
def charge_flaky_not_atomic(request: HttpRequest) -> HttpResponse:
    """:func:`charge_flaky` without the guard's own transaction."""
    return _flaky(request)


def _crash(request: HttpRequest) -> HttpResponse:
    """Writes its effect, then (the first time) tells the test and hangs until killed."""
    made = _charge(request)
    marker = Path(os.environ[CRASH_MARKER_ENV])
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        time.sleep(60)
    return _answer(made)


charge_crash = csrf_exempt(idempotent(lock_timeout=1)(_crash))
# The same views with the key claimed in the view's transaction (CLAIM_IN_TRANSACTION).
charge_crash_tx = csrf_exempt(idempotent(lock_timeout=1, claim_in_transaction=True)(_crash))
charge_tx = csrf_exempt(idempotent(claim_in_transaction=True)(lambda r: _answer(_charge(r))))
# The ASGI test's async view (lease, fenced write, row), with the key claimed in its transaction.
aio_charge_tx = csrf_exempt(
    idempotent(claim_in_transaction=True)(inspect.unwrap(views_async.charge))
)
charge_wait_tx = csrf_exempt(
    idempotent(on_conflict="wait", wait_timeout=30, claim_in_transaction=True)(
        lambda r: _answer(_charge(r))
    )
)


@csrf_exempt
@idempotent
def charge_big(request: HttpRequest) -> HttpResponse:
    _charge(request)
    return HttpResponse(b"x" * int(request.GET.get("size", "10")))


@csrf_exempt
@idempotent
def charge_stream(request: HttpRequest) -> HttpResponse:
    _charge(request)
    return StreamingHttpResponse(iter([b"a", b"b"]))  # type: ignore[return-value]


# The same two without the guard's transaction: their writes commit as they are made.
charge_big_not_atomic = csrf_exempt(idempotent(atomic=False)(inspect.unwrap(charge_big)))
charge_stream_not_atomic = csrf_exempt(idempotent(atomic=False)(inspect.unwrap(charge_stream)))


async def _charge_async(request: HttpRequest) -> HttpResponse:
    data = json.loads(request.body or b"{}")
    made = await Charge.objects.acreate(key="async", amount=int(data.get("amount", 0)))
    if data.get("fail"):
        return HttpResponse("failed", status=500)
    return JsonResponse({"charge": made.pk, "amount": made.amount}, status=201)


@csrf_exempt
@idempotent
async def charge_async(request: HttpRequest) -> HttpResponse:
    return await _charge_async(request)


class ChargeView(IdempotentMixin, View):
    idempotency_required = True

    def post(self, request: HttpRequest) -> HttpResponse:
        return _answer(_charge(request))


class AsyncChargeView(IdempotentMixin, View):
    """An async class-based view: Django runs it as a coroutine (``view_is_async``)."""

    async def post(self, request: HttpRequest) -> HttpResponse:
        return await _charge_async(request)


class AsyncPlainView(View):
    """An async class-based view without the mixin, for ``idempotent(AsyncPlainView.as_view())``."""

    async def post(self, request: HttpRequest) -> HttpResponse:
        return await _charge_async(request)


class CountingBasicAuthentication(BasicAuthentication):
    """Basic auth that counts its runs: the mixin must not authenticate a request twice."""

    runs = 0

    def authenticate(self, request: Request) -> Any:
        CountingBasicAuthentication.runs += 1
        return super().authenticate(request)


class ChargeAPIView(IdempotentMixin, APIView):
    authentication_classes = [CountingBasicAuthentication]

    def post(self, request: Request) -> Response:
        made = _charge(request)
        return Response({"charge": made.pk, "owner": made.owner}, status=201)


class ChargeViewSet(IdempotentMixin, viewsets.ViewSet):
    authentication_classes = [BasicAuthentication]

    def create(self, request: Request) -> Response:
        made = _charge(request)
        return Response({"charge": made.pk, "owner": made.owner}, status=201)


class FlakyThrottle(BaseThrottle):
    """Refuses while ``FAILURES["throttle"]`` says so, asking the client to wait 30 s."""

    def allow_request(self, request: Request, view: APIView) -> bool:
        return not _fail("throttle")

    def wait(self) -> float:
        return 30.0


class FlakyPermission(BasePermission):
    """Denies while ``FAILURES["forbid"]`` says so (DRF answers an authenticated user 403)."""

    def has_permission(self, request: Request, view: APIView) -> bool:
        return not _fail("forbid")


class GuardedAPIView(IdempotentMixin, APIView):
    """A DRF view whose throttle and permission refuse before the handler ran."""

    authentication_classes = [BasicAuthentication]
    throttle_classes = [FlakyThrottle]
    permission_classes = [FlakyPermission]

    def post(self, request: Request) -> Response:
        made = _charge(request)
        if _fail("invalid"):
            # After a write: under ATOMIC_REQUESTS DRF's handler rolls the transaction back.
            raise ValidationError({"amount": ["invalid"]})
        return Response({"charge": made.pk, "owner": made.owner}, status=201)


@api_view(["POST"])
@authentication_classes([TokenAuthentication, SessionAuthentication])
@idempotent
def drf_function_charge(request: Request) -> Response:
    """The order the guide shows: ``@idempotent`` next to the function, under ``@api_view``."""
    made = _charge(request)
    return Response({"charge": made.pk, "owner": made.owner}, status=201)


class NestedChargeView(IdempotentMixin, View):
    """Two guards on one request: the mixin on the view and ``@idempotent`` on its handler."""

    @method_decorator(idempotent)
    def post(self, request: HttpRequest) -> HttpResponse:
        return _answer(_charge(request))


class PlainChargeView(IdempotentMixin, View):
    def post(self, request: HttpRequest) -> HttpResponse:
        return _answer(_charge(request))


def _buffered(request: HttpRequest) -> bool:
    """Whether the whole body was read into memory (Django keeps it as ``request._body``)."""
    return hasattr(request, "_body")


@idempotent
def upload(request: HttpRequest) -> HttpResponse:
    """A multipart upload; not CSRF-exempt, so an enforcing client has the middleware parse it
    before the guard runs."""
    # items() and values() give each field's last file (django-stubs also allows a list).
    files = {
        name: hashlib.sha256(cast("UploadedFile[bytes]", f).read()).hexdigest()
        for name, f in request.FILES.items()
    }
    size = sum(cast("UploadedFile[bytes]", f).size or 0 for f in request.FILES.values())
    made = Charge.objects.create(key="upload", amount=size)
    return JsonResponse(
        {"charge": made.pk, "files": files, "buffered": _buffered(request)}, status=201
    )


@csrf_exempt
@idempotent
def upload_stream(request: HttpRequest) -> HttpResponse:
    """Reads its (non-form) body as a stream, as a view taking large raw uploads does."""
    hasher, size = hashlib.sha256(), 0
    for chunk in iter(lambda: request.read(64 * 1024), b""):
        hasher.update(chunk)
        size += len(chunk)
    made = Charge.objects.create(key="stream", amount=size)
    return JsonResponse(
        {"charge": made.pk, "sha256": hasher.hexdigest(), "buffered": _buffered(request)},
        status=201,
    )


# A held request: charges, sets ENTERED, then answers only once a test sets RELEASE (or 60 s).
ENTERED = threading.Event()
RELEASE = threading.Event()


def _held(request: HttpRequest) -> HttpResponse:
    made = _charge(request)
    ENTERED.set()
    RELEASE.wait(60)
    return _answer(made)


@csrf_exempt
@idempotent(atomic=False, lock_timeout=1, on_conflict="wait", wait_timeout=30)
def order_steps(request: HttpRequest) -> HttpResponse:
    """The steps workflow (tests/steps_workflow.py) as a view: non-atomic, so steps commit."""
    from tests.steps_workflow import place_order

    data = json.loads(request.body or b"{}")
    return JsonResponse(place_order(str(data["order"]), int(data["amount"])), status=201)


def _taken_over(request: HttpRequest) -> None:
    """What a retry does once this attempt's lock lapsed: the key row gets another owner
    (written on a connection of its own, committed at once)."""
    from django.db import connections

    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute(
                "UPDATE idempotency_key SET owner = gen_random_uuid() WHERE key = %s",
                [request.META["HTTP_IDEMPOTENCY_KEY"]],
            )
    finally:
        other.close()


@csrf_exempt
@idempotent(atomic=False)  # an atomic attempt's steps are kept in memory: found lost at the end
def lost_at_a_step(request: HttpRequest) -> HttpResponse:
    """Taken over before its step records: the step raises ``IdempotencyKeyLost``."""
    from idempotency import step

    _taken_over(request)
    step("charge", lambda key: _charge(request).pk)
    return HttpResponse("not reached", status=201)


@csrf_exempt
@idempotent(atomic=False)
async def alost_at_a_step(request: HttpRequest) -> HttpResponse:
    """:func:`lost_at_a_step`, async."""
    from asgiref.sync import sync_to_async

    from idempotency import astep

    await sync_to_async(_taken_over)(request)
    await astep("charge", lambda key: _charge(request).pk)
    return HttpResponse("not reached", status=201)


# The keys the async steps view's remote step was called with.
REMOTE_CALLS: list[str] = []


@csrf_exempt
@idempotent(atomic=False)
async def async_steps(request: HttpRequest) -> HttpResponse:
    """Steps from an async view: a coroutine step and a sync ORM step (``astep``)."""
    from idempotency import astep

    async def remote(key: str) -> str:
        REMOTE_CALLS.append(key)
        return f"remote-{key[:12]}"

    def local(key: str) -> int:
        if _fail("raise"):
            raise RuntimeError("the local step failed")
        return Charge.objects.create(key="order:async", amount=1).pk

    remote_id = await astep("remote", remote)
    row = await astep("local", local)
    return JsonResponse({"remote": remote_id, "row": row}, status=201)


charge_held = csrf_exempt(idempotent(_held))
charge_held_wait = csrf_exempt(idempotent(on_conflict="wait", wait_timeout=0.5)(_held))
# Under ATOMIC_REQUESTS: a started row inserted in the request's transaction, not the gate.
charge_held_row = csrf_exempt(idempotent(claim_in_transaction=False)(_held))


# Undecorated views for the middleware (IDEMPOTENCY["MIDDLEWARE_PATHS"] names "^/idem/mw/").


@csrf_exempt
def mw_charge(request: HttpRequest) -> HttpResponse:
    return _answer(_charge(request))


@csrf_exempt
async def mw_async_charge(request: HttpRequest) -> HttpResponse:
    made = await Charge.objects.acreate(key="async", amount=json.loads(request.body)["amount"])
    return _answer(made)


class MwChargeAPIView(APIView):
    """A DRF view authenticated by token only: the middleware must scope by DRF's user."""

    authentication_classes = [TokenAuthentication]

    def post(self, request: Request) -> Response:
        made = _charge(request)
        return Response({"charge": made.pk, "owner": made.owner}, status=201)


urlpatterns = [
    path("mw/charge/", mw_charge),
    path("mw/async/", mw_async_charge),
    path("mw/drf/", MwChargeAPIView.as_view()),
    path("mw/nested/", charge),
    path("mw-not-listed/", mw_charge),
    path("charge/", charge),
    path("required/", charge_required),
    path("wait/", charge_wait),
    path("flaky/", charge_flaky),
    path("flaky-not-atomic/", charge_flaky_not_atomic),
    path("crash/", charge_crash),
    path("crash-tx/", charge_crash_tx),
    path("charge-tx/", charge_tx),
    path("aio-charge-tx/", aio_charge_tx),
    path("wait-tx/", charge_wait_tx),
    path("big/", charge_big),
    path("stream/", charge_stream),
    path("big-not-atomic/", charge_big_not_atomic),
    path("stream-not-atomic/", charge_stream_not_atomic),
    path("async/", charge_async),
    path("cbv/", csrf_exempt(ChargeView.as_view())),
    path("async-cbv/", csrf_exempt(AsyncChargeView.as_view())),
    path("async-cbv-decorated/", csrf_exempt(idempotent(AsyncPlainView.as_view()))),
    path("drf/", ChargeAPIView.as_view()),
    path("drf-guarded/", GuardedAPIView.as_view()),
    path("drf-function/", drf_function_charge),
    path("held/", charge_held),
    path("order-steps/", order_steps),
    path("lost-at-a-step/", lost_at_a_step),
    path("alost-at-a-step/", alost_at_a_step),
    path("async-steps/", async_steps),
    path("held-wait/", charge_held_wait),
    path("held-row/", charge_held_row),
    path("upload/", upload),
    path("upload-exempt/", csrf_exempt(upload)),
    path("upload-stream/", upload_stream),
    path("nested/", csrf_exempt(NestedChargeView.as_view())),
    path("nested-outside/", csrf_exempt(idempotent(PlainChargeView.as_view()))),
    path("viewset/", ChargeViewSet.as_view({"post": "create"})),
]
