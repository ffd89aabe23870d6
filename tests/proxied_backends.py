"""Lease backends that reach their servers through a :class:`devservers.proxy.FaultProxy`.

Each test gets two aliases over the same servers of its own: ``"proxied"`` (the library under
test, every byte through a proxy the test breaks) and ``"direct"`` (the successor and the
inspector, never faulted). One parameter per backend kind; a new backend adds a builder.

etcd and ZooKeeper use the session's cluster (``tests/clusters.py``: started on first use), with
one proxy per member in front of it; the proxied backend is a fresh instance on the proxies'
addresses, so the faults reach only this test's connections, never the cluster's peer traffic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings

from devservers import RedisServer
from devservers.proxy import FaultProxy
from tests.clusters import etcd_ready, zookeeper_ready

__all__ = ["PROXIED_KINDS", "Proxied", "proxied"]


@dataclass
class Proxied:
    """What a test needs: the kind, its proxies (one per server) and the servers."""

    kind: str
    proxies: list[FaultProxy]
    servers: list[Any] = field(default_factory=list)
    #: The longest one call of ``"proxied"`` may wait when no reply comes: its reply timeout
    #: plus a reconnection's timeout, as configured below.
    call_bound: float = 1.0
    alias: str = "proxied"
    direct: str = "direct"

    def each(self, action: Callable[[FaultProxy], object]) -> None:
        for proxy in self.proxies:
            action(proxy)


def _database(request: pytest.FixtureRequest) -> tuple[dict[str, Any], Proxied, str]:
    alias, server = request.getfixturevalue("fault_database")
    proxy = FaultProxy(server.port)
    settings = dict(connections.settings[alias])
    settings["PORT"] = str(proxy.port)
    settings["OPTIONS"] = {**settings.get("OPTIONS", {}), "connect_timeout": 2}
    connections.settings["proxied"] = settings
    backends = {
        "proxied": {
            "ENGINE": "leases.backends.database",
            "DATABASE": "proxied",
            "REQUEST_TIMEOUT": 1.0,
        },
        "direct": {"ENGINE": "leases.backends.database", "DATABASE": alias},
    }
    return backends, Proxied("database", [proxy], [server], call_bound=3.0), "proxied"


def _redis(request: pytest.FixtureRequest) -> tuple[dict[str, Any], Proxied, str]:
    server: RedisServer = request.getfixturevalue("redis_server")
    proxy = FaultProxy(server.port)
    backends = {
        "proxied": {"ENGINE": "leases.backends.redis", "URL": proxy.url(), "SOCKET_TIMEOUT": 0.5},
        "direct": {"ENGINE": "leases.backends.redis", "URL": server.url},
    }
    return backends, Proxied("redis", [proxy], [server]), ""


def _redlock(request: pytest.FixtureRequest) -> tuple[dict[str, Any], Proxied, str]:
    servers: list[RedisServer] = request.getfixturevalue("redis_servers")(3)
    proxies = [FaultProxy(server.port) for server in servers]
    backends = {
        "proxied": {
            "ENGINE": "leases.backends.redlock",
            "NODES": [p.url() for p in proxies],
            "NODE_TIMEOUT": 0.5,
        },
        "direct": {
            "ENGINE": "leases.backends.redlock",
            "NODES": [s.url for s in servers],
            "NODE_TIMEOUT": 0.5,
        },
    }
    return backends, Proxied("redlock", proxies, list(servers)), ""


def _member_proxies(addresses: list[str], kind: str) -> list[FaultProxy]:
    """One proxy per member of the shared cluster (``host:port`` or ``scheme://host:port``);
    skips when the configured cluster is not on loopback (the proxy forwards to loopback only)."""
    proxies = []
    for address in addresses:
        parts = urlsplit(address if "://" in address else f"tcp://{address}")
        if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
            pytest.skip(f"{kind}: the configured cluster ({address}) is not on loopback")
        proxies.append(FaultProxy(parts.port))
    return proxies


def _etcd(request: pytest.FixtureRequest) -> tuple[dict[str, Any], Proxied, str]:
    alias = etcd_ready(request)
    leases: dict[str, Any] = settings.LEASES
    direct = dict(leases["BACKENDS"][alias])
    if any(str(url).startswith("https") for url in direct["ENDPOINTS"]):
        pytest.skip("etcd: the configured cluster uses TLS; the proxied one would need its files")
    proxies = _member_proxies(list(direct["ENDPOINTS"]), "etcd")
    backends = {
        "proxied": {
            **direct,
            "ENDPOINTS": [p.url("http", "") for p in proxies],
            "REQUEST_TIMEOUT": 0.5,
            "CONNECT_TIMEOUT": 0.5,
        },
        "direct": direct,
    }
    # A call tries each member once: 3 x (connect + reply timeout) at most.
    return backends, Proxied("etcd", proxies, call_bound=3.0), ""


def _zookeeper(request: pytest.FixtureRequest) -> tuple[dict[str, Any], Proxied, str]:
    alias = zookeeper_ready(request)
    leases: dict[str, Any] = settings.LEASES
    direct = dict(leases["BACKENDS"][alias])
    hosts = direct["HOSTS"] if isinstance(direct["HOSTS"], str) else ",".join(direct["HOSTS"])
    members, slash, chroot = hosts.partition("/")
    proxies = _member_proxies(members.split(","), "zookeeper")
    backends = {
        "proxied": {
            **direct,
            "HOSTS": ",".join(f"127.0.0.1:{p.port}" for p in proxies) + slash + chroot,
            # The lease's TTL is bounded by the session: a short one (the ensemble allows 1 s
            # to 10 s) makes a blackholed holder lose within a test's few seconds.
            "SESSION_TIMEOUT": 2.0,
            "REQUEST_TIMEOUT": 0.5,
            "CONNECT_TIMEOUT": 5.0,
        },
        "direct": direct,
    }
    # A call waits for at most two requests (a renewal's read and write). It never starts a
    # new client after close(), and a renewal or release that finds its client ended waits
    # for a new one no longer than its grant's validity (SESSION_TIMEOUT at most): that, no
    # longer CONNECT_TIMEOUT, bounds the calls these tests time.
    proxied = backends["proxied"]
    bound = max(2 * proxied["REQUEST_TIMEOUT"], proxied["SESSION_TIMEOUT"])
    return backends, Proxied("zookeeper", proxies, call_bound=bound), ""


_BUILDERS: dict[str, Callable[[pytest.FixtureRequest], tuple[dict[str, Any], Proxied, str]]] = {
    "database": _database,
    "redis": _redis,
    "redlock": _redlock,
    "etcd": _etcd,
    "zookeeper": _zookeeper,
}
#: Backend kinds every proxied fault test runs on; new backends register a builder here.
PROXIED_KINDS = list(_BUILDERS)


@pytest.fixture(params=PROXIED_KINDS)
def proxied(request: pytest.FixtureRequest, transactional_db: None) -> Iterator[Proxied]:
    """Backends ``"proxied"`` and ``"direct"`` of one kind, on servers of this test's own."""
    backends, made, extra_db = _BUILDERS[request.param](request)
    override = override_settings(
        LEASES={"BACKENDS": {"default": {"ENGINE": "leases.backends.database"}, **backends}}
    )
    override.enable()
    try:
        yield made
    finally:
        made.each(FaultProxy.pass_through)
        override.disable()  # closes the backends (and their connections) first
        made.each(FaultProxy.close)
        if extra_db:
            with contextlib.suppress(Exception):
                connections[extra_db].close()
            connections.settings.pop(extra_db, None)
