"""A release is not durable, a grant is: PostgreSQL crashes right after releases.

The release statement commits with ``synchronous_commit`` off for its own transaction (one WAL
flush per critical section instead of two). These tests crash a server of their own right after
releases and check what that may cost: a lost release leaves the name held by the grant that
was released, with the same token, until its TTL runs out; a later grant is never lost, never
handed out twice, and tokens never go backwards.

To lose the release for certain, the WAL writer is stopped (SIGSTOP) before it, so the commit
record stays in shared memory, and then killed (SIGKILL): the postmaster treats a child killed
that way as a crash, ends every other backend at once and recovers from the WAL on disk, which
is what ``pg_ctl -m immediate`` and a power cut leave behind (the test server runs with
``fsync=off``, but a killed server's ``write()``s stay in the OS page cache, so only what was
never written is lost).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from leases import LeaseUnavailable, acquire
from leases.backends import get_backend
from leases.backends.database import Backend
from leases.handle import Lease
from tests.crashing import crash_after

pytestmark = pytest.mark.fault

#: Long enough that a grant whose release was lost is still valid after a slow recovery on a
#: loaded machine; the tests then move on with a forced release instead of waiting it out.
TTL = 60.0


def crash_backends(alias: str) -> dict[str, Any]:
    leases: dict[str, Any] = settings.LEASES
    backends = dict(leases["BACKENDS"])
    backends["crash"] = {"ENGINE": "leases.backends.database", "DATABASE": alias}
    return {**leases, "BACKENDS": backends}


def test_a_release_lost_in_a_crash_leaves_its_grant_to_expire_and_tokens_move_on(
    fault_database: tuple[str, Any],
) -> None:
    alias, server = fault_database
    with override_settings(LEASES=crash_backends(alias)):
        backend = get_backend("crash")
        assert isinstance(backend, Backend)
        first = acquire("crash-release", ttl=TTL, backend="crash", keepalive=False)
        crash_after(server, first.release)
        info = backend.inspect("crash-release")
        # The release was not durable: the row is the released grant's, token unchanged.
        assert info is not None and info.holder == first.holder, "the release was flushed"
        assert info.held and info.token == first.token
        # Nobody else gets the name while that grant's TTL runs...
        with pytest.raises(LeaseUnavailable):
            acquire("crash-release", ttl=TTL, backend="crash", timeout=0, holder="other")
        # ...and once it ends (forced here, rather than waiting out the TTL) the next grant
        # has a higher token.
        backend.force_release("crash-release", first.token)
        second = acquire("crash-release", ttl=TTL, backend="crash", timeout=0)
        assert second.token > first.token
        second.release()


def test_a_grant_after_a_release_survives_the_crash_and_so_does_the_release(
    fault_database: tuple[str, Any],
) -> None:
    """The grant's durable commit flushes the WAL up to itself, the release included: a crash
    can never keep the later grant and lose the release before it (two holders)."""
    alias, server = fault_database
    with override_settings(LEASES=crash_backends(alias)):
        backend = get_backend("crash")
        tokens: list[int] = []
        kept: list[Lease] = []

        def release_then_grant() -> None:
            first = acquire("crash-grant", ttl=TTL, backend="crash", keepalive=False)
            first.release()
            second = acquire(
                "crash-grant", ttl=TTL, backend="crash", keepalive=False, holder="second"
            )
            tokens.extend([first.token, second.token])
            kept.append(second)

        crash_after(server, release_then_grant)
        info = backend.inspect("crash-grant")
        assert info is not None and info.held
        assert (info.holder, info.token) == ("second", tokens[1])
        assert tokens[1] > tokens[0]
        with pytest.raises(LeaseUnavailable):
            acquire("crash-grant", ttl=TTL, backend="crash", timeout=0, holder="third")
        kept[0].release()  # not left to the watchdog, which would report it lost in a later test


def test_releases_then_crashes_never_regress_tokens_or_grant_twice(
    fault_database: tuple[str, Any],
) -> None:
    """Several crash rounds, each right after a burst of grants and releases."""
    alias, server = fault_database
    with override_settings(LEASES=crash_backends(alias)):
        backend = get_backend("crash")
        highest = 0
        for _ in range(3):
            last: list[Any] = []

            def burst(last: list[Any] = last) -> None:
                for _ in range(5):
                    held = acquire("crash-burst", ttl=TTL, backend="crash", keepalive=False)
                    held.release()
                    last[:] = [held]

            crash_after(server, burst)
            (held,) = last
            assert held.token > highest
            info = backend.inspect("crash-burst")
            assert info is not None and info.token == held.token  # never lower, never higher
            if info.holder:  # the last release was lost: its grant must end first
                assert info.holder == held.holder and info.held
                with pytest.raises(LeaseUnavailable):
                    acquire("crash-burst", ttl=TTL, backend="crash", timeout=0, holder="x")
                backend.force_release("crash-burst", held.token)
            nxt = acquire("crash-burst", ttl=TTL, backend="crash", timeout=0)
            assert nxt.token > held.token
            nxt.release()
            highest = nxt.token
