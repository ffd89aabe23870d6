"""``acquire()``: validate, try, wait in the name's waiting room, try again, until the deadline.

Every argument is checked before the first round trip; the wait is bounded by ``timeout`` on
every backend; a won grant becomes a held lease through :meth:`~leases.handle.Lease.start`.
How long it took, and how much of that was waiting, goes out with ``lease_acquired`` (or
``lease_acquire_failed``) and in the ``leases.acquire`` and ``leases.wait`` spans, so metrics
and traces see the same numbers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from . import conf, signals, tracing
from ._arguments import valid_flag, valid_on_lost, valid_timeout, valid_ttl, warn_if_too_short
from ._event_loop import refuse_blocking
from ._finishing import finish
from .backends import Capability, Grant, LeaseBackend, first_try_until, get_backend, tries_until
from .errors import (
    BackendNotSupported,
    BackendUnavailable,
    LeaseAlreadyHeld,
    LeaseUnavailable,
)
from .handle import Lease, OnLost, held_by, holder_key
from .holders import holder_identity
from .keys import validate_lease_name
from .retry import SYSTEM_CLOCK, Backoff

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = [
    "STOP_READERS_EVERY",
    "Acquisition",
    "Request",
    "Timing",
    "acquire",
    "announce_failure",
    "arelease_quietly",
    "astart",
    "attempt",
    "prepare",
    "retry_failed_try",
    "start",
]

#: How often a waiting exclusive acquirer renews its stop sign for new readers (a round trip
#: of its own): well within the second the backends keep the sign, and not on every retry.
STOP_READERS_EVERY = 0.4

#: What ``with`` passes to ``__exit__``: the block's exception, if any, as ``sys.exc_info()``.
ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]

#: What :func:`start` starts: a :class:`Lease`, or a subclass (a semaphore's ``Slot``).
HandleT = TypeVar("HandleT", bound=Lease)

logger = logging.getLogger(__name__)


class Timing:
    """When an acquisition started, and how long it has spent waiting (monotonic seconds).

    A plain class with slots: one is made on every acquire."""

    __slots__ = ("started", "waited")

    def __init__(self, started: float | None = None, waited: float = 0.0) -> None:
        self.started = SYSTEM_CLOCK.monotonic() if started is None else started
        self.waited = waited

    def elapsed(self) -> float:
        return SYSTEM_CLOCK.monotonic() - self.started


def _grant(
    store: LeaseBackend,
    name: str,
    holder: str,
    ttl: float,
    timeout: float | None,
    timing: Timing,
    shared: bool = False,
) -> Grant:
    """Try; then, in the name's waiting room, wait for a release (or a backoff delay) and
    try again, until the deadline.

    Shared tries skip the waiting room (readers that can join do not need to queue behind each
    other); an exclusive waiter of a store with shared leases stops new readers on each retry.
    """
    deadline = None if timeout is None else timing.started + timeout
    if deadline is None:  # the common case: no bound to set
        grant = attempt(store, name, holder, ttl, deadline, shared)
    else:
        with first_try_until(deadline):
            grant = attempt(store, name, holder, ttl, deadline, shared)
    if grant is not None:
        return grant
    if timeout == 0:
        raise LeaseUnavailable(name, timeout)
    backoff = Backoff(deadline=deadline, floor=store.wait_at_least)
    waiting_since = SYSTEM_CLOCK.monotonic()
    attributes = {"leases.name": name, "leases.backend": store.alias}
    room = contextlib.nullcontext() if shared else store.waiting_room(name, timeout)
    writer = not shared and Capability.SHARED_LEASES in store.capabilities
    stop_readers_at = waiting_since
    won: Grant | None = None
    try:
        with tracing.span("leases.wait", attributes), room, tries_until(deadline):
            while True:
                if (
                    writer
                    and SYSTEM_CLOCK.monotonic() >= stop_readers_at
                    and _stop_new_readers(store, name)
                ):
                    stop_readers_at = SYSTEM_CLOCK.monotonic() + STOP_READERS_EVERY
                won = attempt(store, name, holder, ttl, deadline, shared)
                if won is not None:
                    return won
                delay = backoff.next_delay()
                if delay is None:
                    raise LeaseUnavailable(name, timeout)
                _wait(store, name, delay)
    except BaseException:
        if won is not None:
            # Won, then interrupted (or failed) while leaving the room, a round trip of its
            # own: nobody would get the grant, and the name would stay held for its TTL.
            _release_quietly(store, won)
        raise
    finally:
        timing.waited = SYSTEM_CLOCK.monotonic() - waiting_since


def attempt(
    store: LeaseBackend,
    name: str,
    holder: str,
    ttl: float,
    deadline: float | None,
    shared: bool = False,
) -> Grant | None:
    """One ``try_acquire`` (or ``try_acquire_shared``), tried once more if it could not reach
    its store and the deadline allows (:func:`retry_failed_try`)."""
    once = store.try_acquire_shared if shared else store.try_acquire
    try:
        return once(name, holder, ttl)
    except BackendUnavailable as exc:
        if not retry_failed_try(name, deadline, exc):
            raise
        return once(name, holder, ttl)


def retry_failed_try(name: str, deadline: float | None, exc: BackendUnavailable) -> bool:
    """Whether a try that failed to reach its store is tried once more, at once.

    A connection reset, or a server that closed an idle connection, fails one round trip;
    the backends drop such a connection and the next call makes a new one, so one more try
    tells a blip from a store that is really gone (a second failure is raised). Only before
    the deadline: ``timeout=0`` stays one try, and a silent store already cost this try its
    reply timeout. Safe: a try whose reply was lost may have been granted, but that grant is
    never believed (it ends by its TTL), and the second try is refused while it stands.
    """
    if deadline is not None and SYSTEM_CLOCK.monotonic() >= deadline:
        return False
    logger.debug("leases: a try for %r failed, trying once more: %s", name, exc)
    return True


def _give_back(ask: Request, won: Grant | None) -> None:
    """Undo an acquisition of ``ask`` that won ``won`` (``None``: nothing won) and ends in an
    exception all the same: one that is no ``Exception`` (a ``KeyboardInterrupt``, a task
    runner's time limit, whatever a signal handler raises) can arrive between the grant and
    the return of its handle, and ``lease_acquired`` receivers let it through. Its handle, if
    registered by then, is dropped (no longer "already held", watched or renewed), and the
    grant is released at once rather than left to keep the name from everyone until its TTL.
    Best effort: one release, bounded as every round trip is; its failure is logged, and the
    exception the acquisition ends in is the one raised. (Async: :func:`_agive_back`.)"""
    if won is None:
        return
    _drop_handle(ask, won)
    _release_quietly(ask.store, won)


def _drop_handle(ask: Request, won: Grant) -> None:
    """Drop the handle of ``won`` registered for ``ask``, if any (:func:`_give_back`)."""
    held = held_by(ask.key)
    if held is not None and held.token == won.token and held.name == won.name:
        held._abandon()


async def _agive_back(ask: Request, won: Grant | None) -> None:
    """:func:`_give_back`, awaited (the release runs to its end whatever cancels the caller)."""
    if won is None:
        return
    _drop_handle(ask, won)
    await arelease_quietly(ask.store, won)


def _release_quietly(store: LeaseBackend, grant: Grant) -> None:
    try:
        store.release(grant)
    except Exception as exc:  # any: the exception the acquire ends in goes on
        _not_released(grant, exc)


async def arelease_quietly(store: LeaseBackend, grant: Grant) -> None:
    """Release a grant won by an acquire that is ending in an exception, to its end whatever
    cancels the caller meanwhile; a failure to release is logged (the exception the acquire
    ends in is the one to report, and the grant then expires by its TTL)."""
    try:
        await finish(store.arelease(grant))
    except Exception as exc:  # any: the exception the acquire ends in goes on
        _not_released(grant, exc)


def _not_released(grant: Grant, exc: Exception) -> None:
    logger.warning("leases: %r, won as its acquire ended, not released: %s", grant.name, exc)


def _stop_new_readers(store: LeaseBackend, name: str) -> bool:
    """Best effort, like the wait: fairness saves readers' turns, the next try decides.
    Whether the stop was asked for (``False``: the store knew of no readers to stop)."""
    try:
        return store.stop_new_readers(name) is not False
    except BackendUnavailable as exc:
        logger.debug("leases: could not stop new readers of %r: %s", name, exc)
        return True


def _wait(store: LeaseBackend, name: str, delay: float) -> None:
    """Wait up to ``delay`` for a release; a failed wait only costs the wake-up.

    Waiting merely saves round trips: the next ``try_acquire`` is what decides, and it reports
    a store that is really gone. So a wait that fails (a socket timeout on a loaded machine)
    sleeps out the rest of its delay instead of failing the acquisition.
    """
    started = SYSTEM_CLOCK.monotonic()
    try:
        store.wait_for_release(name, delay)
    except BackendUnavailable as exc:
        logger.debug("leases: waiting for %r failed, retrying after the delay: %s", name, exc)
        SYSTEM_CLOCK.sleep(delay - (SYSTEM_CLOCK.monotonic() - started))


class Request(NamedTuple):
    """An acquisition's arguments, checked before any round trip (shared by ``acquire`` and
    ``aacquire``, so the two can never check differently). A named tuple: made on every
    acquire, and a frozen dataclass costs several times as much to make."""

    name: str
    ttl: float
    timeout: float | None
    store: LeaseBackend
    key: tuple[str, str, str]
    holder: str
    renew_fraction: float | None


def prepare(
    name: str,
    ttl: float | None,
    backend: str,
    timeout: float | None,
    keepalive: bool,
    holder: str | None,
    key_of: Callable[[LeaseBackend, str, str | None], tuple[str, str, str]],
    shared: bool = False,
) -> Request:
    """Validate every argument, refuse a name the caller already holds (under ``key_of``: per
    thread, or per task for async code), and warn of a TTL too short to keep alive. A shared
    lease on a backend without them raises :class:`BackendNotSupported` here."""
    name = validate_lease_name(name)
    settings = conf.get()
    ttl, short = _checked_ttl(ttl, settings)
    if timeout is not None:  # None, the common case, needs no call
        timeout = valid_timeout(timeout)
    store = get_backend(backend)
    if type(keepalive) is not bool or type(shared) is not bool:  # valid_flag's test, no call
        valid_flag("keepalive", keepalive)
        valid_flag("shared", shared)
    if shared and Capability.SHARED_LEASES not in store.capabilities:
        raise BackendNotSupported(store.alias, Capability.SHARED_LEASES.value)
    key = key_of(store, name, holder)
    identity = holder_identity(holder)
    held = held_by(key)
    if held is not None:
        raise LeaseAlreadyHeld(name, held.holder)
    if keepalive and short:
        warn_if_too_short(ttl, settings)
    fraction = settings.renew_fraction if keepalive else None
    # ``Request(...)`` without its generated ``__new__`` (a Python function, run on every
    # acquire just to pack the tuple).
    return tuple.__new__(Request, (name, ttl, timeout, store, key, identity, fraction))


#: TTLs found valid under one settings object (``conf.get()``'s, replaced whole when the
#: settings change), with whether each is too short to keep alive: a process passes the same
#: few TTLs to every acquire, and checking one against the settings anew costs four calls.
#: Bounded: a caller computing a new TTL per acquire gets each checked afresh.
_ttls: tuple[conf.LeasesSettings | None, dict[float | None, tuple[float, bool]]] = (None, {})
_MAX_TTLS = 64


def _checked_ttl(ttl: object, settings: conf.LeasesSettings) -> tuple[float, bool]:
    """``ttl`` (``None``: the default) as valid seconds under ``settings``, and whether it
    leaves too little time to retry a renewal (:func:`warn_if_too_short` warns then).

    Only a plain ``float``, ``int`` or ``None`` is remembered: ``True == 1`` but a bool is
    refused, and anything else may be unhashable or compare equal to what it is not."""
    global _ttls
    kind = type(ttl)
    if kind is not float and kind is not int and ttl is not None:
        seconds = valid_ttl(ttl, settings)
        return seconds, settings.retry_window(seconds) < conf.MIN_RETRY_WINDOW
    key: float | None = ttl  # type: ignore[assignment]  # as just checked
    known = _ttls
    if known[0] is not settings:
        known = _ttls = (settings, {})
    verdict = known[1].get(key)
    if verdict is None:
        # The default TTL was checked with the settings (``conf.problems``): a given one here.
        seconds = settings.default_ttl if key is None else valid_ttl(key, settings)
        verdict = (seconds, settings.retry_window(seconds) < conf.MIN_RETRY_WINDOW)
        if len(known[1]) < _MAX_TTLS:
            known[1][key] = verdict
    return verdict


def acquire(
    name: str,
    *,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
    shared: bool = False,
) -> Lease:
    """Acquire ``name`` and return the :class:`Lease`; the caller must ``release()`` it.

    ``timeout=None`` waits forever, ``0`` tries once; failing raises :class:`LeaseUnavailable`.
    With ``keepalive`` the lease is renewed in the background until released or lost.
    ``shared=True`` takes it as one of many readers (backends with
    :attr:`~leases.backends.Capability.SHARED_LEASES`): readers coexist, an exclusive lease of
    the name excludes them all, and a waiting exclusive acquirer stops new readers.
    """
    ask = prepare(name, ttl, backend, timeout, keepalive, holder, holder_key, shared)
    if on_lost is not None:  # None, the common case, needs no call
        valid_on_lost(on_lost)
    refuse_blocking("acquire()", "aacquire() or alease()")
    # What start() does, without a closure for the grant: this is every acquire's path.
    with Acquisition(ask) as doing:
        won = doing.won = _grant(
            ask.store, ask.name, ask.holder, ask.ttl, ask.timeout, doing, shared
        )
        return doing.hold(won, Lease, on_lost)


class Acquisition(Timing):
    """One acquisition of ``ask``: the ``leases.acquire`` span, its :class:`Timing` (itself,
    from when it is entered), :func:`announce_failure` when it gives up, and :func:`_give_back`
    of the grant it won (:attr:`won`) when it ends in an exception all the same; entered as
    ``with Acquisition(ask) as doing:`` (``async with`` where the grant is awaited, so the
    give-back is awaited too).

    The one block through which ``acquire``, ``acquire_slot`` and their async twins trace, time,
    announce and undo: the grant is won inside it (awaited or not), recorded in :attr:`won` as
    soon as it is, and :meth:`hold` turns it into a held handle. Undoing here rather than in
    each caller's ``try`` keeps the four paths from ever undoing differently. A plain class
    rather than a generator context manager, and its own timing rather than holding one: it is
    on every acquire's path.
    """

    __slots__ = ("_attributes", "_span", "_spanning", "ask", "won")

    _spanning: contextlib.AbstractContextManager[Span | None]
    _span: Span | None
    #: The grant won so far (``None``: none yet), given back if the block ends in an exception.
    won: Grant | None

    def __init__(self, ask: Request, attributes: tracing.Attributes | None = None) -> None:
        # Timing.__init__ is not called: the clock starts when the block is entered.
        self.ask = ask
        self._attributes = attributes

    def __enter__(self) -> Acquisition:
        spanning = self._spanning = tracing.span("leases.acquire", self._spanned)
        self._span = None if spanning is tracing.NO_SPAN else spanning.__enter__()
        self.started = SYSTEM_CLOCK.monotonic()
        self.waited = 0.0
        self.won = None
        return self

    async def __aenter__(self) -> Acquisition:
        return self.__enter__()

    def _spanned(self) -> tracing.Attributes:
        ask = self.ask
        return {
            "leases.name": ask.name,
            "leases.backend": ask.store.alias,
            "leases.ttl": ask.ttl,
            **(self._attributes or {}),
        }

    def __exit__(self, *exc_info: *ExcInfo) -> None:
        try:
            self._end(*exc_info)
        finally:
            if self.won is not None:
                _give_back(self.ask, self.won)

    async def __aexit__(self, *exc_info: *ExcInfo) -> None:
        try:
            self._end(*exc_info)
        finally:
            if self.won is not None:
                await _agive_back(self.ask, self.won)

    def _end(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Announce a failure and end the span; only once both are done does a block that
        ended well let :attr:`won` go (its handle has it), so an interrupt arriving until then
        still gives the grant back. The span never swallows an exception
        (:func:`tracing.span` re-raises), so neither does the block."""
        if isinstance(exc, Exception):
            announce_failure(self.ask, exc, self)
        if self._spanning is not tracing.NO_SPAN:
            self._spanning.__exit__(exc_type, exc, tb)
        if exc is None:
            self.won = None  # handed over with its handle: nothing to give back

    def hold(self, won: Grant, handle: type[HandleT], on_lost: OnLost | None) -> HandleT:
        """Start ``handle`` on the grant ``won`` (``lease_acquired``, keepalive, watchdog)."""
        ask = self.ask
        if self._span is not None:
            self._span.set_attributes({"leases.token": won.token, "leases.outcome": "acquired"})
        return handle.start(
            ask.store,
            won,
            on_lost=on_lost,
            renew_fraction=ask.renew_fraction,
            key=ask.key,
            elapsed=SYSTEM_CLOCK.monotonic() - self.started,  # self.elapsed(), inline
            waited=self.waited,
        )


