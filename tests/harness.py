"""The pytest plugin that owns the servers the suite runs against.

Loaded with ``-p tests.harness`` (see ``pyproject.toml``). ``tests/settings.py`` calls
:func:`bootstrap_servers` while pytest-django imports it, which is before xdist starts its
workers: the controller starts (or finds) PostgreSQL and Redis once and exports their URLs in the
environment, so workers, child processes and Celery workers all inherit them.

Fault tests never touch those shared servers: they take ``pg_server``/``redis_server`` (or
``fault_database``), servers of their own that they may kill, pause and restart.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from devservers import PostgresServer, RedisServer, configured_or_throwaway, reachable
from devservers.etcd import EtcdCluster, etcd_binary
from tests.rabbitmq_server import RabbitMQServer, rabbitmq_binary

ROOT = Path(__file__).resolve().parent.parent
_OWNED: list[PostgresServer | RedisServer] = []


#: Independent Redis servers the ``redlock`` backend of the shared suite runs on.
REDLOCK_NODES = 3


def bootstrap_servers() -> dict[str, str]:
    """``DATABASE_URL``, ``REDIS_URL`` and ``LEASES_REDLOCK_URLS`` (comma-separated) for this
    run, starting servers if none are reachable. (The etcd and ZooKeeper clusters start only
    when a test asks for them: ``tests/clusters.py``.)"""
    first = not _OWNED
    urls = configured_or_throwaway(_OWNED)
    urls["LEASES_REDLOCK_URLS"] = _redlock_urls(REDLOCK_NODES)
    os.environ.update(urls)
    if first and _OWNED:
        atexit.register(_destroy_owned)
    return urls


def _redlock_urls(count: int) -> str:
    """The inherited Redlock nodes when all answer (xdist workers, children), else new ones."""
    urls = [url for url in os.environ.get("LEASES_REDLOCK_URLS", "").split(",") if url]
    if len(urls) == count and all(reachable(url) for url in urls):
        return ",".join(urls)
    servers = [RedisServer().start() for _ in range(count)]
    _OWNED.extend(servers)
    return ",".join(server.url for server in servers)


def _destroy_owned() -> None:
    while _OWNED:
        _OWNED.pop().destroy()


def url_with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def close_connections_of_the_async_orm_thread() -> None:
    """Close the Django connections of asgiref's shared executor thread.

    ``sync_to_async`` called outside any ``async_to_sync`` (``asyncio.run(doc.adelete())`` in
    a sync test) runs the ORM on one thread for the whole process, whose connections nothing
    else closes: left open, one kept the test database from being dropped at the end."""
    import asyncio

    from asgiref.sync import sync_to_async
    from django.db import connections

    asyncio.run(sync_to_async(connections.close_all)())


@pytest.fixture(scope="session")
def _lease_backends_closed(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """Close every lease backend (their private connections), and the async ORM's thread's
    connection, before the test databases go."""
    yield
    from leases.backends import reset

    with django_db_blocker.unblock():
        reset()
        close_connections_of_the_async_orm_thread()


@pytest.fixture(autouse=True)
def _close_lease_backends_at_the_end(request: pytest.FixtureRequest) -> None:
    """Backends keep database connections of their own (counters, LISTEN); dropping the test
    database fails while they are open, so tests that use the database schedule the close."""
    uses_db = "django_db_setup" in request.fixturenames
    if uses_db or request.node.get_closest_marker("django_db") is not None:
        request.getfixturevalue("_lease_backends_closed")


@pytest.fixture
def child_env(request: pytest.FixtureRequest, transactional_db: None) -> dict[str, str]:
    """Environment for a child Python process that uses this test's database.

    Children see only committed data, so tests using them need ``transactional_db`` (implied).
    A test's lease backend is set up first: an etcd or ZooKeeper cluster publishes its
    addresses in the environment when it starts, and a child spawned before that (a test
    naming ``server`` before ``lease_backend``, run on its own) could not reach it.
    """
    from django.db import connection

    if "lease_backend" in request.fixturenames:
        request.getfixturevalue("lease_backend")

    env = dict(os.environ)
    env["DATABASE_URL"] = url_with_database(
        os.environ["DATABASE_URL"], str(connection.settings_dict["NAME"])
    )
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m django ARGS`` as an operator runs it (exit status, stdout, stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "django", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def python() -> str:
    """The interpreter running the tests, for child processes."""
    return sys.executable


@pytest.fixture
def pg_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own, to kill, pause or restart."""
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A Redis server of this test's own, to kill, pause or restart."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def amqp_url() -> Iterator[str]:
    """An AMQP broker URL for this session: ``LEASES_TEST_AMQP_URL`` when set and reachable,
    else a throwaway RabbitMQ node of this process (each xdist worker that asks starts its own).

    Started only when a test asks for it, so runs without AMQP tests pay nothing; skips when
    RabbitMQ is not installed (there is no broker wheel to fall back on, unlike Redis).
    """
    configured = os.environ.get("LEASES_TEST_AMQP_URL")
    if configured and reachable(configured):
        yield configured
        return
    if rabbitmq_binary() is None:
        pytest.skip(
            "RabbitMQ: no rabbitmq-server installed (e.g. apt-get install rabbitmq-server) "
            "and LEASES_TEST_AMQP_URL is not set to a reachable amqp:// URL"
        )
    server = RabbitMQServer().start()
    try:
        yield server.url
    finally:
        server.destroy()


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A 3-member etcd cluster of this test's own, to kill, pause or restart members of."""
    if etcd_binary() is None:
        pytest.skip("etcd: no etcd binary installed (apt-get install etcd-server)")
    cluster = EtcdCluster().start()
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def redis_servers() -> Iterator[Any]:
    """A factory of Redis servers of this test's own (``redis_servers(5)`` for Redlock)."""
    made: list[RedisServer] = []

    def make(count: int = 1) -> list[RedisServer]:
        servers = [RedisServer().start() for _ in range(count)]
        made.extend(servers)
        return servers

    try:
        yield make
    finally:
        for server in made:
            server.destroy()


