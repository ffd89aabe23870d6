"""Postgres advisory locks: two processes that want the same lock take turns.

Two worker processes start together and each runs ``with transaction.atomic(),
advisory.xact_lock("demo:nightly-report"):`` around half a second of "work". Each reports on
stdout when it asked for the lock, got it and committed (monotonic clock, shared by processes on
one machine); the parent checks the two holding intervals do not overlap. Then, while the lock
is held, a caller with ``timeout=0.2`` gets ``LeaseUnavailable`` and its transaction stays
usable.

A worker is this module run as a child process: ``python -m demo_project.scenarios.advisory
worker``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ORDER = 10
TITLE = "Advisory locks: two processes serialised by pg_advisory_xact_lock"

LOCK = "demo:nightly-report"
WORK_SECONDS = 0.5
ROOT = Path(__file__).resolve().parents[2]


# --- the worker (child process) ----------------------------------------------------------------


def _worker() -> None:
    import django

    django.setup()
    from django.db import connection, transaction

    from leases import advisory

    connection.ensure_connection()
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
    sys.stdin.readline()  # the parent starts both workers at the same moment
    asked = time.monotonic()
    with transaction.atomic(), advisory.xact_lock(LOCK):
        got = time.monotonic()
        time.sleep(WORK_SECONDS)
    committed = time.monotonic()  # the lock was released by this commit
    print(json.dumps({"event": "done", "asked": asked, "got": got, "released": committed}))


# --- the scenario (parent) ---------------------------------------------------------------------


def _start_worker() -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "demo_project.scenarios.advisory", "worker"],
        cwd=ROOT,
        env=dict(os.environ),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _read(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"worker {proc.pid} exited without reporting (code {proc.wait()})")
    report: dict[str, Any] = json.loads(line)
    return report


def _race(say: Any) -> None:
    workers = [_start_worker(), _start_worker()]
    try:
        pids = [_read(proc)["pid"] for proc in workers]
        say(f"two worker processes (pids {pids[0]} and {pids[1]}) are connected; both now run")
        say(f'  with transaction.atomic(), advisory.xact_lock("{LOCK}"): <{WORK_SECONDS}s work>')
        for proc in workers:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.close()
        reports = sorted(
            (_read(proc) | {"pid": pid} for proc, pid in zip(workers, pids, strict=True)),
            key=lambda r: r["got"],
        )
        for proc in workers:
            proc.wait(timeout=30)
    finally:
        for proc in workers:
            proc.kill()
            proc.wait(timeout=10)
    start = min(r["asked"] for r in reports)
    for r in reports:
        say(
            f"  pid {r['pid']}: asked at {r['asked'] - start:.2f}s, got the lock at "
            f"{r['got'] - start:.2f}s (waited {r['got'] - r['asked']:.2f}s), released it at "
            f"commit, {r['released'] - start:.2f}s"
        )
    first, second = reports
    if second["got"] < first["released"] - 0.05:  # a little slack for clock reads vs commit
        raise AssertionError("the two workers held the lock at the same time")
    say("the holding intervals do not overlap: the second worker waited for the first commit")


def _timeout(say: Any) -> None:
    from django.db import connection, connections, transaction

    from leases import LeaseUnavailable, advisory

    outcome: list[str] = []

    def impatient() -> None:
        try:
            with transaction.atomic():
                try:
                    with advisory.xact_lock(LOCK, timeout=0.2):
                        outcome.append("got the lock?!")
                except LeaseUnavailable as exc:
                    outcome.append(f"LeaseUnavailable: {exc}")
                with connection.cursor() as cursor:  # the transaction is still usable
                    cursor.execute("SELECT 1")
                    outcome.append(f"then SELECT 1 in the same transaction -> {cursor.fetchone()}")
        finally:
            connections.close_all()

    with advisory.session_lock(LOCK):
        say(f'this process now holds session_lock("{LOCK}"); another thread tries timeout=0.2')
        caller = threading.Thread(target=impatient)
        caller.start()
        caller.join(timeout=30)
    for line in outcome:
        say(f"  {line}")
    if not outcome or not outcome[0].startswith("LeaseUnavailable") or len(outcome) != 2:
        raise AssertionError(f"expected a timeout and a usable transaction, got {outcome}")


def run(say: Any) -> None:
    _race(say)
    _timeout(say)


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
