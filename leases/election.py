"""Leader election on any lease backend: a lease that is campaigned for and kept.

Being elected is holding the lease ``leader:NAME``; keepalive renews it, and a failed renewal
means the leadership is lost. A leader can always be wrong about still leading (it can be
paused past its TTL), so the leadership's ``token`` is a fencing token: every new leader's is
higher, and resources that check it (``obj.save(fence=leadership)``) reject a deposed leader's
late writes. ``is_leader`` is a hint for skipping work, never a guarantee.

Observers ask :func:`leader_of`, which reads the store without campaigning.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex

from . import signals
from ._arguments import valid_on_lost
from ._event_loop import refuse_blocking
from .acquiring import acquire
from .backends import get_backend
from .backends.base import not_serialisable
from .errors import BackendUnavailable, InvalidLeaseName, LeaseLost, LeaseNotHeld
from .holders import parse_holder
from .keepalive import call_on_lost
from .keys import MAX_NAME_LENGTH, validate_name

if TYPE_CHECKING:
    from .handle import Lease

__all__ = [
    "ELECTION_PREFIX",
    "Leader",
    "Leadership",
    "aelect",
    "elect",
    "election_lease_name",
    "leader_of",
]

logger = logging.getLogger(__name__)

#: Lease names of elections carry this prefix, so an election and a lease of the same name
#: never exclude each other by accident.
ELECTION_PREFIX = "leader:"

OnLost = Callable[["Leadership"], object]


def election_lease_name(name: str) -> str:
    """The lease an election of ``name`` is decided by (visible in the admin and the command).
    ``name`` may be as long as the prefix leaves room for, and is refused in its own words."""
    validate_name(name)
    longest = MAX_NAME_LENGTH - len(ELECTION_PREFIX)
    if len(name) > longest:
        raise InvalidLeaseName(
            name[:40] + "…",
            f"is {len(name)} characters long; an election's name may have at most {longest} "
            f"(its lease is named {ELECTION_PREFIX}<name>, at most {MAX_NAME_LENGTH})",
        )
    return ELECTION_PREFIX + name


@dataclass(frozen=True)
class Leader:
    """Who leads an election, as an observer sees it in the store."""

    name: str
    holder: str
    token: int
    backend: str
    host: str
    pid: int | None
    thread: str
    label: str
    expires_at: datetime | None


class Leadership:
    """A won election; keeps leading (by keepalive) until resigned or lost.

    Usable as a context manager that resigns on exit. ``lost`` is set, ``on_lost`` called and
    ``leader_lost`` sent exactly once, whether the loss was noticed by keepalive or by
    :meth:`resign`.
    """

    def __init__(self, name: str, backend: str, on_lost: OnLost | None) -> None:
        valid_on_lost(on_lost)  # before campaigning: the lease is given our own callback
        self.name = name
        self.backend = backend
        self._on_lost = on_lost
        self._lease: Lease | None = None
        self._ended = threading.Event()
        self._over = False  # set first, under the lock; the event only after everyone was told
        self._end_lock = threading.Lock()

    @property
    def lease(self) -> Lease:
        if self._lease is None:
            raise LeaseLost(election_lease_name(self.name), None, "not elected yet")
        return self._lease

    @property
    def token(self) -> int:
        """The leadership's fencing token: higher than every earlier leader's."""
        return self.lease.token

    @property
    def holder(self) -> str:
        return self.lease.holder

    @property
    def lost(self) -> threading.Event:
        """Set once this process no longer leads (lost, revoked or resigned).

        Set after ``leader_lost`` and ``on_lost`` have run, so a waiter sees their effects;
        ``is_leader`` turns false before that.
        """
        return self._ended

    @property
    def is_leader(self) -> bool:
        """Whether this process still leads as far as it can tell (pessimistic, local clock)."""
        lease = self._lease
        return (
            lease is not None
            and not self._over
            and not lease.lost.is_set()
            and lease.remaining() > 0
        )

    def ensure_held(self) -> None:
        """Raise :class:`~leases.errors.LeaseLost` unless still leading (fencing protocol)."""
        if not self.is_leader:
            self.lease.ensure_held()
            raise LeaseLost(self.lease.name, self.lease.token, "leadership ended")

    ensure_leader = ensure_held

    def resign(self) -> None:
        """Stop leading now so another candidate need not wait for the TTL to run out.

        The leadership ends (``is_leader`` false, ``leader_lost`` sent, ``lost`` set) whatever
        the release's outcome, even when it is interrupted (Ctrl-C): once asked to step down,
        this process must not go on claiming to lead beside a successor. A grant whose release
        went unanswered is left to run out by its TTL (watched, never renewed)."""
        lease = self._lease
        with self._stepping_down():
            if lease is not None and not lease.done:
                lease.release()

    async def aresign(self) -> None:
        """:meth:`resign` from async code (the release is awaited, never blocking the loop).

        A cancellation during the release is raised after it ran to its end (see
        :meth:`~leases.handle.Lease.arelease`), and after the leadership has ended."""
        lease = self._lease
        with self._stepping_down():
            if lease is not None and not lease.done:
                await lease.arelease()

    @contextlib.contextmanager
    def _stepping_down(self) -> Iterator[None]:
        """Around a resignation's release: what it may raise, and the end it always ends in
        (in a ``finally``: a ``KeyboardInterrupt`` or a held-back ``CancelledError`` raised
        once the release was attempted skipped it, leaving ``is_leader`` true, ``lost`` unset
        and ``leader_lost`` unsent)."""
        try:
            yield
        except (LeaseLost, LeaseNotHeld):
            pass  # already lost (nothing of ours left to give back), or resigned meanwhile
        except BackendUnavailable as exc:
            # Stepping down must not fail: the grant is given up to its TTL, unrenewed.
            self.lease._abandon()
            logger.warning("could not resign %r, it will expire: %s", self.name, exc)
        finally:
            self._end("resigned")

    def _lease_lost(self, *args: Any, **kwargs: Any) -> None:
        """Keepalive's ``on_lost`` hook: the lease behind the leadership is gone."""
        self._end("lost")

    def _end(self, reason: str) -> None:
        with self._end_lock:
            if self._over:
                return
            self._over = True
        try:
            self._tell(reason)
        finally:
            self._ended.set()

    def _tell(self, reason: str) -> None:
        token = self._lease.token if self._lease is not None else None
        logger.log(
            logging.INFO if reason == "resigned" else logging.WARNING,
            "leadership of %r %s (token %s)",
            self.name,
            reason,
            token,
            extra={
                "event": "leader_lost",
                "election": self.name,
                "backend": self.backend,
                "token": token,
                "reason": reason,
            },
        )
        signals.send(signals.leader_lost, self.backend, leadership=self, reason=reason)
        if self._on_lost is not None and reason != "resigned":
            stop = call_on_lost(self._on_lost, self, f"election {self.name!r}")
            if stop is not None:  # sys.exit() in on_lost, on the thread that found the loss
                raise stop

    def __enter__(self) -> Leadership:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.resign()

    async def __aenter__(self) -> Leadership:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aresign()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """Never pickled nor copied, as its lease is not (a grant's secret inside)."""
        raise not_serialisable("a Leadership", "pickle or copy")

    def __repr__(self) -> str:
        state = "leading" if self.is_leader else "not leading"
        token = self._lease.token if self._lease is not None else None
        return f"<Leadership {self.name!r} token={token} {state}>"