@pytest.fixture
def fault_database(
    pg_server: PostgresServer, django_db_blocker: Any
) -> Iterator[tuple[str, PostgresServer]]:
    """Django database alias ``"fault"`` on a server of this test's own, migrated.

    Yields ``(alias, server)``; the test may stop, pause or restart the server.
    """
    from django.core.management import call_command
    from django.db import connections

    alias = "fault"
    settings = dict(connections["default"].settings_dict)
    settings.update(
        HOST="127.0.0.1",
        PORT=str(pg_server.port),
        NAME="postgres",
        USER="postgres",
        PASSWORD="",
        TEST={"NAME": "postgres"},
    )
    connections.settings[alias] = settings
    try:
        with django_db_blocker.unblock():
            call_command("migrate", database=alias, run_syncdb=True, verbosity=0)
            connections[alias].close()
        yield alias, pg_server
    finally:
        with django_db_blocker.unblock():
            connections[alias].close()
        del connections[alias]
        connections.settings.pop(alias, None)


@pytest.fixture
def silent() -> Iterator[socket.socket]:
    """A port that takes connections (the kernel completes the handshake) and never answers:
    a store behind a firewall that drops its replies, or a paused server. Closing it resets
    the connections waiting in it, which ends the calls stuck on them."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield listener
    finally:
        listener.close()


@pytest.fixture
def empty_database(child_env: dict[str, str]) -> Iterator[str]:
    """The URL of a fresh, empty database on the test server (for a child project that
    migrates its own); dropped afterwards, its connections cut."""
    import uuid

    import psycopg

    name = f"empty_{uuid.uuid4().hex[:10]}"
    admin_url = child_env["DATABASE_URL"]
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url_with_database(admin_url, name)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
