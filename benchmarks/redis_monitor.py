"""Round trips counted from the wire, for Redis: what ``MONITOR`` shows a call sending.

``MONITOR`` prints every command a server runs, with the client that sent it; commands a Lua
script runs are marked ``lua`` and are not round trips. A marker command sent after the call
tells where its commands end, so nothing depends on how a library structures its calls.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import redis

__all__ = ["round_trips"]


def round_trips(urls: list[str], fn: Callable[[], object]) -> int:
    """Commands ``fn()`` sent to the servers at ``urls`` (summed), scripts' own calls excluded."""
    marker = f"bench-monitor-{uuid.uuid4().hex}"
    monitors = []
    for url in urls:
        markers = redis.Redis.from_url(url)
        markers.ping()  # connected before: its handshake is not fn()'s
        monitor = redis.Redis.from_url(url).monitor()  # type: ignore[no-untyped-call]
        monitor.__enter__()
        monitors.append((markers, monitor))
    try:
        fn()
        total = 0
        for markers, monitor in monitors:
            markers.echo(marker)
            for _ in range(10_000):  # bounded: the marker comes after fn()'s commands
                seen = monitor.next_command()
                if marker in seen["command"]:
                    break
                if seen.get("client_type") != "lua":
                    total += 1
        return total
    finally:
        for _, monitor in monitors:
            monitor.__exit__(None, None, None)
