"""What a lease backend must do, and the values it returns.

A backend is a thin, correct client of one lock store. It does exactly one round trip per
acquire, renew and release; every state change is conditional on the holder, token and secret
it was given (never a bare DEL/DELETE); expiry is decided by the store's clock; and tokens of one
name strictly increase across grants, releases, restarts and failovers, or the backend refuses
to grant (:class:`~leases.errors.FencingUnavailable`).

Nothing outside ``leases/backends/`` knows which backend it talks to: :class:`~leases.lease.Lease`
only sees :class:`Grant` values and the errors of :mod:`leases.errors`, and the system checks and
the admin ask the backend *class* to describe itself (:attr:`LeaseBackend.known_options`,
:meth:`LeaseBackend.check_options`, :meth:`LeaseBackend.databases`, its capabilities under the
alias's options: :meth:`LeaseBackend.capabilities_of`) without instantiating it, so ``manage.py
check`` connects nowhere for them; only a store that can be set up to lose leases by itself is
asked once, briefly (:meth:`LeaseBackend.store_checks`). A backend translates its driver's
errors at this edge (``BackendUnavailable`` for an unreachable store, ``LeaseLost`` for a
renewal or release the store refused, ``LeaseNotHeld`` for one without the grant's secret).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import copy
import enum
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, ClassVar, NoReturn, SupportsIndex

from django.db import connections

from ..errors import BackendNotSupported, LeasesImproperlyConfigured

__all__ = [
    "FIRST_TRY_AT_LEAST",
    "FORGED",
    "LIST_BATCH",
    "PRUNE_BATCH",
    "Capability",
    "Grant",
    "InternalLock",
    "LeaseBackend",
    "LeaseInfo",
    "LeaseWaiter",
    "Secret",
    "first_try_until",
    "new_secret",
    "not_revoked",
    "not_serialisable",
    "tries_until",
    "try_deadline",
]


#: Rows a prune reads (and may delete) per batch by default. A batch locks only the rows it
#: deletes (nobody waits for it), so the size only bounds one statement's work and WAL burst.
PRUNE_BATCH = 1000
#: Rows a whole listing (``manage.py leases list --limit 0``) reads per round trip.
LIST_BATCH = 1000


#: The ``time.monotonic()`` instant by which the acquisition making the current try must end
#: (``None``: no deadline). A round trip bounded by a reply timeout need not read it; a
#: backend whose try can wait on its own, as ZooKeeper's does to (re)connect a client, waits
#: no longer, so ``acquire(timeout=...)`` keeps its deadline whatever a try meets. The first
#: try's is at least :data:`FIRST_TRY_AT_LEAST` away (:func:`first_try_until`), so that
#: ``timeout=0`` (or a few milliseconds) can still open a first connection.
try_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "leases_try_deadline", default=None
)


#: Seconds an acquisition's first try may take to (re)connect, whatever its shorter timeout:
#: a first connection to a ZooKeeper ensemble takes a handshake or two, and a client still
#: connecting when the try gives up goes on for the next call.
FIRST_TRY_AT_LEAST = 1.0


def first_try_until(deadline: float | None) -> contextlib.AbstractContextManager[None]:
    """:func:`tries_until` for an acquisition's first try: its deadline, or
    :data:`FIRST_TRY_AT_LEAST` from now if that is later (no bound without a deadline)."""
    if deadline is None:
        return contextlib.nullcontext()
    return tries_until(max(deadline, time.monotonic() + FIRST_TRY_AT_LEAST))


@contextlib.contextmanager
def tries_until(deadline: float | None) -> Iterator[None]:
    """Within the block, :data:`try_deadline` is ``deadline`` (the acquire loops' waits)."""
    token = try_deadline.set(deadline)
    try:
        yield
    finally:
        try_deadline.reset(token)


class Capability(enum.StrEnum):
    """Optional abilities a backend declares; tests skip by capability, not by backend name."""

    #: The store itself issues tokens that strictly increase per name, even across restarts.
    NATIVE_FENCING = "native fencing"
    #: ``wait_for_release`` is woken by the release itself (LISTEN/NOTIFY, BLPOP), not polling.
    WAIT_WITHOUT_POLLING = "wait without polling"
    #: ``force_release`` can revoke a grant by advancing its token.
    FORCE_RELEASE = "force release"
    #: The store keeps grants across its own restart (a durable database).
    DURABLE = "durable"
    #: Its leases are the rows of :class:`leases.models.Lease` (the admin's changelist).
    LEASE_ROWS = "lease rows"
    #: ``prune`` deletes what the store keeps of names unused for a long time, tokens safe.
    PRUNE = "prune"
    #: ``try_acquire_shared``: readers that hold a name together, excluded by an exclusive
    #: grant, with tokens from the name's one sequence (``lease(name, shared=True)``).
    SHARED_LEASES = "shared leases"


class Secret(str):
    """A grant's secret: a ``str``, which every driver sends as it is, whose ``repr`` hides it.

    Tracebacks that show their frames' variables (Django's debug page and HTML error mails,
    ``capture_locals``, Sentry-style error trackers) print the dictionaries and lists a call
    builds around the secret (a statement's parameters, a script's arguments) with ``repr``:
    for a renewal or release that timed out, a live credential, shown to whoever reads the
    report. ``str()``, ``format()`` and ``encode()`` still give the value, where the package
    sends or hashes it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'<secret>'"


@dataclass(frozen=True)
class Grant:
    """A lease the store granted (or renewed): who holds which name with which token.

    ``sent_at`` is ``time.monotonic()`` read *before* the request was sent, so a client that
    computes validity from it can only underestimate how long it holds the lease, never
    overestimate (the request's own travel time is counted against it).
    """

    name: str
    holder: str
    token: int
    ttl: float
    sent_at: float
    expires_at: datetime | None = None
    #: Backend-private data needed to renew or release (e.g. a Redis value, an epoch). Kept
    #: out of ``repr`` as the secret is: some of it is a handle of its own (an etcd lease's
    #: ID lets a client of the cluster keep it alive), and none of it tells a reader more.
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)
    #: The grant's credential (:func:`new_secret`): renew and release must present it, because
    #: holder and token are public (``inspect()``, the admin) and would let anyone release
    #: someone else's lease. Kept out of ``repr`` so it never reaches a log line; stores keep
    #: only a hash of it.
    secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if type(self.secret) is not Secret:  # rebuilt from data (a task's headers, a test)
            object.__setattr__(self, "secret", Secret(self.secret))

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """Never pickled: see :func:`not_serialisable`."""
        raise not_serialisable("a Grant")

    def __copy__(self) -> Grant:
        return self  # frozen: a copy in this process is the same value

    def __deepcopy__(self, memo: dict[int, Any]) -> Grant:
        return replace(self, extra=copy.deepcopy(self.extra, memo))

    def valid_until(self, drift_factor: float, drift_min: float) -> float:
        """Monotonic deadline after which the holder must assume the lease is gone."""
        return self.sent_at + self.ttl - (self.ttl * drift_factor + drift_min)


@dataclass(frozen=True)
class LeaseInfo:
    """What an observer (admin page, ``manage.py leases``, ``leader_of``) can see of a name."""

    name: str
    holder: str
    token: int
    held: bool
    backend: str
    acquired_at: datetime | None = None
    expires_at: datetime | None = None
    renewed_at: datetime | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> tuple[int, str]:
        """Held first, then the rest (expired or free); by name within each."""
        return (0 if self.held else 1, self.name)


@dataclass(frozen=True)
class InternalLock:
    """An advisory lock a backend takes for its own purposes: for which lease, and why
    (``"room"``: its waiters queue on it; ``"tenure"``: its holder keeps it while it holds
    the lease, and its next waiter queues on it; ``"internal"``, with no lease: held by one
    of the backend's own sessions for a lease it cannot name any more, a grant that ended)."""

    lease: str
    purpose: str


@dataclass(frozen=True)
class LeaseWaiter:
    """Someone waiting for a name now, as the store sees it (operators' views)."""

    name: str
    backend: str
    #: The waiting process: ``host:pid:thread``.
    who: str
    #: When its wait began (its own clock).
    since: datetime | None = None
    #: Where it waits (a server, a connection), for an operator looking for it.
    where: str = ""


class LeaseBackend(abc.ABC):
    """Interface every backend module implements as a class named ``Backend``.

    Instances are created once per configured alias and process (see
    :func:`leases.backends.get_backend`) and must be safe to use from several threads.
    """

    #: What the backend can do configured with its defaults, declared on the class. An
    #: instance carries :meth:`capabilities_of` its options instead (set when it is made), so
    #: what an option rules out is never offered: read the instance's, or ask
    #: :meth:`capabilities_of` (what :func:`leases.backends.capabilities` does for an alias).
    capabilities: frozenset[Capability] = frozenset()
    #: The shortest wait for a release between two tries of one acquire (never past its
    #: deadline). Zero: the backoff's jittered delays, short at first, as a poll needs. A
    #: store whose wait the release ends waits this long instead: each wait that runs out
    #: costs a try bound to fail, and a short one, which only the client's deadline can end,
    #: its connection too (and a wake-up lost with it).
    wait_at_least: ClassVar[float] = 0.0
    #: The options of ``LEASES["BACKENDS"][alias]`` (besides ``ENGINE``) this backend reads;
    #: any other is a mistake (a misspelt option would otherwise be silently ignored).
    known_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        problems = self.check_options(alias, options)
        # Reported by leases.E002 at check time; here it would be Django's KeyError, and only
        # once the store had been asked.
        problems += [
            f'LEASES["BACKENDS"][{alias!r}]: database {name!r} is not in DATABASES'
            for name in sorted(self.databases(options))
            if name not in connections.settings
        ]
        if problems:
            raise LeasesImproperlyConfigured("; ".join(problems))
        self.alias = alias
        self.options = dict(options)
        self.capabilities = self.capabilities_of(options)

    @classmethod
    def check_options(cls, alias: str, options: Mapping[str, Any]) -> list[str]:
        """Problems with ``options``, found without I/O: run by ``manage.py check`` and again
        when the backend is made, so a misconfiguration never waits for first use.

        Reports unknown options; a backend extends it (calling this first) with its own
        checks of values that need no connection (a cache alias exists, URLs parse).
        """
        unknown = sorted(set(options) - cls.known_options)
        if not unknown:
            return []
        return [
            f'LEASES["BACKENDS"][{alias!r}] has unknown options {unknown} '
            f"(known: {', '.join(sorted(cls.known_options)) or 'none'})"
        ]

    @classmethod
    def capabilities_of(cls, options: Mapping[str, Any]) -> frozenset[Capability]:
        """The capabilities this backend has configured with ``options``: :attr:`capabilities`,
        less any an option rules out. Without I/O, so the admin can ask it of a backend it
        never made; a backend whose options can take a capability away overrides it, and its
        method then raises :class:`~leases.errors.BackendNotSupported` in that configuration.
        An action offered for a capability the configuration lacks could only fail."""
        return cls.capabilities

    @classmethod
    def check_limits(cls, alias: str, options: Mapping[str, Any]) -> list[str]:
        """Limits outside the backend's options that its traffic will run into (a shared
        connection pool smaller than the waits one process can have), found without I/O.

        Run by plain ``manage.py check`` as warnings (``leases.W005``), only once
        :meth:`check_options` has nothing to say: the backend works until enough acquires
        happen at once, which a test run rarely reaches and production does.
        """
        return []

    @classmethod
    def databases(cls, options: Mapping[str, Any]) -> frozenset[str]:
        """The Django database aliases this backend uses, each of which must be PostgreSQL
        (its lease table, or the durable counter its tokens come from)."""
        return frozenset()

    @abc.abstractmethod
    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        """Take ``name`` for ``holder`` for ``ttl`` seconds if it is free or expired.

        One round trip. Returns the grant with a token higher than any earlier grant of the
        name, carrying a fresh :func:`new_secret` (the store keeps only its hash), or ``None``
        when someone else holds it. A failed try should not write.
        """

    def try_acquire_shared(self, name: str, holder: str, ttl: float) -> Grant | None:
        """Join the readers of ``name`` (or start their group) unless an exclusive grant holds
        it or an exclusive waiter stopped new readers (:meth:`stop_new_readers`).

        Only for backends that declare :attr:`Capability.SHARED_LEASES`. One round trip; the
        grant's token is the name's next (above every grant before it, shared or not), its
        ``extra`` says ``shared``, and :meth:`renew`/:meth:`release` accept it like any grant.
        While readers hold the name, :meth:`try_acquire` fails as if one holder held it.
        """
        raise BackendNotSupported(self.alias, Capability.SHARED_LEASES.value)

    def stop_new_readers(self, name: str) -> bool | None:
        """An exclusive waiter of ``name`` stops readers from joining for a short while (at
        least a second), so a stream of readers cannot starve it; it calls this again while it
        waits (every :data:`~leases.acquiring.STOP_READERS_EVERY` seconds). One round trip;
        nothing to do for backends without :attr:`Capability.SHARED_LEASES`.

        ``False`` means the backend knew there was nothing to stop (no readers held the name at
        the waiter's last try) and asked nothing: the waiter then calls again before its next
        try instead of a while later."""
        return None

    @abc.abstractmethod
    def renew(self, grant: Grant, ttl: float) -> Grant:
        """Extend ``grant`` to ``ttl`` seconds from now, keeping its token.

        One round trip, conditional on name, holder, token and the grant's secret, and on the
        grant not having expired on the store's clock. Raises
        :class:`~leases.errors.LeaseNotHeld` when holder and token are the current grant's but
        the secret is not (someone built the grant from public data: nothing is touched), and
        :class:`~leases.errors.LeaseLost` when the grant expired or was taken over.
        """

    @abc.abstractmethod
    def release(self, grant: Grant) -> None:
        """Free ``grant`` early so the next holder need not wait for expiry.

        One round trip, conditional like :meth:`renew` (a wrong secret raises
        :class:`~leases.errors.LeaseNotHeld`); keeps the name's token counter, and wakes
        waiters. Raises :class:`~leases.errors.LeaseLost` when the grant had already expired
        or been taken over, leaving the new holder untouched.
        """

    @abc.abstractmethod
    def wait_for_release(self, name: str, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a release of ``name``.

        Returns ``True`` when woken by a release, ``False`` on timeout; may return early or
        spuriously (callers retry ``try_acquire``). Backends without notifications sleep.
        """

    # -- the async twins ------------------------------------------------------------------
    #
    # ``aacquire()`` and the handle's ``arenew()``/``arelease()`` call these. A backend whose
    # driver has an async client overrides them with real async I/O (the database backend with
    # psycopg's ``AsyncConnection``, Redis and Redlock with ``redis.asyncio``). The defaults
    # below are for backends without one: they run the blocking method on a worker thread of
    # the loop's default executor (``asyncio.to_thread``), so the event loop never blocks, at
    # the cost of a thread hop per call and one busy executor thread per waiter. The contract
    # is the blocking method's, word for word. A cancelled default call returns at once but
    # its thread finishes the round trip; ``aacquire()`` gives back a grant won that way.
    #
    # ``atry_acquire``, ``atry_acquire_shared`` and ``arelease`` run in the caller's own task
    # with its cancellation held back until they end (:mod:`leases._finishing`): they must
    # not bound their own I/O by cancelling the current task (``asyncio.timeout``), which
    # would be held back too. Cut the connection at the deadline instead (as the database and
    # Redis backends do), or bound the call in a task of its own (``asyncio.wait_for``).

    async def atry_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        """:meth:`try_acquire` without blocking the event loop."""
        return await asyncio.to_thread(self.try_acquire, name, holder, ttl)

    async def arenew(self, grant: Grant, ttl: float) -> Grant:
        """:meth:`renew` without blocking the event loop."""
        return await asyncio.to_thread(self.renew, grant, ttl)

    async def arelease(self, grant: Grant) -> None:
        """:meth:`release` without blocking the event loop."""
        await asyncio.to_thread(self.release, grant)

    async def atry_acquire_shared(self, name: str, holder: str, ttl: float) -> Grant | None:
        """:meth:`try_acquire_shared` without blocking the event loop."""
        return await asyncio.to_thread(self.try_acquire_shared, name, holder, ttl)

    async def astop_new_readers(self, name: str) -> bool | None:
        """:meth:`stop_new_readers` without blocking the event loop."""
        return await asyncio.to_thread(self.stop_new_readers, name)

    async def await_for_release(self, name: str, timeout: float) -> bool:
        """:meth:`wait_for_release` without blocking the event loop; cancelling it stops the
        wait (the default's worker thread still sleeps out ``timeout``, at most a backoff
        delay)."""
        return await asyncio.to_thread(self.wait_for_release, name, timeout)

    async def aclose(self) -> None:  # noqa: B027 - optional hook, like close()
        """Close the async clients this backend opened on the running event loop.

        Async connections belong to the loop that opened them: code that runs loops one after
        another (``asyncio.run`` per job, tests) calls this before its loop ends, so no socket
        is left to a closed loop. Nothing to do for the thread-offloading defaults.
        """

    def waiting_room(self, name: str, timeout: float | None) -> AbstractContextManager[None]:
        """Admit one waiter of ``name`` at a time while others sleep in the store.

        A waiter enters after its first failed try and stays until it acquires or gives up,
        so a release wakes one contender instead of every waiter (a herd that costs a failed
        round trip each). Optional and best effort: the default admits everyone at once, and a
        backend must stop queueing after a short while rather than let a paused waiter hold
        the others back. Safety never depends on it.
        """
        return contextlib.nullcontext()

    def awaiting_room(self, name: str, timeout: float | None) -> AbstractAsyncContextManager[None]:
        """:meth:`waiting_room` for an async waiter (``async with``), held by its task.

        The same contract: entered after the first failed try, left on acquiring or giving
        up, best effort. The default admits everyone at once; the database backend queues the
        waiter in the same per-name room on an async connection of its own, ZooKeeper puts it
        in the name's line.
        """
        return contextlib.nullcontext()

    def doubts(self, grant: Grant) -> str | None:
        """Why this process cannot vouch for ``grant`` right now though its validity has not
        run out, or ``None``.

        No round trip: only what the client already knows. A ZooKeeper connection that is
        suspended, for one, may hide a session the ensemble has already expired, znodes and
        all; until it is back, :meth:`~leases.handle.Lease.ensure_held` refuses (without
        marking the lease lost: it may be trusted again within its validity). The default has
        no doubts: the validity is all a client of the other stores can know.
        """
        return None

    @abc.abstractmethod
    def inspect(self, name: str) -> LeaseInfo | None:
        """The current state of ``name`` (held or not), or ``None`` if never granted."""

    def probe(self, name: str) -> None:
        """Raise unless every store a grant needs answers: the health check's reachability.

        This default reads ``name`` (:meth:`inspect`), a round trip to the store. A backend
        that takes its tokens from a second store a read does not touch overrides it, so a
        load balancer hears that grants fail while the first store answers."""
        self.inspect(name)

    @abc.abstractmethod
    def inspect_all(self) -> list[LeaseInfo]:
        """Every name the store knows, held or not, for operators' views."""

    def inspect_held_first(self, limit: int) -> list[LeaseInfo]:
        """Up to ``limit`` names in :attr:`LeaseInfo.rank` order: what an operator wants to see
        first when the store knows millions of names, nearly all of them free.

        This default reads :meth:`inspect_all` and sorts; a backend that can select the held
        names in the store (the database backend, by a partial index) overrides it, so the
        cost follows ``limit`` and the number of held names, not the number ever used.
        """
        return sorted(self.inspect_all(), key=lambda info: info.rank)[:limit]

    def iter_held_first(self, batch: int = LIST_BATCH) -> Iterator[LeaseInfo]:
        """Every name in :attr:`LeaseInfo.rank` order, read lazily: a whole listing that
        holds a few batches in memory, not the store (``leases list --limit 0``).

        This default sorts :meth:`inspect_all` (stores that forget free names keep few); the
        database backend, whose table keeps a row per name ever used, reads ``batch`` rows a
        round trip. Listings need not carry :attr:`LeaseInfo.meta` (the database backend's
        leave it empty, so its held names come from an index alone); :meth:`inspect` has it.
        """
        yield from sorted(self.inspect_all(), key=lambda info: info.rank)

    def force_release(self, name: str, token: int) -> LeaseInfo:
        """Revoke the grant of ``name`` with ``token`` by advancing the token (operators only).

        Compare-and-revoke: only while the name's stored token is still ``token`` (read by the
        operator from :meth:`inspect`) does it advance the token, free the name and wake
        waiters; the evicted holder's renewals then fail and its fenced writes are rejected.
        Otherwise the name changed hands since it was inspected (or was never granted), and
        evicting whoever holds it now would punish the wrong holder: it raises
        :class:`~leases.errors.LeaseNotHeld` and changes nothing. Returns the name's state
        after the revocation (free, with the advanced token). One round trip where the store
        can compare and write in one request.
        """
        raise BackendNotSupported(self.alias, Capability.FORCE_RELEASE.value)

    def prune(
        self,
        older_than: float,
        *,
        batch_size: int = PRUNE_BATCH,
        progress: Callable[[int, int, int], None] | None = None,
        dry_run: bool = False,
    ) -> int:
        """Forget the names nobody has held for ``older_than`` seconds; returns how many.

        For stores that keep a record of every name ever used (the database backend's rows).
        It must not let a token go backwards: a pruned name's next grant gets a token higher
        than any it ever had. Works in bounded batches (``batch_size``), calling
        ``progress(read, pruned, total estimate)`` after each; ``dry_run`` only counts.
        Stores that forget expired names by themselves do not support it.
        """
        raise BackendNotSupported(self.alias, Capability.PRUNE.value)

    def waiters(self) -> list[LeaseWaiter]:
        """Who waits for which name now, for operators' views.

        Backends whose waiters the store can show implement it (Redis and Redlock, from the
        blocked connections). The database backend's waiters queue in advisory locks, which
        the admin lists from ``pg_locks`` through :meth:`internal_advisory_locks`.
        """
        return []

    def internal_advisory_locks(self) -> dict[int, InternalLock]:
        """PostgreSQL advisory keys this backend locks for its own purposes: for which lease,
        and why.

        Operators' views use it to show such a lock as, say, the waiting room of lease ``x``
        (and its waiters as the lease's waiters) instead of an anonymous 64-bit key. Backends
        that take no advisory locks return nothing.
        """
        return {}

    def store_checks(self) -> list[str]:
        """How the store itself is set up to lose leases behind everyone's back (a Redis that
        evicts keys under memory pressure), read in one short round trip.

        Run by plain ``manage.py check`` (``leases.W004``), since such a store loses leases in
        production while every test passes, and only for backends that override it. The
        check gives each store a second or two and says nothing of one that does not answer
        (a build step without its services must still pass): reachability is
        :meth:`deploy_checks`'s business.
        """
        return []

    def deploy_checks(self) -> list[str]:
        """Problems found by talking to the store (reachability, durability settings).

        Run only by ``manage.py check --deploy`` and the full health check, never at import or
        start-up.
        """
        return []

    def deploy_advice(self) -> list[str]:
        """What costs but breaks nothing, found by talking to the store (another project's
        traffic under the same keys). Run by ``manage.py check --deploy`` only: not by the
        health check, which a balancer or a monitor polls (such a look may read many keys,
        and a store that keeps every lease safe is healthy)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook, most backends need nothing
        """Release connections; called when settings change and at interpreter exit."""


#: Why a renewal or release that named the current holder and token was refused.
FORGED = (
    "holder and token match the current grant, but not its secret: only the process that "
    "acquired it can renew or release it (nothing was changed)"
)


def not_serialisable(what: str, action: str = "pickle") -> TypeError:
    """Why ``what`` (a grant, or a handle holding one) refuses to be pickled (``action``).

    It carries the grant's secret, the credential that renews and releases the lease (holder
    and token are public). A pickle is how Python objects reach a cache, a session, a Celery
    result or a multiprocessing queue, and whoever reads those could then release the lease
    under its holder. Nothing in the package pickles a grant: a Celery guard's travels in its
    message's headers, on purpose and documented."""
    return TypeError(
        f"cannot {action} {what}: it carries the lease's secret, the credential that renews and "
        "releases it, which must not leave this process (a cache, a session, a task's result "
        "or a queue would hand it to whoever reads them). Pass the lease's name and token "
        "instead: the token fences writes wherever it goes"
    )


def new_secret() -> str:
    """A fresh grant secret: 128 random bits, generated by the backend at every acquire."""
    return Secret(secrets.token_hex(16))


def not_revoked(offered: int, current: int | None) -> str:
    """Why a :meth:`LeaseBackend.force_release` did nothing, for its :class:`LeaseNotHeld`."""
    if current is None:
        return f"it was never granted, so token {offered} was not revoked; nothing was done"
    return (
        f"its current token is {current}, not {offered} (it changed hands since it was "
        "inspected); nothing was done: inspect it again and revoke the current token"
    )