def start(
    ask: Request,
    grant: Callable[[Timing], Grant],
    handle: type[HandleT],
    on_lost: OnLost | None,
    attributes: tracing.Attributes | None = None,
) -> HandleT:
    """Win ``grant`` (given the :class:`Timing` to fill) inside an :class:`Acquisition` and
    start ``handle`` on it: how ``acquire`` and ``acquire_slot`` hold, trace and time a name
    (their async twins: :func:`astart`). Giving up is announced with what it cost
    (:func:`announce_failure`; ``lease_acquired`` announces success, from
    :meth:`Lease.start`)."""
    valid_on_lost(on_lost)
    with Acquisition(ask, attributes) as doing:
        won = doing.won = grant(doing)
        return doing.hold(won, handle, on_lost)


async def astart(
    ask: Request,
    grant: Callable[[Timing], Awaitable[Grant]],
    handle: type[HandleT],
    on_lost: OnLost | None,
    attributes: tracing.Attributes | None = None,
) -> HandleT:
    """:func:`start` for an awaited ``grant``: ``aacquire`` and ``aacquire_slot`` (an
    interrupted one gives its grant back as :func:`start` does, awaited: ``_give_back``)."""
    valid_on_lost(on_lost)
    async with Acquisition(ask, attributes) as doing:
        won = doing.won = await grant(doing)
        return doing.hold(won, handle, on_lost)


def announce_failure(ask: Request, error: Exception, timing: Timing) -> None:
    """``lease_acquire_failed`` for ``ask``, with what trying cost (sync and async alike)."""
    signals.send(
        signals.lease_acquire_failed,
        ask.store.alias,
        name=ask.name,
        error=error,
        elapsed=timing.elapsed(),
        waited=timing.waited,
    )
