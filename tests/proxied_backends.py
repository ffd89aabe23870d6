"""Lease backends that reach their servers through a :class:`devservers.proxy.FaultProxy`.

Each test gets two aliases over the same servers of its own: ``"proxied"`` (the library under
test, every byte through a proxy the test breaks) and ``"direct"`` (the successor and the
inspector, never faulted). One parameter per backend kind; a new backend adds a builder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import connections
from django.test import override_settings

from devservers import RedisServer
from devservers.proxy import FaultProxy

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


_BUILDERS: dict[str, Callable[[pytest.FixtureRequest], tuple[dict[str, Any], Proxied, str]]] = {
    "database": _database,
    "redis": _redis,
    "redlock": _redlock,
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
