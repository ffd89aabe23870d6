"""Semaphores, readers/writer and lease-checked writes, on the database backend.

1. Six exports of one tenant start at once under ``semaphore(limit=3)``: never more than three
   run, each holds a slot with its own token.
2. Two readers hold ``catalog`` together; a writer waits and stops a late reader; when the
   readers leave the writer gets a token above both, and once it has fenced the invoice a
   reader-era write is refused.
3. A lease expires on the database clock while its holder still believes it holds it (as if it
   were paused right after its own check): a fenced save would still land, nobody newer has
   written; a lease-checked save is refused in its own statement.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

ORDER = 25
TITLE = "Semaphores, readers/writer and lease-checked writes"


def _exports(say: Callable[[str], None]) -> None:
    from leases import semaphore

    name = f"export:tenant-{uuid.uuid4().hex[:6]}"
    running: list[int] = []
    most = [0]
    guard = threading.Lock()

    def export(index: int) -> None:
        with semaphore(name, limit=3, ttl=10, timeout=30) as slot:
            with guard:
                running.append(index)
                most[0] = max(most[0], len(running))
                say(f"  export {index} runs in slot {slot.slot} (token {slot.token})")
            time.sleep(0.3)
            with guard:
                running.remove(index)

    threads = [threading.Thread(target=export, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert most[0] == 3, f"expected at most 3 at once, saw {most[0]}"
    say(f"six exports, never more than {most[0]} at once")


def _readers_and_writer(say: Callable[[str], None]) -> None:
    from demo_project.shop.models import Invoice
    from leases import LeaseUnavailable, StaleFencingToken, acquire

    name = f"catalog:{uuid.uuid4().hex[:6]}"
    invoice = Invoice.objects.create(number=f"INV-RW-{uuid.uuid4().hex[:6]}", customer="demo")
    readers = [acquire(name, ttl=10, shared=True, holder=f"reader-{i}") for i in (1, 2)]
    say(f"  two readers hold {name!r} together (tokens {[r.token for r in readers]})")
    invoice.save(fence=readers[0])
    got = []
    writer = threading.Thread(
        target=lambda: got.append(acquire(name, ttl=10, timeout=30, holder="writer"))
    )
    writer.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            late = acquire(name, ttl=10, shared=True, timeout=0, holder="late-reader")
        except LeaseUnavailable:
            say("  a writer waits: a late reader is held back")
            break
        late.release()
        time.sleep(0.05)
    for reader in readers:
        reader.release()
    writer.join(timeout=30)
    (held,) = got
    say(f"  the readers left; the writer holds it with token {held.token}")
    invoice.save(fence=held)
    try:
        invoice.save(fence=readers[0].token)
        raise AssertionError("a reader-era write got through the writer's fence")
    except StaleFencingToken as exc:
        say(f"  a reader-era write (token {exc.offered}) is refused: stored {exc.stored}")
    held.release()


def _lease_checked(say: Callable[[str], None]) -> None:
    from django.db import connections

    from demo_project.shop.models import Invoice
    from leases import LeaseCheckFailed, acquire

    held = acquire(f"invoice:{uuid.uuid4().hex[:6]}", ttl=30, keepalive=False)
    invoice = Invoice.objects.create(number=f"INV-LC-{uuid.uuid4().hex[:6]}", customer="demo")
    invoice.save(fence=held, lease=held)
    private = connections.create_connection("default")
    try:
        with private.cursor() as cursor:  # the database clock says: expired
            cursor.execute(
                "UPDATE leases_lease SET expires_at = clock_timestamp() WHERE name = %s",
                [held.name],
            )
    finally:
        private.close()
    say(
        f"  the lease expired on the database clock; the holder thinks {held.remaining():.0f}s left"
    )
    invoice.status = Invoice.Status.ISSUED
    try:
        invoice.save(lease=held)
        raise AssertionError("a lease-checked save landed after the lease expired")
    except LeaseCheckFailed:
        say("  lease-checked save: refused in its own statement, nothing written")
    invoice.save(fence=held)
    say("  fenced save: accepted (nobody newer has written) - the check is the stronger one")


def run(say: Callable[[str], None]) -> None:
    _exports(say)
    _readers_and_writer(say)
    _lease_checked(say)
