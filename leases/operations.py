"""What operators see and do: held and awaited locks, forced release, terminated sessions.

One module behind both the admin pages and ``manage.py leases``, so the two can never disagree
about what "held" means or skip the permission check and the audit record the other keeps.
Every revocation is recorded in the application database, where fenced statements consult it,
and goes through the backend's ``force_release``, which advances the token: the evicted
holder's fenced writes are rejected at once and its renewals fail, which is what makes taking a
lease away safe at all.
"""

from __future__ import annotations

import functools
import heapq
import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import PermissionDenied
from django.db import connections
from django.db.models import Q, QuerySet
from django.utils import timezone

from . import conf, revocation
from ._asking import ANSWER_BOUND, ask_every_backend
from ._paging import Pages
from .backends import Capability, LeaseBackend, get_backend
from .backends.base import LIST_BATCH, InternalLock, LeaseInfo, LeaseWaiter
from .databases import migrated_databases
from .errors import (
    BackendNotSupported,
    BackendUnavailable,
    InvalidFencingToken,
    LeaseError,
    LeaseNotHeld,
    RevocationIncomplete,
)
from .holders import Holder, parse_holder, public_meta, shown_holder
from .keys import split_key

__all__ = [
    "FORCE_RELEASE_PERMISSION",
    "LEASE_STATES",
    "TERMINATE_PERMISSION",
    "AdvisoryLockRow",
    "Holder",
    "advisory_database",
    "advisory_databases",
    "advisory_locks",
    "all_leases",
    "backend_overview",
    "backend_waiters",
    "force_release",
    "lease_state",
    "lease_waiters",
    "parse_holder",
    "remember_advisory_names",
    "row_state",
    "rows_in_state",
    "shown_holder",
    "state_of",
    "terminate_session",
]

logger = logging.getLogger(__name__)

FORCE_RELEASE_PERMISSION = "leases.force_release_lease"
TERMINATE_PERMISSION = "leases.terminate_lock_session"

#: Advisory locks of this database, held or awaited, with the session behind each. A
#: one-argument lock shows as ``classid`` (high 32 bits), ``objid`` (low 32 bits), ``objsubid``
#: 1; the shift rebuilds the signed 64-bit key, which ``leases_advisory_name`` maps to a name.
ADVISORY_LOCKS_SQL = """
SELECT l.pid, l.mode, l.granted, l.objsubid, l.classid::bigint, l.objid::bigint,
       n.name, a.application_name, host(a.client_addr), a.usename, a.state,
       COALESCE(l.waitstart, a.xact_start, a.state_change, a.backend_start) AS since,
       a.query, a.wait_event_type,
       CASE WHEN l.granted THEN '{}'::int[] ELSE pg_blocking_pids(l.pid) END, a.backend_start
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN leases_advisory_name n
       ON l.objsubid = 1 AND n.key = ((l.classid::bigint << 32) | l.objid::bigint)
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY l.granted DESC, since, l.pid
"""

#: ``pg_terminate_backend`` only for a session that holds or awaits an advisory lock now, so
#: the admin cannot be used to kill arbitrary sessions of the database; and only for the
#: session the operator saw, by its start as well as its pid, checked in the same statement:
#: a session that ended may have handed its pid to a new one meanwhile.
TERMINATE_SQL = """
SELECT pg_terminate_backend(l.pid)
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.pid = %s AND a.backend_start = %s
  AND l.pid <> pg_backend_pid()
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
LIMIT 1
"""


