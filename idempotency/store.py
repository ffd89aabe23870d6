"""The key state machine, independent of HTTP: begin, then finish or release.

``begin`` is one statement on the hot path (:data:`~idempotency.statements.BEGIN`): a
read-only probe, so a replay or a duplicate writes nothing, then, only when the key may be
claimed, an insert that on conflict takes over a key whose lock lapsed (a crashed attempt) or
whose TTL passed. The started row is committed on its own (autocommit) before the work runs, so
a duplicate sees "in progress" at once instead of queueing behind an uncommitted insert; that
commit does not wait for the disk (:data:`~idempotency.statements.ASYNC_CLAIM_SQL`): whatever
the attempt commits later commits synchronously and makes the claim durable with it.

An atomic attempt may instead claim its key in its own transaction (``in_transaction``): an
advisory lock rather than a row, the row written once with the outcome (see
:data:`~idempotency.statements.PROBE`). That is the default inside a transaction that is already
open (:func:`claims_in_transaction`), where a row claim could not be committed first either.

A row claim inside a transaction that is already open (``ATOMIC_REQUESTS``, or a caller's
``atomic`` block; ``claim_in_transaction=False``) cannot commit the started row first: it stays
uncommitted while the view runs, and a duplicate's insert would queue behind it for as long as
the first request runs, however long that is, without reading its fingerprint. There the claim
runs in a savepoint and takes the gated claim's two transaction locks before it looks
(:func:`_claim_in_transaction`): a duplicate is answered from them, "in progress" for the same
request and a mismatch for another, without touching the row; the insert waits under a
``lock_timeout`` of the time the caller may wait (a millisecond for ``on_conflict="409"``) only
on rows claimed without those locks; when it fires the savepoint is rolled back, the transaction
stays usable, and the duplicate is told "in progress".

``finish`` is conditional on the attempt's ``owner``: an attempt whose lock lapsed and was taken
over stores nothing, and in atomic mode its effects roll back with it (only one attempt commits).
Every time is the database's ``clock_timestamp()``; app servers' clocks are never compared.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import hashlib
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.db import OperationalError, connections, transaction

from leases.retry import Backoff
from leases.signals import send

from . import signals, statements
from .errors import IdempotencyKeyInProgress, IdempotencyKeyLost, IdempotencyKeyMismatch
from .statements import (
    BEGIN,
    FINISH,
    GATE_SESSION_SQL,
    GATE_XACT_SQL,
    PROBE,
    RECORD_STEP,
    RELEASE,
    STORE,
    UNLOCK_SQL,
)

__all__ = [
    "Attempt",
    "Begun",
    "Claim",
    "Outcome",
    "Status",
    "begin",
    "current",
    "finish",
    "record_step",
    "release",
]

# Around the claim inside an open transaction, in the claim's query: bound the wait on an
# uncommitted key row, and put the caller's own lock_timeout back (SET LOCAL in a released
# savepoint lasts until the end of the transaction), kept meanwhile on the server so that the
# three go in one round trip. A timeout rolls the savepoint back, which undoes both settings.
BOUND_LOCK_WAIT_SQL = (
    "SELECT set_config('idempotency.lock_timeout', current_setting('lock_timeout'), true), "
    "set_config('lock_timeout', %(row_timeout)s, true)"
)
RESTORE_LOCK_TIMEOUT_SQL = (
    "SELECT set_config('lock_timeout', current_setting('idempotency.lock_timeout'), true)"
)
LOCK_NOT_AVAILABLE = "55P03"
_MAX_LOCK_TIMEOUT_MS = 2**31 - 1
# An autocommit claim waits on another transaction's row at most this long a time (the time it
# may wait, if less), then reads who holds it: another request's key is told apart at once, not
# when the whole wait is over, and ``begin`` polls an in-progress one as it polls any.
_ROW_WAIT_SLICE = 0.25

# A key committed between the statement's snapshot and its conflict check shows up in neither
# half of the claim; running it again sees it.
_BEGIN_ATTEMPTS = 3


class Status(enum.StrEnum):
    NEW = "new"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    MISMATCH = "mismatch"


@dataclass(frozen=True)
class Outcome:
    """What a completed key replays: an HTTP status, headers and body (status None off HTTP)."""

    status: int | None
    headers: list[tuple[str, str]]
    body: bytes


@dataclass(frozen=True)
class Claim:
    """A started key this attempt owns until ``locked_until``."""

    id: int
    scope: str
    key: str
    owner: uuid.UUID
    using: str
    taken_over: bool = False
    fingerprint: str = ""
    #: Seconds a lock lasts; each recorded step renews it.
    lock_timeout: float = 60.0
    #: Seconds the key is kept (at least ``lock_timeout``): a started key's recorded steps for
    #: this long after its last step or its release (see
    #: :data:`~idempotency.statements.RECORD_STEP`).
    ttl: float = 86400.0
    #: Steps an earlier attempt recorded (name -> result), which this one resumes after.
    steps: dict[str, Any] = field(default_factory=dict)
    #: For a claim made in the view's transaction: the advisory lock key held instead of a row
    #: (the row is written with the outcome, :data:`~idempotency.statements.STORE`).
    gate: int | None = None
    #: Whether that lock is the session's (taken outside a transaction, released after the
    #: commit) rather than the transaction's.
    session_gate: bool = False
    #: The lock held with it on the key and the request's fingerprint, by which a duplicate
    #: tells a retry of this request from another request (:data:`~idempotency.statements.
    #: GATE_SESSION_SQL`).
    request_gate: int | None = None


@dataclass(frozen=True)
class Begun:
    """What ``begin`` found: a claim to work under, a stored outcome, or why neither."""

    status: Status
    claim: Claim | None = None
    outcome: Outcome | None = None
    retry_after: float = 0.0

    def raise_for_conflict(self, scope: str, key: str) -> None:
        """Raise the error a caller gets for a key used by another request, or still in use."""
        if self.status is Status.MISMATCH:
            raise IdempotencyKeyMismatch(scope, key)
        if self.status is Status.IN_PROGRESS:
            raise IdempotencyKeyInProgress(scope, key, retry_after=self.retry_after)


def _json(value: Any) -> Any:
    """A jsonb column's value: Django's psycopg adapters hand it over as text (a new claim's
    empty steps, the common case, without the parser)."""
    if value == "{}":
        return {}
    return json.loads(value) if isinstance(value, str) else value


def _outcome(status: int | None, headers: Any, body: Any) -> Outcome:
    headers = _json(headers)
    pairs = [(str(name), str(value)) for name, value in headers or []]
    return Outcome(status=status, headers=pairs, body=bytes(body or b""))


def _claim_in_transaction(params: dict[str, Any], using: str, wait: float) -> Begun | None:
    """A row claim inside a transaction that is already open, in a savepoint.

    Such a claim's started row stays uncommitted as long as the caller's transaction runs, so a
    duplicate cannot read its fingerprint: it would queue behind the row, and, bounded by a
    ``lock_timeout``, could only answer 409, to another request as to a retry (the draft has
    422 for another request), and two transactions claiming each other's keys while waiting
    deadlocked. So the row claim takes the gated claim's two locks first, as transaction locks
    (:data:`~idempotency.statements.GATE_XACT_SQL`, the same lock keys, so the two claims see
    each other) and looks at the committed key (:data:`~idempotency.statements.PROBE`): a key
    held by another transaction is answered from its locks, 409 or 422, without touching its
    row; only a key free of both locks is claimed by inserting the row, which waits on a locked
    row at most ``wait`` seconds (a row finished or claimed without the locks, committing at
    once). The locks are kept with a claim, until the transaction ends; otherwise they are
    given back with the savepoint, so a replay or a refusal holds nothing.
    """
    params = _with_transaction_gates(params)
    try:
        with transaction.atomic(using=using):
            probed = _claim_gated(params, using)
            begun = _claim_row(params, using, wait) if probed[0] == "claimed" else None
            if begun is None or begun.claim is None:
                transaction.set_rollback(True, using=using)
    except OperationalError as exc:
        if not _lock_wait_ended(exc):
            raise
        return Begun(Status.IN_PROGRESS, retry_after=1.0)
    if probed[0] == "claimed":
        return begun
    return _probed(params, probed)


def _with_transaction_gates(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the gated claim's lock keys, as transaction locks (GATE_XACT_SQL): a
    copy, so the caller's next try of the claim starts from its own params again."""
    scope, key = params["scope"], params["key"]
    return {
        **params,
        "gate": params.get("gate") or gate_key(scope, key),
        "request_gate": params.get("request_gate") or gate_key(scope, key, params["fingerprint"]),
        "session": False,
    }


