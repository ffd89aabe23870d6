"""The django-health-check check: healthy on the harness's servers, unhealthy when a backend is
down or configured so that it may break the lease contract. Run through django-health-check's
own view, as a load balancer would see it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from asgiref.sync import async_to_sync
from django.db import connections
from django.test import RequestFactory
from health_check.views import HealthCheckView

from devservers import free_port
from leases import FencingUnavailable, acquire
from leases.backends.etcd import revokes_live_leases
from leases.health import LeaseBackendHealth
from tests.clusters import etcd_member_versions
from tests.extra_backends import added_backend, closed_port_backend
from tests.lease_backends import lease_backend

__all__ = ["closed_port_backend", "lease_backend"]  # fixtures, for pytest


def health(*aliases: str) -> tuple[int, dict[str, str]]:
    """The status and JSON report of django-health-check's view checking ``aliases``."""
    checks = [("leases.health.LeaseBackendHealth", {"alias": alias}) for alias in aliases]
    view: Any = HealthCheckView.as_view(checks=checks)
    response = async_to_sync(view)(RequestFactory().get("/ht/", {"format": "json"}))
    return response.status_code, json.loads(response.content)


def test_every_configured_backend_is_healthy(lease_backend: str) -> None:
    """Except an etcd cluster on a release whose old leader revokes live leases (Debian 12's
    3.4.23): unsafe, the deploy check's reason given, no member's URL."""
    status, report = health(lease_backend)
    versions = etcd_member_versions("etcd").values() if lease_backend == "etcd" else ()
    if any(map(revokes_live_leases, versions)):
        assert status == 500, report
        (unsafe,) = report.values()
        assert "unsafe" in unsafe and "#15247" in unsafe and "127.0.0.1" not in unsafe, unsafe
        return
    assert status == 200, report
    assert report == {f"LeaseBackendHealth(alias={lease_backend!r})": "OK"}


def test_a_backend_at_a_closed_port_is_unavailable(closed_port_backend: str) -> None:
    status, report = health("default", closed_port_backend)
    assert status == 500
    assert report["LeaseBackendHealth(alias='default')"] == "OK"
    failed = report[f"LeaseBackendHealth(alias={closed_port_backend!r})"]
    assert failed.startswith("Unavailable:") and "unreachable" in failed
    assert "redis://" not in failed and "127.0.0.1" not in failed  # never the server's URL


@pytest.fixture
def evicting_backend(redis_server: Any) -> Iterator[str]:
    """A Redis backend whose server may evict any key under memory pressure."""
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.close()
    config = {"ENGINE": "leases.backends.redis", "URL": redis_server.url}
    with added_backend("evicting", config) as alias:
        yield alias


@pytest.mark.django_db
def test_a_backend_that_may_evict_leases_is_unsafe(evicting_backend: str) -> None:
    status, report = health(evicting_backend)
    assert status == 500
    failed = report[f"LeaseBackendHealth(alias={evicting_backend!r})"]
    assert "unsafe" in failed and "allkeys-lru" in failed


@pytest.mark.django_db
def test_a_load_balancers_check_asks_reachability_alone(
    evicting_backend: str, closed_port_backend: str
) -> None:
    """``deploy=False``: the same evicting store answers, so it is healthy (every app server
    would otherwise be taken out at once for the store's setting); an unreachable one still
    fails."""
    checks = [
        ("leases.health.LeaseBackendHealth", {"alias": alias, "deploy": False})
        for alias in (evicting_backend, closed_port_backend)
    ]
    view: Any = HealthCheckView.as_view(checks=checks)
    response = async_to_sync(view)(RequestFactory().get("/ht/", {"format": "json"}))
    report = json.loads(response.content)
    assert response.status_code == 500
    assert report[f"LeaseBackendHealth(alias={evicting_backend!r}, deploy=False)"] == "OK"
    failed = report[f"LeaseBackendHealth(alias={closed_port_backend!r}, deploy=False)"]
    assert "unreachable" in failed


def test_an_unknown_alias_is_unavailable() -> None:
    with pytest.raises(Exception, match="unreachable or misconfigured"):
        LeaseBackendHealth(alias="no-such-backend").run()


@pytest.mark.django_db
@pytest.mark.parametrize("deploy", [False, True])
def test_a_redlock_none_of_whose_nodes_answers_is_unavailable(deploy: bool) -> None:
    """Its probe read dropped the nodes that failed and answered "not held": the load
    balancer's check (``deploy=False``) said healthy while every acquire failed."""
    nodes = [f"redis://127.0.0.1:{free_port()}/0" for _ in range(3)]
    config = {"ENGINE": "leases.backends.redlock", "NODES": nodes, "NODE_TIMEOUT": 0.2}
    with added_backend("redlock-down", config) as alias:
        check = LeaseBackendHealth(alias=alias, deploy=deploy)
        with pytest.raises(Exception, match="unreachable or misconfigured"):
            check.run()


@pytest.fixture
def unreachable_database() -> Iterator[str]:
    """A ``DATABASES`` alias for a PostgreSQL at a closed loopback port."""
    connections.settings["nowhere"] = {
        **connections.settings["default"],
        "HOST": "127.0.0.1",
        "PORT": str(free_port()),
        "OPTIONS": {"connect_timeout": 2},
    }
    try:
        yield "nowhere"
    finally:
        del connections.settings["nowhere"]


@pytest.mark.parametrize("deploy", [False, True])
def test_a_redis_backend_whose_epoch_database_is_down_is_unavailable(
    redis_server: Any, unreachable_database: str, deploy: bool
) -> None:
    """Its probe read Redis alone and said healthy, while every name without an epoch yet
    (every new name, every name after Redis forgot) failed with ``FencingUnavailable``."""
    config = {
        "ENGINE": "leases.backends.redis",
        "URL": redis_server.url,
        "PREFIX": f"epochless-{free_port()}:",
        "EPOCH_DATABASE": unreachable_database,
    }
    with added_backend("epochless", config) as alias:
        with pytest.raises(FencingUnavailable):
            acquire("never-granted-here", ttl=5, backend=alias, keepalive=False)
        check = LeaseBackendHealth(alias=alias, deploy=deploy)
        with pytest.raises(Exception, match="unreachable or misconfigured"):
            check.run()
