"""Prometheus metrics, fed from the package's signals: call :func:`install` once per process.

Needs the ``prometheus`` extra (``prometheus_client``); nothing else in the package imports this
module, so a project without it never imports ``prometheus_client``. The metrics are counted by
signal receivers, not by calls sprinkled through the lease code: the signals are the one record
of what happened (sent once per fact, from the thread that observed it), so metrics, logs and a
project's own receivers can never disagree, and a process that does not install metrics pays
only the signals' "no receivers" check.

**Labels are bounded on purpose.** Every label value multiplies the series Prometheus stores,
and lease names are unbounded in practice (``invoice-{id}``, ``sync-{tenant}``): a name label
would grow one series per name per metric, forever, until the server runs out of memory. So
labels are only the backend alias (from ``LEASES["BACKENDS"]``), the outcome, the loss cause,
the fenced model and the database alias: values fixed by configuration and code. The lease
name, token, holder, idempotency scope and key are in the logs and spans instead, where each
event is one record and cardinality costs nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.dispatch import Signal

from idempotency import signals as idempotency_signals

from . import signals
from ._extras import extra_required
from .errors import LeaseUnavailable

with extra_required(__name__, "prometheus", "prometheus_client"):
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

__all__ = ["Metrics", "install", "uninstall"]

#: Acquisition latency: one round trip on a healthy store is milliseconds; a contended name
#: waits up to its timeout, so the buckets reach minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
WAIT_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The collectors, and the receivers that feed them from the signals."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.acquire_duration = Histogram(
            "leases_acquire_duration_seconds",
            "Time acquire() took from its first try to a grant or giving up.",
            ["backend", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.acquire_wait = Histogram(
            "leases_acquire_wait_seconds",
            "Part of an acquisition spent waiting for the holder to let go (0: first try won).",
            ["backend", "outcome"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.grants = _counter(
            "leases_grants", "Leases this process came to hold.", registry, "backend"
        )
        self.releases = _counter(
            "leases_releases", "Leases given back by their holder.", registry, "backend"
        )
        self.renewals = _counter(
            "leases_renewals", "Renewals the store accepted.", registry, "backend"
        )
        self.renew_failures = _counter(
            "leases_renew_failures",
            "Renewals that got no answer (retried while the lease is valid).",
            registry,
            "backend",
        )
        self.losses = _counter(
            "leases_lost",
            "Leases lost by their holder, by cause (expired, renewal_refused, ...).",
            registry,
            "backend",
            "cause",
        )
        self.fence_rejections = _counter(
            "leases_fence_rejections",
            "Fenced writes rejected for a stale or revoked token (nothing was written).",
            registry,
            "model",
            "reason",
        )
        self.replays = _counter(
            "idempotency_replays",
            "Duplicate requests answered with the stored outcome.",
            registry,
            "database",
        )
        self.conflicts = _counter(
            "idempotency_conflicts",
            "Keys refused: mismatch (422), in_progress (409) or lost (409).",
            registry,
            "database",
            "reason",
        )
        self._receivers: list[tuple[Signal, Any]] = [
            (signals.lease_acquired, self._acquired),
            (signals.lease_acquire_failed, self._acquire_failed),
            (signals.lease_renewed, self._renewed),
            (signals.lease_renew_failed, self._renew_failed),
            (signals.lease_released, self._released),
            (signals.lease_lost, self._lost),
            (signals.fence_rejected, self._fence_rejected),
            (idempotency_signals.replayed, self._replayed),
            (idempotency_signals.conflict, self._conflict),
        ]

    def connect(self) -> None:
        for signal, receiver in self._receivers:
            signal.connect(receiver, weak=False, dispatch_uid=_uid(receiver))

    def disconnect(self) -> None:
        for signal, receiver in self._receivers:
            signal.disconnect(dispatch_uid=_uid(receiver))

    def unregister(self) -> None:
        for collector in vars(self).values():
            if isinstance(collector, Counter | Histogram):
                self.registry.unregister(collector)

    # -- receivers (sender: the backend alias, except for fence_rejected) ------------------

    def _acquired(self, sender: str, elapsed: float | None, waited: float | None, **_: Any) -> None:
        self.grants.labels(sender).inc()
        self._observe(sender, "acquired", elapsed, waited)

    def _acquire_failed(
        self, sender: str, error: Exception, elapsed: float, waited: float, **_: Any
    ) -> None:
        outcome = "unavailable" if isinstance(error, LeaseUnavailable) else "error"
        self._observe(sender, outcome, elapsed, waited)

    def _observe(
        self, backend: str, outcome: str, elapsed: float | None, waited: float | None
    ) -> None:
        if elapsed is not None:  # None: a grant adopted from another process, not acquired
            self.acquire_duration.labels(backend, outcome).observe(elapsed)
        if waited is not None:
            self.acquire_wait.labels(backend, outcome).observe(waited)

    def _renewed(self, sender: str, **_: Any) -> None:
        self.renewals.labels(sender).inc()

    def _renew_failed(self, sender: str, **_: Any) -> None:
        self.renew_failures.labels(sender).inc()

    def _released(self, sender: str, **_: Any) -> None:
        self.releases.labels(sender).inc()

    def _lost(self, sender: str, cause: str, **_: Any) -> None:
        self.losses.labels(sender, cause).inc()

    def _fence_rejected(self, sender: Any, reason: str, **_: Any) -> None:
        meta = getattr(sender, "_meta", None)
        self.fence_rejections.labels(meta.label if meta else str(sender), reason).inc()

    def _replayed(self, sender: str, **_: Any) -> None:
        self.replays.labels(sender).inc()

    def _conflict(self, sender: str, reason: str, **_: Any) -> None:
        self.conflicts.labels(sender, reason).inc()


def _counter(name: str, documentation: str, registry: CollectorRegistry, *labels: str) -> Counter:
    return Counter(name, documentation, list(labels), registry=registry)


def _uid(receiver: Any) -> str:
    return f"leases.metrics.{receiver.__name__}"


@dataclass
class _Installed:
    metrics: Metrics | None = None


_installed = _Installed()
_lock = threading.Lock()


def install(registry: CollectorRegistry | None = None) -> Metrics:
    """Register the collectors in ``registry`` (default: ``prometheus_client.REGISTRY``) and
    start counting. Call it once per process, e.g. from an ``AppConfig.ready()``.

    Calling it again with the same registry returns the installed :class:`Metrics`; with
    another one it raises ``ImproperlyConfigured``, because one signal counted into two
    registries would be scraped twice. Serve the registry the usual way
    (``prometheus_client.start_http_server``, ``make_wsgi_app``, django-prometheus).
    """
    registry = REGISTRY if registry is None else registry
    with _lock:
        current = _installed.metrics
        if current is not None:
            if current.registry is not registry:
                raise ImproperlyConfigured(
                    "leases.metrics is installed into another registry: uninstall() it first"
                )
            return current
        metrics = Metrics(registry)
        metrics.connect()
        _installed.metrics = metrics
        return metrics


def uninstall() -> None:
    """Stop counting and remove the collectors from their registry (tests, reconfiguration)."""
    with _lock:
        metrics, _installed.metrics = _installed.metrics, None
    if metrics is not None:
        metrics.disconnect()
        metrics.unregister()
