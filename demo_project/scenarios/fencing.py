"""Fencing tokens: workers in separate processes update one Invoice under a lease.

First three workers take turns (the lease serialises them, each write carries a greater
token). Then Kleppmann's scenario: worker A checks its lease, and is paused (SIGSTOP, as a long
GC pause would) right before writing; its lease expires, worker B takes over and writes; A
resumes and writes with its old token. The invoice refuses that write (StaleFencingToken) and
A learns it lost the lease; B's write stands.

Each worker is this module run as a child process (``python -m demo_project.scenarios.fencing
ROLE ...``), reporting what it does as JSON lines on stdout.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

ORDER = 20
TITLE = "Fencing tokens: a paused worker's late write is rejected"

TTL = 1.5
NUMBER = "INV-FENCE-0001"
LEASE = f"invoice:{NUMBER}"
LINES = (1200, 350, 99)


# --- the worker (child process) ---------------------------------------------------------------


def _emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def _worker(role: str, worker: str, cents: int) -> None:
    import django

    django.setup()
    from demo_project.shop.models import Invoice
    from leases import LeaseLost, StaleFencingToken, acquire

    held = acquire(LEASE, ttl=TTL, timeout=30, holder=worker)
    _emit("acquired", token=held.token)
    invoice = Invoice.objects.get(number=NUMBER)
    invoice.total_cents += cents
    invoice.last_writer = worker
    if role == "slow":
        invoice.status = Invoice.Status.ISSUED
        held.ensure_held()
        _emit("checked")  # the lease was fine a moment ago; now the parent pauses us
        sys.stdin.readline()
    try:
        invoice.save(fence=held.token)
        _emit("written", total=invoice.total_cents)
    except StaleFencingToken as exc:
        _emit("rejected", offered=exc.offered, stored=exc.stored)
    try:
        held.ensure_held()
        held.release()
        _emit("released")
    except LeaseLost as exc:
        _emit("lost", detail=str(exc))


# --- the scenario (parent) ---------------------------------------------------------------------


class _Worker:
    """A worker process and the events it reported."""

    def __init__(self, role: str, name: str, cents: int) -> None:
        from django.conf import settings

        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, role, name, str(cents)],
            cwd=settings.BASE_DIR,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.events: dict[str, dict[str, Any]] = {}

    def expect(self, event: str, timeout: float = 30) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while event not in self.events:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RuntimeError(f"{self.name} did not report {event!r} in {timeout}s")
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"{self.name} exited before reporting {event!r}")
                data = json.loads(line)
                self.events[data.pop("event")] = data
        return self.events[event]

    def finish(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}")


def _reset_invoice() -> Any:
    from demo_project.shop.models import Invoice

    invoice, _ = Invoice.objects.get_or_create(number=NUMBER, defaults={"customer": "ACME"})
    Invoice.objects.filter(pk=invoice.pk).update(
        total_cents=0, status=Invoice.Status.DRAFT, last_writer=""
    )
    return Invoice.objects.get(pk=invoice.pk)


def _take_turns(say: Callable[[str], None]) -> int:
    workers = [_Worker("add", f"worker-{i}", cents) for i, cents in enumerate(LINES, 1)]
    try:
        for w in workers:
            w.expect("released")
    finally:
        for w in workers:
            w.finish()
    for w in sorted(workers, key=lambda w: w.events["acquired"]["token"]):
        e = w.events
        say(
            f"{w.name} held token {e['acquired']['token']}, added a line, total now "
            f"{e['written']['total'] / 100:.2f}"
        )
    return sum(LINES)


def _pause_and_take_over(say: Callable[[str], None]) -> tuple[_Worker, _Worker, float]:
    slow = _Worker("slow", "worker-A", 10_000)
    try:
        token_a = slow.expect("acquired")["token"]
        slow.expect("checked")
        os.kill(slow.proc.pid, signal.SIGSTOP)
        paused_at = time.monotonic()
        say(f"worker-A holds token {token_a}, checked ensure_held(): fine; about to write...")
        say(f"...and is paused (SIGSTOP, like a long GC pause) past its {TTL:g}s TTL")
        fast = _Worker("add", "worker-B", 500)
        try:
            token_b = fast.expect("acquired")["token"]
            waited = time.monotonic() - paused_at
            say(f"worker-B acquired the expired lease after {waited:.1f}s with token {token_b}")
            total = fast.expect("written")["total"]
            say(f"worker-B wrote the invoice (total {total / 100:.2f}) and released")
        finally:
            fast.finish()
        os.kill(slow.proc.pid, signal.SIGCONT)
        paused = time.monotonic() - paused_at
        say(f"worker-A resumes after {paused:.1f}s, unaware, and writes with token {token_a}")
        assert slow.proc.stdin is not None
        slow.proc.stdin.write("go\n")
        slow.proc.stdin.flush()
        slow.expect("lost")
    finally:
        slow.finish()
    return slow, fast, paused


def run(say: Callable[[str], None]) -> None:
    from demo_project.shop.models import Invoice

    invoice = _reset_invoice()
    say(f"{invoice.number} for {invoice.customer}: total 0.00, token {invoice.fencing_token}")
    say(f"three worker processes add a line each under lease {LEASE!r} (TTL {TTL:g}s)")
    expected = _take_turns(say)

    slow, fast, _ = _pause_and_take_over(say)
    rejected = slow.events.get("rejected")
    if rejected is None or "written" in slow.events:
        raise AssertionError(f"worker-A's stale write was not rejected: {slow.events}")
    say(
        f"the invoice refused it: StaleFencingToken (offered {rejected['offered']}, "
        f"stored {rejected['stored']}); nothing changed"
    )
    say(f"worker-A's ensure_held(): LeaseLost ({slow.events['lost']['detail']})")

    final = Invoice.objects.get(pk=invoice.pk)
    token_b = fast.events["acquired"]["token"]
    if (final.last_writer, final.fencing_token, final.total_cents) != (
        "worker-B",
        token_b,
        expected + 500,
    ):
        raise AssertionError(f"the invoice does not hold worker-B's write: {final!r}")
    say(
        f"final: {final}, last written by {final.last_writer} with token "
        f"{final.fencing_token}: the lease made conflicts rare, the fence made this one harmless"
    )


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
