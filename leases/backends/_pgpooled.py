"""What the database backend turns off behind a connection pooler, and what it tells the
operator then.

Whether a connection is behind a pooler is asked by :func:`leases._pgpooler.behind_pooler`
(which :mod:`leases.advisory` asks too); what that means for a *lease backend* is here: its
waiting rooms, tenure locks and ``LISTEN`` are session state, kept only where the backend's
``SESSION_POOLING`` option declares a pooler that keeps each client's server session.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from .._pgpooler import behind_pooler

__all__ = ["keeps_sessions", "warn_pooled", "warn_unheard"]

logger = logging.getLogger("leases")


def keeps_sessions(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], pid: int, session_pooling: bool
) -> bool:
    """Whether session state set on ``conn`` (whose statement ran on server process ``pid``)
    stays with it: connected directly, or through a pooler the backend's ``SESSION_POOLING``
    option declares a session pooler."""
    return session_pooling or not behind_pooler(conn, pid)


def warn_pooled(alias: str) -> None:
    logger.warning(
        "leases: backend %r reaches PostgreSQL through a pooler (its connection's process id "
        "is not its server session's): waiting rooms and tenure locks are off, since a session "
        "lock taken through a transaction pooler can outlive its unlock; give the backend a "
        "DATABASE alias that connects directly for first-come-first-served hand-offs, or set "
        "its SESSION_POOLING option if the pooler keeps each client's server session",
        alias,
    )


def warn_unheard(alias: str) -> None:
    logger.warning(
        "leases: backend %r reaches PostgreSQL through a pooler: its waiters do not LISTEN for "
        "releases (a LISTEN through a transaction pooler is heard by the pooler's other "
        "clients, not by the listener) and retry after their backoff instead; set the "
        "backend's SESSION_POOLING option if the pooler keeps each client's server session",
        alias,
    )
