"""Throwaway PostgreSQL and Redis servers for the test suite, the demo and the benchmarks.

A top-level private package of the repository, not of the distribution (``pyproject.toml``
packages only ``leases`` and ``idempotency``): the demo must not import from ``tests/``, and the
tests, the demo and the benchmarks need the same servers.
"""

from devservers.servers import (
    PostgresServer,
    RedisServer,
    ServerStartFailed,
    configured_or_throwaway,
    database_settings,
    free_port,
    reachable,
)

__all__ = [
    "PostgresServer",
    "RedisServer",
    "ServerStartFailed",
    "configured_or_throwaway",
    "database_settings",
    "free_port",
    "reachable",
]
