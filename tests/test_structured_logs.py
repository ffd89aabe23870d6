"""Loss, renewal-failure and fence-rejection records carry their data as ``extra`` fields, so a
JSON formatter ships fields, not sentences to parse (the election records already do)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from prometheus_client import CollectorRegistry

from leases import LeaseLost, StaleFencingToken, acquire, metrics
from leases.operations import force_release
from tests.extra_backends import added_backend
from tests.factories import UserFactory
from tests.lease_backends import lease_backend, lease_name
from tests.testapp.models_fencing import FencedDoc

__all__ = ["lease_backend", "lease_name"]  # fixtures, for pytest


def records(caplog: pytest.LogCaptureFixture, event: str, **about: Any) -> list[Any]:
    """The ``event`` records whose fields match ``about``: a lease another test left to a
    keepalive thread may log its own loss while this test captures (seen under xdist)."""
    return [
        r
        for r in caplog.records
        if getattr(r, "event", None) == event
        and all(getattr(r, field, None) == value for field, value in about.items())
    ]


@pytest.mark.django_db
def test_loss_and_fence_rejections_log_their_fields(
    lease_backend: str, lease_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    operator: Any = UserFactory(username="logs-operator")
    operator.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    held = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    doc = FencedDoc(title="t")
    doc.save(fence=held)
    with caplog.at_level(logging.WARNING, logger="leases"):
        force_release(held.name, backend=held.backend, token=held.token, user=operator, via="t")
        with pytest.raises(StaleFencingToken):
            doc.save(fence=held)
        other = FencedDoc(title="u")
        other.save(fence=7)
        with pytest.raises(StaleFencingToken):
            other.save(fence=6)
        with pytest.raises(LeaseLost):
            held.release()

    (lost,) = records(caplog, "lease_lost", lease=held.name)
    assert (lost.lease, lost.token, lost.backend) == (held.name, held.token, lease_backend)
    assert lost.cause == "revoked" and lost.reason.startswith("revoked: an operator")
    assert lost.holder == held.holder
    resource = f"testapp.FencedDoc(pk={doc.pk!r})"
    (revoked,) = records(caplog, "fence_rejected", resource=resource)
    (stale,) = records(caplog, "fence_rejected", resource=f"testapp.FencedDoc(pk={other.pk!r})")
    assert (revoked.reason, revoked.resource, revoked.offered) == ("revoked", resource, held.token)
    assert (revoked.backend, revoked.lease, revoked.stored) == (lease_backend, held.name, None)
    assert (stale.reason, stale.resource) == ("stale", f"testapp.FencedDoc(pk={other.pk!r})")
    assert (stale.offered, stale.stored) == (6, 7)
    assert (stale.backend, stale.lease) == (None, None)


@pytest.fixture
def own_redis_backend(redis_server: Any) -> Iterator[str]:
    """A Redis backend on a server of this test's own (to pause), quick to time out."""
    config = {"ENGINE": "leases.backends.redis", "URL": redis_server.url, "SOCKET_TIMEOUT": 0.2}
    with added_backend("own-redis", config) as alias:
        yield alias


@pytest.mark.fault
@pytest.mark.django_db(transaction=True)
def test_a_failing_renewal_logs_its_fields_and_is_counted(
    own_redis_backend: str, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    metrics.install(registry)
    try:
        with caplog.at_level(logging.WARNING, logger="leases"):
            held = acquire("logs-renewal", ttl=3, backend=own_redis_backend)
            redis_server.pause()
            try:
                deadline = time.monotonic() + 10
                while not records(caplog, "renew_failed") and time.monotonic() < deadline:
                    time.sleep(0.05)
            finally:
                redis_server.resume()
        failures = registry.get_sample_value(
            "leases_renew_failures_total", {"backend": own_redis_backend}
        )
    finally:
        metrics.uninstall()
        if not held.done:
            with contextlib.suppress(LeaseLost):
                held.release()
    failed = records(caplog, "renew_failed")
    assert failed, "the keepalive never logged a failed renewal"
    first = failed[0]
    assert (first.lease, first.token, first.backend) == (held.name, held.token, own_redis_backend)
    assert first.reason and first.retry_in > 0 and first.remaining >= 0
    assert failures is not None and failures >= len(failed)
