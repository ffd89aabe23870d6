"""The async twins of ``semaphore()`` and ``acquire_slot()``: ``asemaphore()`` and
``aacquire_slot()``.

The slots are :mod:`leases.semaphore`'s (slot ``k`` of ``name`` is the lease ``name␟k``), and so
are the arguments and their checking (:func:`~leases.semaphore.prepare_slots`), so a sync and
an async holder of one semaphore share its ``limit``. Waiting is :mod:`leases.aio`'s: every try
is an awaited ``atry_acquire`` that a cancellation never abandons halfway (a slot won while
the task was being cancelled is given back before the cancellation is raised), waits on a held
slot never block the event loop, and the whole wait is bounded by ``timeout``. "Already
holds a slot of this semaphore" is per task, as for ``aacquire()``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, cast, overload

from .acquiring import Request, Timing, astart
from .aio import AsyncFunc, P, R, _AsyncLeaseBlock, _try, _wait, task_key
from .backends import Grant
from .handle import OnLost
from .retry import SYSTEM_CLOCK, Backoff
from .semaphore import Slot, SlotTries, all_held, pass_bound, prepare_slots, slot_options

__all__ = ["aacquire_slot", "asemaphore"]


async def _agrant(ask: Request, limit: int, timing: Timing) -> Grant:
    """Try the slots from a random one, until one is won or the deadline has passed (the
    sync loop's passes: :class:`~leases.semaphore.SlotTries`, each bounded by
    :func:`~leases.semaphore.pass_bound`); then wait a slice on one held slot (a release of
    another slot does not wake it, hence the backoff's slices, as long as the store's waits
    at least: see :mod:`leases.semaphore`); until the deadline. The time spent waiting goes
    into ``timing``, as in the sync loop."""
    deadline = None if ask.timeout is None else timing.started + ask.timeout
    backoff = Backoff(deadline=deadline, floor=ask.store.wait_at_least)
    waiting_since: float | None = None
    try:
        while True:
            tries = SlotTries(ask, limit, deadline)
            with pass_bound(deadline, first=waiting_since is None):
                for slot in tries:
                    grant = await _try(ask.store, slot, ask.holder, ask.ttl, deadline)
                    if grant is not None:
                        return grant
            delay = None if ask.timeout == 0 else backoff.next_delay()
            if delay is None:
                raise all_held(ask, limit, tries.tried)
            if waiting_since is None:
                waiting_since = SYSTEM_CLOCK.monotonic()
            await _wait(ask.store, slot, delay)
    finally:
        if waiting_since is not None:
            timing.waited = SYSTEM_CLOCK.monotonic() - waiting_since


async def aacquire_slot(
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
    """:func:`~leases.acquire_slot` for async code; the caller must ``await slot.arelease()``.

    Arguments, checks (before any round trip), errors and the returned :class:`Slot` are
    ``acquire_slot()``'s; see the module docstring for what waiting and cancellation do.
    """
    ask, limit = prepare_slots(name, limit, ttl, backend, timeout, keepalive, holder, task_key)
    grant = functools.partial(_agrant, ask, limit)
    return await astart(ask, grant, Slot, on_lost, {"leases.limit": limit})


class _AsyncSemaphoreBlock(_AsyncLeaseBlock):
    """What ``asemaphore()`` returns: ``alease()``'s block, entered by taking a slot."""

    __slots__ = ()

    _acquire: Callable[..., Awaitable[Slot]] = staticmethod(aacquire_slot)

    async def __aenter__(self) -> Slot:
        return cast(Slot, await super().__aenter__())


@overload
def asemaphore(
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
) -> _AsyncSemaphoreBlock: ...
@overload
def asemaphore(name: AsyncFunc[P, R], /, *, limit: int) -> AsyncFunc[P, R]: ...
def asemaphore(
    name: str | Callable[..., Awaitable[Any]] | None = None,
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
    """Hold one of ``limit`` slots of ``name`` for an ``async with`` block or a decorated
    coroutine function.

    ``async with asemaphore("export:acme", limit=3) as slot:`` runs the block while at most
    two others (tasks, threads or processes, sync or async) run theirs. As a decorator without
    a name, the name is the function's (``module.qualname``). Leaving releases the slot, never
    hiding the body's exception; a body that outlived its slot raises
    :class:`~leases.errors.LeaseLost`. ``limit`` is checked here.
    """
    options = slot_options(limit, ttl, backend, timeout, keepalive, on_lost, holder)
    if callable(name):
        return _AsyncSemaphoreBlock(None, options)(name)  # type: ignore[arg-type]
    return _AsyncSemaphoreBlock(name, options)
