"""Counting semaphores: at most ``limit`` holders of a name at once, each holding a fenced lease.

Slot ``k`` of semaphore ``name`` is the ordinary lease ``name␟k`` (:func:`slot_name`;
user names may not contain ``␟``, so no lease somebody chose can collide with a slot). Taking
the semaphore means taking any one of its ``limit`` slots, so every guarantee of a lease holds
per slot on every backend, with no backend change: a token that strictly increases per slot,
the grant secret, keepalive, loss reported loudly, fenced writes (``fence=slot``), revocation
by an operator, and the admin and ``manage.py leases`` listing each slot.

Why slots rather than a native counting primitive per store: one design is then correct on the
database, Redis, Redlock, etcd and ZooKeeper alike (a native semaphore would be five new
protocols to prove, and tokens per holder would need a counter shared by the slots anyway). The
price is round trips while the semaphore is full: one try per slot, so a pass looks at the
deadline before each try (:class:`SlotTries`), not only at its end. Tries start at a random slot
(so contenders spread over the free ones instead of all racing for slot 0) and a full pass is
followed by a wait on the store's wake-up for one held slot, cut into slices because a
release of another slot does not wake it; hence :data:`MAX_LIMIT`. The slices are the
backoff's, short at first, but never shorter than the store's waits last
(``LeaseBackend.wait_at_least``): a Redis or Redlock wait cut short ends on the client's
deadline and drops its connection, so slices of a few milliseconds made every waiter of a full
semaphore reconnect eight times a second (425 new connections in 5 s for 10 waiters).

Changing ``limit`` for a name is safe but not instant: holders of slots at or above a new, lower
limit keep them until they release, so while they drain the name may have as many holders as
the highest limit any live holder used, never more; new acquirers only take slots below theirs.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast, overload

from ._event_loop import refuse_blocking
from .acquiring import Request, Timing, _wait, attempt, prepare, start
from .backends import Grant, LeaseBackend, first_try_until, tries_until
from .errors import InvalidLeaseOption, LeaseUnavailable
from .handle import Lease, OnLost, holder_key
from .keys import SEPARATOR, derived_name
from .lease import _default_name, _LeaseBlock
from .retry import SYSTEM_CLOCK, Backoff

__all__ = [
    "MAX_LIMIT",
    "Slot",
    "SlotTries",
    "acquire_slot",
    "all_held",
    "pass_bound",
    "prepare_slots",
    "semaphore",
    "slot_name",
    "slot_options",
    "slot_order",
    "valid_limit",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The largest ``limit``: a full pass costs one round trip per slot.
MAX_LIMIT = 256


class Slot(Lease):
    """A held slot of a semaphore: a :class:`~leases.lease.Lease` (``name`` is the slot's
    lease name, ``token`` its fencing token) that also says which semaphore and slot it is."""

    @property
    def semaphore(self) -> str:
        """The semaphore's name."""
        return self.name.rpartition(SEPARATOR)[0]

    @property
    def slot(self) -> int:
        """Which slot, from 0 to ``limit - 1``."""
        return int(self.name.rpartition(SEPARATOR)[2])

    def __repr__(self) -> str:
        return super().__repr__().replace("<Lease", "<Slot", 1)


def slot_name(name: str, slot: int) -> str:
    """The lease name of slot ``slot`` of semaphore ``name``."""
    return derived_name(name, str(slot))


def valid_limit(limit: object, option: str = "limit") -> int:
    """A positive int no greater than :data:`MAX_LIMIT`, checked before any round trip."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise InvalidLeaseOption(option, limit, "must be an int (how many may hold at once)")
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidLeaseOption(option, limit, f"must be between 1 and {MAX_LIMIT}")
    return limit


KeyOf = Callable[[LeaseBackend, str, str | None], tuple[str, str, str]]


def prepare_slots(
    name: str,
    limit: object,
    ttl: float | None,
    backend: str,
    timeout: float | None,
    keepalive: bool,
    holder: str | None,
    key_of: KeyOf = holder_key,
) -> tuple[Request, int]:
    """Check every argument before any round trip (``semaphore()``, ``acquire_slot()`` and
    their async twins alike). One registry entry per semaphore and holder under ``key_of``
    (per thread, or per task): a thread or task takes one slot of a name at a time (a second
    would be a nested block waiting on itself once the slots run out)."""
    limit = valid_limit(limit)

    def semaphore_key(store: LeaseBackend, name: str, holder: str | None) -> tuple[str, str, str]:
        return key_of(store, name + SEPARATOR, holder)

    ask = prepare(name, ttl, backend, timeout, keepalive, holder, semaphore_key)
    slot_name(ask.name, limit - 1)  # the longest slot name must fit
    return ask, limit


def slot_order(name: str, limit: int) -> list[str]:
    """The slots of one pass, from a random one: each pass is a fresh order, so contenders
    spread over the free slots instead of all racing for slot 0."""
    start = random.randrange(limit)
    return [slot_name(name, (start + offset) % limit) for offset in range(limit)]


def all_held(ask: Request, limit: int, tried: int) -> LeaseUnavailable:
    """What a wait for a slot that ran out of time raises, ``tried`` slots tried in its last
    pass: "all held" only when the pass tried them all (see :class:`SlotTries`)."""
    if tried >= limit:
        return LeaseUnavailable(ask.name, ask.timeout, f"all {limit} slots are held")
    return LeaseUnavailable(
        ask.name,
        ask.timeout,
        f"the timeout ran out after {tried} of its {limit} slots were tried in the last pass "
        f"(each held); the other {limit - tried} were not tried",
    )


class SlotTries:
    """The slots of one pass (:func:`slot_order`), cut short once the deadline has passed;
    ``tried`` counts the slots handed out, so the failure says how many were looked at.

    Each try is a round trip, so a pass that looked at the deadline only at its end made a
    failing ``timeout=T`` last at least ``limit`` tries: seconds over ``T`` on a slow store.
    A pass's first slot is always tried, as ``acquire()`` always tries after its wait (so a
    deadline is overrun by one try at most, as there); ``timeout=0`` tries every slot once,
    as documented: it asks "is any slot free now?", which only a whole pass answers."""

    __slots__ = ("ask", "deadline", "limit", "tried")

    def __init__(self, ask: Request, limit: int, deadline: float | None) -> None:
        self.ask = ask
        self.limit = limit
        self.deadline = deadline
        self.tried = 0

    def __iter__(self) -> Iterator[str]:
        timeout, deadline = self.ask.timeout, self.deadline
        for slot in slot_order(self.ask.name, self.limit):
            if (
                self.tried
                and timeout
                and deadline is not None
                and SYSTEM_CLOCK.monotonic() >= deadline
            ):
                return
            self.tried += 1
            yield slot


def pass_bound(deadline: float | None, first: bool) -> contextlib.AbstractContextManager[None]:
    """How long a pass's tries may wait on their own (a ZooKeeper try (re)connecting): the
    first pass as ``acquire()``'s first try (:func:`~leases.backends.first_try_until`, so a
    first connection has its second), later ones to the deadline, as its retries. Without
    it a try against a silent store waits out the backend's own bound (ZooKeeper's: the TTL),
    far past the acquisition's deadline."""
    return first_try_until(deadline) if first else tries_until(deadline)


