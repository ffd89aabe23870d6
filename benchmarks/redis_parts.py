"""Where the Redis backend's scripts spend their server time, part by part.

``python -m benchmarks.redis_parts``: on a throwaway ``redis-server``, the acquire and release
scripts run as shipped and with parts cut out (the replication-id probe, the fencing counter,
the secret's hash, the wake-up), beside the floor's ``SET NX PX`` and compare-and-delete.
Each acquire is a grant (the lock is deleted natively after it), each release a successful
compare-and-delete (the lock is set natively before it), so ``EVALSHA``'s time per call in
``INFO commandstats`` is the script's own (its commands included). Variants take turns in a
shuffled order every round, as in :func:`~benchmarks.common.interleaved`; medians. A cut
variant is a price tag, not a proposal: most of what it removes keeps tokens monotonic.
"""

from __future__ import annotations

import hashlib
import os
import random
import statistics
import sys
from collections.abc import Callable
from typing import Any

import redis

from benchmarks.bench_redis import RAW_RELEASE_LUA
from devservers import RedisServer
from leases.backends._redis_protocol import ACQUIRE_LUA, MAX_COUNTER
from leases.backends._redis_scripts import RELEASE_LUA, lua

OPS, ROUNDS = 2000, 11
_PROBE = "run = string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)') or ''"
_VALUE = "string.format('%d:%d:%s:%s', epoch, counter, redis.sha1hex(ARGV[5]), ARGV[1])"
_WAKE_START = "  local wake_left"
_NO_FENCE = lua("""
local current = redis.call('GET', KEYS[1])
if current then return {BUSY, current, ''} end
local value = string.format('%d:%d:%s:%s', 1, 1, redis.sha1hex(ARGV[5]), ARGV[1])
redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2])
return {OK, value, ''}
""")
_BARE = lua("""
local current = redis.call('GET', KEYS[1])
if current then return {BUSY, current, ''} end
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
return {OK, ARGV[1], ''}
""")


def _cut(text: str, old: str, new: str) -> str:
    if old not in text:
        raise SystemExit(f"the script changed: {old!r} not found, update {__name__}")
    return text.replace(old, new)


def _without_wake(text: str) -> str:
    start = text.index(_WAKE_START)
    end = text.index("  end\n", text.index("PEXPIRE", start)) + len("  end\n")
    return text[:start] + text[end:]


#: Acquire variants: (script, whether the connection's replication id is sent).
ACQUIRES: dict[str, tuple[str, bool]] = {
    "acquire as shipped (probe read)": (ACQUIRE_LUA, False),
    "acquire, id trusted (no INFO)": (ACQUIRE_LUA, True),
    "acquire, no INFO, no secret hash": (_cut(ACQUIRE_LUA, _VALUE, "ARGV[5]"), True),
    "acquire, no fencing counter, no INFO": (_NO_FENCE, False),
    "GET + SET NX PX in a script": (_BARE, False),
    "an empty script (return 1)": ("return 1", False),
}
RELEASES: dict[str, str] = {
    "release as shipped": RELEASE_LUA,
    "release, no wake-up": _without_wake(RELEASE_LUA),
    "floor's compare-and-delete": RAW_RELEASE_LUA,
}


def _evalsha(admin: Any) -> tuple[int, int]:
    stats = admin.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("usec", 0)), int(stats.get("calls", 0))


def measure(url: str) -> dict[str, float]:
    """Median µs of script time per call of every variant."""
    client = redis.Redis.from_url(url)
    replid = client.info("replication")["master_replid"]
    lock, fence, wake = "parts:{n}:lock", "parts:{n}:fence", "parts:{n}:wake"
    secret = "s" * 32
    first = client.register_script(ACQUIRE_LUA)
    base = ["h", 30000, "0", MAX_COUNTER, secret, "bench"]
    nonce = first(keys=[lock, fence], args=base)[3].decode()  # a reservation, then an epoch
    first(keys=[lock, fence], args=[*base[:2], f"1:{nonce}", *base[3:]])
    client.delete(lock)

    def acquire(text: str, trusted: bool) -> Callable[[], object]:
        script = client.register_script(text)
        args = [*base, replid if trusted else ""]

        def run() -> None:
            script(keys=[lock, fence], args=args)
            client.delete(lock)

        return run

    def release(text: str) -> Callable[[], object]:
        script = client.register_script(text)
        value = f"1:5:{hashlib.sha1(secret.encode(), usedforsecurity=False).hexdigest()}:h"
        floor = text == RAW_RELEASE_LUA
        keys: list[str] = [lock] if floor else [lock, wake]
        args: list[str | int] = [value] if floor else ["1:5:", "h", secret, 5000]

        def run() -> None:
            client.set(lock, value, px=30000)
            assert script(keys=keys, args=args) == 1

        return run

    runs = {label: acquire(*variant) for label, variant in ACQUIRES.items()}
    runs |= {label: release(text) for label, text in RELEASES.items()}
    samples: dict[str, list[float]] = {label: [] for label in runs}
    order, turns = list(runs.items()), random.Random(len(runs))
    for _ in range(ROUNDS):
        turns.shuffle(order)
        for label, run in order:
            usec, calls = _evalsha(client)
            for _ in range(OPS):
                run()
            after_usec, after_calls = _evalsha(client)
            samples[label].append((after_usec - usec) / (after_calls - calls))
    sets = client.info("commandstats")["cmdstat_set"]
    medians = {label: statistics.median(values) for label, values in samples.items()}
    medians["a plain SET (every SET of the run, natively)"] = sets["usec"] / sets["calls"]
    return medians


def main() -> int:
    server = RedisServer().start()
    try:
        figures = measure(server.url)
    finally:
        server.destroy()
    print(f"µs of server time per call (INFO commandstats), load {os.getloadavg()[0]:.2f}:")
    for label, usec in figures.items():
        print(f"  {usec:6.2f}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
