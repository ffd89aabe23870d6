"""A process with more than ``FD_SETSIZE`` (1024) files open: its new connections' sockets get
numbers ``select()`` refuses, and every backend must still grant, hand off and release (the
package waits on sockets with ``poll``: ``leases._fdwait``)."""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Iterator

import pytest

from leases import acquire
from leases.backends import get_backend, reset
from tests.lease_backends import lease_backend, lease_name
from tests.test_lease_database import room_locks
from tests.waiting import wait_until

__all__ = ["lease_backend", "lease_name"]

FD_SETSIZE = 1024


@pytest.fixture
def high_descriptors() -> Iterator[None]:
    """Fill every descriptor number below ``FD_SETSIZE`` + 64, so sockets opened meanwhile
    get numbers above it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FD_SETSIZE + 512
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the descriptor limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    reset()  # every backend's next connections open after the filling, past FD_SETSIZE
    fillers: list[int] = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY)
            fillers.append(fd)
            if fd >= FD_SETSIZE + 64:
                break
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_every_backend_works_on_sockets_past_fd_setsize(
    lease_backend: str, lease_name: str, high_descriptors: None
) -> None:
    backend = get_backend(lease_backend)
    first = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)
    own = getattr(backend, "connection", lambda: None)()
    session = None
    if own is not None:  # the database backend: its connection is kept, not found "dead"
        assert own.fileno() > FD_SETSIZE
        session = own.info.backend_pid
    first.release()
    got: list[int] = []
    second = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False)

    def wait() -> None:
        waiter = acquire(lease_name, ttl=30, backend=lease_backend, keepalive=False, timeout=30)
        got.append(waiter.token)
        waiter.release()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    if session is not None:  # the waiter queued in the name's room (on the holder's tenure)
        wait_until(lambda: room_locks(lease_name).get(True) == 1, 15, "the waiter in the room")
    second.release()
    thread.join(30)
    assert got and got[0] > second.token > first.token
    if session is not None:
        again = getattr(backend, "connection", lambda: None)()
        assert again is not None and again.info.backend_pid == session
