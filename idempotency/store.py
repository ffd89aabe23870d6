"""The key state machine, independent of HTTP: begin, then finish or release.

``begin`` is one statement on the hot path: an insert that, on conflict, takes over only a key
whose lock lapsed (a crashed attempt) or whose TTL passed, and otherwise reads the row that is
there. ``xmax = 0`` on the returned row tells a fresh insert from a take-over. The started row is
committed on its own (autocommit) before the work runs, so a duplicate sees "in progress" at once
instead of queueing behind an uncommitted insert.

Inside a transaction that is already open (``ATOMIC_REQUESTS``, or a caller's ``atomic`` block)
the started row cannot be committed first: it stays uncommitted while the view runs, and a
duplicate's insert would queue behind it for as long as the first request runs, however long
that is. There the claim runs in a savepoint under a ``lock_timeout`` of the time the caller may
wait (a millisecond for ``on_conflict="409"``); when it fires the savepoint is rolled back, the
transaction stays usable, and the duplicate is told "in progress".

``finish`` is conditional on the attempt's ``owner``: an attempt whose lock lapsed and was taken
over stores nothing, and in atomic mode its effects roll back with it (only one attempt commits).
Every time is the database's ``clock_timestamp()``; app servers' clocks are never compared.
"""

from __future__ import annotations

import enum
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.db import OperationalError, connections, transaction

from leases.retry import Backoff

from .errors import IdempotencyKeyInProgress, IdempotencyKeyLost, IdempotencyKeyMismatch

__all__ = ["Attempt", "Begun", "Claim", "Outcome", "Status", "begin", "finish", "release"]

BEGIN_SQL = """
WITH claimed AS (
    INSERT INTO idempotency_key AS k (scope, key, fingerprint, state, owner, locked_until,
        response_status, response_headers, response_body, created_at, expires_at)
    VALUES (%(scope)s, %(key)s, %(fingerprint)s, 'started', %(owner)s,
        clock_timestamp() + %(lock)s * interval '1 second', NULL, '[]'::jsonb, NULL,
        clock_timestamp(), clock_timestamp() + %(ttl)s * interval '1 second')
    ON CONFLICT (scope, key) DO UPDATE SET
        fingerprint = EXCLUDED.fingerprint, state = 'started', owner = EXCLUDED.owner,
        locked_until = EXCLUDED.locked_until, response_status = NULL,
        response_headers = '[]'::jsonb, response_body = NULL,
        created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
    WHERE (k.state = 'completed' AND k.expires_at < clock_timestamp())
       OR (k.state = 'started' AND k.locked_until < clock_timestamp()
           AND (k.fingerprint = EXCLUDED.fingerprint OR k.expires_at < clock_timestamp()))
    RETURNING k.id, CASE WHEN k.xmax = 0 THEN 'new' ELSE 'taken_over' END AS kind
)
SELECT id, kind, NULL, NULL, NULL, NULL, NULL, 0.0 FROM claimed
UNION ALL
SELECT id, 'existing', state, fingerprint, response_status, response_headers, response_body,
       extract(epoch FROM locked_until - clock_timestamp())::float8
FROM idempotency_key
WHERE scope = %(scope)s AND key = %(key)s AND NOT EXISTS (SELECT 1 FROM claimed)
"""

FINISH_SQL = """
UPDATE idempotency_key
SET state = 'completed', owner = NULL, locked_until = NULL, response_status = %(status)s,
    response_headers = %(headers)s::jsonb, response_body = %(body)s,
    expires_at = clock_timestamp() + %(ttl)s * interval '1 second'
WHERE id = %(id)s AND owner = %(owner)s AND state = 'started'
"""

RELEASE_SQL = """
DELETE FROM idempotency_key WHERE id = %(id)s AND owner = %(owner)s AND state = 'started'
"""

# Around BEGIN_SQL inside an open transaction: bound the wait on an uncommitted key row, and put
# the caller's own lock_timeout back (SET LOCAL in a released savepoint lasts until the end of
# the transaction). A timeout rolls the savepoint back, which undoes the setting by itself.
BOUND_LOCK_WAIT_SQL = (
    "SELECT current_setting('lock_timeout'), set_config('lock_timeout', %(timeout)s, true)"
)
RESTORE_LOCK_TIMEOUT_SQL = "SELECT set_config('lock_timeout', %(previous)s, true)"
LOCK_NOT_AVAILABLE = "55P03"
_MAX_LOCK_TIMEOUT_MS = 2**31 - 1

# A key committed between the statement's snapshot and its conflict check shows up in neither
# half of BEGIN_SQL; running it again sees it.
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


def _outcome(status: int | None, headers: Any, body: Any) -> Outcome:
    if isinstance(headers, str):
        headers = json.loads(headers)
    pairs = [(str(name), str(value)) for name, value in headers or []]
    return Outcome(status=status, headers=pairs, body=bytes(body or b""))


class _Busy(enum.Enum):
    """The claim timed out waiting on a key row another open transaction inserted or changed."""

    BUSY = "busy"


