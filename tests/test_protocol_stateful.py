"""Random sequences of lease operations on every backend, checked step by step.

Hypothesis drives one lease name per example through acquire, renew, release, an operator's
force release, expiry (waiting past a short TTL), fenced writes and crashes (a handle dropped
without a release, so its grant expires), and after every step :class:`Contract`, a small
reference model of what DESIGN.md promises, says which outcomes were allowed. A failure
shrinks to the shortest sequence of steps that breaks the contract. It is the model checked in
``model/leases.pml``, run against the real servers instead of an abstraction of them.

Time is the only source of doubt: the server decided a grant's expiry somewhere between the
moment its request was sent and the moment the reply came back, and a loaded machine may
stretch that. So each grant carries the window in which it certainly lives and the instant
after which it certainly does not; in between, the model accepts either outcome. TTLs are 1 s
(short) or 30 s (long); nothing asserts a duration.

Profiles: ``LEASES_HYPOTHESIS_PROFILE=ci`` (the default: a few short examples per backend)
or ``long`` (many longer ones, for local runs).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from leases import (
    LeaseAlreadyHeld,
    LeaseError,
    LeaseLost,
    LeaseNotHeld,
    LeaseUnavailable,
    acquire,
)
from leases.backends import get_backend
from leases.lease import Lease
from leases.operations import force_release
from leases.revocation import Offer
from tests.checker import ACCEPTED, LOST, REVOKED, STALE, check_history, history, record_write
from tests.lease_backends import lease_backend
from tests.test_revocation import operator
from tests.testapp.models_fencing import FencedRegister

__all__ = ["lease_backend", "operator"]  # fixtures, re-exported for pytest

_BASE = settings(
    deadline=None,  # one step is a few round trips; a loaded machine must not fail them
    database=None,  # no .hypothesis/ directory in the work tree
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile("ci", _BASE, max_examples=20, stateful_step_count=15)
settings.register_profile("long", _BASE, max_examples=200, stateful_step_count=40)
PROFILE = settings.get_profile(os.environ.get("LEASES_HYPOTHESIS_PROFILE", "ci"))

SHORT_TTL = 1.0
LONG_TTL = 30.0
#: How far the server's decision may sit outside the [sent, replied] window of a request
#: (Redis rounds PX to milliseconds; clocks tick at very nearly the same rate).
SLACK = 0.05
#: Waiting for expiry goes this far past the latest moment a short grant may live.
EXPIRY_MARGIN = 0.3
#: How much later than the TTL a store may still report an expired grant as held. etcd grants
#: whole seconds (a 1 s request may get its minimum) and its leader revokes expired leases
#: through Raft on a periodic check, so a lapsed lease can linger; the holder itself still
#: counts the TTL it asked for (it only gives up early), which is what safety needs.
SERVER_EXPIRY_LAG = {"etcd": 3.0}
#: Waits for expiry per example: each costs about a second.
MAX_WAITS = 1
#: A call slower than this may legitimately fail where a quick one must succeed: Redlock gives
#: up a grant (or renewal) won too late to be worth anything, and a node that timed out may
#: still hold what a release could not reach. Slow calls get the benefit of the doubt.
QUICK = 0.25


def now() -> float:
    return time.monotonic()


@dataclass(eq=False)
class Grant:
    """One grant as the contract sees it, with the handle its client holds."""

    lease: Lease
    client: int
    ttl: float
    sent: float  # when the request that last set its expiry was sent
    replied: float  # and when its reply arrived
    released: bool = False  # release() was called on the handle
    lost: bool = False  # the handle was told it is lost (a refused renewal)
    ended: bool = False  # certainly no longer held in the store (released or revoked)

    def __repr__(self) -> str:
        return f"<grant token {self.lease.token} ttl {self.ttl:g}>"

    @property
    def token(self) -> int:
        return self.lease.token

    def certainly_live(self, at: float) -> bool:
        """The store surely still holds it at ``at`` (unless released or superseded)."""
        return not self.ended and at < self.sent + self.ttl - SLACK

    def possibly_live(self, at: float) -> bool:
        return not self.ended and at < self.replied + self.ttl + SLACK

    def extended(self, sent: float, replied: float) -> None:
        self.sent, self.replied = sent, replied

    def doubt(self) -> None:
        """The store may or may not hold it any more (until it certainly expired)."""
        self.sent = float("-inf")


@dataclass
class Contract:
    """What the store and the resource may do, given everything done so far."""

    grants: list[Grant] = field(default_factory=list)
    fence: int = 0  # the highest token the resource accepted
    revoked: int = 0  # the revoked-through token
    highest: int = 0  # the highest token handed out or revoked into

    def holder(self) -> Grant | None:
        """The only grant the store may hold: the newest, unless it ended (older grants were
        superseded: a grant is only issued when the previous one is not held)."""
        newest = self.grants[-1] if self.grants else None
        return newest if newest is not None and not newest.ended else None

    def surely_held(self, at: float) -> Grant | None:
        grant = self.holder()
        return grant if grant is not None and grant.certainly_live(at) else None

    def maybe_held(self, at: float) -> bool:
        grant = self.holder()
        return grant is not None and grant.possibly_live(at)

    def write_outcome(self, token: int) -> str:
        """What the fenced statement must answer (FENCE_SQL / the fenced UPDATE)."""
        if self.fence > token:
            return STALE
        return REVOKED if self.revoked >= token else ACCEPTED


class LeaseProtocol(RuleBasedStateMachine):
    """Operations on one name of backend :attr:`alias`, against :class:`Contract`."""

    alias: ClassVar[str] = "default"
    operator: ClassVar[Any] = None

    grants = Bundle("grants")

    def __init__(self) -> None:
        super().__init__()
        self.name = f"protocol-{uuid.uuid4().hex[:12]}"
        self.register = self.name
        self.store = get_backend(self.alias)
        self.contract = Contract()
        self.waits = 0
        self.expiry_lag = SERVER_EXPIRY_LAG.get(self.alias, 0.0)

    # -- the rules ----------------------------------------------------------------------

    @rule(target=grants, client=st.integers(0, 1), short=st.booleans())
    def take(self, client: int, short: bool) -> Any:
        ttl = SHORT_TTL if short else LONG_TTL
        start = now()
        try:
            held = acquire(
                self.name,
                ttl=ttl,
                backend=self.alias,
                timeout=0,
                keepalive=False,
                holder=f"client-{client}",  # every grant of a client: stale handles share it
            )
        except LeaseAlreadyHeld:
            # Refused locally while the client's previous handle is neither released nor
            # known lost (its watchdog forgets it once its validity ran out).
            mine = [g for g in self.contract.grants if g.client == client]
            assert mine and not mine[-1].released, "refused as held by a released handle"
            return multiple()
        except LeaseUnavailable:
            quick = now() - start < QUICK
            assert self.contract.maybe_held(start) or not quick, "a free name was refused"
            return multiple()
        end = now()
        assert self.contract.surely_held(end) is None, "a held name was granted again"
        assert held.token > self.contract.highest, (
            f"token {held.token} does not exceed {self.contract.highest}, handed out before"
        )
        grant = Grant(held, client, ttl, held.grant.sent_at, end)
        self.contract.grants.append(grant)
        self.contract.highest = held.token
        return grant

    @rule(grant=grants)
    def renew(self, grant: Grant) -> None:
        valid_until = grant.lease.valid_until  # before the renewal moves it on
        usable = not (grant.released or grant.lost)
        start = now()
        try:
            renewed = grant.lease.renew()
        except LeaseLost:
            end = now()
            quick = end - start < QUICK
            assert not (
                quick
                and usable
                and end < valid_until
                and self.contract.holder() is grant
                and grant.certainly_live(end)
            ), "a renewal of a held, valid grant was refused"
            grant.lost = True
            grant.doubt()  # a refused Redlock renewal also gives the grant up
            return
        assert usable and start < valid_until, "a released, lost or expired handle renewed"
        assert self.contract.holder() is grant and grant.possibly_live(start), (
            "a renewal succeeded for a grant the store no longer holds"
        )
        grant.extended(renewed.sent_at, now())

    @rule(grant=grants)
    def release(self, grant: Grant) -> None:
        start = now()
        try:
            grant.lease.release()
            outcome = "released"
        except LeaseNotHeld:
            outcome = "twice"
        except LeaseLost:
            outcome = "lost"
        end = now()
        if grant.released:
            assert outcome == "twice", f"a second release answered {outcome!r}"
            return
        grant.released = True
        holder = self.contract.holder()
        if outcome == "released":
            assert not grant.lost, "a handle that knew it was lost released quietly"
            assert holder is grant and grant.possibly_live(start), (
                "a release succeeded for a grant the store no longer holds"
            )
            grant.ended = True
            return
        assert outcome == "lost", f"a first release answered {outcome!r}"
        if end - start < QUICK:
            assert not (
                holder is grant and grant.certainly_live(end) and end < grant.lease.valid_until
            ), "the release of a held, valid grant was refused"
            grant.ended = True  # refused by the store, or freed by a handle that knew it lost
        else:
            grant.doubt()  # a node that timed out may still hold it, until it expires

    @precondition(lambda self: bool(self.contract.grants))
    @rule(pick=st.integers(0, 3))
    def force_release(self, pick: int) -> None:
        """The operator names a grant's token (0: the newest grant; more: older ones)."""
        grants = self.contract.grants
        grant = grants[max(0, len(grants) - 1 - pick)]
        start = now()
        try:
            record = force_release(
                self.name, backend=self.alias, token=grant.token, user=self.operator, via="test"
            )
        except LeaseNotHeld:
            end = now()
            assert end - start >= QUICK or self.contract.surely_held(end) is not grant, (
                "force release refused a grant the store surely holds"
            )
            return
        assert self.contract.holder() is grant and grant.possibly_live(start), (
            "force release evicted a grant the store no longer holds"
        )
        grant.ended = True
        self.contract.revoked = max(self.contract.revoked, grant.token)
        self.contract.highest = max(self.contract.highest, int(record.new_token))

    @rule(grant=grants)
    def write(self, grant: Grant) -> None:
        start = now()
        record_write(self.register, grant.lease, grant.lease.holder)
        end = now()
        outcome = history(self.register)[-1].outcome
        if grant.released or grant.lost or start >= grant.lease.valid_until:
            assert outcome == LOST, f"a handle that must know it is lost wrote ({outcome})"
            return
        if outcome == LOST:
            assert end >= grant.lease.valid_until, "a valid handle refused to write (lost)"
            return
        expected = self.contract.write_outcome(grant.token)
        assert outcome == expected, f"token {grant.token}: {outcome}, the contract says {expected}"
        if outcome == ACCEPTED:
            self.contract.fence = grant.token

    @rule(grant=grants)
    def write_after_pause(self, grant: Grant) -> None:
        """The holder checked its lease, was paused, and its write arrives only now.

        An :class:`Offer` is what a fenced write carries once ``ensure_held()`` has passed, so
        this is the paused holder's statement: only the fence and the revocation can stop it.
        """
        record_write(self.register, Offer(grant.token, self.alias, self.name), grant.lease.holder)
        outcome = history(self.register)[-1].outcome
        expected = self.contract.write_outcome(grant.token)
        assert outcome == expected, f"token {grant.token}: {outcome}, the contract says {expected}"
        if outcome == ACCEPTED:
            self.contract.fence = grant.token

    @rule(grant=consumes(grants))
    def crash(self, grant: Grant) -> None:
        """The holder dies: nobody uses the handle again (its grant expires in the store)."""

    # Not a function of time: Hypothesis must be able to replay the same steps when it shrinks.
    @precondition(
        lambda self: (
            self.waits < MAX_WAITS
            and any(g.ttl == SHORT_TTL and not g.ended for g in self.contract.grants)
        )
    )
    @rule()
    def expire(self) -> None:
        """Wait until every short grant has certainly expired (on a loaded machine too)."""
        self.waits += 1
        short = [g for g in self.contract.grants if g.ttl == SHORT_TTL and not g.ended]
        until = max(g.replied + g.ttl + SLACK for g in short) + self.expiry_lag
        time.sleep(max(0.0, until + EXPIRY_MARGIN - now()))

    # -- after every step ---------------------------------------------------------------

    @invariant()
    def store_agrees(self) -> None:
        start = now()
        info = self.store.inspect(self.name)
        end = now()
        surely = self.contract.surely_held(end)
        if surely is not None:
            assert info is not None and info.held and info.token == surely.token, (
                f"the store shows {info}, but grant {surely.token} surely holds the name"
            )
        if not self.contract.maybe_held(start - self.expiry_lag):
            assert info is None or not info.held, f"the store shows {info}, but nobody holds it"
        if info is not None:
            assert info.token >= self.contract.highest, "the store's token went backwards"

    @invariant()
    def resource_agrees(self) -> None:
        rows = FencedRegister.objects.filter(name=self.register)
        stored = rows.values_list("fencing_token", flat=True).first() or 0
        assert stored == self.contract.fence, (
            f"the resource holds token {stored}, the contract {self.contract.fence}"
        )

    def teardown(self) -> None:
        for grant in self.contract.grants:
            if not grant.released:
                with contextlib.suppress(LeaseError):  # cleanup only: the name is fresh per example
                    grant.lease.release()
        grants = self.contract.grants
        revoked = [g.token for g in grants if g.token <= self.contract.revoked]
        check_history(self.register, [g.token for g in grants], revoked=revoked)


@pytest.mark.slow
def test_random_operation_sequences_keep_the_contract(lease_backend: str, operator: Any) -> None:
    machine = type(
        f"LeaseProtocol_{lease_backend}",
        (LeaseProtocol,),
        {"alias": lease_backend, "operator": operator},
    )
    # etcd's expiry waits are seconds longer (SERVER_EXPIRY_LAG): half the examples there keep
    # its run near the others' (47 s of a 15-minute suite, otherwise); the long profile keeps
    # its count.
    examples = PROFILE.max_examples
    if lease_backend in SERVER_EXPIRY_LAG and PROFILE is settings.get_profile("ci"):
        examples = max(1, examples // 2)
    run_state_machine_as_test(machine, settings=settings(PROFILE, max_examples=examples))