@dataclass(frozen=True)
class AdvisoryLockRow:
    """One row of ``pg_locks`` for an advisory lock, joined with its session."""

    pid: int
    mode: str
    granted: bool
    key: str
    name: str
    application: str
    client: str
    user: str
    state: str
    since: datetime | None
    query: str
    wait_event_type: str
    #: For a waiting row: the sessions it waits for (``pg_blocking_pids``).
    blocked_by: tuple[int, ...] = ()
    #: When a lease backend took this lock itself: the lease whose waiting room it is.
    room_of: str = ""
    #: Or the lease whose holder keeps it (its next waiter queues on it: a tenure lock).
    tenure_of: str = ""
    #: The signed 64-bit key of a one-argument lock (``None`` for the two-int4 form).
    key64: int | None = None
    #: A lease backend took it for its own purposes (a room, a tenure, or one a backend
    #: knows as its own without knowing the lease any more: a grant's that has ended).
    internal: bool = False
    #: When the session began (``pg_stat_activity.backend_start``): with the pid, which the
    #: server reuses once a session ends, it names one session.
    started: datetime | None = None

    @property
    def status(self) -> str:
        return "held" if self.granted else "WAITING"

    @property
    def label(self) -> str:
        """What an operator should read: the name, the waiting room's lease, or the key."""
        if self.room_of:
            return f"waiting room of lease {self.room_of!r}"
        if self.tenure_of:
            return f"tenure of lease {self.tenure_of!r}"
        return self.name or self.key

    @property
    def shared(self) -> bool:
        return self.mode.startswith("Share")


def _key_text(objsubid: int, classid: int, objid: int) -> str:
    if objsubid == 2:  # the two-int4 form: both halves are signed 32-bit keys
        return f"({_signed32(classid)}, {_signed32(objid)})"
    signed = _signed64(classid, objid)
    assert split_key(signed) == (classid, objid)
    return str(signed)


def _signed32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def advisory_databases() -> list[str]:
    """The databases whose advisory locks operators see: PostgreSQL aliases where the
    ``leases`` app is migrated (its name table joins ``pg_locks``), one alias per database."""
    from .models import AdvisoryLockName

    return migrated_databases(AdvisoryLockName)


def advisory_database(requested: str | None = None) -> str:
    """``requested`` if operators may look at it, else the first such database.

    Raises :class:`PermissionDenied` for an alias that is not one of
    :func:`advisory_databases` (a URL parameter must not reach an arbitrary connection).
    """
    allowed = advisory_databases()
    if requested:
        if requested not in allowed:
            raise PermissionDenied(f"no advisory locks are shown for database {requested!r}")
        return requested
    if not allowed:
        raise PermissionDenied("no PostgreSQL database has the leases tables")
    return allowed[0]


def advisory_locks(using: str | None = None) -> list[AdvisoryLockRow]:
    """Advisory locks held or awaited now on database ``using`` (default: the first of
    :func:`advisory_databases`), held ones first.

    A backend's own lock other than a waiting room (a lease's tenure lock, above all) is
    listed only while someone waits on it: every held database lease keeps one (it only
    wakes the next waiter), so listed always it would double the list with locks that
    explain nothing."""
    using = advisory_database(using)
    with connections[using].cursor() as cursor:
        cursor.execute(ADVISORY_LOCKS_SQL)
        found = cursor.fetchall()
    rooms = _waiting_rooms() if found else {}
    rows = [_advisory_row(row, rooms) for row in found]
    awaited = {row.key for row in rows if not row.granted}
    return [
        row
        for row in rows
        if not row.internal or row.room_of or not row.granted or row.key in awaited
    ]


def lease_waiters(using: str | None = None) -> list[AdvisoryLockRow]:
    """Who waits for which lease, from the waiting rooms: the one inside the room (granted)
    is next in line, the others queue behind it. Waiters a backend does not queue in a room
    (overflow past the room's limits) are not visible here; those of backends that show
    their own are :func:`backend_waiters`."""
    return [row for row in advisory_locks(using) if row.room_of]


def backend_waiters(bound: float = ANSWER_BOUND) -> list[LeaseWaiter]:
    """Waiters every configured backend reports itself (Redis and Redlock: the connections
    blocked waiting), longest waiting first. Backends are asked at once, each for at most
    ``bound`` seconds; one that is down or does not answer hides only its own."""
    answers, errors = ask_every_backend("waiters", _waiters_of, bound)
    for alias, exc in errors.items():
        logger.debug("leases: waiters of backend %r unavailable: %s", alias, exc)
    return _longest_waiting_first(answers.values())


