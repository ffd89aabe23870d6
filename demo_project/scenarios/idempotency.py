"""Idempotency keys: a payment resent by an impatient client is charged once.

The client posts a payment with an ``Idempotency-Key``, then resends it (the replay, byte for
byte), reuses the key for a different amount (422), and resends a slow payment while it is still
running (409 with Retry-After, then the replay once it finished). Finally a non-HTTP operation
(a refund job run twice) records its result once with ``idempotency_key``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

ORDER = 40
TITLE = "Idempotency keys: a resent payment is charged once"


def _post(key: str, body: dict[str, Any]) -> Any:
    from django.db import connection
    from django.test import Client

    try:
        return Client(HTTP_HOST="localhost").post(
            "/payments/",
            json.dumps(body),
            "application/json",
            HTTP_IDEMPOTENCY_KEY=f'"{key}"',
            HTTP_X_API_KEY="demo-shop-1",  # whose key space (demo_project/payments/scopes.py)
        )
    finally:
        if threading.current_thread() is not threading.main_thread():
            connection.close()


def _show(say: Callable[[str], None], what: str, response: Any) -> None:
    replayed = " (Idempotent-Replayed: true)" if response.has_header("Idempotent-Replayed") else ""
    say(f"{what}: {response.status_code}{replayed} {response.content.decode()}")


def _wait_until_started(key: str) -> None:
    from idempotency.models import IdempotencyKey

    deadline = time.monotonic() + 10
    while not IdempotencyKey.objects.filter(key=key, state="started").exists():
        if time.monotonic() > deadline:
            raise AssertionError("the slow payment never started")
        time.sleep(0.05)


def _conflicts(say: Callable[[str], None]) -> None:
    key = f"demo-slow-{uuid.uuid4()}"
    body = {"amount": 500, "delay": 1.5}
    answers: list[Any] = []
    slow = threading.Thread(target=lambda: answers.append(_post(key, body)))
    slow.start()
    try:
        _wait_until_started(key)
        busy = _post(key, body)
        assert busy.status_code == 409 and busy.has_header("Retry-After"), busy.content
        _show(say, "the same key while the first is still running", busy)
    finally:
        slow.join(30)
    later = _post(key, body)
    assert later.content == answers[0].content and later.has_header("Idempotent-Replayed")
    _show(say, "after it finished, the retry", later)


def _operation(say: Callable[[str], None]) -> None:
    from idempotency import idempotency_key

    job = f"demo-refund-{uuid.uuid4()}"
    results = []
    for attempt in (1, 2):
        with idempotency_key(job, scope="demo-jobs") as op:
            if not op.replayed:
                op.result = {"refunded_cents": 250, "run": attempt}
        results.append((op.replayed, op.result))
    assert results[0] == (False, {"refunded_cents": 250, "run": 1})
    assert results[1] == (True, {"refunded_cents": 250, "run": 1})
    say(f"a refund job run twice with key {job!r}: ran once, the re-run got {results[1][1]}")


def run(say: Callable[[str], None]) -> None:
    from demo_project.payments.models import Payment

    before = Payment.objects.count()
    key = f"demo-{uuid.uuid4()}"
    first = _post(key, {"amount": 1000, "currency": "EUR"})
    assert first.status_code == 201, first.content
    _show(say, f'POST /payments/ with Idempotency-Key: "{key}"', first)
    again = _post(key, {"amount": 1000, "currency": "EUR"})
    assert again.content == first.content and again["Idempotent-Replayed"] == "true"
    _show(say, "the client resends it (timeout, retry button)", again)
    other = _post(key, {"amount": 2000, "currency": "EUR"})
    assert other.status_code == 422, other.content
    _show(say, "the same key for a different amount", other)
    _conflicts(say)
    made = Payment.objects.count() - before
    assert made == 2, f"{made} payments were made for 2 distinct keys"
    say(f"6 requests, 2 keys: {made} payments in the database")
    _operation(say)
