"""Latency against the number of contenders, for each backend and the peer libraries, plotted.

1, 2, 4, 8, 16 and 32 threads of one process contend for one name, each acquiring (blocking,
with a timeout), holding for nothing and releasing, again and again for ``SECONDS``. Plotted:
the median and 90th percentile time from asking to holding, and critical sections per second,
for ours on the database, Redis and Redlock (3 servers), django-pglock's transaction-scoped
advisory lock, python-redis-lock and pottery's Redlock (3 servers). The PNG goes to
``docs/guide/img/contention.png``, shown by the guide's performance page.

Threads, not processes: 32 processes would not fit the 2-core machines the numbers come from,
and every library pays the same GIL. Peers that poll (pottery) show it as latency.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from django.db import connections

from benchmarks.bench_redis import configured
from benchmarks.common import Report
from devservers import RedisServer
from leases import acquire

TITLE = "contention: acquire latency against 1-32 contenders, every backend and peer, plotted"

CONTENDERS = (1, 2, 4, 8, 16, 32)
SECONDS = 1.5
TTL = 30.0
PLOT = Path(__file__).resolve().parent.parent / "docs" / "guide" / "img" / "contention.png"

#: Blocks until it holds ``name`` and returns the function that releases it.
Take = Callable[[str], Callable[[], object]]


def takers(client: Any, three: list[Any]) -> dict[str, Take]:
    import pglock
    import redis_lock
    from pottery import Redlock

    def ours(alias: str) -> Take:
        def take(name: str) -> Callable[[], object]:
            return acquire(name, ttl=TTL, backend=alias, keepalive=False, timeout=30).release

        return take

    def pglock_xact(name: str) -> Callable[[], object]:
        lock = pglock.advisory(name, xact=True)  # opens and commits its own transaction
        lock.__enter__()
        return lambda: lock.__exit__(None, None, None)

    def python_redis_lock(name: str) -> Callable[[], object]:
        held = redis_lock.Lock(client, name, expire=int(TTL))
        held.acquire(blocking=True, timeout=30)
        release: Callable[[], object] = held.release
        return release

    def pottery(name: str) -> Callable[[], object]:
        held = Redlock(key=name, masters=set(three), auto_release_time=TTL)
        held.acquire(blocking=True, timeout=30)
        release: Callable[[], object] = held.release
        return release

    return {
        "ours, database": ours("default"),
        "ours, redis": ours("bench-redis"),
        "ours, redlock (3 servers)": ours("bench-redlock"),
        "django-pglock (xact advisory, no token)": pglock_xact,
        "python-redis-lock": python_redis_lock,
        "pottery Redlock (3 servers)": pottery,
    }


def contend(take: Take, threads: int) -> tuple[list[float], int]:
    """Acquire latencies of ``threads`` threads cycling on one name for ``SECONDS``, and how
    many critical sections they completed."""
    name = f"bench:contention:{uuid.uuid4().hex[:8]}"
    latencies: list[float] = []
    lock = threading.Lock()
    stop_at = [0.0]
    start = threading.Barrier(
        threads, action=lambda: stop_at.__setitem__(0, time.monotonic() + SECONDS)
    )

    def run() -> None:
        mine: list[float] = []
        start.wait()
        try:
            while time.monotonic() < stop_at[0]:
                asked = time.perf_counter()
                release = take(name)
                mine.append(time.perf_counter() - asked)
                release()
        finally:
            connections.close_all()
            with lock:
                latencies.extend(mine)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(SECONDS + 60)
    return latencies, len(latencies)


def plot(results: dict[str, dict[int, tuple[float, float, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, rate) = plt.subplots(1, 2, figsize=(12, 4.8))
    for label, points in results.items():
        xs = sorted(points)
        line = latency.plot(xs, [points[x][0] * 1e3 for x in xs], marker="o", label=label)[0]
        latency.plot(xs, [points[x][1] * 1e3 for x in xs], linestyle=":", color=line.get_color())
        rate.plot(xs, [points[x][2] for x in xs], marker="o", label=label)
    for axes in (latency, rate):
        axes.set_xscale("log", base=2)
        axes.set_xticks(list(CONTENDERS), [str(n) for n in CONTENDERS])
        axes.set_xlabel("contending threads, one name")
        axes.grid(True, which="both", alpha=0.3)
    latency.set_yscale("log")
    latency.set_ylabel("time from asking to holding, ms (median; dotted: p90)")
    rate.set_yscale("log")
    rate.set_ylabel("critical sections per second")
    rate.legend(fontsize=8, loc="lower left")
    figure.suptitle("Lease latency and throughput against contenders (2-core machine)")
    figure.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(PLOT, dpi=90, metadata={"Software": None})
    plt.close(figure)


def main(report: Report) -> None:
    nodes = [RedisServer().start() for _ in range(3)]
    try:
        urls = [node.url for node in nodes]
        client = redis.Redis.from_url(os.environ["REDIS_URL"])
        three = [redis.Redis.from_url(url) for url in urls]
        results: dict[str, dict[int, tuple[float, float, float]]] = {}
        with configured(urls):
            for label, take in takers(client, three).items():
                rows = []
                for threads in CONTENDERS:
                    latencies, done = contend(take, threads)
                    latencies.sort()
                    median = statistics.median(latencies) if latencies else float("nan")
                    p90 = latencies[int(len(latencies) * 0.9)] if latencies else float("nan")
                    results.setdefault(label, {})[threads] = (median, p90, done / SECONDS)
                    rows.append((f"{threads:2d} contenders", median))
                    report.note(
                        f"{label}, {threads} contenders: median {median * 1e3:.2f} ms, "
                        f"p90 {p90 * 1e3:.2f} ms, {done / SECONDS:.0f} critical sections/s"
                    )
                report.table(f"{label}: median time from asking to holding", rows, unit="ms")
        plot(results)
        report.note(f"plot written to {PLOT}")
    finally:
        for node in nodes:
            node.destroy()