def elect(
    name: str,
    *,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    on_lost: OnLost | None = None,
    holder: str | None = None,
) -> Leadership:
    """Campaign for ``name`` until elected (or ``timeout`` passes) and return the leadership.

    ``timeout=None`` campaigns forever, ``0`` tries once; failing raises
    :class:`~leases.errors.LeaseUnavailable`. ``on_lost(leadership)`` runs (on the keepalive
    thread) when leadership is lost without resigning.
    """
    leadership = Leadership(validate_name(name), backend, on_lost)
    refuse_blocking("elect()", "aelect()")
    leadership._lease = acquire(
        election_lease_name(name),
        ttl=ttl,
        backend=backend,
        timeout=timeout,
        keepalive=True,
        on_lost=leadership._lease_lost,
        holder=holder,
    )
    return _elected(leadership)


async def aelect(
    name: str,
    *,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    on_lost: OnLost | None = None,
    holder: str | None = None,
) -> Leadership:
    """:func:`elect` for async code: campaigns with :func:`~leases.aio.aacquire`, so waiting
    never blocks the event loop; ``async with`` the leadership resigns on exit (``aresign``).
    Keepalive and loss detection are the sync leadership's (see :mod:`leases.keepalive`)."""
    from .aio import aacquire

    leadership = Leadership(validate_name(name), backend, on_lost)
    leadership._lease = await aacquire(
        election_lease_name(name),
        ttl=ttl,
        backend=backend,
        timeout=timeout,
        keepalive=True,
        on_lost=leadership._lease_lost,
        holder=holder,
    )
    return _elected(leadership)


def _elected(leadership: Leadership) -> Leadership:
    """Announce a won election (log line and ``leader_elected``)."""
    name, backend = leadership.name, leadership.backend
    logger.info(
        "elected leader of %r with token %s",
        name,
        leadership.token,
        extra={
            "event": "leader_elected",
            "election": name,
            "backend": backend,
            "token": leadership.token,
        },
    )
    signals.send(signals.leader_elected, backend, leadership=leadership)
    return leadership


def leader_of(name: str, *, backend: str = "default") -> Leader | None:
    """The current leader of ``name`` as the store sees it, or ``None`` if nobody leads.

    A snapshot: the leader may be gone by the time the caller acts on it.
    """
    info = get_backend(backend).inspect(election_lease_name(name))
    if info is None or not info.held:
        return None
    parts = parse_holder(info.holder)
    return Leader(
        name=name,
        holder=info.holder,
        token=info.token,
        backend=backend,
        host=parts.host,
        pid=parts.pid,
        thread=parts.thread,
        label=parts.label,
        expires_at=info.expires_at,
    )