def _lock_wait_ended(exc: OperationalError) -> bool:
    """Whether ``exc`` is a bounded wait on a locked row running out (``lock_timeout``)."""
    return getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE


def _lock_timeout(wait: float) -> str:
    """A ``lock_timeout`` of ``wait`` seconds, at least a millisecond (0 would wait forever)."""
    return f"{min(max(math.ceil(wait * 1000), 1), _MAX_LOCK_TIMEOUT_MS)}ms"


def _claim_row(params: dict[str, Any], using: str, wait: float) -> Begun | None:
    """BEGIN's answer inside an open transaction, waiting at most ``wait`` seconds on a locked
    row (a ``lock_timeout``, which rolls back the caller's savepoint when it fires)."""
    bounded = {**params, "async": False, "row_wait": None, "row_timeout": _lock_timeout(wait)}
    with connections[using].cursor() as cursor:
        statements.execute(
            cursor, BEGIN, bounded, before=BOUND_LOCK_WAIT_SQL, after=RESTORE_LOCK_TIMEOUT_SQL
        )
        row = cursor.fetchone()
    return _begun_from_row(params, using, row)


def claims_in_transaction(atomic: bool, option: bool | None, setting: bool, using: str) -> bool:
    """Whether an attempt claims its key in its transaction: only an atomic one; as its option
    says, else as the setting says, else whenever a transaction is already open (under
    ``ATOMIC_REQUESTS``), where a row claim could not be committed first either and the key
    already comes and goes with the caller's transaction: there the gated claim is the row
    claim's first statement alone (the same locks and look, without the savepoint, the insert
    and its bounded wait)."""
    if not atomic:
        return False
    if option is not None:
        return option
    return setting or connections[using].in_atomic_block


