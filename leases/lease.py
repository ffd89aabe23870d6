"""The lease handle, ``acquire()``, and ``lease()``, the context manager and decorator.

A :class:`Lease` knows nothing about SQL or Lua: it holds the :class:`~leases.backends.Grant` its
backend returned and keeps the client's side of the contract. It believes it holds the lease only
until ``sent_at + ttl - drift`` on the monotonic clock (the request's travel time counts against
it), so it can never think it holds what the store has already expired. Loss is reported once,
loudly (``lost``, ``on_lost``, ``lease_lost``, a log line), and a forked child can neither renew
nor release its parent's grant.

Leases are not reentrant: acquiring a name the same thread already holds raises
:class:`~leases.errors.LeaseAlreadyHeld` instead of waiting for itself or nesting silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import os
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, overload

from django.dispatch import Signal

from . import conf, keepalive
from ._arguments import holder_identity, valid_timeout, valid_ttl, warn_if_too_short
from .backends import Grant, LeaseBackend, get_backend
from .errors import (
    BackendUnavailable,
    InvalidLeaseOption,
    LeaseAlreadyHeld,
    LeaseLost,
    LeaseNotHeld,
    LeaseUnavailable,
)
from .keys import validate_name
from .retry import SYSTEM_CLOCK, Backoff, Clock
from .signals import lease_acquired, lease_lost, lease_released, lease_renewed

__all__ = ["Lease", "acquire", "lease"]

logger = logging.getLogger("leases")

F = TypeVar("F", bound=Callable[..., Any])
OnLost = Callable[["Lease"], object]

#: Leases this process holds, by (backend alias, name, holder or thread): reentrancy guard.
_held: dict[tuple[str, str, str], Lease] = {}
_held_lock = threading.Lock()


def _send(signal: Signal, lease: Lease, **kwargs: Any) -> None:
    """Send ``signal``; a receiver that raises is logged, never allowed to break the lease.

    Most processes connect no receivers, and every acquire and release sends a signal: skip
    building the call when nobody listens.
    """
    if not signal.receivers:
        return
    for receiver, result in signal.send_robust(sender=lease.backend, lease=lease, **kwargs):
        if isinstance(result, Exception):
            logger.error(
                "leases: a receiver of a lease signal raised: %r",
                result,
                exc_info=result,
                extra={"receiver": receiver},
            )


class Lease:
    """A grant held by this process: ``name``, ``token``, ``holder``, ``expires_at``.

    ``int(lease)`` is its fencing token, so a lease can be passed wherever a token is expected.
    """

    def __init__(
        self,
        backend: LeaseBackend,
        grant: Grant,
        *,
        on_lost: OnLost | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        settings = conf.get()
        self.name = grant.name
        self.token = grant.token
        self.holder = grant.holder
        #: The alias of the backend in ``LEASES["BACKENDS"]``.
        self.backend = backend.alias
        self.lost_reason: str | None = None
        self._lost = False
        self._lost_event: threading.Event | None = None
        self.clock = clock
        self._store = backend
        self._on_lost = on_lost
        self._drift = (settings.drift_factor, settings.drift_min)
        self._pid = os.getpid()
        self._key: tuple[str, str, str] = (self.backend, self.name, "")
        self._state = threading.Lock()
        self._released = False
        self.grant = grant
        self.valid_until = grant.valid_until(*self._drift)

    def __repr__(self) -> str:
        state = "lost" if self._lost else "released" if self._released else "held"
        return f"<Lease {self.name!r} token={self.token} {state} holder={self.holder!r}>"

    def __int__(self) -> int:
        return self.token

    @property
    def expires_at(self) -> Any:
        """When the store expires the grant, on the store's clock (``None`` if it cannot say)."""
        return self.grant.expires_at

    @property
    def lost(self) -> threading.Event:
        """Set once the lease is lost (never cleared).

        Made on first use: most leases are never waited on, and a ``threading.Event`` costs
        more to build than the rest of the lease.
        """
        with self._state:
            if self._lost_event is None:
                self._lost_event = threading.Event()
                if self._lost:
                    self._lost_event.set()
            return self._lost_event

    @property
    def done(self) -> bool:
        """Released or lost: nothing more to renew or watch."""
        return self._released or self._lost

    def remaining(self) -> float:
        """Seconds this holder may still rely on the lease; pessimistic, never negative."""
        if self.done or os.getpid() != self._pid:
            return 0.0
        return max(0.0, self.valid_until - self.clock.monotonic())

    def ensure_held(self) -> None:
        """Raise :class:`LeaseLost` unless the lease is still held by this process.

        Checks this process's knowledge only (no round trip): fenced writes call it to fail
        fast, and the fence itself rejects what a paused holder could not know.
        """
        if os.getpid() != self._pid:
            raise LeaseLost(self.name, self.token, f"held by process {self._pid}, not this child")
        if self._released:
            raise LeaseLost(self.name, self.token, "it was released")
        if not self._lost and self.clock.monotonic() >= self.valid_until:
            self._mark_lost("expired: its validity ran out before this check")
        if self._lost:
            raise LeaseLost(self.name, self.token, self.lost_reason or "lost")

    def renew(self, ttl: float | None = None) -> Grant:
        """Extend the lease to ``ttl`` seconds (default: its TTL) from now, in one round trip."""
        self._check_owner("renew")
        self.ensure_held()
        ttl = self.grant.ttl if ttl is None else valid_ttl(ttl)
        try:
            grant = self._store.renew(self.grant, ttl)
        except LeaseLost as exc:
            self._mark_lost(f"renewal refused: {exc}")
            raise
        except LeaseNotHeld as exc:  # our own secret refused: another grant holds the name now
            self._mark_lost(f"renewal refused: {exc}")
            raise LeaseLost(self.name, self.token, self.lost_reason or str(exc)) from exc
        with self._state:
            if not self.done:
                self.grant = grant
                self.valid_until = grant.valid_until(*self._drift)
        self.ensure_held()  # lost or released while the renewal was on its way
        _send(lease_renewed, self)
        return grant

    def release(self) -> None:
        """Give the lease back early, conditional on still holding it.

        Raises :class:`LeaseLost` when it was lost before (the store's row, now someone else's,
        is left untouched) and :class:`LeaseNotHeld` when released twice or from a forked child.
        """
        self._check_owner("release")
        with self._state:
            if self._released:
                raise LeaseNotHeld(self.name, "this lease was already released")
            self._released = True
            lost_before = self._lost
        _unregister(self)
        try:
            self._store.release(self.grant)
        except (LeaseLost, LeaseNotHeld) as exc:  # NotHeld: our secret refused, so lost too
            if not lost_before:
                self._report_lost(f"release refused: {exc}")
            raise LeaseLost(self.name, self.token, self.lost_reason or str(exc)) from exc
        if lost_before:
            raise LeaseLost(self.name, self.token, self.lost_reason or "lost before release")
        _send(lease_released, self)

    def _check_owner(self, action: str) -> None:
        if os.getpid() != self._pid:
            raise LeaseNotHeld(
                self.name, f"cannot {action} in a forked child: process {self._pid} holds it"
            )

    def _mark_lost(self, reason: str) -> None:
        """Record the loss once and tell everyone (keepalive, watchdog and checks call this)."""
        with self._state:
            if self.done:
                return
            self._flag_lost(reason)
        _unregister(self)
        self._report_lost(reason)

    def _flag_lost(self, reason: str) -> None:
        """Record the loss; the caller holds ``_state``."""
        self.lost_reason = self.lost_reason or reason
        self._lost = True
        if self._lost_event is not None:
            self._lost_event.set()

    def _report_lost(self, reason: str) -> None:
        with self._state:
            self._flag_lost(reason)
        logger.warning("leases: lost %r (token %s): %s", self.name, self.token, reason)
        if self._on_lost is not None:
            try:
                self._on_lost(self)
            except Exception:
                logger.exception("leases: on_lost callback for %r raised", self.name)
        _send(lease_lost, self, reason=reason)


