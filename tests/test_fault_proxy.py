"""The fault proxy itself, one test per mode, against a real Redis of the test's own.

The lease fault tests trust the proxy to do exactly what its mode says; these prove it does,
with a plain redis-py client, so a failure there is about the library and not the proxy.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from devservers import RedisServer
from devservers.proxy import FaultProxy

pytestmark = pytest.mark.fault


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port) as proxied:
        yield proxied


def client(proxy: FaultProxy, timeout: float = 5.0) -> redis.Redis:
    """A client that never retries behind the test's back."""
    return redis.Redis.from_url(proxy.url(), socket_timeout=timeout, retry=Retry(NoBackoff(), 0))


def test_pass_through_forwards_both_ways(proxy: FaultProxy) -> None:
    r = client(proxy)
    assert r.set("k", "v") and r.get("k") == b"v"
    assert proxy.accepted == 1 and proxy.connections == 1


def test_delay_applies_to_each_direction(proxy: FaultProxy) -> None:
    r = client(proxy)
    r.ping()  # connected before the delay, so only the round trip is timed
    proxy.delay(150)
    started = time.monotonic()
    assert r.ping()
    took = time.monotonic() - started
    assert took >= 0.3 * 0.95, f"a round trip through 150 ms each way took only {took:.3f}s"
    proxy.pass_through()
    # The fastest of a few: one round trip may wait to be scheduled on a loaded machine, but
    # with the delay still in place every one of them would take 0.3 s or more.
    fastest = min(_timed_ping(r) for _ in range(5))
    assert fastest < 0.3, f"the fastest round trip after pass_through took {fastest:.3f}s"


def _timed_ping(r: redis.Redis) -> float:
    started = time.monotonic()
    r.ping()
    return time.monotonic() - started


def test_blackhole_answers_nothing_and_closes_nothing(proxy: FaultProxy) -> None:
    r = client(proxy, timeout=0.5)
    r.ping()
    proxy.blackhole()
    with pytest.raises(redis.TimeoutError):
        r.ping()
    # A new connection is accepted (no refusal, no RST) and as silent.
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=0.5)
    raw.sendall(b"PING\r\n")
    with pytest.raises(TimeoutError):
        raw.recv(10)
    assert proxy.holding == 2  # both requests, held on their way to the server
    raw.close()


def test_blackholed_replies_are_delivered_late_when_it_lifts(
    proxy: FaultProxy, redis_server: RedisServer
) -> None:
    """``replies_only``: the server acts on the request; only its answer is held."""
    r = client(proxy, timeout=10)
    r.ping()
    proxy.blackhole(replies_only=True)
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(r.set("held", "1")))
    thread.start()
    direct = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 5
    while direct.get("held") is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert direct.get("held") == b"1", "the request never reached the server"
    thread.join(0.3)
    assert thread.is_alive() and not got, "the reply got through the blackhole"
    assert proxy.holding == 1  # the reply, held
    proxy.pass_through()
    thread.join(5)
    assert got == [True]
    assert proxy.holding == 0


def test_drop_next_reply_loses_exactly_one(proxy: FaultProxy) -> None:
    r = client(proxy, timeout=0.5)
    r.ping()
    proxy.drop_next_reply()
    with pytest.raises(redis.TimeoutError):
        r.ping()
    assert proxy.dropped == 1
    fresh = client(proxy)  # the first connection is out of step: a new one works
    assert fresh.ping() and fresh.ping()
    assert proxy.dropped == 1


def test_reset_all_sends_rst_to_every_connection(proxy: FaultProxy) -> None:
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    raw.sendall(b"PING\r\n")
    assert raw.recv(10) == b"+PONG\r\n"
    # One redis-py connection, not a client: a client's pool quietly replaces a pooled
    # connection it finds reset before its next command. The proxy's RST lands either at once
    # or only when the next bytes reach the proxy (its pump thread still holds the socket), so
    # a client's ``ping()`` failed or not by timing; this connection fails either way.
    # redis-py leaves its connections' methods unannotated.
    conn = redis.Connection(host="127.0.0.1", port=proxy.port, socket_timeout=5.0)  # type: ignore[no-untyped-call]
    conn.send_command("PING")  # type: ignore[no-untyped-call]
    assert conn.read_response() in (b"PONG", "PONG", True)
    deadline = time.monotonic() + 5
    while proxy.connections < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxy.reset_all() >= 2  # both ours (a client may have opened a spare meanwhile)
    with pytest.raises(ConnectionResetError):
        raw.sendall(b"PING\r\n")
        raw.recv(10)
    raw.close()
    with pytest.raises(redis.ConnectionError):
        conn.send_command("PING")  # type: ignore[no-untyped-call]
        conn.read_response()
    conn.disconnect()  # type: ignore[no-untyped-call]
    assert client(proxy).ping()  # new connections still pass
