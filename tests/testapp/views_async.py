"""Async views for the end-to-end ASGI tests (URLconf: ``aio/``), served by uvicorn.

``register`` takes a lease with ``alease`` and writes the shared fenced register under it
(logged for :mod:`tests.checker`); ``charge`` is an ``@idempotent`` async view that takes a
lease and makes a fenced ``aupdate`` before its one visible effect, a ``Charge`` row.
"""

from __future__ import annotations

import asyncio
import json

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from idempotency import idempotent
from leases import alease
from tests.checker import arecord_write
from tests.testapp.models_fencing import FencedRegister
from tests.testapp.models_idempotency import Charge

#: Requests of this process inside a lease's block right now, per lease name: never above 1.
_inside: dict[str, int] = {}
_most: dict[str, int] = {}


@csrf_exempt
async def register(request: HttpRequest, name: str) -> HttpResponse:
    """Hold ``aio:<name>`` (on the ``backend`` query parameter's alias) and write the register."""
    writer = request.GET.get("writer", "?")
    async with alease(f"aio:{name}", ttl=5, backend=request.GET.get("backend", "default")) as held:
        _inside[name] = _inside.get(name, 0) + 1
        _most[name] = max(_most.get(name, 0), _inside[name])
        try:
            await asyncio.sleep(0.01)
            accepted = await arecord_write(name, held, writer)
        finally:
            _inside[name] -= 1
    return JsonResponse({"token": held.token, "accepted": accepted, "most": _most[name]})


@csrf_exempt
@idempotent
async def charge(request: HttpRequest) -> HttpResponse:
    """Charge once per key: lease, fenced ``aupdate`` of the account's register, then the row."""
    data = json.loads(request.body or b"{}")
    account = str(data["account"])
    async with alease(f"aio-account:{account}", ttl=5) as held:
        await FencedRegister.objects.aget_or_create(name=account)
        await FencedRegister.objects.filter(name=account).fenced(held).aupdate(value="charged")
        await asyncio.sleep(float(data.get("sleep", 0)))
        made = await Charge.objects.acreate(amount=int(data["amount"]), key=account)
    return JsonResponse({"charge": made.pk, "token": held.token}, status=201)


urlpatterns = [
    path("register/<str:name>/", register),
    path("charge/", charge),
]
