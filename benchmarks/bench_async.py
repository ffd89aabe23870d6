"""Async leases: ``alease()`` and the backends' async methods vs the raw async drivers and pottery.

Uncontended acquire + release per operation, on one event loop, everyone on the same servers in
the same run, taking turns in short blocks (medians):

- Redis: the floor is ``redis.asyncio`` sending ``SET NX PX`` then an ``EVALSHA``
  compare-and-delete; pottery's ``AIORedlock`` on 1 and 3 servers; ours through
  ``atry_acquire``/``arelease`` and through ``alease()``, on the redis and redlock backends.
- Database: the floor is the backend's own two statements (acquire upsert, conditional release)
  through a psycopg ``AsyncConnection``, as plain text; the same prepared by psycopg are shown
  beside it (the backend prepares its statements too); ours through the backend and
  ``alease()``.

Redis round trips are counted with ``MONITOR`` (a script's own commands are not round trips).
The goal (issue 13): ``alease()`` within 1.15x of its floor.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import redis
import redis.asyncio
from django.db import connection

from benchmarks.bench_lease import SECRET
from benchmarks.bench_redis import RAW_RELEASE_LUA, configured
from benchmarks.common import WARM, Report, settle
from benchmarks.redis_monitor import round_trips
from devservers import RedisServer
from leases import alease
from leases.backends import get_backend
from leases.backends._waiting_room import room_key
from leases.backends.database import ACQUIRE_SQL, RELEASE_SQL, ROOM_GRACE

TITLE = "async leases: alease() and async backends vs redis.asyncio, psycopg async, AIORedlock"

TTL = 30.0
OPS, ROUNDS, WARMUP = 40, 25, 20
GOAL = 1.15

Op = Callable[[], Awaitable[object]]


async def interleaved(contenders: dict[str, Op]) -> list[tuple[str, float]]:
    """Median seconds per awaited call of each contender, taking turns in a shuffled order
    round by round (as :func:`benchmarks.common.interleaved`)."""
    samples: dict[str, list[float]] = {label: [] for label in contenders}
    for op in contenders.values():
        for _ in range(WARMUP):
            await op()
    turns, order = random.Random(len(contenders)), list(contenders.items())
    for _ in range(ROUNDS):
        turns.shuffle(order)  # see benchmarks.common.interleaved
        for label, op in order:
            settle()
            for _ in range(WARM):  # as settle() warms a sync contender
                await op()
            started = time.perf_counter()
            for _ in range(OPS):
                await op()
            samples[label].append((time.perf_counter() - started) / OPS)
    return [(label, statistics.median(values)) for label, values in samples.items()]


def redis_contenders(url: str, three: list[str]) -> dict[str, Op]:
    from pottery import AIORedlock

    client = redis.asyncio.Redis.from_url(url)
    release = client.register_script(RAW_RELEASE_LUA)
    masters = [redis.asyncio.Redis.from_url(node) for node in three]
    name = f"bench:async:{uuid.uuid4().hex[:8]}"

    async def floor() -> None:
        value = uuid.uuid4().hex
        await client.set(name, value, nx=True, px=int(TTL * 1000))
        await release(keys=[name], args=[value])

    def pottery(servers: list[Any], key: str) -> Op:
        async def run() -> None:
            held = AIORedlock(key=key, masters=set(servers), auto_release_time=TTL)
            await held.acquire(blocking=False)
            await held.release()

        return run

    return {
        "redis.asyncio SET NX PX + EVALSHA compare-and-delete (redis floor)": floor,
        "pottery AIORedlock, 1 server": pottery([client], name + ":pot1"),
        "pottery AIORedlock, 3 servers": pottery(masters, name + ":pot3"),
        **ours("bench-redis", "redis", name),
        **ours("bench-redlock", "redlock 3 servers", name),
    }


def ours(alias: str, label: str, name: str) -> dict[str, Op]:
    store = get_backend(alias)

    async def backend() -> None:
        grant = await store.atry_acquire(f"{name}:{alias}:b", "bench", TTL)
        assert grant is not None
        await store.arelease(grant)

    async def public() -> None:
        async with alease(f"{name}:{alias}:api", ttl=TTL, backend=alias, keepalive=False):
            pass

    async def kept_alive() -> None:
        async with alease(f"{name}:{alias}:ka", ttl=TTL, backend=alias):
            pass

    return {
        f"ours, {label}: atry_acquire + arelease": backend,
        f"ours, {label}: alease(keepalive=False)": public,
        f"ours, {label}: alease() with keepalive": kept_alive,
    }


async def database_contenders() -> dict[str, Op]:
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)  # Django's is a sync cursor class
    raw = await psycopg.AsyncConnection.connect(**params, autocommit=True)
    name = f"bench:async-db:{uuid.uuid4().hex[:8]}"

    async def floor() -> None:
        grant: dict[str, object] = {"name": name, "holder": "bench-floor", "secret": SECRET}
        grant |= {"room": room_key(name), "grace": ROOM_GRACE, "in_room": False}  # as a first try
        async with raw.cursor() as cursor:
            await cursor.execute(ACQUIRE_SQL, {**grant, "ttl": TTL})
            ((token, _),) = await cursor.fetchall()
            await cursor.execute(RELEASE_SQL, {**grant, "token": token})

    async def prepared() -> None:
        grant: dict[str, Any] = {"name": name + ":p", "holder": "bench-floor", "secret": SECRET}
        grant |= {"room": room_key(name + ":p"), "grace": ROOM_GRACE, "in_room": False}
        async with raw.cursor() as cursor:
            await cursor.execute(ACQUIRE_SQL, {**grant, "ttl": TTL}, prepare=True)
            ((token, _),) = await cursor.fetchall()
            await cursor.execute(RELEASE_SQL, {**grant, "token": token}, prepare=True)

    return {
        "psycopg AsyncConnection, the backend's 2 statements (database floor)": floor,
        "psycopg AsyncConnection, the same 2 statements prepared (for comparison)": prepared,
        **ours("default", "database", name),
    }


def main(report: Report) -> None:
    nodes = [RedisServer().start() for _ in range(3)]
    loop = asyncio.new_event_loop()
    try:
        urls = [node.url for node in nodes]
        with configured(urls):
            contenders = redis_contenders(os.environ["REDIS_URL"], urls[:3])
            rows = loop.run_until_complete(interleaved(contenders))
            report.table("async, Redis: uncontended acquire + release (median per op)", rows)
            seconds, floor = dict(rows), rows[0][1]
            for label in seconds:
                if label.startswith("ours, redis: alease"):
                    report.note(
                        f"{label}: x{seconds[label] / floor:.2f} the floor (goal <= {GOAL})"
                    )
            pottery = seconds["pottery AIORedlock, 3 servers"]
            redlock = seconds["ours, redlock 3 servers: alease(keepalive=False)"]
            report.note(
                f"pottery AIORedlock 3 servers / ours redlock alease: {pottery / redlock:.2f}x"
            )
            every = [os.environ["REDIS_URL"], *urls]
            for label, op in contenders.items():

                def once(op: Op = op) -> object:
                    return loop.run_until_complete(op())

                trips = round_trips(every, once)
                report.note(f"{label}: {trips} round trips")

            db = loop.run_until_complete(database_contenders())
            rows = loop.run_until_complete(interleaved(db))
            report.table("async, database: uncontended acquire + release (median per op)", rows)
            seconds, floor = dict(rows), rows[0][1]
            for label in seconds:
                if label.startswith("ours, database: alease"):
                    report.note(
                        f"{label}: x{seconds[label] / floor:.2f} the floor (goal <= {GOAL})"
                    )
            for alias in ("bench-redis", "bench-redlock", "default"):
                loop.run_until_complete(get_backend(alias).aclose())
    finally:
        loop.close()
        for node in nodes:
            node.destroy()
