"""Redlock under contention: many threads of one process cycling on one name stay live.

A key left on a node by a try or release that was not given back keeps the name from every
contender until its TTL: with a 30 s TTL any such leak shows as a long stretch with no grant.
Round trips that a loaded box makes slower than the node timeout are tolerated (they are not
leaks); a contender that waits out its acquire timeout is not.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import Any

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings

from devservers import RedisServer
from leases import acquire
from leases.errors import BackendUnavailable
from tests import checker

pytestmark = [pytest.mark.django_db(transaction=True)]

CONTENDERS = 32
SECONDS = 5.0
TTL = 30.0
#: No grant for this long is a leak: far below the TTL, far above a loaded box's hiccups.
GAP = 8.0


def contended(nodes: list[str]) -> dict[str, Any]:
    leases: dict[str, Any] = settings.LEASES
    backends = dict(leases["BACKENDS"])
    backends["contended"] = {
        "ENGINE": "leases.backends.redlock",
        "NODES": nodes,
        "NODE_TIMEOUT": 1.0,  # as the contention benchmark
    }
    return {**leases, "BACKENDS": backends}


def test_many_contenders_each_get_the_lease_and_the_name_never_stalls(
    redis_servers: Any,
) -> None:
    """32 threads cycle on one name with a 30 s TTL: no stretch without a grant comes near
    the TTL, every thread holds it, tokens rise in grant order and fence every write.

    Before the fix a failed try's give-back (or a release) sent on a fresh connection could
    run on a node before the try's own ``SET``, still unread on another connection, which then
    held that node for the whole TTL; a few such leftovers left no quorum for anyone."""
    servers: list[RedisServer] = redis_servers(3)
    name = f"rl-contended-{uuid.uuid4().hex[:8]}"
    register = checker.new_register("redlock-contended")
    grants: list[tuple[float, int]] = []  # (when, token), appended while holding
    failures: list[BaseException] = []
    unreachable: list[BackendUnavailable] = []
    won = [0] * CONTENDERS
    stop_at = [0.0]
    start = threading.Barrier(
        CONTENDERS, action=lambda: stop_at.__setitem__(0, time.monotonic() + SECONDS)
    )

    def run(index: int) -> None:
        try:
            start.wait(30)
            while time.monotonic() < stop_at[0]:
                try:
                    held = acquire(name, ttl=TTL, backend="contended", keepalive=False, timeout=GAP)
                except BackendUnavailable as exc:  # every node slower than its timeout
                    unreachable.append(exc)
                    continue
                try:
                    grants.append((time.monotonic(), held.token))
                    won[index] += 1
                    if won[index] % 4 == 1:  # fenced writes, but not so many they pace it
                        checker.record_write(register, held, f"t{index}")
                finally:
                    try:
                        held.release()
                    except BackendUnavailable as exc:  # a node slower than its timeout
                        unreachable.append(exc)  # (on a loaded box): liveness is the point
        except BaseException as exc:  # reported by the test
            failures.append(exc)
        finally:
            connections.close_all()

    with override_settings(LEASES=contended([s.url for s in servers])):
        workers = [threading.Thread(target=run, args=(i,)) for i in range(CONTENDERS)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(SECONDS + 2 * GAP + 30)
        assert not any(worker.is_alive() for worker in workers), "a contender never returned"
    assert not failures, f"{len(failures)} contenders failed, first: {failures[0]!r}"
    times = [stop_at[0] - SECONDS, *(at for at, _ in grants), stop_at[0]]
    gaps = [later - earlier for earlier, later in itertools.pairwise(sorted(times))]
    assert max(gaps) < GAP, (
        f"no grant for {max(gaps):.1f} s (TTL {TTL} s): a key was left "
        f"({len(grants)} grants, {len(unreachable)} round trips unanswered)"
    )
    assert all(won), f"contenders that never held the lease: {won}"
    tokens = [token for _, token in grants]
    checker.check_history(register, grants=tokens)
