"""Plain ``manage.py check`` catches a misconfigured backend, asking its class, never a store;
``check --deploy`` reports instead of crashing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.core.checks import CheckMessage, run_checks
from django.db import connections
from django.test import override_settings

from leases import acquire
from leases.admin import database_backend_alias
from leases.backends._redis_io import POOL
from leases.checks import check_advisory_database, check_backends
from leases.errors import BackendUnavailable, LeasesImproperlyConfigured

pytestmark = pytest.mark.django_db

DATABASE = {"ENGINE": "leases.backends.database"}
LOCMEM = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}


def leases_checks(backends: dict[str, Any], *, deploy: bool = False) -> list[CheckMessage]:
    with override_settings(LEASES={"BACKENDS": {"default": DATABASE, **backends}}):
        messages = run_checks(include_deployment_checks=deploy)
    return [m for m in messages if str(m.id).startswith("leases.")]


def ids(messages: list[CheckMessage]) -> list[str]:
    return sorted(str(m.id) for m in messages)


@pytest.mark.parametrize("engine", ["leases.backends.nowhere", "leases.keys", "", "..x"])
def test_an_engine_that_is_no_backend_is_an_error(engine: str) -> None:
    messages = leases_checks({"broken": {"ENGINE": engine}})
    assert ids(messages) == ["leases.E004"]
    assert "'broken'" in messages[0].msg and messages[0].hint


def test_a_misspelt_option_is_an_error() -> None:
    messages = leases_checks({"db": {**DATABASE, "DATABSE": "default"}})
    assert ids(messages) == ["leases.E005"]
    assert "'DATABSE'" in messages[0].msg and "DATABASE" in messages[0].msg


def test_redis_needs_an_existing_django_redis_cache() -> None:
    with override_settings(CACHES={"default": LOCMEM}):
        missing = leases_checks({"redis": {"ENGINE": "leases.backends.redis", "CACHE": "nope"}})
        locmem = leases_checks({"redis": {"ENGINE": "leases.backends.redis", "CACHE": "default"}})
    assert ids(missing) == ids(locmem) == ["leases.E005"]
    assert "not an alias of CACHES" in missing[0].msg
    assert "not a django-redis one" in locmem[0].msg


def test_redis_needs_one_of_cache_and_url() -> None:
    messages = leases_checks({"redis": {"ENGINE": "leases.backends.redis"}})
    assert ids(messages) == ["leases.E005"]


@pytest.mark.parametrize(
    "options",
    [
        {"NODES": []},
        {"NODES": "redis://a:6379/0"},
        {"NODES": ["redis//a:6379/0", "redis://b:6379/0", "redis://c:6379/0"]},
        {"NODES": ["http://a:6379/0", "redis://b:6379/0", "redis://c:6379/0"]},
        {"NODES": ["redis://a:port/0", "redis://b:6379/0", "redis://c:6379/0"]},
        {"NODES": ["redis://a:6379/0", "redis://b:6379/0", "redis://c:6379/0"], "NODE_TIMEOUT": 0},
        # One server listed twice counts twice toward the quorum: with 3 copies of one server
        # every try failed ("held by someone else") on a free name.
        {"NODES": ["redis://a:6379/0", "redis://a:6379/0", "redis://b:6379/0"]},
        # One keyspace under two spellings passed: the default port written out or not, the
        # database left out, the host's case.
        {"NODES": ["redis://a:6379/0", "redis://a/0", "redis://b:6379/0"]},
        {"NODES": ["redis://a:6379/0", "redis://a:6379", "redis://b:6379/0"]},
        {"NODES": ["redis://a:6379/0", "redis://A:6379/0", "redis://b:6379/0"]},
        {"NODES": ["redis://a:6379/1", "rediss://a/1", "redis://b:6379/0"]},
        # A node URL redis-py reads as database 0, or raises ValueError for, at first use.
        {"NODES": ["redis://a:6379/db1", "redis://b:6379/0", "redis://c:6379/0"]},
        {"NODES": ["redis://a:6379/0?socket_timeout=x", "redis://b:6379/0", "redis://c:6379/0"]},
        # Raised ModuleNotFoundError / TypeError at the first grant, check said nothing.
        {"NODES": ["redis://a:6379/0"], "TOKEN_SOURCE": "nowhere.next_token"},
        {"NODES": ["redis://a:6379/0"], "TOKEN_SOURCE": "os.sep"},
    ],
)
def test_malformed_redlock_nodes_are_an_error(options: dict[str, Any]) -> None:
    messages = leases_checks({"redlock": {"ENGINE": "leases.backends.redlock", **options}})
    assert ids(messages) == ["leases.E005"]


def test_databases_of_one_server_are_independent_nodes() -> None:
    """Independent keyspaces that fail together: a quorum with no fault tolerance, which a
    development setup may want (the demo's three databases of its one Redis)."""
    nodes = ["redis://a:6379/3", "redis://a:6379/4", "redis://a:6379/5"]
    assert leases_checks({"redlock": {"ENGINE": "leases.backends.redlock", "NODES": nodes}}) == []


REDIS_URL_ONLY = {"ENGINE": "leases.backends.redis", "URL": "redis://127.0.0.1:1/0"}
NODES = ["redis://a:6379/0", "redis://b:6379/0", "redis://c:6379/0"]


@pytest.mark.parametrize("seconds", [float("inf"), 1e11, float("nan"), -1, "5"])
@pytest.mark.parametrize(
    ("backend", "option"),
    [
        (REDIS_URL_ONLY, "SOCKET_TIMEOUT"),
        (REDIS_URL_ONLY, "TRUST_SERVER_ID"),
        ({"ENGINE": "leases.backends.redlock", "NODES": NODES}, "NODE_TIMEOUT"),
        (DATABASE, "REQUEST_TIMEOUT"),
        ({"ENGINE": "leases.backends.etcd", "ENDPOINTS": ["http://a:2379"]}, "REQUEST_TIMEOUT"),
        ({"ENGINE": "leases.backends.etcd", "ENDPOINTS": ["http://a:2379"]}, "CONNECT_TIMEOUT"),
        ({"ENGINE": "leases.backends.zookeeper", "HOSTS": "a:2181"}, "REQUEST_TIMEOUT"),
        ({"ENGINE": "leases.backends.zookeeper", "HOSTS": "a:2181"}, "CONNECT_TIMEOUT"),
        ({"ENGINE": "leases.backends.zookeeper", "HOSTS": "a:2181"}, "SESSION_TIMEOUT"),
    ],
)
def test_a_timeout_option_must_be_a_finite_number_of_seconds(
    backend: dict[str, Any], option: str, seconds: object
) -> None:
    """``float("inf")`` ("no timeout") or ``1e11`` passed the check, and then every acquire on
    Redis and Redlock raised a bare ``OverflowError`` from the socket, which no ``except
    LeaseError`` catches. Every backend's timeouts are finite, at most a day."""
    messages = leases_checks({"store": {**backend, option: seconds}})
    assert ids(messages) == ["leases.E005"], messages
    assert option in messages[0].msg and "second" in messages[0].msg


@pytest.mark.parametrize(
    "options",
    [
        # Passed the check; the first acquire raised ValueError (port out of range).
        {"ENGINE": "leases.backends.etcd", "ENDPOINTS": ["http://127.0.0.1:99999"]},
        {"ENGINE": "leases.backends.etcd", "ENDPOINTS": ["http://127.0.0.1:port"]},
        # TypeError (an int in the list), ValueError (a relative znode path), at first use.
        {"ENGINE": "leases.backends.zookeeper", "HOSTS": ["127.0.0.1:2181", 2181]},
        {"ENGINE": "leases.backends.zookeeper", "HOSTS": "127.0.0.1:2181", "PREFIX": "/a/./b"},
        {"ENGINE": "leases.backends.zookeeper", "HOSTS": "127.0.0.1:2181", "PREFIX": "/a//b"},
        {"ENGINE": "leases.backends.zookeeper", "HOSTS": "127.0.0.1:2181", "PREFIX": "/a/.."},
    ],
)
def test_addresses_and_paths_that_fail_at_first_use_fail_the_check(
    options: dict[str, Any],
) -> None:
    assert ids(leases_checks({"store": options})) == ["leases.E005"]


@pytest.mark.parametrize(
    ("url", "extra"),
    [
        ("redis://127.0.0.1:6379/db1", {}),
        ("redis://127.0.0.1:6379/1/2", {}),
        ("redis://127.0.0.1:6379/0?socket_timeout=abc", {}),
        ("redis://127.0.0.1:6379/3", {"CLUSTER": True}),
        ("redis://127.0.0.1:6379/0?db=3", {"CLUSTER": True}),
    ],
)
def test_a_redis_url_redis_py_cannot_honour_is_an_error(url: str, extra: dict[str, Any]) -> None:
    """Passed the check: redis-py reads ``/db1`` as database 0, silently (two apps meant to be
    apart shared one keyspace), raised ``ValueError`` for ``socket_timeout=abc`` at the first
    grant, and a Redis Cluster has no database 3."""
    backend = {"ENGINE": "leases.backends.redis", "URL": url, **extra}
    assert ids(leases_checks({"store": backend})) == ["leases.E005"]


def test_a_redis_cluster_flag_must_be_a_bool() -> None:
    """``"CLUSTER": "no"`` is truthy: it made a cluster client for a plain server."""
    redis = {"ENGINE": "leases.backends.redis", "URL": "redis://127.0.0.1:1/0", "CLUSTER": "no"}
    assert ids(leases_checks({"redis": redis})) == ["leases.E005"]


def test_a_store_database_missing_from_databases_is_refused_before_any_round_trip() -> None:
    """It was a raw ``KeyError`` from Django, and only after a round trip to the store (nothing
    listens on the URL here: reaching for it would raise ``BackendUnavailable``)."""
    url = "redis://127.0.0.1:1/0"
    backends = {
        "redis": {"ENGINE": "leases.backends.redis", "URL": url, "EPOCH_DATABASE": "nowhere"},
        "redlock": {
            "ENGINE": "leases.backends.redlock",
            "NODES": [url],
            "TOKEN_DATABASE": "nowhere",
        },
    }
    with override_settings(LEASES={"BACKENDS": {"default": DATABASE, **backends}}):
        for alias in backends:
            with pytest.raises(LeasesImproperlyConfigured, match="'nowhere' is not in DATABASES"):
                acquire("x", ttl=1, backend=alias, timeout=0)


def test_an_unreachable_redis_cluster_is_backend_unavailable() -> None:
    """redis-py's ``RedisClusterException`` (no ``RedisError``) escaped raw from the first use."""
    redis = {"ENGINE": "leases.backends.redis", "URL": "redis://127.0.0.1:1/0", "CLUSTER": True}
    settings = {"BACKENDS": {"default": DATABASE, "redis": redis}}
    with override_settings(LEASES=settings), pytest.raises(BackendUnavailable):
        acquire("x", ttl=1, backend="redis", timeout=0)


def test_well_formed_backends_pass_without_connecting() -> None:
    nodes = ["redis://127.0.0.1:1/0", "rediss://127.0.0.1:2/0", "unix:///tmp/none.sock"]
    messages = leases_checks(
        {
            "redis": {"ENGINE": "leases.backends.redis", "URL": "redis://127.0.0.1:1/0"},
            "redlock": {"ENGINE": "leases.backends.redlock", "NODES": nodes},
        }
    )
    assert messages == []


def test_check_deploy_reports_a_missing_cache_instead_of_crashing() -> None:
    backends = {
        "redis": {"ENGINE": "leases.backends.redis", "CACHE": "nope"},
        "broken": {"ENGINE": "leases.backends.nowhere"},
    }
    messages = leases_checks(backends, deploy=True)
    assert ids(messages) == ["leases.E004", "leases.E005"]


@pytest.fixture
def lite() -> Iterator[str]:
    """A SQLite alias that is configured but never connected to: only its vendor is read."""
    connections.settings["lite"] = {
        **connections["default"].settings_dict,
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": ":memory:",
    }
    try:
        yield "lite"
    finally:
        del connections["lite"]
        connections.settings.pop("lite", None)


def test_every_database_a_backend_uses_must_be_postgresql(lite: str) -> None:
    backends = {
        "default": DATABASE,
        "redis": {"ENGINE": "leases.backends.redis", "CACHE": "default", "EPOCH_DATABASE": lite},
    }
    with override_settings(LEASES={"BACKENDS": backends}):
        errors = check_advisory_database()
        assert check_backends() == []
    assert [e.id for e in errors] == ["leases.E002"]
    assert "'lite' is sqlite" in errors[0].msg


def test_the_admin_finds_the_lease_rows_by_capability() -> None:
    backends = {
        "default": {"ENGINE": "leases.backends.redis", "CACHE": "default"},
        "broken": {"ENGINE": "leases.backends.nowhere"},
        "rows": DATABASE,
    }
    with override_settings(LEASES={"BACKENDS": backends}):
        assert database_backend_alias() == "rows"


@pytest.mark.parametrize(
    "options",
    [
        {"ENGINE": "leases.backends.redis", "URL": "redis://127.0.0.1:1/0"},
        {
            "ENGINE": "leases.backends.etcd",
            "ENDPOINTS": ["http://127.0.0.1:1"],
            "REQUEST_TIMEOUT": 0.5,
            "CONNECT_TIMEOUT": 0.5,
        },
        # An unreachable ensemble was a warning: a deploy gated on the check passed.
        {
            "ENGINE": "leases.backends.zookeeper",
            "HOSTS": "127.0.0.1:1",
            "REQUEST_TIMEOUT": 0.5,
            "CONNECT_TIMEOUT": 0.5,
        },
    ],
    ids=["redis", "etcd", "zookeeper"],
)
def test_an_unreachable_store_is_named_once_in_its_deploy_error(options: dict[str, Any]) -> None:
    """It read "lease backend 'r': lease backend 'r' is unavailable: ...". An unreachable
    etcd cluster was only a warning (``leases.W003``), its reason empty, where every other
    unreachable store is an error that says what failed."""
    messages = leases_checks({"r": options}, deploy=True)
    (error,) = [m for m in messages if m.id == "leases.E003"]
    assert error.msg.count("'r'") == 1, error.msg
    assert error.msg.rstrip().endswith(":") is False and "127.0.0.1:1" in error.msg, error.msg


def django_redis_cache(location: str, **pool: int) -> dict[str, Any]:
    """A django-redis cache; ``pool`` is its ``CONNECTION_POOL_KWARGS``. django-redis keeps
    one pool per LOCATION for the whole process, so each test cache has a LOCATION of its own
    (nothing listens there: the check connects to nothing)."""
    options: dict[str, Any] = {"CONNECTION_POOL_KWARGS": pool} if pool else {}
    return {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": location, "OPTIONS": options}


#: The limit redis-py gives a pool told none: 100 since redis-py 8, none (2**31) before it.
DEFAULT_POOL_LIMIT = redis.ConnectionPool().max_connections
POOL_CACHES = {
    "plain": django_redis_cache("redis://127.0.0.1:1/11"),  # redis-py's own limit
    "plain-too": django_redis_cache("redis://127.0.0.1:1/12"),
    "in-url": django_redis_cache("redis://127.0.0.1:1/13?max_connections=50"),
    "roomy": django_redis_cache("redis://127.0.0.1:1/14", max_connections=10_000),
}


def test_a_cache_pool_smaller_than_the_backends_own_is_warned() -> None:
    """A CACHE alias's pool (since redis-py 8, 100 unless told otherwise) caps the sync acquires one
    process can have at once; past it they fail (``test_redis_checks.py`` shows how). A
    Redlock node given as a cache alias shares its pool the same way."""
    backends = {
        "redis": {"ENGINE": "leases.backends.redis", "CACHE": "plain"},
        "redlock": {"ENGINE": "leases.backends.redlock", "NODES": ["plain-too", "in-url", "roomy"]},
    }
    with override_settings(CACHES=POOL_CACHES):
        messages = leases_checks(backends)
    if DEFAULT_POOL_LIMIT >= POOL:  # redis-py before 8: only the pool told 50 has a limit
        assert ids(messages) == ["leases.W005"] and "'in-url'" in messages[0].msg
        assert "allows 50 connections" in messages[0].msg
        return
    assert ids(messages) == ["leases.W005"] * 3
    redis_warning, *redlock_warnings = sorted(messages, key=lambda m: m.msg)
    assert "'plain'" in redis_warning.msg and "allows 100 connections" in redis_warning.msg
    assert sorted("allows 50" in m.msg for m in redlock_warnings) == [False, True]
    assert all("max_connections" in m.msg and m.hint for m in messages)


@pytest.mark.parametrize(
    "options",
    [
        {"ENGINE": "leases.backends.redis", "CACHE": "roomy"},
        {"ENGINE": "leases.backends.redis", "URL": "redis://127.0.0.1:1/0"},
        {"ENGINE": "leases.backends.redlock", "NODES": ["roomy", "redis://127.0.0.1:1/0"]},
    ],
    ids=["roomy-cache", "url", "redlock-roomy-and-url"],
)
def test_a_pool_with_room_is_not_warned(options: dict[str, Any]) -> None:
    with override_settings(CACHES=POOL_CACHES):
        assert leases_checks({"r": options}) == []


def test_a_misconfigured_backend_gets_its_error_not_a_pool_warning() -> None:
    options = {"ENGINE": "leases.backends.redis", "CACHE": "plain", "PREFX": "x"}
    with override_settings(CACHES=POOL_CACHES):
        assert ids(leases_checks({"r": options})) == ["leases.E005"]
