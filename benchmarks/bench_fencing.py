"""Fenced writes: what the fence costs over the same conditional UPDATE sent by hand.

Contenders update one ``Invoice`` row per operation in autocommit on the same server in the same
run: the raw driver and Django's cursor sending the fenced ``UPDATE`` themselves (the floor),
Django's plain ``save()`` (what users pay today, unprotected), and ``save(fence=...)``. Round
trips are counted from libpq's protocol trace (see ``bench_advisory.round_trips``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg
from django.db import connection

from benchmarks.bench_advisory import round_trips
from benchmarks.common import Report, per_op
from demo_project.shop.models import Invoice
from leases import StaleFencingToken, check_fence
from leases.fencing import FENCE_SQL, fence_offer

TITLE = "fencing: save(fence=...) and check_fence vs the same statement sent by hand"

FENCED_UPDATE_SQL = (
    "UPDATE shop_invoice SET total_cents = %s, fencing_token = %s "
    "WHERE id = %s AND fencing_token <= %s"
)
TOKEN = 10


def _invoice() -> Invoice:
    invoice, _ = Invoice.objects.get_or_create(number="BENCH-FENCE", defaults={"customer": "b"})
    Invoice.objects.filter(pk=invoice.pk).update(fencing_token=TOKEN)
    return Invoice.objects.get(pk=invoice.pk)


def _save_rows(invoice: Invoice, raw: psycopg.Connection[Any]) -> list[tuple[str, float]]:
    params = [1, TOKEN, invoice.pk, TOKEN]

    def by_driver() -> None:
        raw.execute(FENCED_UPDATE_SQL, params)

    def by_cursor() -> None:
        with connection.cursor() as cursor:
            cursor.execute(FENCED_UPDATE_SQL, params)

    def fenced_fields() -> None:
        invoice.save(fence=TOKEN, update_fields=["total_cents"])

    return [
        ("psycopg: fenced UPDATE by hand", per_op(by_driver)),
        ("Django cursor: fenced UPDATE by hand", per_op(by_cursor)),
        ("Invoice.save() (unfenced)", per_op(invoice.save)),
        ("Invoice.save(fence=token)", per_op(lambda: invoice.save(fence=TOKEN))),
        ("Invoice.save(fence=token, update_fields=[1 field])", per_op(fenced_fields)),
    ]


def _rejected(invoice: Invoice) -> None:
    with contextlib.suppress(StaleFencingToken):
        invoice.save(fence=TOKEN - 1)


def main(report: Report) -> None:
    invoice = _invoice()
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as raw:
        rows = _save_rows(invoice, raw)
        report.table("one fenced row update, autocommit (per op)", rows)
        report.table("what the fence adds to a model save (per op)", rows[2:4])

        def by_driver() -> None:
            raw.execute(FENCE_SQL, ["bench:fence", TOKEN, *fence_offer(TOKEN).params()]).fetchone()

        report.table(
            "check_fence on a leases_fence row (per op)",
            [
                ("psycopg: the same upsert by hand", per_op(by_driver)),
                ("check_fence(resource, token)", per_op(lambda: check_fence("bench:fence", TOKEN))),
            ],
        )
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    trips = {
        "save(fence) accepted": round_trips(pgconn, lambda: invoice.save(fence=TOKEN)),
        "save(fence) rejected": round_trips(pgconn, lambda: _rejected(invoice)),
        "check_fence accepted": round_trips(pgconn, lambda: check_fence("bench:fence", TOKEN)),
    }
    report.note("round trips: " + ", ".join(f"{name} {count}" for name, count in trips.items()))