def _waiters_of(backend: LeaseBackend) -> list[LeaseWaiter]:
    return backend.waiters()


def _longest_waiting_first(found: Iterable[list[LeaseWaiter]]) -> list[LeaseWaiter]:
    every = [waiter for waiters in found for waiter in waiters]
    return sorted(every, key=lambda w: (w.since is None, w.since, w.name, w.backend))


def _advisory_row(row: tuple[Any, ...], rooms: dict[int, InternalLock]) -> AdvisoryLockRow:
    (pid, mode, granted, objsubid, classid, objid, name, application, client, user) = row[:10]
    state, since, query, wait_event_type, blocked_by, started = row[10:]
    key64 = _signed64(classid, objid) if objsubid == 1 else None
    internal = rooms.get(key64) if key64 is not None else None
    return AdvisoryLockRow(
        pid=pid,
        mode=mode,
        granted=granted,
        key=_key_text(objsubid, classid, objid),
        name=name or "",
        application=application or "",
        client=client or "local socket",
        user=user or "",
        state=state or "",
        since=since,
        query=query or "",
        wait_event_type=wait_event_type or "",
        blocked_by=tuple(blocked_by or ()),
        room_of=internal.lease if internal and internal.purpose == "room" else "",
        tenure_of=internal.lease if internal and internal.purpose == "tenure" else "",
        key64=key64,
        internal=internal is not None,
        started=started,
    )


def _signed64(classid: int, objid: int) -> int:
    unsigned = (classid << 32) | objid
    return unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned


def _waiting_rooms() -> dict[int, InternalLock]:
    """Every backend's internal advisory keys (waiting rooms, tenures) -> what they are for.

    A backend that is down only loses its labels: the page must still show the locks.
    """
    answers, _ = ask_every_backend("rooms", _rooms_of)
    rooms: dict[int, InternalLock] = {}
    for found in answers.values():
        rooms.update(found)
    return rooms


def _rooms_of(backend: LeaseBackend) -> dict[int, InternalLock]:
    return backend.internal_advisory_locks()


def all_leases(
    limit: int | None = None, bound: float = ANSWER_BOUND
) -> tuple[list[LeaseInfo], dict[str, str]]:
    """Leases on every configured backend, held first, and the error of each backend that
    failed; at most ``limit`` of them (``None``: all).

    A backend that is down must not hide the others from an operator in the middle of an
    incident, nor make them wait for its timeouts: backends are asked at once, each for at
    most ``bound`` seconds, and errors (a backend that did not answer in time is unreachable)
    are collected per alias instead of raised. Names are never deleted, so a store may know
    millions: with a ``limit`` each backend is asked only for its first ``limit``
    (:meth:`~leases.backends.base.LeaseBackend.inspect_held_first`).
    """
    answers, errors = ask_every_backend(("leases", limit), _LeasesOf(limit), bound)
    return _held_first(answers.values(), limit), {a: str(e) for a, e in errors.items()}


def backend_overview(
    limit: int, bound: float = ANSWER_BOUND
) -> tuple[list[LeaseInfo], dict[str, str], list[LeaseWaiter]]:
    """:func:`all_leases` and :func:`backend_waiters` in one question to every backend, so a
    view that shows both waits for an unreachable store once (``bound``), not twice."""
    leases_of = _LeasesOf(limit)

    def both(backend: LeaseBackend) -> tuple[list[LeaseInfo], list[LeaseWaiter]]:
        infos = leases_of(backend)
        try:
            return infos, backend.waiters()
        except LeaseError as exc:
            logger.debug("leases: waiters of backend %r unavailable: %s", backend.alias, exc)
            return infos, []

    answers, errors = ask_every_backend(("overview", limit), both, bound)
    infos = _held_first((found for found, _ in answers.values()), limit)
    waiters = _longest_waiting_first(found for _, found in answers.values())
    return infos, {alias: str(exc) for alias, exc in errors.items()}, waiters


