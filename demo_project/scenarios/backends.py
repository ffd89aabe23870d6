"""One story on three backends: PostgreSQL, Redis and Redlock, through the same ``lease()``.

On each backend worker-A takes the lease of an invoice and then stops renewing it, as a process
paused by a long GC or SIGSTOP renews nothing; once the TTL has passed worker-B is granted the
lease with a higher token and writes. A wakes up and writes with its old token: the invoice
refuses it (``StaleFencingToken``), whichever store granted the lease. Only the backend alias
differs between the three runs.

The demo's Redlock runs over three Redis databases of one server so that it needs nothing
more than ``REDIS_URL``; a real deployment gives it three independent servers
(``manage.py check --deploy`` warns below three).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

ORDER = 25
TITLE = "Backends: the same lease() and fence on PostgreSQL, Redis and Redlock"

TTL = 1.0
BACKENDS = {
    "default": "PostgreSQL (leases.backends.database)",
    "redis": "Redis (leases.backends.redis)",
    "redlock": "Redlock over 3 nodes (leases.backends.redlock)",
}


def _invoice(alias: str) -> Any:
    """An invoice per backend: each backend's tokens are its own sequence (Redis tokens carry
    an epoch in their high bits), so one resource is fenced by one backend's leases."""
    from demo_project.shop.models import Invoice

    number = f"INV-{alias.upper()}-0001"
    invoice, _ = Invoice.objects.get_or_create(number=number, defaults={"customer": "ACME"})
    return invoice


def _story(alias: str, say: Callable[[str], None]) -> None:
    from demo_project.shop.models import Invoice
    from leases import LeaseLost, StaleFencingToken, acquire, lease

    invoice = _invoice(alias)
    name = f"invoice:{invoice.number}"
    worker_a = acquire(name, ttl=TTL, backend=alias, timeout=10, keepalive=False, holder="A")
    stale_copy = Invoice.objects.get(pk=invoice.pk)
    time.sleep(TTL + 0.3)  # A is paused: no renewal reaches the store
    with lease(name, ttl=10, backend=alias, timeout=10, holder="B") as worker_b:
        fresh = Invoice.objects.get(pk=invoice.pk)
        fresh.total_cents += 500
        fresh.last_writer = "B"
        fresh.save(fence=worker_b)
    try:
        stale_copy.total_cents += 100
        stale_copy.last_writer = "A"
        stale_copy.save(fence=worker_a.token)  # the number alone: the resource decides
    except StaleFencingToken as exc:
        verdict = f"A's write with token {exc.offered} refused (stored {exc.stored})"
    else:
        raise AssertionError(f"{alias}: the paused holder's write was accepted")
    try:
        worker_a.ensure_held()
    except LeaseLost:
        verdict += "; A's ensure_held() raises LeaseLost"
    else:
        raise AssertionError(f"{alias}: the paused holder still believes it holds the lease")
    final = Invoice.objects.get(pk=invoice.pk)
    if final.last_writer != "B":
        raise AssertionError(f"{alias}: the invoice does not hold B's write: {final!r}")
    say(f"{BACKENDS[alias]}: A token {worker_a.token}, B token {worker_b.token}; {verdict}")


def run(say: Callable[[str], None]) -> None:
    say(f"worker-A holds a {TTL:g}s lease and pauses past it; worker-B takes over and writes")
    for alias in BACKENDS:
        _story(alias, say)
    say("same code on every store: only backend= changed, and the fence held on each")
