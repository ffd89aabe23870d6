"""Child processes for the lease fault tests: ``python -m tests.lease_worker MODE ARGS...``.

Every event is one JSON line on stdout with ``time.monotonic()`` (system-wide on Linux, so the
parent can compare it with its own clock). Writes go through the shared fenced register with the
bare token, so only the fence (not the holder's own belief) decides whether they land.

- ``contend ALIAS NAME REGISTER TTL SECONDS``: acquire, write a few times, release, repeat,
  for SECONDS or until a line on stdin.
- ``contenders ALIAS NAME REGISTER TTL SECONDS COUNT``: COUNT ``contend`` processes forked
  after one set-up, all told to stop by one line on stdin.
- ``hold-slot ALIAS NAME REGISTER TTL LIMIT``: ``hold``, with a slot of semaphore NAME; writes go
  to the slot's own register ``REGISTER/<slot>``.
- ``hold-shared ALIAS NAME REGISTER TTL``: ``hold``, as one of the name's readers.
- ``hold ALIAS NAME REGISTER TTL``: acquire and write once, then wait for a line on stdin;
  then write again, try ``ensure_held()`` and ``release()``, and report each outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from typing import Any, cast

#: Set in a forked contender (``contenders``) when told to stop (SIGUSR1).
_told = threading.Event()
#: Whether this contender holds the lease (from the grant until its release is reported).
_holding = [False]


def _on_told(signum: int, frame: object) -> None:
    """SIGUSR1 in a forked contender: stop now unless holding (then after this round), so
    the test need not wait out an acquire's timeout; no write is ever cut short."""
    _told.set()
    if not _holding[0]:
        os._exit(0)


def emit(event: str, **fields: Any) -> None:
    """One JSON line, in one ``write`` (forked contenders share the pipe: a line shorter than
    ``PIPE_BUF`` written at once is never interleaved with another's)."""
    line = json.dumps({"event": event, "at": time.monotonic(), "pid": os.getpid(), **fields})
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def contend(
    alias: str, name: str, register: str, ttl: float, seconds: float, told: threading.Event | None
) -> None:
    from leases import LeaseLost, LeaseUnavailable, acquire
    from tests.checker import record_write

    if told is None:
        # A line on stdin (or its end) says the test has seen what it needed: finish this
        # round (release) and exit, instead of contending for the rest of ``seconds``.
        told = threading.Event()
        stop = told
        threading.Thread(
            target=lambda: (sys.stdin.readline(), cast(object, stop.set())), daemon=True
        ).start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not told.is_set():
        try:
            held = acquire(name, ttl=ttl, backend=alias, timeout=min(2 * ttl, seconds))
        except LeaseUnavailable:
            continue
        _holding[0] = True
        emit("acquired", token=held.token, sent=held.grant.sent_at, holder=held.holder)
        for _ in range(3):
            time.sleep(random.uniform(0, ttl / 6))
            accepted = record_write(register, held.token, held.holder)
            emit("wrote", token=held.token, accepted=accepted)
        try:
            held.release()
            emit("released", token=held.token)
        except LeaseLost as exc:
            emit("lost", token=held.token, detail=str(exc))
        _holding[0] = False
        time.sleep(random.uniform(0, ttl / 10))


def hold(
    alias: str, name: str, register: str, ttl: float, limit: int | None = None, shared: bool = False
) -> None:
    from leases import LeaseError, acquire
    from leases.semaphore import acquire_slot
    from tests.checker import record_write

    if limit is None:
        held = acquire(name, ttl=ttl, backend=alias, timeout=10, shared=shared)
    else:
        held = acquire_slot(name, limit=limit, ttl=ttl, backend=alias, timeout=10)
        register = f"{register}/{held.slot}"
    accepted = record_write(register, held.token, held.holder)
    emit("acquired", token=held.token, holder=held.holder, accepted=accepted, name=held.name)
    sys.stdin.readline()
    outcomes: dict[str, bool | str] = {"write": record_write(register, held.token, held.holder)}
    for action in ("ensure_held", "release"):
        try:
            getattr(held, action)()
            outcomes[action] = "ok"
        except LeaseError as exc:
            outcomes[action] = type(exc).__name__
    emit("resumed", token=held.token, lost=held.lost.is_set(), **outcomes)


def contenders(
    alias: str, name: str, register: str, ttl: float, seconds: float, count: int
) -> None:
    """``count`` ``contend`` processes forked after one ``django.setup()`` (each printing its
    own pid in its events), instead of ``count`` interpreters each importing and setting up
    Django: on a loaded machine that start-up, not the contention, was most of a test's time.

    Forked before any connection or thread exists, so each child opens its own. Each child dies
    with this process (``PR_SET_PDEATHSIG``); a line on stdin tells them all to stop
    (SIGUSR1), and this process exits when they have.
    """
    import ctypes

    import leases  # noqa: F401  (imported once, before forking)
    import tests.checker  # noqa: F401

    signal.signal(signal.SIGUSR1, _on_told)
    assert threading.active_count() == 1, threading.enumerate()
    sys.stdout.flush()
    children = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                contend(alias, name, register, ttl, seconds, _told)
                code = 0
            finally:
                sys.stdout.flush()
                os._exit(code)
        children.append(pid)

    def tell() -> None:
        sys.stdin.readline()
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGUSR1)

    threading.Thread(target=tell, daemon=True).start()
    for child in children:
        os.waitpid(child, 0)


def main(argv: list[str]) -> int:
    import django

    django.setup()
    mode, alias, name, register, ttl, *rest = argv
    if mode == "contend":
        contend(alias, name, register, float(ttl), float(rest[0]), None)
    elif mode == "contenders":
        contenders(alias, name, register, float(ttl), float(rest[0]), int(rest[1]))
    elif mode == "hold-shared":
        hold(alias, name, register, float(ttl), shared=True)
    elif mode == "hold-slot":
        hold(alias, name, register, float(ttl), int(rest[0]))
    else:
        hold(alias, name, register, float(ttl))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
