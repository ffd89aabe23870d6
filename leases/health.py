"""A django-health-check check for a lease backend (the ``health`` extra).

A lease store can fail in two ways a load balancer or an on-call engineer should hear about
before a lease does: it stops answering (every acquire fails), or it answers but is configured
so that it may break the lease contract (a Redis that evicts keys under memory pressure, a
PostgreSQL without durable commits, a Redlock with fewer than three nodes): those are what
each backend's ``store_checks()`` and ``deploy_checks()`` report, the lists ``manage.py check
--deploy`` prints.

Reachability is one cheap read, ``probe()`` of a name nobody holds (a round trip to each store
a grant needs: the Redis backend's epoch database too), and writes nothing. Wire it into
django-health-check's view, once per alias::

    path("ht/", HealthCheckView.as_view(checks=[
        "health_check.checks.Database",
        ("leases.health.LeaseBackendHealth", {"alias": "default"}),
        ("leases.health.LeaseBackendHealth", {"alias": "redis"}),
    ])),

The second kind is the store's state, the same for every app server: a load balancer fed it
takes them all out at once while the store answers. Give a load balancer
``{"alias": "default", "deploy": False}`` (reachability alone), and the full check to whoever
can fix the store.

The messages name the alias and the problem, never a URL (which may carry a password);
the exception behind an unreachable store is logged under ``leases.health`` instead.
"""

from __future__ import annotations

import dataclasses
import logging

from ._extras import extra_required
from .backends import get_backend

with extra_required(__name__, "health", "health_check"):
    from health_check.base import HealthCheck
    from health_check.exceptions import ServiceUnavailable

__all__ = ["PROBE_NAME", "LeaseBackendHealth"]

logger = logging.getLogger(__name__)

#: The name whose state the check reads: any valid name works, nobody needs to hold it.
PROBE_NAME = "leases-health-probe"


@dataclasses.dataclass
class LeaseBackendHealth(HealthCheck):  # type: ignore[misc]  # health_check ships no types
    """Unavailable when the ``alias`` backend does not answer or reports deploy problems."""

    alias: str = "default"
    #: ``False``: reachability only (the probe read), for a load balancer. The deploy problems
    #: are the store's, shared by every app server: a balancer fed them takes all of them out
    #: at once for a store that is answering.
    deploy: bool = True

    def __repr__(self) -> str:
        """The check's name in django-health-check's report: as before the ``deploy`` option
        for the full check (monitoring keyed on it keeps working), marked when reduced."""
        reduced = "" if self.deploy else ", deploy=False"
        return f"{type(self).__name__}(alias={self.alias!r}{reduced})"

    def run(self) -> None:
        """Synchronous on purpose: django-health-check runs it on a worker thread, and every
        backend client is blocking."""
        try:
            backend = get_backend(self.alias)
            backend.probe(PROBE_NAME)
            problems = backend.store_checks() + backend.deploy_checks() if self.deploy else []
        except Exception as exc:
            logger.warning(
                "lease backend %r failed its health check: %s",
                self.alias,
                exc,
                extra={"event": "health_check_failed", "backend": self.alias},
            )
            raise ServiceUnavailable(
                f"lease backend {self.alias!r} is unreachable or misconfigured"
            ) from exc
        if problems:
            raise ServiceUnavailable(
                f"lease backend {self.alias!r} is unsafe: {'; '.join(map(_without_urls, problems))}"
            )


def _without_urls(problem: str) -> str:
    """A deploy problem with any ``scheme://...`` location cut down to its scheme."""
    return " ".join(
        word.split("://", 1)[0] + "://…" if "://" in word else word for word in problem.split(" ")
    )
