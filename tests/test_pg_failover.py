"""PostgreSQL failover under the database backend: an asynchronous standby is promoted after
the primary dies, and the transactions it never received (the lost tail) include a grant.

The library reaches "the primary" through a :class:`~devservers.proxy.FaultProxy` that the
test points at the standby after promotion, as a virtual IP or a pooler would. Tokens go to a
resource in another store (the shared fenced register, in the test database), so the question
is the one an application faces: can the promoted server hand out a token the resource has
already seen from a grant the standby never heard of?
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connections
from django.test import override_settings

from devservers import PostgresServer
from devservers.proxy import FaultProxy
from devservers.servers import _descendants
from leases import acquire
from leases.backends import get_backend
from tests import checker
from tests.lease_backends import lease_name
from tests.waiting import wait_until

__all__ = ["lease_name"]

pytestmark = [pytest.mark.fault, pytest.mark.slow]

HA = "ha"


def _query(server: PostgresServer, sql: str) -> Any:
    with psycopg.connect(server.url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(sql).fetchone()
        return row[0] if row else None


def _crash(server: PostgresServer) -> None:
    """SIGKILL the postmaster and every backend at once, none resumed first (a stopped
    WAL sender must not get to send the tail while the server dies)."""
    assert server.proc is not None
    pids = [server.proc.pid, *_descendants(server.proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.proc.wait()
    server.stop("kill")  # cleanup of whatever is left


@pytest.fixture(params=["database", "redlock"])
def ha(
    request: pytest.FixtureRequest, transactional_db: None, django_db_blocker: Any
) -> Iterator[tuple[PostgresServer, PostgresServer, FaultProxy]]:
    """A migrated primary, its streaming standby, alias ``"ha"`` through a proxy, and lease
    backend ``"ha"``: the database backend on it, or Redlock taking its tokens from it."""
    from django.core.management import call_command

    primary = PostgresServer().start()
    replica: PostgresServer | None = None
    proxy = FaultProxy(primary.port)
    settings = dict(connections["default"].settings_dict)
    settings.update(
        HOST="127.0.0.1",
        PORT=str(proxy.port),
        NAME="postgres",
        USER="postgres",
        PASSWORD="",
        TEST={"NAME": "postgres"},
    )
    connections.settings[HA] = settings
    if request.param == "database":
        backend: dict[str, Any] = {"ENGINE": "leases.backends.database", "DATABASE": HA}
    else:
        nodes = [server.url for server in request.getfixturevalue("redis_servers")(3)]
        backend = {
            "ENGINE": "leases.backends.redlock",
            "NODES": nodes,
            "NODE_TIMEOUT": 0.5,
            "TOKEN_DATABASE": HA,
        }
    override = override_settings(
        LEASES={"BACKENDS": {"default": {"ENGINE": "leases.backends.database"}, HA: backend}}
    )
    try:
        with django_db_blocker.unblock():
            call_command("migrate", database=HA, verbosity=0)
            connections[HA].close()
        replica = PostgresServer(replica_of=primary).start()
        override.enable()
        yield primary, replica, proxy
    finally:
        override.disable()
        with django_db_blocker.unblock():
            connections[HA].close()
        del connections[HA]
        connections.settings.pop(HA, None)
        proxy.close()
        for server in (replica, primary):
            if server is not None:
                server.destroy()


def test_promoted_standby_never_reissues_a_token_of_the_lost_tail(ha: Any, lease_name: str) -> None:
    """A grant (its token) commits on the primary but never reaches the standby; the primary
    dies and the standby is promoted. The next grant's token is higher than the lost grant's
    (not equal: the resource has seen that one), so the resource refuses the lost holder and
    accepts the successor. A database-backend holder of the lost grant learns it lost; a
    Redlock holder still holds (its grant is on the Redis nodes) until it releases."""
    primary, replica, proxy = ha
    register = checker.new_register()
    first = acquire(lease_name, ttl=3, backend=HA, holder="a", keepalive=False)
    assert checker.record_write(register, first, "a")
    first.release()
    caught_up = _query(primary, "SELECT pg_current_wal_lsn()::text")
    wait_until(
        lambda: _query(replica, f"SELECT pg_last_wal_replay_lsn() >= '{caught_up}'::pg_lsn"),
        30,
        "the standby to replay the first grant and its release",
    )
    sender = _query(primary, "SELECT pid FROM pg_stat_replication")
    os.kill(sender, signal.SIGSTOP)  # from here on, the primary's commits stay on the primary
    lost_tail = acquire(lease_name, ttl=3, backend=HA, holder="b")
    assert lost_tail.token > first.token
    assert checker.record_write(register, lost_tail, "b")
    _crash(primary)
    assert _query(replica, "SELECT pg_promote(wait => true)") is True
    proxy.target = ("127.0.0.1", replica.port)
    proxy.reset_all()
    if get_backend(HA).__module__.endswith("redlock"):
        # Its grant lives on the Redis nodes, which did not fail: it still holds, and frees it.
        lost_tail.ensure_held()
        lost_tail.release()
    else:
        # It learns it lost within its TTL: its row is not on the new primary.
        assert lost_tail.lost.wait(3 + 3), "the holder of the lost grant never learned it lost"
    successor = acquire(lease_name, ttl=30, backend=HA, holder="c", timeout=10)
    assert successor.token > lost_tail.token, (
        f"the promoted standby granted token {successor.token}, but token {lost_tail.token} was "
        "already granted (and written to the resource) on the old primary"
    )
    assert checker.record_write(register, successor, "c")
    assert not checker.record_write(register, lost_tail.token, "b")
    successor.release()
    checker.check_history(register, [first.token, lost_tail.token, successor.token])
