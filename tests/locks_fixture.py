"""A scene for the operator views: held, expired and free leases plus held and waiting locks."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from leases.backends import get_backend
from leases.keys import advisory_key
from leases.operations import remember_advisory_names


@dataclass
class LockScene:
    held: str
    expired: str
    free: str
    advisory: str
    holder: str
    holder_pid: int
    waiter_pid: int
    tokens: dict[str, int] = field(default_factory=dict)


def _connect(application: str) -> psycopg.Connection[Any]:
    from django.db import connection

    params = dict(connection.get_connection_params())
    params.pop("cursor_factory", None)
    params["application_name"] = application
    return psycopg.connect(autocommit=True, **params)


@pytest.fixture(name="lock_scene")
def lock_scene_fixture(transactional_db: None) -> Iterator[LockScene]:
    """Committed state other connections (a live server, a command) can see."""
    suffix = uuid.uuid4().hex[:8]
    backend = get_backend("default")
    holder = f"billing@worker-1:4242:MainThread/{suffix}"
    scene_names = [f"{kind}-{suffix}" for kind in ("held", "expired", "free", "advisory")]
    held, expired, free, advisory = scene_names
    tokens = {}
    for name, ttl in ((held, 300.0), (expired, 0.05), (free, 300.0)):
        grant = backend.try_acquire(name, holder, ttl)
        assert grant is not None
        tokens[name] = grant.token
        if name == free:
            backend.release(grant)
    time.sleep(0.1)  # let the short lease expire on the server's clock
    remember_advisory_names(advisory)
    key = advisory_key(advisory)
    owner, waiter = _connect("lock-owner"), _connect("lock-waiter")
    owner.execute("SELECT pg_advisory_lock(%s)", [key])

    def wait_for_lock() -> None:
        with contextlib.suppress(psycopg.Error):  # cancelled or terminated at teardown
            waiter.execute("SELECT pg_advisory_lock(%s)", [key])

    waiting = threading.Thread(target=wait_for_lock, daemon=True)
    waiting.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = owner.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND pid = %s",
            [waiter.info.backend_pid],
        ).fetchone()
        if row and row[0]:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the waiter never started waiting for the advisory lock")
    try:
        yield LockScene(
            held=held,
            expired=expired,
            free=free,
            advisory=advisory,
            holder=holder,
            holder_pid=owner.info.backend_pid,
            waiter_pid=waiter.info.backend_pid,
            tokens=tokens,
        )
    finally:
        with contextlib.suppress(psycopg.Error):
            waiter.cancel()
        waiting.join(10)
        owner.close()
        waiter.close()
