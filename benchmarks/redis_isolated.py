"""The Redis benchmark's goal rows, each contender timed alone in a process of its own: the
check that the benchmark's ratios are not artifacts of the one process its contenders share.
Not a ``bench_`` topic.

``python -m benchmarks.redis_isolated [--rounds N] [--seconds S]`` (in the worktree's
environment) starts a fresh Python process per contender and round, contenders alternating,
each timing blocks of :data:`~benchmarks.bench_redis.OPS` calls for ``S`` seconds (the
median block is its figure). In a process of its own every garbage collection a contender
waits for is one its own allocations set off, and nothing another contender left behind
lands in its blocks: what ``benchmarks.common.settle`` approximates in the shared process.
It prints each round's ratios of the goal rows: ``lease()`` to the raw floor (goal at most
1.10) and pottery's Redlock on three servers to ours (goal at least 3).

Servers: ``DATABASE_URL`` / ``REDIS_URL`` when reachable, else throwaway ones, and three
throwaway Redis nodes for the Redlock rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.arguments import at_least, positive_seconds
from benchmarks.servers import django_on_servers
from devservers import RedisServer

FLOOR = "raw redis-py SET NX PX + EVALSHA compare-and-delete (floor)"
POTTERY = "pottery Redlock, 3 servers"
OURS_REDLOCK = "ours, redlock 3 servers: lease(keepalive=False)"
LABELS = (
    FLOOR,
    "ours, redis: lease(keepalive=False)",
    "ours, redis: lease() with keepalive",
    POTTERY,
    OURS_REDLOCK,
)


def _one(label: str, seconds: float) -> float:
    """In the child: median seconds per call of ``label``, built as ``bench_redis`` builds it."""
    import django
    import redis

    django.setup()
    from benchmarks import bench_redis

    urls = json.loads(os.environ["REDLOCK_NODES_JSON"])
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    three = [redis.Redis.from_url(url) for url in urls]
    with bench_redis.configured(urls):
        contenders = {
            **bench_redis.floor_and_peers(client, three),
            **bench_redis.ours("bench-redis", "redis"),
            **bench_redis.ours("bench-redlock", "redlock 3 servers"),
        }
        fn = contenders[label]
        for _ in range(bench_redis.WARMUP):
            fn()
        blocks = []
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            started = time.perf_counter()
            for _ in range(bench_redis.OPS):
                fn()
            blocks.append((time.perf_counter() - started) / bench_redis.OPS)
    return statistics.median(blocks)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.redis_isolated")
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--seconds", type=positive_seconds, default=3.0)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child's contender
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one, args.seconds)))
        return 0
    with django_on_servers() as owned:
        nodes = [RedisServer().start() for _ in range(3)]
        owned.extend(nodes)
        env = {**os.environ, "REDLOCK_NODES_JSON": json.dumps([node.url for node in nodes])}
        command = [sys.executable, "-m", "benchmarks.redis_isolated", "--seconds"]
        for round_ in range(args.rounds):
            found: dict[str, float] = {}
            for label in LABELS:
                child = subprocess.run(
                    [*command, str(args.seconds), "--one", label],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=args.seconds + 120,
                )
                found[label] = json.loads(child.stdout.strip().splitlines()[-1])
            ratios = [f"{label}: x{found[label] / found[FLOOR]:.2f}" for label in LABELS[1:3]]
            ratios.append(f"pottery / ours, redlock: {found[POTTERY] / found[OURS_REDLOCK]:.2f}x")
            print(
                f"round {round_}: floor {found[FLOOR] * 1e6:.0f} us; " + "; ".join(ratios),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