def _grant(ask: Request, limit: int, timing: Timing) -> Grant:
    """Try the slots from a random one, until one is won or the deadline has passed
    (:class:`SlotTries`); then wait a slice on one held slot; until the deadline."""
    deadline = None if ask.timeout is None else timing.started + ask.timeout
    backoff = Backoff(deadline=deadline, floor=ask.store.wait_at_least)
    waiting_since: float | None = None
    try:
        while True:
            tries = SlotTries(ask, limit, deadline)
            with pass_bound(deadline, first=waiting_since is None):
                for slot in tries:
                    grant = attempt(ask.store, slot, ask.holder, ask.ttl, deadline)
                    if grant is not None:
                        return grant
            delay = None if ask.timeout == 0 else backoff.next_delay()
            if delay is None:
                raise all_held(ask, limit, tries.tried)
            if waiting_since is None:
                waiting_since = SYSTEM_CLOCK.monotonic()
            _wait(ask.store, slot, delay)
    finally:
        if waiting_since is not None:
            timing.waited = SYSTEM_CLOCK.monotonic() - waiting_since


def acquire_slot(
    name: str,
    *,
    limit: int,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
) -> Slot:
    """Take one of the ``limit`` slots of semaphore ``name``; the caller must ``release()`` it.

    The other arguments are :func:`~leases.acquire`'s, with its guarantees: everything is
    checked before the first round trip (``limit`` must be an int from 1 to :data:`MAX_LIMIT`),
    ``timeout=None`` waits forever and ``0`` tries each slot once, and failing raises
    :class:`~leases.errors.LeaseUnavailable` within the timeout.
    """
    ask, limit = prepare_slots(name, limit, ttl, backend, timeout, keepalive, holder)
    refuse_blocking("acquire_slot()", "aacquire_slot() or asemaphore()")
    grant = functools.partial(_grant, ask, limit)
    return start(ask, grant, Slot, on_lost, {"leases.limit": limit})


class _SemaphoreBlock(_LeaseBlock):
    """What ``semaphore()`` returns: ``lease()``'s block, entered by taking a slot."""

    _acquire = staticmethod(acquire_slot)

    def __enter__(self) -> Slot:
        return cast(Slot, super().__enter__())


@overload
def semaphore(
    name: str | None = None,
    /,
    *,
    limit: int,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
) -> _SemaphoreBlock: ...
@overload
def semaphore(name: F, /, *, limit: int) -> F: ...
def semaphore(
    name: str | Callable[..., Any] | None = None,
    /,
    *,
    limit: int,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
) -> Any:
    """Hold one of ``limit`` slots of ``name`` for a ``with`` block or a decorated function.

    ``with semaphore("export:acme", limit=3) as slot:`` runs the block while at most two others
    run theirs; ``slot`` is a :class:`Slot`, to pass to fenced writes. As a decorator without a
    name, the name is the function's (``module.qualname``). Leaving releases the slot; a body
    that outlived its slot raises :class:`~leases.errors.LeaseLost`, as with ``lease()``.
    ``limit`` is checked here, so a bad one fails where the decorator is written.
    """
    options = slot_options(limit, ttl, backend, timeout, keepalive, on_lost, holder)
    if callable(name):
        return _SemaphoreBlock(_default_name(name), options)(name)
    return _SemaphoreBlock(name, options)


def slot_options(
    limit: object,
    ttl: float | None,
    backend: str,
    timeout: float | None,
    keepalive: bool,
    on_lost: OnLost | None,
    holder: str | None,
) -> dict[str, Any]:
    """A block's arguments (``semaphore()`` and ``asemaphore()``), ``limit`` checked here so
    a bad one fails where the decorator is written, not at the first call."""
    return {
        "limit": valid_limit(limit),
        "ttl": ttl,
        "backend": backend,
        "timeout": timeout,
        "keepalive": keepalive,
        "on_lost": on_lost,
        "holder": holder,
    }
