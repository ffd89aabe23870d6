"""``acquire()``: validate, try, wait in the name's waiting room, try again, until the deadline.

Every argument is checked before the first round trip; the wait is bounded by ``timeout`` on
every backend; a won grant becomes a held lease through :meth:`~leases.handle.Lease.start`.
"""

from __future__ import annotations

import logging

from . import conf
from ._arguments import valid_timeout, valid_ttl, warn_if_too_short
from .backends import Grant, LeaseBackend, get_backend
from .errors import BackendUnavailable, LeaseAlreadyHeld, LeaseUnavailable
from .handle import Lease, OnLost, held_by, holder_key
from .holders import holder_identity
from .keys import validate_name
from .retry import SYSTEM_CLOCK, Backoff

__all__ = ["acquire"]

logger = logging.getLogger(__name__)


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
    key = holder_key(store, name, holder)
    holder = holder_identity(holder)
    held = held_by(key)
    if held is not None:
        raise LeaseAlreadyHeld(name, held.holder)
    if keepalive:
        warn_if_too_short(ttl, settings)
    grant = _grant(store, name, holder, ttl, timeout)
    fraction = settings.renew_fraction if keepalive else None
    return Lease.start(store, grant, on_lost=on_lost, renew_fraction=fraction, key=key)