def gate_key(scope: str, key: str, fingerprint: str | None = None) -> int:
    """The advisory lock key of ``(scope, key)``, or with ``fingerprint`` of one request under
    it: a 64-bit hash, so two share a lock only by a collision (about 2**-64 a pair), which
    would answer one of them 409 or 422 while the other runs, never run anything twice."""
    name = f"idempotency\0{scope}\0{key}"
    if fingerprint is not None:
        name += f"\0{fingerprint}"
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _claim_gated(params: dict[str, Any], using: str) -> Any:
    """PROBE's row after the gate, in one round trip; a session gate is given back if the
    query fails after taking it."""
    session = params["session"]
    with connections[using].cursor() as cursor:
        try:
            gate = GATE_SESSION_SQL if session else GATE_XACT_SQL
            undo = UNLOCK_SQL if session else ""
            statements.execute(cursor, PROBE, params, before=gate, undo_before=undo)
            return cursor.fetchone()
        except BaseException:
            if session and connections[using].is_usable():
                cursor.execute(UNLOCK_SQL, params)
            raise


def _begin_in_transaction_once(params: dict[str, Any], using: str) -> Begun:
    row = _claim_gated(params, using)
    kind, row_id, _, fingerprint, _, _, _, _, steps, _ = row
    scope, key = params["scope"], params["key"]
    if kind == "claimed":
        claim = Claim(
            row_id or 0,
            scope,
            key,
            params["owner"],
            using,
            taken_over=row_id is not None,
            # A crashed attempt's steps are resumed under the fingerprint they were made with.
            fingerprint=params["fingerprint"] if steps is None else fingerprint,
            lock_timeout=params["lock"],
            ttl=params["ttl"],
            steps=_json(steps) or {},
            gate=params["gate"],
            session_gate=params["session"],
            request_gate=params["request_gate"],
        )
        return Begun(Status.NEW, claim=claim)
    return _probed(params, row)


def _probed(params: dict[str, Any], row: Any) -> Begun:
    """What a PROBE row that is not a claim means: an attempt of this request holds the key
    (``busy``), one of another request does (``other``), or a row that may not be claimed."""
    kind, _, state, fingerprint, status, headers, body, remaining, _, _ = row
    if kind == "busy":
        return Begun(Status.IN_PROGRESS, retry_after=1.0)
    if kind == "other":
        return Begun(Status.MISMATCH)
    return _existing(params, state, fingerprint, status, headers, body, remaining)


def _existing(
    params: dict[str, Any],
    state: str,
    fingerprint: str,
    status: int | None,
    headers: Any,
    body: Any,
    remaining: float | None,
) -> Begun:
    """What a row that may not be claimed means for this request (the same request when it
    holds the request's fingerprint or, stored before the upgrade, its legacy one)."""
    if fingerprint != params["fingerprint"] and fingerprint != params["legacy"]:
        return Begun(Status.MISMATCH)
    if state == "completed":
        return Begun(Status.COMPLETED, outcome=_outcome(status, headers, body))
    return Begun(Status.IN_PROGRESS, retry_after=max(float(remaining or 0.0), 0.0))