def _holder_key(store: LeaseBackend, name: str, holder: str | None) -> tuple[str, str, str]:
    """Who "already holds" a name: an explicit holder identity, else the calling thread."""
    return (store.alias, name, holder if holder is not None else f"thread:{threading.get_ident()}")


def _register(lease: Lease, key: tuple[str, str, str]) -> None:
    lease._key = key
    with _held_lock:
        _held[key] = lease


def _unregister(lease: Lease) -> None:
    with _held_lock:
        if _held.get(lease._key) is lease:
            del _held[lease._key]


def _forget_after_fork() -> None:
    """A forked child holds none of its parent's leases."""
    global _held_lock
    _held_lock = threading.Lock()
    _held.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _grant(store: LeaseBackend, name: str, holder: str, ttl: float, timeout: float | None) -> Grant:
    """Try; then, in the name's waiting room, wait for a release (or a backoff delay) and
    try again, until the deadline."""
    deadline = None if timeout is None else SYSTEM_CLOCK.monotonic() + timeout
    grant = store.try_acquire(name, holder, ttl)
    if grant is not None:
        return grant
    if timeout == 0:
        raise LeaseUnavailable(name, timeout)
    backoff = Backoff(deadline=deadline)
    with store.waiting_room(name, timeout):
        while True:
            grant = store.try_acquire(name, holder, ttl)
            if grant is not None:
                return grant
            delay = backoff.next_delay()
            if delay is None:
                raise LeaseUnavailable(name, timeout)
            _wait(store, name, delay)


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


