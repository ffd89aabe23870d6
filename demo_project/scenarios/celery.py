"""Celery: two real workers, and one task per decorator of ``leases.celery`` / ``idempotency``.

Two prefork ``celery worker`` processes consume the shop's queues (the demo's Redis is the
broker). Six ``finalise_invoice`` calls for one invoice run one at a time with increasing
tokens; a charge sent three times with one key is applied once; ten concurrent report requests
queue one rebuild; the nightly summary is sent by this process because it wins the election;
and each customer's syncs land on the same partition queue.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ORDER = 50
TITLE = "Celery: locked, idempotent, singleton, leader-only and partitioned tasks"

ROOT = Path(__file__).resolve().parents[2]


def _workers(names: list[str], queues: list[str]) -> list[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "celery", "-A", "demo_project.celery", "worker",
               "-P", "prefork", "-c", "1", "--without-heartbeat", "--without-gossip",
               "--without-mingle", "--loglevel", "WARNING", "-Q", ",".join(queues)]  # fmt: skip
    return [
        subprocess.Popen([*command, "-n", f"{name}@%h"], cwd=ROOT, env=os.environ,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name in names
    ]  # fmt: skip


def _wait_ready(names: list[str], timeout: float = 60) -> None:
    from demo_project.celery import app

    wanted = {f"{name}@{socket.gethostname()}" for name in names}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answered = {k for reply in app.control.ping(timeout=0.5) or [] for k in reply}
        if wanted <= answered:
            return
    raise AssertionError(f"the demo's workers did not start in {timeout}s")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()


def run(say: Callable[[str], None]) -> None:
    from demo_project.shop import tasks
    from demo_project.shop.models import Invoice
    from leases.celery import partition_for, partition_queues, resign_leaderships

    run_id = uuid.uuid4().hex[:6]
    names = [f"demo-a-{run_id}", f"demo-b-{run_id}"]
    procs = _workers(names, [tasks.QUEUE, *partition_queues(tasks.sync_customer)])
    try:
        _wait_ready(names)
        say("two prefork workers consume the shop's queues on the demo's Redis.")
        _locked(say, tasks, Invoice, run_id)
        _idempotent(say, tasks, Invoice, run_id)
        _singleton(say, tasks, run_id)
        summary = tasks.nightly_summary.delay()
        say(f"nightly_summary.delay(): this process won the election, sent it -> {summary.get(30)}")
        resign_leaderships()
        customers = [f"customer-{n}" for n in range(4)]
        for customer in customers:
            assert tasks.sync_customer.delay(customer).get(30) == customer
        placed = ", ".join(f"{c} -> partition {partition_for(c, 4)}" for c in customers)
        say(f"sync_customer routes by a stable hash of the customer: {placed}.")
    finally:
        _stop(procs)


def _locked(say: Callable[[str], None], tasks: object, invoice_model: type, run_id: str) -> None:
    number = f"C-{run_id}"
    invoice_model.objects.create(number=number, customer="ACME")  # type: ignore[attr-defined]
    results = [tasks.finalise_invoice.delay(number) for _ in range(6)]  # type: ignore[attr-defined]
    tokens = [r.get(timeout=60) for r in results]
    assert len(set(tokens)) == 6, tokens
    invoice = invoice_model.objects.get(number=number)  # type: ignore[attr-defined]
    assert invoice.fencing_token == max(tokens)
    say(f"finalise_invoice x6 for {number}: one body at a time, tokens {sorted(tokens)};")
    say(f"the invoice holds the highest token ({invoice.fencing_token}): {invoice.last_writer}.")


def _idempotent(
    say: Callable[[str], None], tasks: object, invoice_model: type, run_id: str
) -> None:
    number = f"C-{run_id}"
    charge = tasks.charge_invoice  # type: ignore[attr-defined]
    first = charge.apply_async((number, "ch-1", 500))
    totals = [first.get(30), charge.apply_async((number, "ch-1", 500), task_id=first.id).get(30),
              charge.delay(number, "ch-1", 500).get(30)]  # fmt: skip
    stored = invoice_model.objects.get(number=number).total_cents  # type: ignore[attr-defined]
    assert totals == [500, 500, 500] and stored == 500, (totals, stored)
    say("charge_invoice sent 3 times with key ch-1 (one a redelivery of the same task id):")
    say(f"every run answered {totals[0]} cents and the invoice total is {stored}: applied once.")


def _singleton(say: Callable[[str], None], tasks: object, run_id: str) -> None:
    rebuild = tasks.rebuild_report  # type: ignore[attr-defined]
    with ThreadPoolExecutor(max_workers=10) as pool:
        ids = set(pool.map(lambda _: rebuild.delay(f"ACME-{run_id}").id, range(10)))
    assert len(ids) == 1, ids
    say(f"rebuild_report.delay() x10 at once -> one task ({next(iter(ids))[:8]}...) queued.")