def _begin_once(
    params: dict[str, Any], using: str, wait: float, in_transaction: bool = False
) -> Begun | None:
    if in_transaction:
        params["session"] = not connections[using].in_atomic_block
        return _begin_in_transaction_once(params, using)
    if connections[using].in_atomic_block:
        return _claim_in_transaction(params, using, wait)
    # The started row's commit need not wait for the disk (ASYNC_CLAIM_SQL says why), and its
    # insert waits on another transaction's row for a slice of the wait at most (ROW_WAIT_SQL).
    row_wait = _lock_timeout(min(wait, _ROW_WAIT_SLICE))
    try:
        row = statements.fetch_one(using, BEGIN, {**params, "async": True, "row_wait": row_wait})
    except OperationalError as exc:
        if not _lock_wait_ended(exc):
            raise
        return _held_elsewhere(params, using)
    return _begun_from_row(params, using, row)


def _held_elsewhere(params: dict[str, Any], using: str) -> Begun | None:
    """Who holds the row an autocommit claim's insert timed out on, read from the locks a claim
    inside an open transaction holds with its uncommitted row (the gated claim's transaction
    locks, tried and given back at the end of the look's own implicit transaction): this
    request's attempt (in progress, 409) or another request's (a mismatch, 422), as the other
    claims answer. A key free of both locks was held by a claim without them, committing at
    once, or is free again: None, the claim runs again."""
    params = _with_transaction_gates(params)
    probed = _claim_gated(params, using)
    return None if probed[0] == "claimed" else _probed(params, probed)


def _begun_from_row(params: dict[str, Any], using: str, row: Any) -> Begun | None:
    """What BEGIN's row means (None: no row, the claim has to run again)."""
    if row is None:
        return None
    row_id, kind, state, fingerprint, status, headers, body, remaining, steps, _ = row
    if kind in ("new", "taken_over"):
        claim = Claim(
            row_id,
            params["scope"],
            params["key"],
            params["owner"],
            using,
            taken_over=kind == "taken_over",
            fingerprint=fingerprint,  # as stored: a resumed attempt's may be its legacy one
            lock_timeout=params["lock"],
            ttl=params["ttl"],
            steps=_json(steps) or {},
        )
        return Begun(Status.NEW, claim=claim)
    return _existing(params, state, fingerprint, status, headers, body, remaining)


def begin(
    scope: str,
    key: str,
    fingerprint: str,
    *,
    ttl: float,
    lock_timeout: float,
    wait: float = 0.0,
    using: str = "default",
    in_transaction: bool = False,
    legacy_fingerprint: str | None = None,
) -> Begun:
    """Claim ``(scope, key)`` or report what holds it; one round trip in autocommit unless
    waiting.

    ``legacy_fingerprint`` is the request's fingerprint as versions up to 0.1.0 made it
    (:mod:`idempotency.fingerprint`): a key stored under it is the same request's too.

    ``in_transaction`` claims for an atomic attempt by an advisory lock instead of a committed
    row (see :data:`~idempotency.statements.PROBE`): nothing is written until the outcome is
    stored, in the attempt's transaction, so a crashed attempt leaves nothing behind.

    With ``wait`` > 0 an in-progress key is polled (backing off, on the database clock for the
    lock) until it completes, is taken over, or ``wait`` seconds pass. Inside an open
    transaction a key another open transaction holds is answered from its locks, and a row
    claimed without them is waited on for at most the time left, then reported in progress
    (see the module's docstring).
    """
    params = {
        "scope": scope,
        "key": key,
        "fingerprint": fingerprint,
        "legacy": legacy_fingerprint or fingerprint,
        "owner": uuid.uuid4(),
        "lock": lock_timeout,
        "ttl": max(ttl, lock_timeout),
    }
    if in_transaction:  # only the claim in the transaction has locks
        params["gate"] = gate_key(scope, key)
        params["request_gate"] = gate_key(scope, key, fingerprint)
    deadline = time.monotonic() + wait
    backoff: Backoff | None = None
    misses = 0
    while True:
        begun = _begin_once(params, using, deadline - time.monotonic(), in_transaction)
        if begun is None:
            misses += 1
            if misses < _BEGIN_ATTEMPTS:
                continue
            begun = Begun(Status.IN_PROGRESS, retry_after=1.0)
        if begun.status is not Status.IN_PROGRESS:
            if begun.status is not Status.NEW:
                _announce(begun, scope, key, using)
            return begun
        if backoff is None:  # made only to wait: most claims are new keys, or not waiting
            backoff = Backoff(base=0.01, cap=0.25, deadline=deadline)  # the package's one backoff
        # Done unless there is time left to wait (next_delay: None past the deadline).
        if (delay := backoff.next_delay()) is None:
            _announce(begun, scope, key, using)
            return begun
        time.sleep(min(delay, max(begun.retry_after, 0.001)))


