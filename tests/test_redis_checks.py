"""Redis stores that can lose leases: an evicting policy is a plain ``manage.py check`` warning
(``leases.W004``), the rest is ``--deploy``'s; an unreachable store fails only ``--deploy``."""

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
def test_evicting_policy_is_a_plain_warning_and_few_nodes_a_deploy_one(
    redis_server: RedisServer,
) -> None:
    with override_settings(LEASES=leases_on(redis_server.url)):
        redis.Redis.from_url(redis_server.url).config_set("maxmemory-policy", "volatile-lru")
        plain = [m for m in run_checks() if str(m.id).startswith("leases.")]
        deploy = check_backend_stores()
    # One each for the redis backend and the one-node Redlock, reported once, not again
    # under --deploy, which adds only what it alone can say (too few nodes).
    assert ids(plain) == ["leases.W004"] * 2
    assert all("volatile-lru" in m.msg for m in plain)
    assert ids(deploy) == ["leases.W003"]
    assert "node" in deploy[0].msg


def test_unreachable_store_is_a_deploy_error_and_silent_otherwise() -> None:
    dead = RedisServer().url  # never started
    with override_settings(LEASES=leases_on(dead)):
        assert ids(check_backend_stores()) == ["leases.E003", "leases.E003"]
        assert not [m for m in run_checks() if str(m.id).startswith("leases.")]
