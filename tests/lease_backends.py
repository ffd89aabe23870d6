"""The lease backends every conformance test runs against, as one fixture parameter.

``LEASE_BACKENDS`` lists aliases of ``LEASES["BACKENDS"]`` in ``tests/settings.py``. A backend
module's tests append its alias here (and configure it in the settings), and register in
``SETUP`` what its alias needs before each test (a flushed Redis, servers of its own):

    LEASE_BACKENDS.append("redis")
    SETUP["redis"] = lambda request: request.getfixturevalue("...")

Tests skip by declared capability (:func:`require`), never by backend name.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from leases.backends import Capability, LeaseBackend, get_backend
from tests.clusters import etcd_ready, zookeeper_ready

__all__ = [
    "LEASE_BACKENDS",
    "SETUP",
    "lease_backend",
    "lease_name",
    "require",
    "wait_overshoots",
]

#: Aliases the conformance suite runs on; backends append theirs.
LEASE_BACKENDS: list[str] = ["default", "redis", "redlock"]
LEASE_BACKENDS.append("zookeeper")  # the ensemble of tests/clusters.py, started on first use


#: Per-alias preparation run by :func:`lease_backend` before each test (nothing for "default").
SETUP: dict[str, Callable[[pytest.FixtureRequest], object]] = {}
SETUP["zookeeper"] = zookeeper_ready


LEASE_BACKENDS.append("etcd")
SETUP["etcd"] = etcd_ready  # likewise


@pytest.fixture(params=LEASE_BACKENDS)
def lease_backend(request: pytest.FixtureRequest, db: None) -> str:
    """The alias of one configured lease backend, ready to use.

    Takes ``db`` statically (the checker and the database backend live in the test database;
    pytest-django sets databases up only for tests that declare it); a test that also takes
    ``child_env`` or ``transactional_db`` gets a transactional database instead.
    """
    alias: str = request.param
    setup = SETUP.get(alias)
    if setup is not None:
        setup(request)
    return alias


@pytest.fixture
def lease_name() -> str:
    """A lease name no other test (or earlier run) uses: lease rows outlive test transactions."""
    return f"test-{uuid.uuid4().hex[:16]}"


def require(alias: str, *capabilities: Capability) -> LeaseBackend:
    """The backend for ``alias``; skips the test unless it declares every capability."""
    backend = get_backend(alias)
    missing = [c.value for c in capabilities if c not in backend.capabilities]
    if missing:
        pytest.skip(f"backend {alias!r} lacks {', '.join(missing)}")
    return backend


def wait_overshoots(
    backend: LeaseBackend, name: str, wait: float = 0.21, tries: int = 7
) -> list[float]:
    """How late ``wait_for_release`` returns when nothing is released, sorted (seconds).

    Back-to-back waits of 0.21 s on an idle server each start just after the timer tick that
    ended the one before, so a timeout left to that tick (every 100 ms) is ~90 ms late every
    time, not just sometimes: the test cannot pass by a lucky phase. (Negative: it ended
    early, which ``wait_for_release`` may.)
    """
    late = []
    for _ in range(tries):
        started = time.monotonic()
        assert backend.wait_for_release(name, wait) is False
        late.append(time.monotonic() - started - wait)
    return sorted(late)
