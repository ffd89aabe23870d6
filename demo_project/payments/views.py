"""``POST /payments/``: an idempotent payment endpoint; ``GET /payments/`` counts payments.

The key row and the ``Payment`` commit in one transaction (atomic mode), so a retry after a
timeout, a crash or a 5xx never charges twice, and a retry of a completed payment gets the first
answer back byte for byte with ``Idempotent-Replayed: true``.
"""

from __future__ import annotations

import json
import time

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from idempotency import idempotent

from .models import Payment
from .scopes import by_api_key

MAX_DELAY = 10.0


def _problem(detail: str) -> JsonResponse:
    body = {"title": "Invalid payment", "status": 400, "detail": detail}
    return JsonResponse(body, status=400, content_type="application/problem+json")


@idempotent(required=True, methods=["POST"], scope=by_api_key)
def _create(request: HttpRequest) -> HttpResponse:
    try:
        data = json.loads(request.body or b"{}")
        amount = int(data["amount"])
    except (ValueError, KeyError, TypeError):
        return _problem('send JSON like {"amount": 1000, "currency": "EUR"}')
    payment = Payment.objects.create(
        amount_cents=amount,
        currency=str(data.get("currency", "EUR"))[:3].upper(),
        description=str(data.get("description", ""))[:200],
    )
    # A slow payment provider, so a demo can send the same key while this one is running.
    time.sleep(min(float(data.get("delay", 0)), MAX_DELAY))
    answer = {"id": payment.pk, "amount": amount, "currency": payment.currency, "status": "paid"}
    response = JsonResponse(answer, status=201)
    response["Location"] = f"/payments/{payment.pk}"
    return response


@csrf_exempt
@require_http_methods(["GET", "POST"])
def payments(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        return _create(request)
    return JsonResponse({"payments": Payment.objects.count()})
