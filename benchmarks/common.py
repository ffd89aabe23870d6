"""Timing and reporting shared by every benchmark module.

A benchmark module is ``benchmarks/bench_<topic>.py`` defining ``TITLE`` and
``main(report: Report) -> None``. It times each contender with :func:`per_op` on the same
servers in the same run and hands the numbers to :meth:`Report.table`, which prints ratios to
the first (baseline) row. Numbers are medians of several rounds, so one GC pause or scheduler
hiccup does not decide a comparison.
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

__all__ = ["WARM", "Report", "interleaved", "per_op", "settle"]

#: Untimed calls of a contender between :func:`settle`'s collection and its timed block.
WARM = 2


def settle(fn: Callable[[], object] | None = None, warm: int = WARM) -> None:
    """Collect the garbage the last timed block left, then (given ``fn``) call ``fn`` ``warm``
    times, before the next block starts its clock.

    Contenders take turns in one process, so without this the garbage one of them leaves is
    collected in whichever block comes next: in the Redis benchmark the ratio of ``lease()``
    to the raw floor swung from 0.53 to 1.89 between runs of the same code, the floor's median
    doubling while the same two round trips through our backend did not. A collection walks
    the whole heap (95,000 objects, 23 ms, in the Redis benchmark's process) and leaves the
    caches cold: timed at once after it, a block of 50 Redlock leases (25 ms) ran 5 % slower
    and one of pottery's (100 ms) not measurably, so the contender runs ``warm`` times,
    untimed, first. Each block still pays the young collections its own allocations set off
    while it runs. (``timeit`` goes further and turns the collector off while timing.)
    """
    gc.collect()
    if fn is not None:
        for _ in range(warm):
            fn()


def per_op(
    fn: Callable[[], object],
    *,
    ops: int = 500,
    rounds: int = 5,
    warmup: int = 50,
    max_seconds: float = 10.0,
) -> float:
    """Median seconds per call of ``fn`` over ``rounds`` rounds of ``ops`` calls.

    Bounded by ``max_seconds`` in total, so a slow contender cannot stall the run.
    """
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    budget = time.monotonic() + max_seconds
    for _ in range(rounds):
        done = 0
        start = time.perf_counter()
        while done < ops:
            fn()
            done += 1
            if time.monotonic() > budget:
                break
        samples.append((time.perf_counter() - start) / done)
        if time.monotonic() > budget:
            break
    return statistics.median(samples)


def interleaved(
    contenders: dict[str, Callable[[], object]],
    *,
    ops: int = 100,
    rounds: int = 7,
    warmup: int = 10,
) -> list[tuple[str, float]]:
    """Median seconds per call of each contender, the contenders taking turns round by round.

    On a shared machine load comes in waves; taking turns spreads each wave over every
    contender instead of letting it land on whoever happened to run then. The order of turns
    is shuffled every round (seeded, so a run can be repeated): in a fixed order the first
    contender of every round pays for what the last one left behind (garbage, cold caches,
    background threads), which made a raw-driver floor look twice as slow as the same two
    round trips through a backend. Shuffling spreads what is left behind at random; each
    block starting after :func:`settle` takes the garbage out of it. Rows come back in the
    order given, ready for :meth:`Report.table` (first one is the baseline).
    """
    samples: dict[str, list[float]] = {label: [] for label in contenders}
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    turns = random.Random(len(contenders))
    order = list(contenders.items())
    for _ in range(rounds):
        turns.shuffle(order)
        for label, fn in order:
            settle(fn)
            start = time.perf_counter()
            for _ in range(ops):
                fn()
            samples[label].append((time.perf_counter() - start) / ops)
    return [(label, statistics.median(values)) for label, values in samples.items()]


@dataclass
class Report:
    """Collects result tables and prints them with ratios to the baseline row."""

    out: TextIO = sys.stdout
    tables: list[tuple[str, list[tuple[str, float]]]] = field(default_factory=list)
    #: Command-line options a module may read (``--rows``, ``--keys`` for ``scale``).
    options: dict[str, int | None] = field(default_factory=dict)

    def table(self, title: str, rows: list[tuple[str, float]], unit: str = "us") -> None:
        """Print ``rows`` of (contender, seconds); the first row is the baseline (ratio 1.00)."""
        self.tables.append((title, rows))
        scale = {"us": 1e6, "ms": 1e3, "s": 1.0}[unit]
        base = rows[0][1] if rows and rows[0][1] > 0 else 1.0
        width = max((len(name) for name, _ in rows), default=10)
        print(f"\n{title}", file=self.out)
        for name, seconds in rows:
            print(
                f"  {name:<{width}}  {seconds * scale:10.1f} {unit}   x{seconds / base:5.2f}",
                file=self.out,
            )
        self.out.flush()

    def note(self, text: str) -> None:
        print(f"  {text}", file=self.out)
