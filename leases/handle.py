"""The lease handle: what a process holds, and the one door through which it comes to hold it.

A :class:`Lease` knows nothing about SQL or Lua: it holds the :class:`~leases.backends.Grant` its
backend returned and keeps the client's side of the contract. It believes it holds the lease only
until ``sent_at + ttl - drift`` on the monotonic clock (the request's travel time counts against
it), so it can never think it holds what the store has already expired. Loss is reported once,
loudly (``lost``, ``on_lost``, ``lease_lost``, a log line), and a forked child can neither renew
nor release its parent's grant.

:meth:`Lease.start` is the only way a grant becomes a held lease (registered, announced,
watched, kept alive); the registry of held leases is what makes leases non-reentrant.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, NoReturn, Self, SupportsIndex

from . import _process, conf, keepalive, signals, tracing
from ._arguments import valid_ttl
from ._finishing import finish
from .backends import Grant, LeaseBackend
from .backends.base import not_serialisable
from .errors import LeaseLost, LeaseNotHeld
from .retry import SYSTEM_CLOCK, Clock

__all__ = ["Lease", "OnLost", "held_by", "holder_key"]

logger = logging.getLogger(__name__)

OnLost = Callable[["Lease"], object]

#: Leases this process holds, by (backend alias, name, holder or thread): reentrancy guard.
_held: dict[tuple[str, str, str], Lease] = {}
_held_lock = threading.Lock()


class Lease:
    """A grant held by this process: ``name``, ``token``, ``holder``, ``expires_at``.

    ``int(lease)`` is its fencing token, so a lease can be passed wherever a token is expected.
    Slotted: one is made on every acquire (a subclass without slots gets a ``__dict__``).
    """

    __slots__ = (
        "__weakref__",
        "_drift",
        "_fraction",
        "_keep_gen",
        "_key",
        "_lost",
        "_lost_event",
        "_on_lost",
        "_pid",
        "_released",
        "_state",
        "_store",
        "backend",
        "clock",
        "grant",
        "holder",
        "lost_reason",
        "name",
        "token",
        "valid_until",
    )

    def __init__(
        self,
        backend: LeaseBackend,
        grant: Grant,
        *,
        on_lost: OnLost | None = None,
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
        self.clock: Clock = SYSTEM_CLOCK
        self._store = backend
        self._on_lost = on_lost
        self._drift = (settings.drift_factor, settings.drift_min)
        self._pid = _process.pid
        self._key: tuple[str, str, str] = (self.backend, self.name, "")
        self._state = threading.Lock()
        self._released = False
        #: The ``RENEW_FRACTION`` keepalive renews at (``None``: not kept alive), and the
        #: generation of its keepalive jobs (see :func:`leases.keepalive.rewatch`).
        self._fraction: float | None = None
        self._keep_gen = 0
        self.grant = grant
        self.valid_until = grant.valid_until(*self._drift)

    @classmethod
    def start(
        cls,
        store: LeaseBackend,
        grant: Grant,
        *,
        on_lost: OnLost | None = None,
        renew_fraction: float | None = None,
        key: tuple[str, str, str] | None = None,
        elapsed: float | None = None,
        waited: float | None = None,
    ) -> Self:
        """The one door from a grant to a held lease: handle, registry, signal, watchdog.

        Every way of coming to hold a grant (``acquire()``, a Celery worker adopting the guard
        its sender took) goes through here, so each held lease is registered against reentry
        (under ``key``, default: its holder), announced with ``lease_acquired``, watched until
        its validity runs out, and, with ``renew_fraction``, renewed in the background.
        ``elapsed`` and ``waited`` are what the acquisition cost, for the signal (``None``
        for an adopted grant, which this process did not wait for).

        Interrupted before it returns (anything that is no ``Exception``, which the signal's
        ``send_robust`` lets through: a ``KeyboardInterrupt``, a task runner's time limit), it
        drops the handle again, registration and watch, so the name is not "already held" by
        a handle nobody has; the grant is then the caller's to give back
        (``leases.acquiring._give_back``).
        """
        held = cls(store, grant, on_lost=on_lost)
        held._key = key = key or (store.alias, grant.name, grant.holder)
        with _held_lock:  # registered against reentry (see held_by)
            _held[key] = held
        try:
            if signals.lease_acquired.receivers:  # read per call: receivers connect any time
                signals.send(
                    signals.lease_acquired,
                    held.backend,
                    lease=held,
                    elapsed=elapsed,
                    waited=waited,
                )
            held._fraction = renew_fraction
            keepalive.watch(held, renew_fraction)  # and, with a fraction, renewed when due
        except BaseException:
            held._abandon()
            raise
        return held

    def __repr__(self) -> str:
        state = "lost" if self._lost else "released" if self._released else "held"
        return f"<Lease {self.name!r} token={self.token} {state} holder={self.holder!r}>"

    def __int__(self) -> int:
        return self.token

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """Never pickled (its grant's secret, see :func:`~leases.backends.base.not_serialisable`)
        nor copied: a second handle of one grant, released, would leave this one renewing."""
        raise not_serialisable(f"a {type(self).__name__}", "pickle or copy")

    @property
    def expires_at(self) -> Any:
        """When the store expires the grant, on the store's clock (``None`` if it cannot say)."""
        return self.grant.expires_at

    @property
    def shared(self) -> bool:
        """Held as one of many readers (``lease(name, shared=True)``), not exclusively."""
        return bool(self.grant.extra.get("shared"))

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
        """Seconds this holder may still rely on the lease; pessimistic, never negative (0
        while its backend doubts the grant, see :meth:`ensure_held`)."""
        # ``done`` spelt out: every release after a block asks (a property is a call).
        if self._released or self._lost or _process.pid != self._pid:
            return 0.0
        if self._store.doubts(self.grant):
            return 0.0
        return max(0.0, self.valid_until - self.clock.monotonic())

    def ensure_held(self) -> None:
        """Raise :class:`LeaseLost` unless the lease is still held by this process.

        Checks this process's knowledge only (no round trip): fenced writes call it to fail
        fast, and the fence itself rejects what a paused holder could not know. While the
        backend doubts the grant (a ZooKeeper connection suspended) it raises too, without
        marking the lease lost: it is trusted again if the doubt clears within its validity.
        """
        self._ensure_valid()
        doubt = self._store.doubts(self.grant)
        if doubt:
            raise LeaseLost(self.name, self.token, doubt)

    def _ensure_valid(self) -> None:
        """:meth:`ensure_held` without the backend's doubts: what renewing needs (a renewal
        is how a doubted lease is confirmed or found lost)."""
        if _process.pid != self._pid:
            raise LeaseLost(self.name, self.token, f"held by process {self._pid}, not this child")
        if self._released:
            raise LeaseLost(self.name, self.token, "it was released")
        if not self._lost and self.clock.monotonic() >= self.valid_until:
            self._mark_lost("expired: its validity ran out before this check")
        if self._lost:
            raise LeaseLost(self.name, self.token, self.lost_reason or "lost")

    def renew(self, ttl: float | None = None) -> Grant:
        """Extend the lease to ``ttl`` seconds (default: its TTL) from now, in one round trip."""
        return self._renew(ttl, aside=False)

    def _renew_kept(self) -> Grant:
        """:meth:`renew` for keepalive, on the alias's shared renewer thread: a refusal is worded
        and reported from a thread of its own (see :meth:`_report_refusal_aside`)."""
        return self._renew(None, aside=True)

    def _renew(self, ttl: float | None, *, aside: bool) -> Grant:
        ttl = self._before_renew(ttl)
        try:
            grant = self._store.renew(self.grant, ttl)
        except (LeaseLost, LeaseNotHeld) as exc:
            if self._refused(exc):
                if aside:
                    self._report_refusal_aside(exc)
                else:
                    self._report_refusal(exc, self._revoked_through())
            raise self._refused_error(exc) from exc
        except Exception as exc:
            self._renewal_failed(exc)
            raise
        return self._renewed(grant)

    async def arenew(self, ttl: float | None = None) -> Grant:
        """:meth:`renew` from async code: the round trip never blocks the event loop."""
        ttl = self._before_renew(ttl)
        try:
            grant = await self._store.arenew(self.grant, ttl)
        except (LeaseLost, LeaseNotHeld) as exc:
            if self._refused(exc):
                self._report_refusal(exc, await asyncio.to_thread(self._revoked_through))
            raise self._refused_error(exc) from exc
        except Exception as exc:
            self._renewal_failed(exc)
            raise
        return self._renewed(grant)

    def _before_renew(self, ttl: float | None) -> float:
        self._check_owner("renew")
        self._ensure_valid()
        return self.grant.ttl if ttl is None else valid_ttl(ttl)

    def _refused(self, exc: LeaseLost | LeaseNotHeld) -> bool:
        """A refused renewal loses the lease (our own secret refused too: another grant holds
        the name now, or an operator revoked ours); whether this refusal is what lost it.

        Marked at once, in the store's words: ``lost`` is set and :meth:`ensure_held` raises
        from here on, before anyone asks the database whether an operator's force release is
        why. Only the wording waits for that read (:meth:`_report_refusal`)."""
        return self._claim_loss(_refusal("renewal refused", exc, None))

    def _refused_error(self, exc: LeaseLost | LeaseNotHeld) -> LeaseLost:
        return LeaseLost(self.name, self.token, self.lost_reason or str(exc))

    def _report_refusal(self, exc: LeaseLost | LeaseNotHeld, revoked: int | None) -> None:
        """Word a refusal :meth:`_refused` marked ("revoked" when ``revoked`` says an operator
        is why) and report it: the log line, ``on_lost`` and ``lease_lost`` carry the final
        word, and ``lost_reason`` has it before they run."""
        reason = _refusal("renewal refused", exc, revoked)
        with self._state:
            self.lost_reason = reason  # the store's words until now
        self._report_lost(reason)

    def _report_refusal_aside(self, exc: LeaseLost | LeaseNotHeld) -> None:
        """:meth:`_report_refusal` on a short-lived thread, for a refusal keepalive met.

        The revocation read behind the wording is bounded (``LOOKUP_TIMEOUT``, 1 s), but on the
        alias's shared renewer thread even a bounded wait on a database that hangs would hold
        up the renewal of every other lease of the alias. Not on the watchdog's thread either:
        it reports expiries when stores do not answer, and must wait on none. A thread per
        refused renewal is cheap (each is a loss, one per lease at most), unlike one per
        acquire. The loss is marked already (:meth:`_refused`), so only the report waits for
        the read: whoever waits for ``on_lost`` or ``lease_lost`` gets the final cause, while
        a waiter on ``lost`` may still read ``lost_reason`` in the store's words.
        """

        def report() -> None:
            try:
                self._report_refusal(exc, self._revoked_through())
            except Exception:  # a thread's last resort: _report_lost guards its callbacks
                logger.exception("leases: reporting the loss of %r failed", self.name)

        keepalive.PackageThread(target=report, name="leases-loss-report", daemon=True).start()

    def _renewal_failed(self, exc: Exception) -> None:
        """Any error but a refusal gives no verdict (the store is unreachable): still held for
        now, announced as ``lease_renew_failed``, and the caller retries within the validity."""
        signals.send(signals.lease_renew_failed, self.backend, lease=self, error=exc)

    def _revoked_through(self) -> int | None:
        """Whether an operator's force release is why the store refused this grant (a database
        read, bounded, made only after a refusal: see :func:`leases.revocation.revoked_grant`).
        Imported here: the module needs Django's models, and importing the package (or
        ``idempotency``) must not load them before settings and the app registry exist."""
        from . import revocation

        return revocation.revoked_grant(self.backend, self.name, self.token)

    def _renewed(self, grant: Grant) -> Grant:
        with self._state:
            retimed = not self.done and grant.ttl != self.grant.ttl
            if not self.done:
                self.grant = grant
                self.valid_until = grant.valid_until(*self._drift)
        if retimed:
            # Renewed to another TTL: the watchdog and renewer were due by the old one (a
            # shorter TTL was never renewed in time, and its loss reported seconds late).
            keepalive.rewatch(self, self._fraction)
        self._ensure_valid()  # lost or released while the renewal was on its way
        signals.send(signals.lease_renewed, self.backend, lease=self)
        return grant

    def release(self) -> None:
        """Give the lease back early, conditional on still holding it.

        Raises :class:`LeaseLost` when it was lost before (the store's row, now someone else's,
        is left untouched) and :class:`LeaseNotHeld` when released twice or from a forked child.
        """
        lost_before = self._before_release()
        spanning = tracing.span("leases.release", self._span_attributes)
        try:
            if spanning is tracing.NO_SPAN:  # nothing records: no block to enter and leave
                self._store.release(self.grant)
            else:
                with spanning:
                    self._store.release(self.grant)
        except (LeaseLost, LeaseNotHeld) as exc:  # NotHeld: our secret refused, so lost too
            revoked = None if lost_before else self._revoked_through()
            raise self._release_refused(exc, lost_before, revoked) from exc
        except BaseException:
            self._outcome_unknown()
            raise
        if lost_before or signals.lease_released.receivers:  # the common case needs no call
            self._released_cleanly(lost_before)

    async def arelease(self) -> None:
        """:meth:`release` from async code.

        The round trip runs to its end even if the awaiting task is cancelled meanwhile (the
        cancellation is raised after it): a release cut off halfway would leave the name held
        until its TTL ran out, with keepalive already stopped.
        """
        lost_before = self._before_release()
        spanning = tracing.span("leases.release", self._span_attributes)
        try:
            if spanning is tracing.NO_SPAN:
                await finish(self._store.arelease(self.grant))
            else:
                with spanning:
                    await finish(self._store.arelease(self.grant))
        except (LeaseLost, LeaseNotHeld) as exc:
            revoked = None if lost_before else await asyncio.to_thread(self._revoked_through)
            raise self._release_refused(exc, lost_before, revoked) from exc
        except asyncio.CancelledError:
            raise  # finish() ran the release to its end: its outcome is known
        except Exception:
            self._outcome_unknown()
            raise
        if lost_before or signals.lease_released.receivers:  # the common case needs no call
            self._released_cleanly(lost_before)

    def _before_release(self) -> bool:
        """Mark released (once) and unregister; whether the lease was lost before."""
        if _process.pid != self._pid:  # _check_owner's test, without the call on every release
            self._check_owner("release")
        with self._state:
            if self._released:
                raise LeaseNotHeld(self.name, "this lease was already released")
            self._released = True
            lost_before = self._lost
        _unregister(self)
        return lost_before

    def _span_attributes(self) -> dict[str, Any]:
        return {
            "leases.name": self.name,
            "leases.backend": self.backend,
            "leases.token": self.token,
        }

    def _outcome_unknown(self) -> None:
        """A release whose outcome is unknown (a timeout, a dropped reply): never claim
        "released", and let the caller retry, which is safe since release is conditional.
        Held again, it is registered and watched again: the watchdog and renewer saw it
        released and dropped out, and its loss would have gone unreported. Watched, not
        renewed: its holder asked to give it up, so it runs out by its TTL unless a retry
        releases it first. Renewed, a grant whose holder dropped the handle after the
        failed release (a ``with`` block's, every caller that only logs the error) stayed
        held for as long as the process lived."""
        with self._state:
            self._released = False
            lost = self._lost
        if not lost:
            with _held_lock:
                _held.setdefault(self._key, self)
            keepalive.rewatch(self)

    def _abandon(self) -> None:
        """Give up a lease whose release got no answer after the block it protected ended in
        time (``lease()``, ``alease()``): nobody holds the handle any more, and the grant is
        left to run out by its TTL, as the block's warning says. Done, unwatched: its expiry
        is no loss to report, the work it protected having finished while it was held. Also
        how a handle interrupted before it reached its caller is dropped (:meth:`start`)."""
        with self._state:
            if self._released or self._lost:
                return
            self._released = True
            self._keep_gen += 1  # retires the watchdog's job (and a renewer's, were there one)
        _unregister(self)

    def _release_refused(
        self, exc: LeaseLost | LeaseNotHeld, lost_before: bool, revoked: int | None
    ) -> LeaseLost:
        if not lost_before:
            self._report_lost(_refusal("release refused", exc, revoked))
        return LeaseLost(self.name, self.token, self.lost_reason or str(exc))

    def _released_cleanly(self, lost_before: bool) -> None:
        """What a release that reached the store ends with. Its callers call it only for a
        lease lost before or a connected receiver: every release passes there, and most
        processes connect no receiver (no call, no keyword dictionary for nothing)."""
        if lost_before:
            raise LeaseLost(self.name, self.token, self.lost_reason or "lost before release")
        if signals.lease_released.receivers:
            signals.send(signals.lease_released, self.backend, lease=self)

    def _check_owner(self, action: str) -> None:
        if _process.pid != self._pid:
            raise LeaseNotHeld(
                self.name, f"cannot {action} in a forked child: process {self._pid} holds it"
            )

    def _mark_lost(self, reason: str) -> None:
        """Record the loss once and tell everyone (keepalive, watchdog and checks call this)."""
        if self._claim_loss(reason):
            self._report_lost(reason)

    def _claim_loss(self, reason: str) -> bool:
        """Record the loss unless the lease is already done; whether this call recorded it
        (and so must report it)."""
        with self._state:
            if self.done:
                return False
            self._flag_lost(reason)
        _unregister(self)
        return True

    def _flag_lost(self, reason: str) -> None:
        """Record the loss; the caller holds ``_state``."""
        self.lost_reason = self.lost_reason or reason
        self._lost = True
        if self._lost_event is not None:
            self._lost_event.set()

    def _report_lost(self, reason: str) -> None:
        with self._state:
            self._flag_lost(reason)
        cause = _LOSS_CAUSES.get(reason.partition(":")[0], "other")
        logger.warning(
            "leases: lost %r (token %s): %s",
            self.name,
            self.token,
            reason,
            extra={
                "event": "lease_lost",
                "lease": self.name,
                "token": self.token,
                "backend": self.backend,
                "holder": self.holder,
                "reason": reason,
                "cause": cause,
            },
        )
        stop = None
        if self._on_lost is not None:
            stop = keepalive.call_on_lost(self._on_lost, self, f"lease {self.name!r}")
        signals.send(signals.lease_lost, self.backend, lease=self, reason=reason, cause=cause)
        if stop is not None:  # sys.exit() in on_lost, on the caller's own thread
            raise stop


def _refusal(how: str, exc: Exception, revoked: int | None) -> str:
    """A refused renewal's or release's loss reason, or "revoked" when an operator's force
    release is why: the backend only knows its grant is gone ("expired or taken over"), not who
    took it away, and saying both would contradict itself."""
    if revoked is None:
        # The store's own words: a LeaseLost's message repeats what the reason is part of.
        detail = exc.detail if isinstance(exc, LeaseLost) and exc.detail else str(exc)
        return f"{how}: {detail}"
    return f"revoked: an operator force-released it (through token {revoked}): {how}"


#: How a loss reason begins (every one is "<how>: <detail>") -> ``lease_lost``'s ``cause``.
_LOSS_CAUSES = {
    "revoked": "revoked",
    "expired": "expired",
    "renewal refused": "renewal_refused",
    "release refused": "release_refused",
}


def held_by(key: tuple[str, str, str]) -> Lease | None:
    """The lease this process holds under ``key`` (see :func:`holder_key`), if any.

    Read without the lock (every acquire asks): one ``dict.get`` is atomic, and the lock
    would not make the answer any fresher, as nothing holds it between this check and the
    registration of the lease acquired after it. Registering and unregistering (a
    compare-and-delete) take it."""
    return _held.get(key)


def holder_key(store: LeaseBackend, name: str, holder: str | None) -> tuple[str, str, str]:
    """Who "already holds" a name: an explicit holder identity, else the calling thread."""
    return (store.alias, name, holder if holder is not None else _process.thread.key)


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