def _announce(begun: Begun, scope: str, key: str, using: str) -> None:
    """Tell receivers about a duplicate: a replay or a conflict (a new claim is not news)."""
    if begun.status is Status.COMPLETED:
        send(signals.replayed, using, scope=scope, key=key)
    elif begun.status is Status.MISMATCH:
        send(signals.conflict, using, scope=scope, key=key, reason="mismatch")
    elif begun.status is Status.IN_PROGRESS:
        send(signals.conflict, using, scope=scope, key=key, reason="in_progress")


def _owned_write(
    claim: Claim,
    write: statements.OwnedWrite,
    params: dict[str, Any],
    *,
    commit: bool,
    after_commit: str = "",
) -> bool:
    """A write only the key's owner may make (else IdempotencyKeyLost), committing the open
    transaction in the same round trip when ``commit`` (the caller's outermost block) and the
    driver sends one query; returns whether it did (and ran ``after_commit`` after it)."""
    done, committed = statements.owned_write_on(
        claim.using, write, params, commit=commit, after_commit=after_commit
    )
    if not done:
        send(signals.conflict, claim.using, scope=claim.scope, key=claim.key, reason="lost")
        raise IdempotencyKeyLost(claim.scope, claim.key)
    return committed


def finish(claim: Claim, outcome: Outcome, *, ttl: float, commit: bool = False) -> bool:
    """Store the outcome; raises IdempotencyKeyLost if another attempt took the key over.

    Returns whether the claim's session gate was given back in the same query (after the
    COMMIT), which happens when ``commit`` and the claim holds one.
    """
    if claim.gate is not None:
        stored: dict[str, Any] = {
            "scope": claim.scope,
            "key": claim.key,
            "fingerprint": claim.fingerprint,
            "status": outcome.status,
            "headers": json.dumps(outcome.headers),
            "body": outcome.body,
            "ttl": ttl,
            "gate": claim.gate,
            "request_gate": claim.request_gate,
        }
        after = UNLOCK_SQL if claim.session_gate else ""
        committed = _owned_write(claim, STORE, stored, commit=commit, after_commit=after)
        return committed and claim.session_gate
    params: dict[str, Any] = {
        "id": claim.id,
        "owner": claim.owner,
        "status": outcome.status,
        "headers": json.dumps(outcome.headers),
        "body": outcome.body,
        "ttl": ttl,
    }
    _owned_write(claim, FINISH, params, commit=commit)
    return False


def record_step(claim: Claim, step: str, result: str, *, commit: bool = False) -> None:
    """Record a completed step (``result`` is JSON text), renew the lock and keep the key for
    a TTL from now; raises IdempotencyKeyLost if another attempt took the key over. Only for
    an attempt that does not keep its steps in memory (:attr:`Attempt.steps_in_memory`)."""
    params = {
        "id": claim.id,
        "owner": claim.owner,
        "step": step,
        "result": result,
        "lock": claim.lock_timeout,
        "ttl": claim.ttl,
    }
    _owned_write(claim, RECORD_STEP, params, commit=commit)


def release(claim: Claim) -> None:
    """Give up a key whose attempt failed (never another owner's): deleted, so the retry runs
    again, unless it holds recorded steps, which the retry resumes after if it comes within a
    TTL from now. A claim made in the transaction wrote nothing: its session gate is given back
    (a transaction's gate goes with the transaction)."""
    if claim.gate is not None:
        if claim.session_gate:
            with connections[claim.using].cursor() as cursor:
                cursor.execute(UNLOCK_SQL, {"gate": claim.gate, "request_gate": claim.request_gate})
        return
    params = {"id": claim.id, "owner": claim.owner, "ttl": claim.ttl}
    statements.fetch_one(claim.using, RELEASE, params)


# The attempts running in this context, innermost last: what ``idempotency.step`` works under.
_ACTIVE: contextvars.ContextVar[tuple[Attempt, ...]] = contextvars.ContextVar(
    "idempotency_attempts", default=()
)