def _claim_in_transaction(params: dict[str, Any], using: str, wait: float) -> Any:
    """BEGIN_SQL's row, in a savepoint that waits at most ``wait`` seconds on a locked row."""
    timeout_ms = min(max(math.ceil(wait * 1000), 1), _MAX_LOCK_TIMEOUT_MS)
    try:
        with transaction.atomic(using=using), connections[using].cursor() as cursor:
            cursor.execute(BOUND_LOCK_WAIT_SQL, {"timeout": f"{timeout_ms}ms"})
            previous = cursor.fetchone()[0]
            cursor.execute(BEGIN_SQL, params)
            row = cursor.fetchone()
            cursor.execute(RESTORE_LOCK_TIMEOUT_SQL, {"previous": previous})
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        return _Busy.BUSY
    return row


def _begin_once(params: dict[str, Any], using: str, wait: float) -> Begun | None:
    if connections[using].in_atomic_block:
        row = _claim_in_transaction(params, using, wait)
        if row is _Busy.BUSY:
            return Begun(Status.IN_PROGRESS, retry_after=1.0)
    else:
        with connections[using].cursor() as cursor:
            cursor.execute(BEGIN_SQL, params)
            row = cursor.fetchone()
    if row is None:
        return None
    row_id, kind, state, fingerprint, status, headers, body, remaining = row
    scope, key = params["scope"], params["key"]
    if kind in ("new", "taken_over"):
        claim = Claim(row_id, scope, key, params["owner"], using, taken_over=kind == "taken_over")
        return Begun(Status.NEW, claim=claim)
    if fingerprint != params["fingerprint"]:
        return Begun(Status.MISMATCH)
    if state == "completed":
        return Begun(Status.COMPLETED, outcome=_outcome(status, headers, body))
    return Begun(Status.IN_PROGRESS, retry_after=max(float(remaining or 0.0), 0.0))


def begin(
    scope: str,
    key: str,
    fingerprint: str,
    *,
    ttl: float,
    lock_timeout: float,
    wait: float = 0.0,
    using: str = "default",
) -> Begun:
    """Claim ``(scope, key)`` or report what holds it; one round trip in autocommit unless
    waiting.

    With ``wait`` > 0 an in-progress key is polled (backing off, on the database clock for the
    lock) until it completes, is taken over, or ``wait`` seconds pass. Inside an open
    transaction a row another transaction has not committed is waited on for at most the time
    left, then reported in progress (see the module's docstring).
    """
    params = {
        "scope": scope,
        "key": key,
        "fingerprint": fingerprint,
        "owner": uuid.uuid4(),
        "lock": lock_timeout,
        "ttl": max(ttl, lock_timeout),
    }
    deadline = time.monotonic() + wait
    backoff = Backoff(base=0.01, cap=0.25, deadline=deadline)  # the package's one backoff
    misses = 0
    while True:
        begun = _begin_once(params, using, deadline - time.monotonic())
        if begun is None:
            misses += 1
            if misses < _BEGIN_ATTEMPTS:
                continue
            begun = Begun(Status.IN_PROGRESS, retry_after=1.0)
        if begun.status is not Status.IN_PROGRESS:
            return begun
        delay = backoff.next_delay()
        if delay is None:  # the wait's deadline has passed
            return begun
        time.sleep(min(delay, max(begun.retry_after, 0.001)))


def finish(claim: Claim, outcome: Outcome, *, ttl: float) -> None:
    """Store the outcome; raises IdempotencyKeyLost if another attempt took the key over."""
    params: dict[str, Any] = {
        "id": claim.id,
        "owner": claim.owner,
        "status": outcome.status,
        "headers": json.dumps(outcome.headers),
        "body": outcome.body,
        "ttl": ttl,
    }
    with connections[claim.using].cursor() as cursor:
        cursor.execute(FINISH_SQL, params)
        stored = cursor.rowcount == 1
    if not stored:
        raise IdempotencyKeyLost(claim.scope, claim.key)


def release(claim: Claim) -> None:
    """Free a key whose attempt failed, so the retry runs again (never another owner's key)."""
    with connections[claim.using].cursor() as cursor:
        cursor.execute(RELEASE_SQL, {"id": claim.id, "owner": claim.owner})


@dataclass
class Attempt:
    """The work done under one claim: in atomic mode, one transaction with the stored outcome.

    ``start`` opens the transaction; ``commit`` stores the outcome in it and commits, so the
    effects and the key become visible together; ``abort`` rolls the effects back and frees the
    key. A crash between the two leaves the started row, which a retry takes over once its lock
    lapses; the crashed transaction's effects never committed.
    """

    claim: Claim
    atomic: bool
    ttl: float
    _block: Any = field(default=None, repr=False)

    def start(self) -> None:
        if self.atomic:
            self._block = transaction.atomic(using=self.claim.using)
            self._block.__enter__()

    def commit(self, outcome: Outcome) -> None:
        try:
            finish(self.claim, outcome, ttl=self.ttl)
        except BaseException:
            self.abort()
            raise
        block, self._block = self._block, None
        if block is not None:
            try:
                block.__exit__(None, None, None)
            except BaseException:
                release(self.claim)
                raise

    def abort(self) -> None:
        block, self._block = self._block, None
        if block is not None:
            transaction.set_rollback(True, using=self.claim.using)
            block.__exit__(None, None, None)
        release(self.claim)
