"""A session lock on a connection that goes silent, and the TCP settings that bound it; and
one behind a transaction pooler, which is refused.

The holder's Django connection goes through :class:`devservers.proxy.FaultProxy`; a blackhole
there is a half-open peer as the client sees it (no reply, no FIN, no RST). The holder must
learn within the documented bound (:data:`leases.advisory.CHECK_TIMEOUT`), and the server
must then release the lock for others. The package's own connections carry keepalive and
``tcp_user_timeout`` settings; the last test reads them back from the sockets.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import connections, transaction
from django.test import override_settings

from devservers.pgbouncer import PgBouncer, pgbouncer_binary
from devservers.proxy import FaultProxy
from leases import LeaseLost, advisory
from leases.backends._pgconn import connect
from leases.errors import BackendNotSupported
from tests.advisory_support import free_elsewhere
from tests.waiting import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.slow]


@pytest.fixture
def half_open(
    fault_database: tuple[str, Any], django_db_blocker: Any
) -> Iterator[tuple[str, str, FaultProxy]]:
    """Alias ``"halfopen"`` (through a proxy) and the direct alias, on one server of our own."""
    direct, server = fault_database
    proxy = FaultProxy(server.port)
    settings = dict(connections.settings[direct])
    settings["PORT"] = str(proxy.port)
    connections.settings["halfopen"] = settings
    with django_db_blocker.unblock():
        try:
            yield "halfopen", direct, proxy
        finally:
            proxy.pass_through()
            for alias in ("halfopen", direct):
                with contextlib.suppress(Exception):  # the cut connection is already gone
                    connections[alias].close()
            proxy.close()
            del connections["halfopen"]
            connections.settings.pop("halfopen", None)


@pytest.fixture
def bounced(fault_database: tuple[str, Any], django_db_blocker: Any) -> Iterator[str]:
    """Alias ``"bounced"``: the server of our own through PgBouncer in transaction pooling."""
    if pgbouncer_binary() is None:
        pytest.skip("pgbouncer is not installed")
    direct, server = fault_database
    with PgBouncer(server.port, pool_mode="transaction", pool_size=1) as bouncer:
        settings = dict(connections.settings[direct])
        settings["PORT"] = str(bouncer.port)
        settings["DISABLE_SERVER_SIDE_CURSORS"] = True
        connections.settings["bounced"] = settings
        try:
            with django_db_blocker.unblock():
                yield "bounced"
        finally:
            with contextlib.suppress(Exception):
                connections["bounced"].close()
            del connections["bounced"]
            connections.settings.pop("bounced", None)


def taken_elsewhere(alias: str, name: str) -> Callable[[], bool]:
    """Whether another session (``alias``, in a thread of its own) can take ``name`` now."""
    return functools.partial(free_elsewhere, alias, name)


def test_a_silent_connection_under_a_session_lock_is_learnt_within_the_bound(
    half_open: tuple[str, str, FaultProxy],
) -> None:
    alias, direct, proxy = half_open
    name = "half-open-check"
    with pytest.raises(LeaseLost), advisory.session_lock(name, using=alias) as lock:
        lock.ensure_held(timeout=1)
        assert not taken_elsewhere(direct, name)()
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(LeaseLost):
            lock.ensure_held(timeout=1)
        assert time.monotonic() - started < 1 + 3  # slack for a loaded machine
    # Once the server hears of the shut-down connection, the session and its lock are gone.
    proxy.pass_through()
    wait_until(taken_elsewhere(direct, name), 10, "the server to release the lock")


def test_a_session_lock_exit_on_a_silent_connection_is_bounded(
    half_open: tuple[str, str, FaultProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    alias, direct, proxy = half_open
    monkeypatch.setattr(advisory, "CHECK_TIMEOUT", 1.0)
    started = time.monotonic()
    with (
        pytest.raises(LeaseLost, match="session ended"),
        advisory.session_lock("half-open-exit", using=alias),
    ):
        proxy.blackhole()
    assert time.monotonic() - started < 1 + 3
    proxy.pass_through()
    wait_until(taken_elsewhere(direct, "half-open-exit"), 10, "the server to release the lock")


def test_the_packages_connections_carry_their_keepalive_and_user_timeout(
    half_open: tuple[str, str, FaultProxy],
) -> None:
    """Read back from the socket, not from the parameters: what the kernel will enforce."""
    conn = connect(half_open[1])
    try:
        sock = socket.socket(fileno=conn.fileno())
        try:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 2
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10_000
        finally:
            sock.detach()  # the descriptor is psycopg's
    finally:
        conn.close()


def test_a_session_lock_behind_a_transaction_pooler_is_refused(bounced: str) -> None:
    """Two clients handed one server session both held one ``session_lock`` (re-entrant per
    session) and both unlocks succeeded, so neither exit noticed, though the guide promised
    ``LeaseNotHeld``. The connection is probed before its first session lock, as the lease
    backend probes its own; transaction locks still work."""
    with (
        pytest.raises(BackendNotSupported, match="SESSION_POOLING"),
        advisory.session_lock("bounced", using=bounced),
    ):
        pytest.fail("a session lock was taken through a transaction pooler")
    with transaction.atomic(using=bounced), advisory.xact_lock("bounced", using=bounced) as lock:
        assert lock.held()


def test_a_declared_session_pooler_is_taken_at_its_word(bounced: str) -> None:
    """``LEASES["SESSION_POOLING"]`` names the aliases whose pooler keeps each client's
    session (the client cannot read the pooler's mode), as the backend option does."""
    declared = {**getattr(django_settings, "LEASES", {}), "SESSION_POOLING": [bounced]}
    with override_settings(LEASES=declared), advisory.session_lock("declared", using=bounced):
        pass