def current() -> Attempt | None:
    """The innermost attempt running in this context (thread or task), if any."""
    active = _ACTIVE.get()
    return active[-1] if active else None


@dataclass
class Attempt:
    """The work done under one claim: in atomic mode, one transaction with the stored outcome.

    A claim made in the transaction (``Claim.gate``) holds an advisory lock, not a row, until
    its outcome is stored: the row is inserted with the outcome and the lock given back after
    the COMMIT, in the same query when the block is the outermost one.

    ``start`` opens the transaction; ``commit`` stores the outcome in it and commits, so the
    effects and the key become visible together; ``abort`` rolls the effects back and frees the
    key. A crash between the two leaves the started row, which a retry takes over once its lock
    lapses; the crashed transaction's effects never committed. Steps
    (:mod:`idempotency.steps`) record recovery points under the claim as the work goes.

    When the attempt's block is the outermost one, storing the outcome and committing are one
    round trip (:func:`~idempotency.statements.execute_and_commit`).
    """

    claim: Claim
    atomic: bool
    ttl: float
    _block: Any = field(default=None, repr=False)
    _outermost: bool = field(default=False, repr=False)
    #: Steps recorded so far, by this attempt or the ones it resumes (name -> result).
    recorded: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.recorded.update(self.claim.steps)

    def start(self) -> None:
        using = self.claim.using
        try:
            # Prepared now, outside the transaction, where a session that lost them can
            # recover.
            statements.prepare(
                using, STORE if self.claim.gate is not None else FINISH, RECORD_STEP, RELEASE
            )
            if self.atomic:
                self._outermost = not connections[using].in_atomic_block
                self._block = transaction.atomic(using=using)
                self._block.__enter__()
        except BaseException:
            # A session gate would outlive the request on a kept connection; best effort, the
            # error that stopped the start is the one to report.
            if self.claim.session_gate:
                with contextlib.suppress(Exception):
                    release(self.claim)
            raise
        # Not a token reset: the async views start and end attempts in sync_to_async threads,
        # whose context changes asgiref copies back, so a token would belong to another context.
        _ACTIVE.set((*_ACTIVE.get(), self))

    @property
    def steps_in_memory(self) -> bool:
        """Whether this attempt's steps are kept in memory rather than written to its key row:
        an atomic attempt's. Its steps roll back with its transaction whatever happens (a crash
        rolls every one back), so writing them would add nothing, and would cost liveness: the
        write locks the row until the attempt ends and its lock renewal stays invisible, so once
        the committed lock lapsed a duplicate's claim queued on the row for as long as the
        attempt ran. A claim made in the transaction has no row to write to anyway."""
        return self.atomic or self.claim.gate is not None

    def _leave(self) -> None:
        _ACTIVE.set(tuple(attempt for attempt in _ACTIVE.get() if attempt is not self))

    def commits_in_one_trip(self) -> bool:
        """Whether a write can carry this attempt's COMMIT: its block is the outermost one and
        nothing has marked it for rollback."""
        connection = connections[self.claim.using]
        return self._block is not None and self._outermost and not connection.needs_rollback

    def commit(self, outcome: Outcome) -> None:
        self._leave()
        connection = connections[self.claim.using]
        if connection.needs_rollback:
            if self._block is None:
                # A non-atomic attempt inside a transaction the work marked for rollback: the
                # claim (made in that transaction) rolls back with it, and nothing can be
                # written there. The key stays free, as the effects are undone.
                return
            # The work undid its own writes and still answered (``set_rollback(True)``, as
            # DRF's exception handler does for every error under ``ATOMIC_REQUESTS``): roll
            # them back as it asked, then store the answer outside the block, where the claim
            # (made before the block opened) still stands. Stored inside, the write was refused
            # and the answer lost to a 500.
            block, self._block = self._block, None
            block.__exit__(None, None, None)
        try:
            released = finish(self.claim, outcome, ttl=self.ttl, commit=self.commits_in_one_trip())
        except BaseException:
            self.abort()
            raise
        block, self._block = self._block, None
        if block is not None:
            try:
                block.__exit__(None, None, None)
            except BaseException:
                if not released:
                    release(self.claim)
                raise
        if self.claim.session_gate and not released:
            release(self.claim)  # stored and committed (or rolled back) without its query

    def abort(self) -> None:
        self._leave()
        block, self._block = self._block, None
        if block is not None:
            transaction.set_rollback(True, using=self.claim.using)
            block.__exit__(None, None, None)
        release(self.claim)
