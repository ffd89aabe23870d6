"""The shop's Celery tasks: one per decorator of django-leases (``celery -A demo_project.celery``).

- ``finalise_invoice``: a locked task; its body gets the lease and writes the invoice fenced.
- ``charge_invoice``: an idempotent task; a redelivered charge is applied once.
- ``rebuild_report``: a singleton task; a burst of requests queues one rebuild per customer.
- ``nightly_summary``: a leader-only periodic task; run beat anywhere, the leader sends it.
- ``sync_customer``: a partitioned task; one queue per partition, one consumer per queue.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from django.db.models import F

from idempotency import idempotent_task
from leases import Lease
from leases.celery import leader_only, locked_task, partitioned, singleton_task

from .models import Invoice

#: Every demo task goes to this queue unless it is partitioned: ``CELERY_TASK_ROUTES`` in
#: ``demo_project/settings.py`` routes them there (Celery 5.7 deprecates a task's ``queue``).
QUEUE = "demo-shop"


@locked_task(key="invoice:{number}", ttl=10, busy_backoff=0.05, busy_backoff_max=0.5)
def finalise_invoice(number: str, lease: Lease) -> int:
    """Issue an invoice; bodies for one invoice never overlap, and a stale one cannot write."""
    invoice = Invoice.objects.get(number=number)
    time.sleep(0.1)  # the slow part: rendering, a call to the tax service...
    invoice.status = Invoice.Status.ISSUED
    invoice.last_writer = f"{socket.gethostname()[:60]} token {lease.token}"
    invoice.save(fence=lease)
    return lease.token


@idempotent_task(key="charge:{number}:{charge_id}")
def charge_invoice(number: str, charge_id: str, cents: int) -> int:
    """Add a charge; recorded with its result in one transaction, so a rerun changes nothing."""
    Invoice.objects.filter(number=number).update(total_cents=F("total_cents") + cents)
    return Invoice.objects.get(number=number).total_cents


@singleton_task(key="report:{customer}", ttl=30)
def rebuild_report(customer: str) -> int:
    """An expensive rebuild that one request triggers as well as a hundred."""
    time.sleep(0.5)
    return Invoice.objects.filter(customer=customer).count()


@leader_only(key="demo:nightly-summary", ttl=30)
def nightly_summary() -> dict[str, Any]:
    """Run from several beat processes for availability; only the elected one sends it."""
    return {"invoices": Invoice.objects.count()}


@partitioned(key="{customer}", partitions=4, queue_prefix="demo-customer")
def sync_customer(customer: str) -> str:
    """Sync one customer to the CRM; a customer's syncs run in order on one consumer."""
    return customer