def acquire(
    name: str,
    *,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
) -> Lease:
    """Acquire ``name`` and return the :class:`Lease`; the caller must ``release()`` it.

    ``timeout=None`` waits forever, ``0`` tries once; failing raises :class:`LeaseUnavailable`.
    With ``keepalive`` the lease is renewed in the background until released or lost.
    """
    name = validate_name(name)
    settings = conf.get()
    ttl = valid_ttl(settings.default_ttl if ttl is None else ttl)
    timeout = valid_timeout(timeout)
    store = get_backend(backend)
    key = _holder_key(store, name, holder)
    holder = holder_identity(holder)
    with _held_lock:
        held = _held.get(key)
    if held is not None:
        raise LeaseAlreadyHeld(name, held.holder)
    if keepalive:
        warn_if_too_short(ttl, settings)
    grant = _grant(store, name, holder, ttl, timeout)
    lease = Lease(store, grant, on_lost=on_lost)
    _register(lease, key)
    _send(lease_acquired, lease)
    _start_watching(lease, settings.renew_fraction if keepalive else None)
    return lease


def _start_watching(lease: Lease, fraction: float | None) -> None:
    """Have the watchdog report the lease's expiry, and renew it when ``fraction`` is set."""
    keepalive.watch(lease)
    if fraction is not None:
        keepalive.keep_alive(lease, fraction)


#: The leases entered by ``with lease(...)`` blocks in this context, innermost last.
_entered: contextvars.ContextVar[tuple[Lease, ...]] = contextvars.ContextVar(
    "leases_entered", default=()
)


class _LeaseBlock(contextlib.ContextDecorator):
    """What ``lease()`` returns: a context manager that is also a decorator.

    Holds only its arguments; the live :class:`Lease` of each ``with`` is kept on a context
    variable, so one decorated function can run in many threads at once.
    """

    def __init__(self, name: str | None, options: dict[str, Any]) -> None:
        self.name = name
        self.options = options

    def __call__(self, func: F) -> F:
        if inspect.iscoroutinefunction(func) or inspect.isgeneratorfunction(func):
            raise InvalidLeaseOption(
                "func",
                func,
                "lease() cannot decorate a coroutine or generator function: the lease would be "
                "released when the call returns, before the body runs; use a with block inside",
            )
        if self.name is None:
            return _LeaseBlock(_default_name(func), self.options)(func)
        return super().__call__(func)

    def __enter__(self) -> Lease:
        if self.name is None:
            raise InvalidLeaseOption("name", None, "lease() needs a name in a with statement")
        entered = acquire(self.name, **self.options)
        _entered.set((*_entered.get(), entered))
        return entered

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack = _entered.get()
        _entered.set(stack[:-1])
        _finish(stack[-1], exc)


def _finish(held: Lease, body_error: BaseException | None) -> None:
    """Release after a ``with`` body, never hiding the body's own exception.

    A body that finished while the lease was lost ran unprotected: that raises
    :class:`LeaseLost`. A release that merely could not reach the store after the body finished
    in time is logged: the work was protected and the grant expires by itself.
    """
    protected = held.remaining() > 0
    try:
        held.release()
    except (LeaseLost, BackendUnavailable) as exc:
        if body_error is not None:
            body_error.add_note(f"and then the lease {held.name!r} could not be released: {exc}")
            return
        if isinstance(exc, LeaseLost) or not protected:
            raise
        logger.warning("leases: could not release %r, it will expire: %s", held.name, exc)


def _default_name(func: Callable[..., Any]) -> str:
    return f"{func.__module__}.{func.__qualname__}"


@overload
def lease(name: F, /) -> F: ...
@overload
def lease(
    name: str | None = None,
    /,
    *,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
) -> _LeaseBlock: ...
def lease(
    name: str | Callable[..., Any] | None = None,
    /,
    *,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
) -> Any:
    """Hold ``name`` for the duration of a ``with`` block or a decorated function.

    ``@lease`` bare names the lease after the function (``module.qualname``). Arguments are
    those of :func:`acquire`. Leaving the block releases; see :func:`_finish` for errors.
    """
    options: dict[str, Any] = {
        "ttl": ttl,
        "backend": backend,
        "timeout": timeout,
        "keepalive": keepalive,
        "on_lost": on_lost,
        "holder": holder,
    }
    if callable(name):
        return _LeaseBlock(_default_name(name), options)(name)
    return _LeaseBlock(name, options)
