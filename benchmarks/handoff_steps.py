"""Where the database backend's hand-off goes: timestamps of each step, not a ``bench_`` topic.

``python -m benchmarks.handoff_steps [N]`` (in the worktree's environment) holds a name, lets
one thread wait for it in the name's waiting room, releases, and stamps each step of the
hand-off on the release's clock: the releaser's statement returns, the waiter's ``NOTIFY``
arrives, its try inside the room is sent and returns, it leaves the room, its ``acquire()``
returns. Medians and p90 over ``N`` hand-offs (default 60), with each step's share. The
steps are found by wrapping the backend's and the room's methods in this process only.

Servers: ``DATABASE_URL`` when reachable, else a throwaway one (``fsync=off``, as the
benchmarks' own: the grant's flush is then a WAL write without ``fdatasync``).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.servers import django_on_servers

STEPS = (
    "release statement returns",
    "NOTIFY seen by the waiter",
    "waiter's try sent",
    "waiter's try returns",
    "waiter left the room",
    "waiter's acquire() returns",
)


def _stamping(stamps: dict[str, float]) -> None:
    """Wrap the steps' methods so each stamps its moment (the first time per hand-off)."""
    from leases.backends import _pgprepared, database
    from leases.backends import _waiting_room as room

    def stamp(step: str) -> None:
        stamps.setdefault(step, time.perf_counter())

    def after(owner: Any, attribute: str, step: str, when: Callable[[Any], bool]) -> None:
        wrapped = getattr(owner, attribute)

        def run(*args: Any, **kwargs: Any) -> Any:
            result = wrapped(*args, **kwargs)
            if when(result):
                stamp(step)
            return result

        setattr(owner, attribute, run)

    after(database.Backend, "release", STEPS[0], lambda _: True)
    after(room.WaitingRoom, "wait", STEPS[1], bool)
    tried = _pgprepared.run_prepared

    def try_inside(*args: Any, **kwargs: Any) -> Any:
        stamp(STEPS[2])
        rows = tried(*args, **kwargs)
        stamp(STEPS[3])
        return rows

    vars(room)["run_prepared"] = try_inside  # the name _waiting_room calls it by
    after(room.WaitingRoom, "_leave", STEPS[4], lambda _: True)


def measure(count: int) -> list[dict[str, float]]:
    """``count`` hand-offs: each step's microseconds after ``release()`` was called."""
    from leases import acquire

    stamps: dict[str, float] = {}
    _stamping(stamps)
    name = f"bench:steps:{uuid.uuid4().hex[:8]}"
    samples = []
    for _ in range(count):
        held = acquire(name, ttl=30, keepalive=False, timeout=10)
        returned: list[float] = []

        def wait(returned: list[float] = returned) -> None:
            mine = acquire(name, ttl=30, keepalive=False, timeout=10)
            returned.append(time.perf_counter())
            mine.release()

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.02)  # the waiter is inside the room by now
        stamps.clear()
        released = time.perf_counter()
        held.release()
        waiter.join(15)
        stamps[STEPS[5]] = returned[0]
        samples.append({step: (at - released) * 1e6 for step, at in stamps.items()})
    return samples


def main(argv: list[str]) -> int:
    count = int(argv[0]) if argv else 60
    with django_on_servers(("DATABASE_URL",)):
        from django.test import override_settings

        backends = {"default": {"ENGINE": "leases.backends.database"}}
        with override_settings(DEBUG=False, LEASES={"BACKENDS": backends}):
            samples = measure(count)
        print(f"{count} hand-offs, microseconds after release() (load {os.getloadavg()[0]:.1f})")
        previous = 0.0
        for step in STEPS:
            values = sorted(sample[step] for sample in samples if step in sample)
            median = statistics.median(values)
            p90 = values[int(len(values) * 0.9)]
            took = median - previous
            print(f"  {step:28s} median {median:7.0f}  p90 {p90:7.0f}  step {took:6.0f}")
            previous = median
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
