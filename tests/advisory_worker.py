"""A child process for the advisory lock tests: increments a shared counter, racing its peers.

``python -m tests.advisory_worker COUNTER MODE TIMES PAUSE`` where MODE is ``none`` (no lock),
``xact`` (``xact_lock`` in ``atomic()``) or ``session`` (``session_lock`` around ``atomic()``).
Each increment reads the row, sleeps PAUSE seconds (widening the race window), then writes
value + 1: without a lock, concurrent workers overwrite each other's increments.

The worker connects, prints ``ready``, and starts only when a line arrives on stdin, so every
worker races from the same moment however long Django takes to start.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext


def _increment(counter: str, pause: float) -> None:
    from tests.testapp.models_advisory import AdvisoryCounter

    row = AdvisoryCounter.objects.get(name=counter)
    time.sleep(pause)
    AdvisoryCounter.objects.filter(name=counter).update(value=row.value + 1)


def _guards(mode: str, counter: str) -> tuple[Callable[[], AbstractContextManager[object]], ...]:
    """(outside the transaction, inside it) context managers for one increment."""
    from leases import advisory

    name = f"counter:{counter}"
    if mode == "xact":
        return nullcontext, lambda: advisory.xact_lock(name)
    if mode == "session":
        return lambda: advisory.session_lock(name), nullcontext
    if mode == "none":
        return nullcontext, nullcontext
    raise SystemExit(f"unknown mode {mode!r}")


def main(argv: list[str]) -> int:
    counter, mode, times, pause = argv[0], argv[1], int(argv[2]), float(argv[3])
    import django

    django.setup()
    from django.db import connection, transaction

    connection.ensure_connection()
    outer, inner = _guards(mode, counter)
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(times):
        with outer(), transaction.atomic(), inner():
            _increment(counter, pause)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
