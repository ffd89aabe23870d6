"""Semaphores, shared leases and lease-checked writes: what each costs over the plain tool.

- A semaphore slot vs a lease, uncontended (one try), and with ``limit - 1`` slots held (the
  expected number of tries grows with the held slots: one round trip per slot tried).
- A shared (reader) lease vs an exclusive one, acquire + release.
- ``save(lease=...)`` vs ``save(fence=...)`` vs a plain ``save()`` of one row.
- The async twins (``aacquire_slot``, ``aacquire(shared=True)``) vs ``aacquire``, on one event
  loop kept for the whole table (each call is one ``run_until_complete``, in every row alike).
All on the database backend, in the same run, keepalive off (its thread is not the point).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from benchmarks.common import Report, interleaved
from demo_project.shop.models import Invoice
from leases import Lease, Slot, aacquire, aacquire_slot, acquire, acquire_slot
from leases.backends import get_backend

TITLE = "limits: semaphore slots, shared leases and lease-checked writes vs their plain forms"


def _held_semaphore(name: str, limit: int) -> list[Slot]:
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
        for holder in holders:
            holder.release()
    report.table("acquire + release, uncontended (per op)", rows)
    _async_table(report)

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


def _async_table(report: Report) -> None:
    loop = asyncio.new_event_loop()

    def on_loop(make: Callable[[], Awaitable[Lease]]) -> Callable[[], None]:
        async def once() -> None:
            held = await make()
            await held.arelease()

        return lambda: loop.run_until_complete(once())

    holders = _held_semaphore("bench:limits:afull", 8)
    try:
        rows = interleaved(
            {
                "aacquire()+arelease()": on_loop(
                    lambda: aacquire("bench:limits:alease", ttl=30, keepalive=False)
                ),
                "aacquire_slot(limit=8), all free": on_loop(
                    lambda: aacquire_slot(
                        "bench:limits:afree", limit=8, ttl=30, keepalive=False, timeout=0
                    )
                ),
                "aacquire_slot(limit=8), 7 of 8 held": on_loop(
                    lambda: aacquire_slot(
                        "bench:limits:afull", limit=8, ttl=30, keepalive=False, timeout=0
                    )
                ),
                "aacquire(shared=True)+arelease()": on_loop(
                    lambda: aacquire("bench:limits:ashared", ttl=30, keepalive=False, shared=True)
                ),
            }
        )
    finally:
        for holder in holders:
            holder.release()
        loop.run_until_complete(get_backend("default").aclose())
        loop.close()
    report.table("async acquire + release, uncontended (per op)", rows)