@dataclass(frozen=True)
class _LeasesOf:
    """The question :func:`all_leases` asks each backend."""

    limit: int | None

    def __call__(self, backend: LeaseBackend) -> list[LeaseInfo]:
        if self.limit is None:
            return backend.inspect_all()
        return backend.inspect_held_first(self.limit)


def _held_first(found: Iterable[list[LeaseInfo]], limit: int | None) -> list[LeaseInfo]:
    every = [info for infos in found for info in infos]
    every.sort(key=lambda info: (*info.rank, info.backend))
    return every[:limit]


def stream_leases(
    errors: dict[str, str], *, page: int = LIST_BATCH, bound: float = ANSWER_BOUND
) -> Iterator[LeaseInfo]:
    """Every lease on every configured backend in :func:`all_leases`' order, read lazily
    (:meth:`~leases.backends.base.LeaseBackend.iter_held_first`): ``leases list --limit 0``
    holds a few pages in memory, not a million rows.

    Backends are read at once, ``page`` leases at a time, each page within ``bound`` seconds
    of being asked for (:class:`~leases._paging.Pages`), and their streams merged as they
    come. A backend that fails or does not answer in time (at its start or half-way) ends its
    own stream and its error lands in ``errors``; the others go on.
    """
    aliases = list(conf.get().backends)
    pool = ThreadPoolExecutor(max(1, len(aliases)), thread_name_prefix="leases-list")
    try:
        streams: list[Iterator[tuple[tuple[int, str], str, LeaseInfo]]] = []
        for alias in aliases:
            try:
                backend = get_backend(alias)
            except LeaseError as exc:
                errors[alias] = str(exc)
                continue
            pages = Pages(
                alias,
                functools.partial(backend.iter_held_first, page),
                pool,
                errors,
                page=page,
                bound=bound,
            )
            streams.append(_ranked(alias, pages))
        for _, _, info in heapq.merge(*streams):
            yield info
    finally:
        # Not waiting: a thread stuck on a store that stopped answering ends with its timeouts.
        pool.shutdown(wait=False, cancel_futures=True)


def _ranked(
    alias: str, infos: Iterable[LeaseInfo]
) -> Iterator[tuple[tuple[int, str], str, LeaseInfo]]:
    """What the merge of :func:`stream_leases` compares: rank, then backend (never the info)."""
    for info in infos:
        yield info.rank, alias, info


#: The three states an operator sees, in the order the admin's filter offers them.
LEASE_STATES = ("held", "expired", "free")


def state_of(holder: str, held: bool) -> str:
    """``held``, ``expired`` (a holder whose time ran out) or ``free`` (released).

    The one definition of the verdict: the command, both admin pages and the admin's filter
    (:func:`rows_in_state`) all derive theirs from it.
    """
    if held:
        return "held"
    return "expired" if holder else "free"


def lease_state(info: LeaseInfo) -> str:
    """The verdict for what a backend reported: the store's own clock decided ``held``."""
    return state_of(info.holder, info.held)


def shown_meta(row: Any) -> dict[str, Any]:
    """A ``leases_lease`` row's ``meta`` as operators may see it: without the readers'
    secret hashes, as every listing shows it (the admin's change page showed it raw)."""
    return public_meta(row.meta or {})


def row_state(row: Any, now: datetime | None = None) -> str:
    """The verdict for a ``leases_lease`` row, on the web server's clock (a hint)."""
    now = now or timezone.now()
    held = bool(row.holder) and row.expires_at is not None and row.expires_at > now
    return state_of(row.holder, held)


