"""Opt-in plugin: which test left a lease to the keepalive threads (``-p tests.leaked_leases``).

A lease a test neither releases nor sees lost stays with the renewer or the watchdog, which
reports its loss when its TTL runs out: inside whichever test captures logs then (under xdist,
any test of the same worker). After each test this lists the leases still live in the
keepalive schedulers that earlier tests had not left, and writes them, with the test's id, to
``$LEASES_LEAKED_LEASES`` (default ``leaked-leases.txt``; each worker appends its own lines).
Not loaded by default: it reads the schedulers' private state.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

_reported: set[int] = set()


def _live_leases() -> list[Any]:
    from leases import keepalive

    schedulers = list(keepalive._renewers.values())
    if keepalive._watchdog is not None:
        schedulers.append(keepalive._watchdog)
    live = []
    for scheduler in schedulers:
        with scheduler._cond:
            jobs = [job for _, _, job in scheduler._heap]
        live += [job.lease for job in jobs if not job.finished() and hasattr(job, "lease")]
    return live


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # after every fixture of the test is torn down
    left = [lease for lease in _live_leases() if id(lease) not in _reported]
    if not left:
        return
    _reported.update(id(lease) for lease in left)
    with open(os.environ.get("LEASES_LEAKED_LEASES", "leaked-leases.txt"), "a") as out:
        for lease in left:
            out.write(f"{item.nodeid}\t{lease.name}\t{lease.backend}\n")
