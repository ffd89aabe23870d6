"""Redis stores that can lose leases: an evicting policy is a plain ``manage.py check`` warning
(``leases.W004``), the rest is ``--deploy``'s; an unreachable store fails only ``--deploy``. A
cache alias whose pool is too small for lease traffic is a plain warning too (``leases.W005``)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import django_redis  # type: ignore[import-untyped]
import pytest
import redis
from django.conf import settings
from django.core.checks import run_checks
from django.test import override_settings
from redis.exceptions import MaxConnectionsError

from devservers import RedisServer
from leases import acquire
from leases.backends import get_backend
from leases.backends._redis_io import POOL
from leases.backends.redis import Backend
from leases.checks import check_backend_stores
from leases.errors import BackendUnavailable
from tests.test_backend_checks import DEFAULT_POOL_LIMIT

pytestmark = pytest.mark.django_db


def leases_on(*urls: str) -> dict[str, object]:
    return {
        "BACKENDS": {
            "default": {"ENGINE": "leases.backends.database"},
            "redis": {"ENGINE": "leases.backends.redis", "URL": urls[0], "SOCKET_TIMEOUT": 0.5},
            "redlock": {"ENGINE": "leases.backends.redlock", "NODES": list(urls)},
        }
    }


def ids(messages: Sequence[object]) -> list[str]:
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


def test_past_a_cache_pools_limit_acquires_and_releases_fail_as_the_check_warns(
    redis_server: RedisServer,
) -> None:
    """What ``leases.W005`` warns about, on a real server: a django-redis alias with no
    ``CONNECTION_POOL_KWARGS`` gets redis-py's limit of 100 connections. The connections taken
    here stand for 100 acquires of one process blocked in ``BLPOP`` (each keeps one: with 120
    threads waiting for one name, some of their acquires failed just so); the next acquire, and
    the release that would have woken them, get no connection, and the name stays held. (The
    backend first gives back the connections it keeps between round trips, as if they were
    busy with round trips of other threads.)"""
    if DEFAULT_POOL_LIMIT >= POOL:
        pytest.skip("before redis-py 8 a pool told no limit has none: nothing to run past")
    caches = {
        **settings.CACHES,
        "small": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_server.url},
    }
    backends = {
        "default": {"ENGINE": "leases.backends.database"},
        "redis": {"ENGINE": "leases.backends.redis", "CACHE": "small"},
    }
    name = f"pool-{uuid.uuid4().hex[:8]}"
    with override_settings(CACHES=caches, LEASES={"BACKENDS": backends}):
        (warning,) = [m for m in run_checks() if m.id == "leases.W005"]
        assert "allows 100 connections" in warning.msg
        held = acquire(name, ttl=60, backend="redis", keepalive=False)
        get_backend("redis").close()
        pool = django_redis.get_redis_connection("small").connection_pool
        taken = []
        try:
            with pytest.raises(MaxConnectionsError):
                while True:
                    taken.append(pool.get_connection())
            assert len(taken) == 100
            with pytest.raises(BackendUnavailable) as refused:
                acquire(f"{name}-other", ttl=60, backend="redis", timeout=0, keepalive=False)
            assert isinstance(refused.value.__cause__, MaxConnectionsError)
            with pytest.raises(BackendUnavailable):
                held.release()
        finally:
            for connection in taken:
                pool.release(connection)
        info = get_backend("redis").inspect(name)
        assert info is not None and info.held  # until its TTL: nobody else gets it
        pool.disconnect()


@pytest.mark.django_db(transaction=True)
def test_a_user_whose_acl_refuses_info_fails_the_deploy_check_and_the_probe() -> None:
    """An ACL user without ``INFO`` (``+@all -@dangerous``) passed ``check --deploy`` and the
    health probe, then every acquire failed (the acquire script reads ``INFO replication``);
    the store check called the ACL's refusal of ``CONFIG`` "CONFIG is disabled"."""
    server = RedisServer().start()
    try:
        admin = redis.Redis.from_url(server.url)
        admin.acl_setuser(
            "app", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-@dangerous"]
        )
        url = f"redis://app:pw@127.0.0.1:{server.port}/0"
        backend = Backend("redis-acl", {"URL": url, "PREFIX": f"acl-{uuid.uuid4().hex[:6]}:"})
        try:
            with pytest.raises(BackendUnavailable):
                backend.try_acquire("job", "me", 5.0)
            assert any("may not run INFO" in p for p in backend.deploy_checks())
            with pytest.raises(BackendUnavailable, match="may not run INFO"):
                backend.probe("job")
            assert any("may not run CONFIG GET" in p for p in backend.store_checks())
        finally:
            backend.close()
    finally:
        server.destroy()
