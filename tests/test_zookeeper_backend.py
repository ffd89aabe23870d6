"""The ZooKeeper backend's line of contenders, on the session ensemble (alias ``"zookeeper"``).

What the shared suites cannot see: that a release wakes the next contender and nobody else
(ZooKeeper's lock recipe, each contender watching only its predecessor).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from leases.backends import get_backend
from tests.clusters import zookeeper_ready
from tests.lease_backends import lease_name
from tests.waiting import wait_until

__all__ = ["lease_name"]  # fixture, re-exported for pytest

pytestmark = [pytest.mark.django_db]


@pytest.fixture
def zookeeper() -> str:
    """The session ensemble's alias (started on first use), skipped without ZooKeeper."""
    return zookeeper_ready()


def test_a_release_wakes_only_the_next_in_line(zookeeper: str, lease_name: str) -> None:
    """Four waiters queue one after another behind a 30 s holder; the release wakes the first
    of them, which then holds the name, and leaves the other three asleep: no herd of failed
    tries. (With one watch on the name's children every waiter woke at once.)"""
    store = get_backend(zookeeper)
    holder = store.try_acquire(lease_name, "holder", 30)
    assert holder is not None
    woken: list[tuple[int, Any]] = []
    done = threading.Event()

    def wait_in_line(index: int, queued: threading.Event) -> None:
        with store.waiting_room(lease_name, 20):
            assert store.try_acquire(lease_name, f"w{index}", 30) is None
            queued.set()
            if store.wait_for_release(lease_name, 20):
                grant = store.try_acquire(lease_name, f"w{index}", 30)
                woken.append((index, grant))
                done.wait(20)
                if grant is not None:
                    store.release(grant)

    waiters = []
    for index in range(4):  # one at a time, so the line's order is known
        queued = threading.Event()
        waiter = threading.Thread(target=wait_in_line, args=(index, queued), daemon=True)
        waiter.start()
        waiters.append(waiter)
        assert queued.wait(10), f"waiter {index} never queued"
    try:
        store.release(holder)
        wait_until(lambda: bool(woken), 5, "the first waiter to wake")
        time.sleep(1.0)  # time enough for a herd to show itself
        assert [index for index, _ in woken] == [0], woken
        grant = woken[0][1]
        assert grant is not None and grant.token > holder.token
        info = store.inspect(lease_name)
        assert info is not None and info.held and info.holder == "w0"
    finally:
        done.set()
        for waiter in waiters:
            waiter.join(30)
