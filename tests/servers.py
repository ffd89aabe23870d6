"""Moved to :mod:`devservers` (the demo and benchmarks use it too, and must not import tests).

Kept so that branches written against the old path still import; new code imports
``devservers``.
"""

from devservers import (
    PostgresServer,
    RedisServer,
    configured_or_throwaway,
    database_settings,
    free_port,
    reachable,
)

__all__ = [
    "PostgresServer",
    "RedisServer",
    "configured_or_throwaway",
    "database_settings",
    "free_port",
    "reachable",
]
