"""The async twins of ``acquire()`` and ``lease()``: ``aacquire()`` and ``alease()``.

Same arguments, same validation, same handle: a won grant becomes a held
:class:`~leases.handle.Lease` through :meth:`~leases.handle.Lease.start`, so keepalive, the
watchdog, signals and ``ensure_held()`` are the ones sync code gets (see
:mod:`leases.keepalive` for why renewal stays on a thread). What differs is waiting:

- every round trip goes through the backend's async methods
  (:meth:`~leases.backends.LeaseBackend.atry_acquire`, ``await_for_release``...), real async I/O
  where the driver has it, so the event loop never blocks;
- the wait is bounded by ``timeout`` like the sync one (``asyncio.timeout`` guards the
  backend's own bound);
- cancelling the awaiting task stops the wait at once and leaves nothing held: a try already
  on the wire is awaited to its end and, if it won, given back before the cancellation is
  raised;
- "already held" is per task, not per thread: coroutines of one event loop share its thread
  but contend for a name like threads do (``LeaseAlreadyHeld`` only when the same task
  re-enters). Exclusive waiters queue in the backend's waiting room as sync ones do
  (:meth:`~leases.backends.LeaseBackend.awaiting_room`: on the database backend, the same
  per-name queue on async connections, so a release wakes the one task inside, in arrival
  order; on ZooKeeper, the name's line, woken by the watch on the predecessor only); backends
  without one back off and are woken by the release (``WAIT_WITHOUT_POLLING`` backends).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import itertools
import logging
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, NoReturn, ParamSpec, TypeVar, overload

from . import tracing
from ._arguments import valid_decoration, valid_on_lost
from ._finishing import finish
from .acquiring import (
    STOP_READERS_EVERY,
    Acquisition,
    Timing,
    arelease_quietly,
    prepare,
    retry_failed_try,
)
from .backends import Capability, Grant, LeaseBackend, first_try_until, tries_until
from .errors import BackendUnavailable, InvalidLeaseOption, LeaseUnavailable
from .handle import Lease, OnLost
from .lease import _default_name, _settle
from .retry import SYSTEM_CLOCK, Backoff

__all__ = ["aacquire", "alease"]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
AsyncFunc = Callable[P, Coroutine[Any, Any, R]]

#: How far past its own bound a backend's wait may run before ``asyncio.timeout`` cuts it.
_WAIT_SLACK = 0.05
#: The longest one wait of a waiter without a deadline (a waiting room's wait for the
#: release lasts up to its own queueing bound, a second: this only guards against more).
_LONGEST_WAIT = 5.0


#: A number per task, never given twice: ``id(task)`` is the address of the task, which
#: CPython hands to a later task once this one is freed, and a lease taken in a task that
#: ended (``asyncio.wait_for`` runs its awaitable in a task of its own before Python 3.12)
#: would then be "already held" by an unrelated task.
_task_numbers: weakref.WeakKeyDictionary[asyncio.Task[Any], int] = weakref.WeakKeyDictionary()
_next_task_number = itertools.count(1)


def task_key(store: LeaseBackend, name: str, holder: str | None) -> tuple[str, str, str]:
    """Who "already holds" a name in async code: an explicit holder, else the current task."""
    if holder is not None:
        return (store.alias, name, holder)
    task = asyncio.current_task()
    if task is None:  # not in a task (a coroutine driven by hand): no task to hold it
        return (store.alias, name, "task:none")
    number = _task_numbers.get(task)
    if number is None:
        number = _task_numbers.setdefault(task, next(_next_task_number))
    return (store.alias, name, f"task:{number}")


async def _try(
    store: LeaseBackend,
    name: str,
    holder: str,
    ttl: float,
    deadline: float | None,
    shared: bool = False,
) -> Grant | None:
    """One ``atry_acquire`` (or ``atry_acquire_shared``), never abandoned halfway: if the
    caller is cancelled while it is on the wire, it is awaited to its end and a grant it won
    is released, then the cancellation is raised (:func:`~leases._finishing.finish`).
    Otherwise a cancelled acquire could hold the name, unseen, until its TTL. A try that
    could not reach its store is tried once more as the sync one is
    (:func:`~leases.acquiring.retry_failed_try`)."""
    trying = store.atry_acquire_shared if shared else store.atry_acquire
    try:
        return await finish(trying(name, holder, ttl), store.arelease)
    except BackendUnavailable as exc:
        if not retry_failed_try(name, deadline, exc):
            raise
        return await finish(trying(name, holder, ttl), store.arelease)


async def _wait(store: LeaseBackend, name: str, delay: float, bound: float = 0.0) -> None:
    """Wait up to ``delay`` for a release (a waiting room may wait longer, up to ``bound``:
    a waiter inside it is woken by the release, not by its backoff); as in the sync loop, a
    failed wait only costs the wake-up (the next try decides and reports a store that is
    really gone)."""
    started = SYSTEM_CLOCK.monotonic()
    try:
        async with asyncio.timeout(max(delay, bound) + _WAIT_SLACK):
            await store.await_for_release(name, delay)
    except (BackendUnavailable, TimeoutError) as exc:
        logger.debug("leases: waiting for %r failed, retrying after the delay: %s", name, exc)
        await asyncio.sleep(max(0.0, delay - (SYSTEM_CLOCK.monotonic() - started)))


async def _await_grant(
    store: LeaseBackend,
    name: str,
    holder: str,
    ttl: float,
    timeout: float | None,
    deadline: float | None,
    timing: Timing,
    shared: bool = False,
) -> Grant:
    """After a first try that lost (:func:`aacquire` makes it, with :func:`_try` as every
    try): wait for a release (or a backoff delay) and try again, until the deadline. How long
    the waiting took goes into ``timing`` (for the signals), as in the sync loop. An exclusive
    waiter of a store with shared leases stops new readers as the sync one does (every
    :data:`~leases.acquiring.STOP_READERS_EVERY` seconds)."""
    if timeout == 0:
        raise LeaseUnavailable(name, timeout)
    backoff = Backoff(deadline=deadline, floor=store.wait_at_least)
    writer = not shared and Capability.SHARED_LEASES in store.capabilities
    waiting_since = stop_readers_at = SYSTEM_CLOCK.monotonic()
    attributes = {"leases.name": name, "leases.backend": store.alias}
    room = contextlib.nullcontext() if shared else store.awaiting_room(name, timeout)
    # Only a store with a waiting room of its own may wait past the backoff's delay.
    queued = not shared and type(store).awaiting_room is not LeaseBackend.awaiting_room
    won: Grant | None = None
    try:
        with tracing.span("leases.wait", attributes), tries_until(deadline):
            async with room:
                while True:
                    delay = backoff.next_delay()
                    if delay is None:
                        raise LeaseUnavailable(name, timeout)
                    if (
                        writer
                        and SYSTEM_CLOCK.monotonic() >= stop_readers_at
                        and await _stop_new_readers(store, name)
                    ):
                        stop_readers_at = SYSTEM_CLOCK.monotonic() + STOP_READERS_EVERY
                    left = backoff.remaining()
                    bound = (_LONGEST_WAIT if left is None else left) if queued else 0.0
                    await _wait(store, name, delay, bound)
                    won = await _try(store, name, holder, ttl, deadline, shared)
                    if won is not None:
                        return won
    except BaseException:
        if won is not None:
            # Won, then cancelled (or failed) while leaving the room, a round trip of its
            # own: nobody would get the grant, and the name would stay held for its TTL.
            await arelease_quietly(store, won)
        raise
    finally:
        timing.waited = SYSTEM_CLOCK.monotonic() - waiting_since


async def _stop_new_readers(store: LeaseBackend, name: str) -> bool:
    """Best effort, like the sync one: fairness saves readers' turns, the next try decides.
    Whether the stop was asked for (``False``: the store knew of no readers to stop)."""
    try:
        return await store.astop_new_readers(name) is not False
    except BackendUnavailable as exc:
        logger.debug("leases: could not stop new readers of %r: %s", name, exc)
        return True


async def aacquire(
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
    """:func:`~leases.acquire` for async code; the caller must ``await lease.arelease()``.

    Arguments, errors, signals (``lease_acquired`` and ``lease_acquire_failed`` with
    ``elapsed`` and ``waited``) and the returned handle are those of ``acquire()``
    (``shared=True``: as one of many readers, on backends with shared leases; the others raise
    :class:`~leases.errors.BackendNotSupported` before any round trip); see the module
    docstring for what waiting and cancellation do.
    """
    ask = prepare(name, ttl, backend, timeout, keepalive, holder, task_key, shared)
    if on_lost is not None:  # None, the common case, needs no call
        valid_on_lost(on_lost)
    # What astart() does, without a closure for the grant, and the first try made here
    # rather than in a coroutine of its own: this is every acquire's path, and most win it.
    async with Acquisition(ask) as doing:
        deadline = None if ask.timeout is None else doing.started + ask.timeout
        with first_try_until(deadline):
            won = doing.won = await _try(ask.store, ask.name, ask.holder, ask.ttl, deadline, shared)
        if won is None:
            won = doing.won = await _await_grant(
                ask.store, ask.name, ask.holder, ask.ttl, ask.timeout, deadline, doing, shared
            )
        return doing.hold(won, Lease, on_lost)


#: The leases entered by ``async with alease(...)`` blocks in this context, innermost last.
_entered: contextvars.ContextVar[tuple[Lease, ...]] = contextvars.ContextVar(
    "leases_aentered", default=()
)


class _AsyncLeaseBlock:
    """What ``alease()`` returns: an async context manager that also decorates coroutine
    functions. Holds only its arguments (the live lease is on a context variable), so one
    decorated coroutine function can run in many tasks at once. Slotted: one is made for
    every ``async with alease(...)``."""

    __slots__ = ("name", "options")

    #: How ``__aenter__`` comes to hold the name (``asemaphore()`` takes a slot instead).
    _acquire: Callable[..., Awaitable[Lease]] = staticmethod(aacquire)

    def __init__(self, name: str | None, options: dict[str, Any]) -> None:
        self.name = name
        self.options = options

    def __call__(self, func: AsyncFunc[P, R]) -> AsyncFunc[P, R]:
        if not inspect.iscoroutinefunction(func):
            raise InvalidLeaseOption(
                "func",
                func,
                "alease() decorates coroutine functions (async def); use lease() for others",
            )
        name = _default_name(func) if self.name is None else self.name  # "" is refused
        block = type(self)(name, self.options)
        valid_decoration(block.name, self.options)

        @functools.wraps(func)
        async def leased(*args: P.args, **kwargs: P.kwargs) -> R:
            async with block:
                return await func(*args, **kwargs)

        return leased

    def __enter__(self) -> NoReturn:
        """A plain ``with`` would otherwise fail with Python's bare "does not support the
        context manager protocol", naming neither the fix nor the sync twin."""
        raise InvalidLeaseOption(
            "with", self.name, "alease() is entered with `async with`; in sync code use lease()"
        )

    def __exit__(self, *exc: object) -> None:
        """Never reached (``__enter__`` raises); Python needs both to call ``__enter__``."""

    async def __aenter__(self) -> Lease:
        if self.name is None:
            raise InvalidLeaseOption("name", None, "alease() needs a name in an async with")
        entered = await self._acquire(self.name, **self.options)
        _entered.set((*_entered.get(), entered))
        return entered

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack = _entered.get()
        _entered.set(stack[:-1])
        held = stack[-1]
        protected = held.remaining() > 0
        try:
            await held.arelease()
        except BaseException as error:  # settled exactly as lease() settles its release
            _settle(held, exc, protected, error)


@overload
def alease(name: AsyncFunc[P, R], /) -> AsyncFunc[P, R]: ...
@overload
def alease(
    name: str | None = None,
    /,
    *,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
    shared: bool = False,
) -> _AsyncLeaseBlock: ...
def alease(
    name: str | Callable[..., Awaitable[Any]] | None = None,
    /,
    *,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
    shared: bool = False,
) -> Any:
    """Hold ``name`` for an ``async with`` block or a decorated coroutine function.

    ``@alease`` bare names the lease after the function (``module.qualname``), as ``@lease``
    does. Arguments are those of :func:`aacquire` (``shared=True``: as one of many readers);
    leaving the block releases, never hiding
    the body's exception, and raises :class:`~leases.errors.LeaseLost` for a body that outlived
    its lease (its work ran unprotected).
    """
    options: dict[str, Any] = {
        "ttl": ttl,
        "backend": backend,
        "timeout": timeout,
        "keepalive": keepalive,
        "on_lost": on_lost,
        "holder": holder,
        "shared": shared,
    }
    if callable(name):
        return _AsyncLeaseBlock(None, options)(name)  # type: ignore[arg-type]
    return _AsyncLeaseBlock(name, options)
