"""Semaphores, shared leases and lease-checked writes: what each costs over the plain tool.

- A semaphore slot vs a lease, uncontended (one try), and with ``limit - 1`` slots held (the
  expected number of tries grows with the held slots: one round trip per slot tried).
- A shared (reader) lease vs an exclusive one, acquire + release.
- ``save(lease=...)`` vs ``save(fence=...)`` vs a plain ``save()`` of one row.
All on the database backend, in the same run, keepalive off (its thread is not the point).
"""

from __future__ import annotations

from benchmarks.common import Report, interleaved
from demo_project.shop.models import Invoice
from leases import acquire, acquire_slot

TITLE = "limits: semaphore slots, shared leases and lease-checked writes vs their plain forms"


def _held_semaphore(name: str, limit: int) -> list[object]:
    return [
        acquire_slot(name, limit=limit, ttl=60, keepalive=False, holder=f"h{i}")
        for i in range(limit - 1)
    ]


def main(report: Report) -> None:
    def plain() -> None:
        acquire("bench:limits:lease", ttl=30, keepalive=False).release()

    def slot(limit: int, name: str) -> None:
        acquire_slot(name, limit=limit, ttl=30, keepalive=False, timeout=0).release()

    holders = _held_semaphore("bench:limits:full", 8)
    try:
        rows = interleaved(
            {
                "acquire()+release()": plain,
                "acquire_slot(limit=8), all free": lambda: slot(8, "bench:limits:free"),
                "acquire_slot(limit=8), 7 of 8 held": lambda: slot(8, "bench:limits:full"),
                "acquire(shared=True)+release()": lambda: acquire(
                    "bench:limits:shared", ttl=30, keepalive=False, shared=True
                ).release(),
            }
        )
    finally:
        for held in holders:
            held.release()  # type: ignore[attr-defined]
    report.table("acquire + release, uncontended (per op)", rows)

    invoice, _ = Invoice.objects.get_or_create(number="BENCH-LIMITS", defaults={"customer": "b"})
    held = acquire("bench:limits:write", ttl=60, keepalive=False)
    try:
        report.table(
            "one row save under a held lease (per op)",
            interleaved(
                {
                    "save()": invoice.save,
                    "save(fence=lease)": lambda: invoice.save(fence=held),
                    "save(lease=lease)": lambda: invoice.save(lease=held),
                    "save(fence=lease, lease=lease)": lambda: invoice.save(fence=held, lease=held),
                }
            ),
        )
    finally:
        held.release()
