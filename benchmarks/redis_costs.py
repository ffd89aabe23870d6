"""Where an uncontended Redis acquire + release spends its time: client CPU and server CPU.

On a loaded 2-core machine wall-clock time is mostly waiting to be scheduled, and it moves
with whoever else runs; the CPU each side spends per operation moves much less, and it tells
what a change can still win. Client CPU is this process's (``time.process_time``: the
benchmark is single-threaded while it runs), server CPU is what ``INFO cpu`` reports for the
server (event loop, system calls and scripts), and the replication-id probe is the time
``INFO`` spent inside scripts (``INFO commandstats``; the two ``INFO`` reads of the
measurement itself add a few microseconds over the whole block). Blocks take turns, as in
:func:`~benchmarks.common.interleaved`; medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Costs", "costs"]

#: Per operation, in seconds: client CPU, server CPU, the server's ``INFO`` time.
Costs = tuple[float, float, float]


def _server(admin: Any) -> tuple[float, float]:
    cpu = admin.info("cpu")
    info = admin.info("commandstats").get("cmdstat_info", {})
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"], float(info.get("usec", 0)) / 1e6


def costs(
    admin: Any, contenders: dict[str, Callable[[], object]], *, ops: int = 300, rounds: int = 5
) -> dict[str, Costs]:
    """Median client CPU, server CPU and ``INFO`` time per call of each contender, measured
    on the server ``admin`` talks to (every contender must use only that server)."""
    samples: dict[str, list[Costs]] = {label: [] for label in contenders}
    for _ in range(rounds):
        for label, fn in contenders.items():
            server_before, info_before = _server(admin)
            started = time.process_time()
            for _ in range(ops):
                fn()
            client = time.process_time() - started
            server_after, info_after = _server(admin)
            samples[label].append(
                (
                    client / ops,
                    (server_after - server_before) / ops,
                    (info_after - info_before) / ops,
                )
            )
    return {
        label: (
            statistics.median(s[0] for s in rows),
            statistics.median(s[1] for s in rows),
            statistics.median(s[2] for s in rows),
        )
        for label, rows in samples.items()
    }
