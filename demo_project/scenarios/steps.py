"""Multi-step idempotency: a checkout whose worker dies after the charge resumes, never recharges.

A checkout is three steps: charge the card at a payment provider (a stand-in HTTP server in a
process of its own, :mod:`devservers.provider`, which deduplicates by ``Idempotency-Key`` as
Stripe does), record the payment row, send the receipt through the provider. The first worker
is SIGKILLed right after the charge; a second worker retries the same key, skips the recorded
charge, and finishes. The provider's ledger shows one charge and one receipt; the database one
payment.

``python -m demo_project.scenarios.steps KEY PROVIDER_URL [pause]`` is the worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ORDER = 45
TITLE = "Multi-step idempotency: a crash after the charge resumes, never charges twice"

PAUSE_SECONDS = 60


def checkout(key: str, provider: str, pause: Path | None) -> dict[str, Any]:
    """The operation: each step recorded with its effects; outside calls get derived keys."""
    from demo_project.payments.models import Payment
    from devservers.provider import post
    from idempotency import idempotency_key

    with idempotency_key(key, scope="demo-checkout", atomic=False, lock_timeout=1, wait=30) as op:
        if op.replayed:
            return dict(op.result)
        charge = op.step("charge", lambda k: post(provider, "/charges", {"amount": 1200}, k))
        if pause is not None:
            pause.write_text(str(os.getpid()))  # the worker dies here, before the next step
            time.sleep(PAUSE_SECONDS)
        payment = op.step(
            "payment",
            lambda k: Payment.objects.create(amount_cents=1200, description=charge["id"]).pk,
        )
        receipt = op.step("receipt", lambda k: post(provider, "/emails", {"to": "ada"}, k))
        op.result = {"charge": charge["id"], "payment": payment, "receipt": receipt["id"]}
    return dict(op.result)


def _worker(key: str, provider: str, pause: Path | None) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "demo_project.scenarios.steps", key, provider]
    return subprocess.Popen(
        [*command, *([str(pause)] if pause else [])],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run(say: Callable[[str], None]) -> None:
    from demo_project.payments.models import Payment
    from devservers.provider import Provider

    key = f"demo-checkout-{uuid.uuid4()}"
    provider = Provider().start()
    try:
        before = Payment.objects.count()
        with tempfile.TemporaryDirectory() as directory:
            marker = Path(directory, "charged")
            first = _worker(key, provider.url, marker)
            deadline = time.monotonic() + 60
            while not marker.exists() and first.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert marker.exists(), "the first worker never reached the charge"
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(30)
        say(f"worker 1 charged the card for {key!r}, then was SIGKILLed before the next step")
        second = _worker(key, provider.url, None)
        out, _ = second.communicate(timeout=90)
        assert second.returncode == 0, "the retrying worker failed"
        result = json.loads(out)
        say(f"worker 2 retried the key once its lock lapsed: {result}")
        ledger = provider.ledger()
        charges = [c for c in ledger["received"] if c["path"] == "/charges"]
        assert ledger["effects"] == {"/charges": 1, "/emails": 1}, ledger
        assert len(charges) == 1, "the recorded charge step ran again"
        assert Payment.objects.count() - before == 1
        say(
            "the provider made 1 charge and 1 receipt (the charge was never sent again: its step "
            "was recorded); 1 payment row in the database"
        )
    finally:
        provider.stop()


if __name__ == "__main__":
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")
    django.setup()
    pause_at = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    print(json.dumps(checkout(sys.argv[1], sys.argv[2], pause_at)))