def rows_in_state(rows: QuerySet[Any], state: str, now: datetime | None = None) -> QuerySet[Any]:
    """``rows`` (of ``leases_lease``) whose :func:`row_state` is ``state``, as one filter."""
    now = now or timezone.now()
    held = ~Q(holder="") & Q(expires_at__gt=now)
    conditions = {"held": held, "expired": ~Q(holder="") & ~held, "free": Q(holder="")}
    return rows.filter(conditions[state])


def expires_in(info: LeaseInfo, now: datetime | None = None) -> timedelta | None:
    """Time left on the store's last word (negative once expired); ``None`` when unknown."""
    if info.expires_at is None:
        return None
    return info.expires_at - (now or timezone.now())


def _require(user: Any, permission: str) -> None:
    if user is None or not user.is_active or not user.has_perm(permission):
        who = (user.get_username() if user is not None else "") or "anonymous"
        raise PermissionDenied(f"{who} lacks the {permission} permission")


def force_release(name: str, *, backend: str, token: int, user: Any, via: str) -> Any:
    """Revoke grant ``token`` of ``name`` on ``backend``; record who did it and when.

    A compare-and-release on what the operator saw: if the name's token is no longer ``token``
    (the lease was released and someone else took it since the page was drawn), nothing is
    done and :class:`~leases.errors.LeaseNotHeld` says so, so a click can never evict a
    successor nobody looked at. Raises :class:`PermissionDenied` unless ``user`` has
    ``leases.force_release_lease``, and :class:`~leases.errors.BackendNotSupported`, with
    nothing recorded, unless the backend as configured can revoke.

    In order: the revocation is committed in the application database(s) (from then on every
    write fenced by the evicted lease is refused by the resource itself, on any backend), then
    the backend advances the token (the holder's renewals fail, waiters are woken), then the
    audit record is written. Returns the :class:`~leases.models.ForceRelease` record.

    A backend that does not confirm the revocation (:class:`~leases.errors.BackendUnavailable`,
    :class:`~leases.errors.RevocationIncomplete` where it moved the token but could not take
    the grant away) has its error raised, but only after an ``incomplete`` audit record: the
    revocation is recorded by then, and may have moved the token, so the action has effects
    someone will need to explain.
    """
    _require(user, FORCE_RELEASE_PERMISSION)
    if isinstance(token, bool) or not isinstance(token, int) or token < 1:
        raise InvalidFencingToken(token, "the token of the grant to release, as shown")
    store = get_backend(backend)
    if Capability.FORCE_RELEASE not in store.capabilities:  # before a revocation is recorded
        raise BackendNotSupported(backend, Capability.FORCE_RELEASE.value)
    before = store.inspect(name)
    if before is None or not before.held:
        raise LeaseNotHeld(name, "nothing to release", by=f"anyone on backend {backend!r}")
    if before.token != token:
        raise LeaseNotHeld(
            name,
            f"its token on {backend!r} is now {before.token}, not {token}: it changed hands "
            "since you looked, so nothing was released",
            by=f"grant {token}",
        )
    revocation.record(backend, name, token)
    holder = shown_holder(before.holder, before.meta, named=True)
    audit = functools.partial(
        _audit, user, via, name=name, backend=backend, holder=holder, token=token
    )
    try:
        after = store.force_release(name, token)
    except BackendUnavailable as exc:
        moved = exc.token if isinstance(exc, RevocationIncomplete) else None
        message = f"lease {name!r} force release on {backend!r} incomplete ({exc})"
        audit(message, action="incomplete", new_token=moved)
        raise
    return audit(
        f"lease {name!r} force-released on {backend!r}", action="release", new_token=after.token
    )


