"""Child processes for the lease fault tests: ``python -m tests.lease_worker MODE ARGS...``.

Every event is one JSON line on stdout with ``time.monotonic()`` (system-wide on Linux, so the
parent can compare it with its own clock). Writes go through the shared fenced register with the
bare token, so only the fence (not the holder's own belief) decides whether they land.

- ``contend ALIAS NAME REGISTER TTL SECONDS``: acquire, write a few times, release, repeat.
- ``hold-slot ALIAS NAME REGISTER TTL LIMIT``: ``hold``, with a slot of semaphore NAME; writes go
  to the slot's own register ``REGISTER/<slot>``.
- ``hold-shared ALIAS NAME REGISTER TTL``: ``hold``, as one of the name's readers.
- ``hold ALIAS NAME REGISTER TTL``: acquire and write once, then wait for a line on stdin;
  then write again, try ``ensure_held()`` and ``release()``, and report each outcome.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}), flush=True)


def contend(alias: str, name: str, register: str, ttl: float, seconds: float) -> None:
    from leases import LeaseLost, LeaseUnavailable, acquire
    from tests.checker import record_write

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            held = acquire(name, ttl=ttl, backend=alias, timeout=min(2 * ttl, seconds))
        except LeaseUnavailable:
            continue
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
    outcomes = {"write": record_write(register, held.token, held.holder)}
    for action in ("ensure_held", "release"):
        try:
            getattr(held, action)()
            outcomes[action] = "ok"
        except LeaseError as exc:
            outcomes[action] = type(exc).__name__
    emit("resumed", token=held.token, lost=held.lost.is_set(), **outcomes)


def main(argv: list[str]) -> int:
    import django

    django.setup()
    mode, alias, name, register, ttl, *rest = argv
    if mode == "contend":
        contend(alias, name, register, float(ttl), float(rest[0]))
    elif mode == "hold-shared":
        hold(alias, name, register, float(ttl), shared=True)
    elif mode == "hold-slot":
        hold(alias, name, register, float(ttl), int(rest[0]))
    else:
        hold(alias, name, register, float(ttl))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
