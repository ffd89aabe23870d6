"""Prometheus metrics, read the way Prometheus reads them: an HTTP scrape of the exposition.

Every test installs the metrics into a registry of its own, served by ``prometheus_client``'s
own HTTP server on a free loopback port, then does real work against the real servers and
asserts what the scrape says.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from leases import LeaseLost, LeaseUnavailable, StaleFencingToken, acquire, metrics
from leases.errors import BackendUnavailable
from leases.operations import force_release
from tests.extra_backends import closed_port_backend
from tests.factories import UserFactory
from tests.lease_backends import lease_backend, lease_name
from tests.testapp.models_fencing import FencedDoc

__all__ = ["closed_port_backend", "lease_backend", "lease_name"]  # fixtures, for pytest

Scrape = Callable[[], dict[tuple[str, frozenset[tuple[str, str]]], float]]


@pytest.fixture
def scrape() -> Iterator[Scrape]:
    """Metrics installed into a fresh registry, and a function scraping it over HTTP."""
    registry = CollectorRegistry()
    metrics.install(registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"

    def read() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    try:
        yield read
    finally:
        metrics.uninstall()
        server.shutdown()
        server.server_close()
        thread.join(5)


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_acquires_waits_and_releases_are_measured(
    scrape: Scrape, lease_backend: str, lease_name: str
) -> None:
    first = acquire(lease_name, ttl=10, backend=lease_backend, keepalive=False)
    with pytest.raises(LeaseUnavailable):
        acquire(lease_name, ttl=10, backend=lease_backend, timeout=0, holder="contender")
    releasing = threading.Timer(0.3, first.release)
    releasing.start()
    started = time.monotonic()
    second = acquire(lease_name, ttl=10, backend=lease_backend, timeout=20, holder="contender")
    took = time.monotonic() - started
    second.release()
    # The waiter may be granted before the releasing thread has recorded its release (the
    # store freed the name, the thread had yet to count it): the count is its, so wait for it.
    releasing.join(10)

    samples = scrape()
    backend = {"backend": lease_backend}
    acquired = {**backend, "outcome": "acquired"}
    unavailable = {**backend, "outcome": "unavailable"}
    assert value(samples, "leases_grants_total", **backend) == 2
    assert value(samples, "leases_releases_total", **backend) == 2
    assert value(samples, "leases_acquire_duration_seconds_count", **acquired) == 2
    assert value(samples, "leases_acquire_duration_seconds_count", **unavailable) == 1
    assert 0.3 <= value(samples, "leases_acquire_duration_seconds_sum", **acquired) <= took + 1
    # The first acquire did not wait; the second waited about as long as the holder kept it.
    assert value(samples, "leases_acquire_wait_seconds_bucket", **acquired, le="0.0") == 1
    assert 0.25 <= value(samples, "leases_acquire_wait_seconds_sum", **acquired) <= took
    assert value(samples, "leases_acquire_wait_seconds_count", **unavailable) == 1


def test_an_unreachable_store_is_an_error_outcome(scrape: Scrape, closed_port_backend: str) -> None:
    with pytest.raises(BackendUnavailable):
        acquire("metrics-unreachable", ttl=5, backend=closed_port_backend, timeout=0)
    samples = scrape()
    error = {"backend": closed_port_backend, "outcome": "error"}
    assert value(samples, "leases_acquire_duration_seconds_count", **error) == 1


@pytest.mark.django_db
def test_losses_and_fence_rejections_are_counted(
    scrape: Scrape, lease_backend: str, lease_name: str
) -> None:
    operator: Any = UserFactory(username="metrics-operator")
    operator.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    doc = FencedDoc(title="t")
    doc.save(fence=held)
    force_release(held.name, backend=held.backend, token=held.token, user=operator, via="test")
    with pytest.raises(StaleFencingToken):  # FencingTokenRevoked is one
        doc.save(fence=held)
    with pytest.raises(LeaseLost):
        held.release()
    fresh = FencedDoc(title="u")
    fresh.save(fence=7)
    with pytest.raises(StaleFencingToken):
        fresh.save(fence=6)

    samples = scrape()
    lost = {
        "backend": lease_backend,
        "cause": "revoked",
    }  # not "release_refused": the record says why
    assert value(samples, "leases_lost_total", **lost) == 1
    rejected = "leases_fence_rejections_total"
    assert value(samples, rejected, model="testapp.FencedDoc", reason="revoked") == 1
    assert value(samples, rejected, model="testapp.FencedDoc", reason="stale") == 1
    assert not any("lease" in dict(labels) for _, labels in samples), "no per-name series"


@pytest.mark.django_db
def test_idempotent_replays_and_conflicts_are_counted(scrape: Scrape) -> None:
    client = Client()
    client.session  # an identity, so keyed requests are accepted

    def post(key: str, amount: int) -> Any:
        body = json.dumps({"amount": amount})
        return client.post(
            "/idem/charge/", body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
        )

    assert post("m-1", 1).status_code == 201
    assert post("m-1", 1)["Idempotent-Replayed"] == "true"
    assert post("m-1", 1)["Idempotent-Replayed"] == "true"
    assert post("m-1", 2).status_code == 422

    samples = scrape()
    assert value(samples, "idempotency_replays_total", database="default") == 2
    mismatch = {"database": "default", "reason": "mismatch"}
    assert value(samples, "idempotency_conflicts_total", **mismatch) == 1


def test_install_is_once_per_registry() -> None:
    registry = CollectorRegistry()
    try:
        installed = metrics.install(registry)
        assert metrics.install(registry) is installed
        with pytest.raises(ImproperlyConfigured):
            metrics.install(CollectorRegistry())
    finally:
        metrics.uninstall()
    assert list(registry.collect()) == []