def terminate_session(
    pid: int, *, started: datetime | None, user: Any, via: str, using: str | None = None
) -> Any:
    """End the database session ``pid`` that began at ``started`` (its ``backend_start``, as
    :func:`advisory_locks` shows it) so the session locks it holds are freed.

    Only for a session that holds or awaits an advisory lock now, and only the one the operator
    saw: a pid names a session only while it lasts (the server hands it to a new one after),
    so the start is checked too, in the termination's own statement. Whatever that session
    was doing is rolled back; its lock is not fenced, so this is the blunt tool of last resort
    and needs its own permission (``leases.terminate_lock_session``). Returns the audit record.
    """
    _require(user, TERMINATE_PERMISSION)
    using = advisory_database(using)
    rows = [row for row in advisory_locks(using) if row.pid == pid]
    if not rows:
        raise LeaseNotHeld(f"pid {pid}", "that session holds or awaits no advisory lock now")
    if started is None or rows[0].started != started:
        raise LeaseNotHeld(
            f"pid {pid}",
            f"that pid is now a session started at {rows[0].started}, not the one you saw "
            f"(started at {started}): not terminated",
        )
    with connections[using].cursor() as cursor:
        cursor.execute(TERMINATE_SQL, [pid, started])
        done = cursor.fetchone()
    if not done or not done[0]:
        raise LeaseNotHeld(f"pid {pid}", "the session could not be terminated (already gone?)")
    described = ", ".join(f"{row.name or row.key} ({row.status})" for row in rows)
    return _audit(
        user,
        via,
        f"database session {pid} holding {described} terminated",
        action="terminate",
        name=described,
        backend=f"postgres:{using}",
        holder=f"pid {pid} {rows[0].application} {rows[0].client}".strip(),
    )


_EVENTS = {
    "release": "lease_force_released",
    "incomplete": "lease_force_release_incomplete",
    "terminate": "lock_session_terminated",
}


def _fitted(model: Any, field: str, value: Any) -> Any:
    """``value``, cut to ``model.field``'s ``max_length`` if it is text longer than that."""
    limit = getattr(model._meta.get_field(field), "max_length", None)
    return value[:limit] if isinstance(value, str) and limit else value


def _audit(user: Any, via: str, message: str, **fields: Any) -> Any:
    """Record an operator's action in ``ForceRelease`` and log it with structured fields."""
    from .models import ForceRelease

    texts = {"by_username": user.get_username(), "via": via, **fields}
    record = ForceRelease.objects.create(
        by=user if getattr(user, "pk", None) else None,
        # Text longer than its column is cut rather than fail the audit of an action already
        # done: an e-mail address as USERNAME_FIELD, a database alias (Django bounds none; the
        # column's 100 is a lease backend alias's bound), a long list of locks or readers.
        **{key: _fitted(ForceRelease, key, value) for key, value in texts.items()},
    )
    details = {key: value for key, value in fields.items() if key not in ("action", "name")}
    logger.warning(
        "%s by %s (%s)",
        message,
        record.by_username,
        ", ".join(f"{key} {value}" for key, value in details.items()),
        extra={
            "event": _EVENTS[fields["action"]],
            "lease": fields["name"],
            **details,
            "by": record.by_username,
            "via": via,
        },
    )
    return record


def remember_advisory_names(*names: str, using: str | None = None) -> None:
    """Record ``name -> key`` so the admin and ``manage.py leases`` show advisory locks by name.

    ``pg_locks`` only knows the 64-bit key. ``advisory.xact_lock``/``session_lock`` record each
    name the first time a process locks it (in the background, ``RECORD_ADVISORY_NAMES``);
    call this to record names ahead of time, e.g. in a data migration. It ignores names
    already recorded. (Not from ``AppConfig.ready()``: no queries there.)
    """
    from .models import AdvisoryLockName

    rows = [AdvisoryLockName(key=_name_key(name), name=name) for name in names]  # before SQL
    manager = AdvisoryLockName.objects if using is None else AdvisoryLockName.objects.using(using)
    manager.bulk_create(rows, ignore_conflicts=True)


def _name_key(name: str) -> int:
    """The key of ``name``, validated before any SQL: an explicit key (an ``int``, a pair)
    has no name to record, and a bare ``assert`` let a pair through under ``python -O``
    while an ``int`` was stored as its text."""
    from .keys import hashed_key, validate_name

    return hashed_key(validate_name(name))
