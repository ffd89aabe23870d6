"""A claim is not durable, what commits under it is: PostgreSQL crashes right after claims.

The row claim commits its started row with ``synchronous_commit`` off for its own transaction
(:data:`idempotency.statements.ASYNC_CLAIM_SQL`): a first request or task pays one WAL flush
instead of two. These tests crash a server of their own (``tests.crashing``) and check what that
may cost: a claim lost in the crash frees its key at once, which is what the retry wants, since
nothing committed under it; and a claim whose attempt committed is never lost while its effects
survive (the outcome's durable commit flushes the WAL before it, the claim's included), so a
retry can never run committed effects a second time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections

from idempotency.store import Attempt, Begun, Outcome, Status, begin
from tests.crashing import crash_after
from tests.testapp.models_idempotency import Charge

pytestmark = pytest.mark.fault

FP = "f" * 64
OUTCOME = Outcome(status=201, headers=[("Content-Type", "text/plain")], body=b"charged")


@pytest.fixture
def crashable(fault_database: tuple[str, Any], django_db_blocker: Any) -> Iterator[tuple[str, Any]]:
    with django_db_blocker.unblock():
        yield fault_database


def _begin(alias: str, key: str) -> Begun:
    return begin("crash", key, FP, ttl=60, lock_timeout=60, using=alias)


@pytest.mark.parametrize("by_name", [False, True], ids=["prepared_here", "run_by_name"])
def test_a_claim_lost_in_a_crash_frees_its_key_at_once(
    crashable: tuple[str, Any], by_name: bool
) -> None:
    """Fails with a durable claim: the started row would come back locked for LOCK_TIMEOUT.
    A session's first claim prepares the statement in its query; later ones run it by name
    through libpq (``idempotency._direct``): the same statement, so the same commit."""
    alias, server = crashable
    if by_name:
        assert _begin(alias, "k-earlier").status is Status.NEW
    claimed: list[Begun] = []
    crash_after(server, lambda: claimed.append(_begin(alias, "k-lost")))
    assert claimed[0].status is Status.NEW
    connections[alias].close()  # its session ended with the crash
    again = _begin(alias, "k-lost")
    assert again.status is Status.NEW, "the claim was flushed before the crash"
    assert again.claim is not None and not again.claim.taken_over


def test_effects_committed_under_a_claim_survive_a_crash_with_their_key(
    crashable: tuple[str, Any],
) -> None:
    alias, server = crashable

    def claim_charge_and_commit() -> None:
        claim = _begin(alias, "k-kept").claim
        assert claim is not None
        attempt = Attempt(claim, atomic=True, ttl=60)
        attempt.start()
        Charge.objects.using(alias).create(key="k-kept", amount=1)
        attempt.commit(OUTCOME)

    crash_after(server, claim_charge_and_commit)
    connections[alias].close()
    done = _begin(alias, "k-kept")
    assert done.status is Status.COMPLETED and done.outcome == OUTCOME
    assert Charge.objects.using(alias).filter(key="k-kept").count() == 1
