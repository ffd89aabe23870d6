"""``manage.py check --deploy`` reports Redis stores that can lose leases; plain checks never
talk to a store."""

from __future__ import annotations

import pytest
import redis
from django.core.checks import run_checks
from django.test import override_settings

from devservers import RedisServer
from leases.checks import check_backend_stores

pytestmark = pytest.mark.django_db


def leases_on(*urls: str) -> dict[str, object]:
    return {
        "BACKENDS": {
            "default": {"ENGINE": "leases.backends.database"},
            "redis": {"ENGINE": "leases.backends.redis", "URL": urls[0], "SOCKET_TIMEOUT": 0.5},
            "redlock": {"ENGINE": "leases.backends.redlock", "NODES": list(urls)},
        }
    }


def ids(messages: list[object]) -> list[str]:
    return sorted(str(getattr(m, "id", "")) for m in messages)


@pytest.mark.fault
def test_evicting_policy_is_a_deploy_warning(redis_server: RedisServer) -> None:
    with override_settings(LEASES=leases_on(redis_server.url)):
        redis.Redis.from_url(redis_server.url).config_set("maxmemory-policy", "volatile-lru")
        messages = check_backend_stores()
    # One for the redis backend; the one-node Redlock gets two (policy, too few nodes).
    assert ids(messages) == ["leases.W003"] * 3
    assert all("volatile-lru" in m.msg or "node" in m.msg for m in messages)


def test_unreachable_store_is_a_deploy_error_and_never_checked_otherwise() -> None:
    dead = RedisServer().url  # never started
    with override_settings(LEASES=leases_on(dead)):
        assert ids(check_backend_stores()) == ["leases.E003", "leases.E003"]
        assert not [m for m in run_checks() if str(m.id).startswith("leases.")]
