"""The default backend: leases in the ``leases_lease`` table of a Django PostgreSQL database.

Every state change is one statement on a connection of the backend's own, in autocommit, so the
caller's transaction can neither hide nor roll back an acquire or a release (and a grant commits
durably: ``synchronous_commit`` is forced on for this connection, because a grant lost in a crash
would be handed out again with the same token). Expiry is decided by ``clock_timestamp()`` on the
server, and a row is never deleted: it carries the name's token counter.

A failed try writes nothing. ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` alone would lock the
held row even when its ``WHERE`` is false, which assigns a transaction id and costs a WAL record
and a commit flush per failed try; the read-only ``NOT EXISTS`` probe in the same statement makes
the insert produce no row at all when the lease is held, so nothing is locked or written
(``tests/test_lease_database.py::test_failed_try_assigns_no_transaction_id`` proves both).

The release statement notifies channel :data:`CHANNEL` (payload = name) in the same round
trip, and commits without waiting for its WAL flush (see :data:`RELEASE_SQL`: only grants
must be durable). Waiters queue in a per-name "waiting room" (a session advisory lock): the
one inside listens on its own connection and retries there on each release, the rest sleep in
the server's lock queue, so a release wakes one waiter instead of a herd, and callers outside
the room do not overtake it (see :mod:`~leases.backends._waiting_room`: the room is a first
come, first served queue). Waiters that find no room (too many) sleep on the process's shared
``LISTEN`` connection. A thread's try in the room waits on the server instead of for the
``NOTIFY``: on the tenure lock that the holder's session keeps until its release (the room
connection it won on, or the own connection for a grant won uncontended: see
:mod:`~leases.backends._tenure`), so a hand-off is the release's statement, a wake-up of the
waiter's server session and the grant's commit.

A reply lost on a connection that stays open (a NAT, a proxy, a paused server) would hang a
statement for ever, so each waits at most ``REQUEST_TIMEOUT`` seconds (default 5), a renewal at
most half of what is left of its grant (see :mod:`~leases._pgdeadline`); then the
connection is dropped and the call raises :class:`~leases.errors.BackendUnavailable`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import replace
from typing import Any

import psycopg
from django.db import connections

from .._pgdeadline import REQUEST_TIMEOUT
from .._pgpooler import BACKEND_PID_SQL
from ..errors import BackendUnavailable, LeaseLost, LeaseNotHeld, LeasesImproperlyConfigured
from ..holders import public_meta
from ._aio import PerLoop
from ._counter import TIMELINE_FLOOR_SQL
from ._options import seconds_problems
from ._pg_shared import (
    GROUP,
    SHARED_ACQUIRE_SQL,
    SHARED_RELEASE_SQL,
    SHARED_RENEW_SQL,
    STOP_READERS_SQL,
    shared_acquire_params,
    shared_params,
    stop_readers_params,
)
from ._pgaio import AsyncState
from ._pgconn import (
    APPLICATION_NAME,
    CHANNEL,
    Listener,
    PrivateConnection,
    ThreadNotes,
    driver_failure,
    inherit,
    track,
)
from ._pgprepared import Prepared
from ._pruning import FLOOR_SQL, Progress, prune_rows
from ._tenure import UNLOCK_TENURES_SQL, Tenures, tenure_key_sql
from ._waiting_room import (
    ROOM_CONNECTIONS,
    ROOM_GRACE,
    ROOM_TIMEOUT,
    AsyncWaitingRoom,
    WaitingRoom,
    room_key,
)
from .base import (
    FORGED,
    LIST_BATCH,
    PRUNE_BATCH,
    Capability,
    Grant,
    InternalLock,
    LeaseBackend,
    LeaseInfo,
    new_secret,
    not_revoked,
)

logger = logging.getLogger("leases")

__all__ = ["CHANNEL", "ROOM_CONNECTIONS", "ROOM_GRACE", "ROOM_TIMEOUT", "Backend"]

#: Take ``name`` if it is free or expired, bumping its token (never below the timeline's floor);
#: nothing is written when it is held.
#: The row keeps only the SHA-256 of the grant's secret, computed here on the server, so the
#: table (backups, replicas, anyone with SELECT) never holds the credential itself. A new row's
#: first token is above every pruned one (:data:`~._pruning.FLOOR_SQL`), and no token is
#: below the timeline's floor (:data:`~._counter.TIMELINE_FLOOR_SQL`: a promoted standby).
#: A caller outside the name's waiting room (``in_room`` false) does not overtake the waiters
#: in it: it takes the name only if nobody is in or queued for the room (the shared try-lock
#: fails while an exclusive holder or waiter exists), or if the name has been free for longer
#: than ``grace`` (the waiter inside is paused or gone: it must not block the name for good).
ACQUIRE_SQL = f"""
INSERT INTO leases_lease AS l
    (name, holder, token, acquired_at, expires_at, renewed_at, meta, secret_hash)
SELECT %(name)s::text, %(holder)s::text, GREATEST({FLOOR_SQL}, {TIMELINE_FLOOR_SQL}),
       clock_timestamp(),
       clock_timestamp() + make_interval(secs => %(ttl)s), NULL, '{{}}', sha256(%(secret)s::bytea)
WHERE NOT EXISTS (
    SELECT 1 FROM leases_lease
    WHERE name = %(name)s::text AND holder <> '' AND expires_at > clock_timestamp()
)
AND (%(in_room)s::bool OR pg_try_advisory_xact_lock_shared(%(room)s::bigint) OR NOT EXISTS (
    SELECT 1 FROM leases_lease
    WHERE name = %(name)s::text AND expires_at > clock_timestamp() - %(grace)s::interval
))
ON CONFLICT (name) DO UPDATE
SET holder = EXCLUDED.holder, token = GREATEST(l.token + 1, {TIMELINE_FLOOR_SQL}),
    acquired_at = EXCLUDED.acquired_at,
    expires_at = EXCLUDED.expires_at, renewed_at = NULL, secret_hash = EXCLUDED.secret_hash
WHERE l.holder = '' OR l.expires_at IS NULL OR l.expires_at <= clock_timestamp()
RETURNING l.token, l.expires_at
"""  # noqa: S608

#: :data:`ACQUIRE_SQL` on the backend's own connection: granted, its session also takes the
#: new grant's tenure lock when ``tenure`` is true (see :class:`~._tenure.Tenures`), so the
#: first waiter's queued try in the room waits on the server for this grant's release too,
#: not only for the ``NOTIFY`` (the third column: whether it took it).
OWN_ACQUIRE_SQL = f"""
WITH granted AS ({ACQUIRE_SQL})
SELECT token, expires_at,
       CASE WHEN %(tenure)s::bool
            THEN pg_try_advisory_lock({tenure_key_sql("%(name)s::text", "token")})
            ELSE false END
FROM granted
"""  # noqa: S608

#: The waiter inside the room takes the name. Granted, it stays in the room until the grant
#: has committed: it leaves afterwards, sending the unlock without waiting for its reply
#: (see :mod:`~._waiting_room`). Unlocking here, before the commit, let the
#: next waiter in and look at the name while this grant was still uncommitted: it saw the name
#: free, and spent a try that waited for this commit and then failed (in the 8-process benchmark,
#: nearly every hand-off paid one).
#: Refused, it gets one token-less row back when readers hold the name (else none): only then
#: does it need to stop new readers (a round trip of its own) before its next try.
ROOM_ACQUIRE_SQL = f"""
WITH granted AS ({ACQUIRE_SQL})
SELECT token, expires_at FROM granted
UNION ALL
SELECT NULL, NULL FROM leases_lease
WHERE name = %(name)s::text AND holder = %(group)s::text AND secret_hash IS NULL
  AND expires_at > clock_timestamp() AND NOT EXISTS (SELECT FROM granted)
"""  # noqa: S608

#: Extend a grant that is still ours (holder, token and secret) and still valid on the server's
#: clock. One row back: the new expiry, or NULL when holder and token are the current grant's
#: but the secret is not (a forged grant: nothing was written). No row: expired or taken over.
RENEW_SQL = """
WITH renewed AS (
    UPDATE leases_lease
    SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
        renewed_at = clock_timestamp()
    WHERE name = %(name)s::text AND holder = %(holder)s::text AND token = %(token)s
      AND secret_hash = sha256(%(secret)s::bytea) AND expires_at > clock_timestamp()
    RETURNING expires_at
)
SELECT expires_at FROM renewed
UNION ALL
SELECT NULL FROM leases_lease
WHERE name = %(name)s::text AND holder = %(holder)s::text AND token = %(token)s
  AND secret_hash IS DISTINCT FROM sha256(%(secret)s::bytea) AND NOT EXISTS (SELECT FROM renewed)
"""

#: Free a grant that is still ours, keeping the token counter, and wake waiters (same trip).
#: One row back when freed; none when refused, and only then does :data:`RELEASE_REFUSED_SQL`
#: say why (a refusal is rare: the common release is one plain ``UPDATE``, no second scan).
#: The secret is hashed here, on the server, as :data:`ACQUIRE_SQL` stored it: the client
#: does not send the hash it could compute, since then the hash (which the table, backups and
#: replicas hold) would be the credential.
#: The release alone commits without waiting for its WAL flush (``synchronous_commit`` off
#: for this transaction only): losing it in a crash leaves the row held by its old grant,
#: which then expires by its TTL, and the token is untouched. Any later grant commits
#: durably, and its flush covers this earlier commit record, so no grant can survive a
#: crash that the release it followed did not (``tests/test_lease_database_crash.py``).
#: The second column says whether waiters are in or queued for the name's room: then the
#: releaser's own next try would be refused (it may not overtake them), so it skips it.
RELEASE_SQL = """
UPDATE leases_lease SET holder = '', expires_at = clock_timestamp(), secret_hash = NULL
WHERE name = %(name)s::text AND holder = %(holder)s::text AND token = %(token)s
  AND secret_hash = sha256(%(secret)s::bytea) AND expires_at > clock_timestamp()
RETURNING pg_notify('leases_released', name)::text IS NOT NULL
          AND set_config('synchronous_commit', 'off', true) IS NOT NULL,
          NOT pg_try_advisory_xact_lock_shared(%(room)s::bigint)
"""

#: :data:`RELEASE_SQL` on the connection a grant won in the waiting room kept (see
#: :mod:`~._tenure`), unlocking the grant's tenure lock after the row is freed (so the waiter
#: queued on it goes on to take the name), whether or not the release was refused: a revoked
#: or expired holder must not keep it either. The last column says the unlock found the lock.
PINNED_RELEASE_SQL = f"""
WITH freed(released, queued) AS ({RELEASE_SQL})
SELECT freed.released, freed.queued,
       pg_advisory_unlock({tenure_key_sql("%(name)s::text", "%(token)s::bigint")})
FROM (SELECT 1) AS one LEFT JOIN freed ON true
"""  # noqa: S608

#: Why :data:`RELEASE_SQL` refused, read only after it did. A row whose first column is true:
#: this grant's own release already freed the name (a retry after a reply was lost): only that
#: release clears the holder and keeps the token (an expiry keeps the holder; a take-over, a
#: reader group or a revocation advances the token). Else a row whose second column is true:
#: holder and token are the current grant's but the secret is not (a forged grant: the lease
#: stays held, as in :data:`RENEW_SQL`). No row: the grant expired or was taken over.
#: Read-only, so a forger retrying it costs no write.
RELEASE_REFUSED_SQL = """
SELECT holder = '', secret_hash IS DISTINCT FROM sha256(%(secret)s::bytea) FROM leases_lease
WHERE name = %(name)s::text AND holder IN (%(holder)s::text, '') AND token = %(token)s
"""

#: Compare-and-revoke: only if ``name``'s stored token is still ``token``, advance it (so the
#: evicted holder's renewals and fenced writes fail), free the name and wake waiters. Otherwise
#: nothing is written and the one row says what the token is now (``NULL``: never granted);
#: an operator's click on a stale page must not evict whoever holds the name by then.
FORCE_RELEASE_SQL = """
WITH revoked AS (
    UPDATE leases_lease
    SET token = token + 1, holder = '', expires_at = clock_timestamp(), secret_hash = NULL
    WHERE name = %(name)s::text AND token = %(token)s
    RETURNING name, holder, token, acquired_at, expires_at, renewed_at, meta
)
SELECT name, holder, token, acquired_at, expires_at, renewed_at, meta, false,
       pg_notify('leases_released', name)
FROM revoked
UNION ALL
SELECT NULL, NULL, (SELECT token FROM leases_lease WHERE name = %(name)s::text),
       NULL, NULL, NULL, NULL, NULL, NULL
WHERE NOT EXISTS (SELECT 1 FROM revoked)
"""

#: What observers see. ``expires_at`` is clamped into what Python's ``datetime`` can hold: a
#: row written with an absurd TTL (year 33715) must not make every read of the table fail.
_COLUMNS = """name, holder, token, acquired_at, LEAST(expires_at, '9999-12-30 00:00:00+00'),
       renewed_at, meta, holder <> '' AND expires_at > clock_timestamp()"""
INSPECT_SQL = f"""
SELECT {_COLUMNS}
FROM leases_lease WHERE name = %(name)s::text
"""  # noqa: S608
#: Names someone holds, or held until their grant ran out unreleased (only these can have
#: waiters in their waiting rooms), and the key of each grant's tenure lock (a grant left to
#: run out keeps its lock until its process's next acquire: see ``_tenure.Tenures``).
HELD_NAMES_SQL = f"""
SELECT name, {tenure_key_sql("name", "token")}
FROM leases_lease WHERE holder <> ''
"""  # noqa: S608
#: Advisory locks held by sessions of the package's own connections (by their application
#: name), on this database: besides rooms and tenures of current grants, the tenure locks of
#: grants that ended without their holder's release (a force release, a grant left to run
#: out), which a listing would otherwise show as bare keys held by django-leases.
PACKAGE_LOCKS_SQL = """
SELECT (l.classid::bigint << 32) | l.objid::bigint
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND a.application_name = %(application)s
"""
INSPECT_ALL_SQL = f"""
SELECT {_COLUMNS}
FROM leases_lease ORDER BY name
"""  # noqa: S608
#: What operators' listings show: every column but ``meta`` (no listing prints it, and it has no
#: size bound, so no index can carry it). For a row with a holder these all come from the
#: covering partial index ``leases_lease_holder_cover``: listing the held names reads no table
#: page of a row whose page is all-visible (an index-only scan), so a million rows scattered
#: over as many pages cost what a few pages do.
_LISTED = """name, holder, token, acquired_at, LEAST(expires_at, '9999-12-30 00:00:00+00'),
       renewed_at, NULL::jsonb, holder <> '' AND expires_at > clock_timestamp()"""
_HELD = "holder <> '' AND expires_at > clock_timestamp()"
#: Held-first listing for operators: the held names from the covering index in name order,
#: then the others (expired or free) in name order by the primary key. The outer ``LIMIT``
#: stops the second part from running at all once the held names fill the page (an Append
#: runs its parts in turn): a million rows cost what ``limit`` held ones do.
INSPECT_HELD_FIRST_SQL = f"""
(SELECT {_LISTED} FROM leases_lease WHERE {_HELD} ORDER BY name LIMIT %(limit)s)
UNION ALL
(SELECT {_LISTED} FROM leases_lease WHERE ({_HELD}) IS NOT TRUE ORDER BY name LIMIT %(limit)s)
LIMIT %(limit)s
"""  # noqa: S608
#: The whole listing in batches, by name from where the last batch ended (keyset: no cursor,
#: transaction or snapshot stays open while a terminal reads): the held names, then the rest.
LIST_HELD_BATCH_SQL = f"""
SELECT {_LISTED} FROM leases_lease WHERE name > %(after)s::text AND {_HELD}
ORDER BY name LIMIT %(batch)s
"""  # noqa: S608
LIST_REST_BATCH_SQL = f"""
SELECT {_LISTED} FROM leases_lease WHERE name > %(after)s::text AND ({_HELD}) IS NOT TRUE
ORDER BY name LIMIT %(batch)s
"""  # noqa: S608

#: The statements of every uncontended acquire, renewal and release, sent prepared (parsed and
#: planned once per session, see :mod:`~._pgprepared`) on the backend's own connection.
PREPARED_ACQUIRE = Prepared("acquire", ACQUIRE_SQL)
PREPARED_OWN_ACQUIRE = Prepared("own_acquire", OWN_ACQUIRE_SQL)
PREPARED_RENEW = Prepared("renew", RENEW_SQL)
PREPARED_RELEASE = Prepared("release", RELEASE_SQL)
PREPARED_PINNED_RELEASE = Prepared("pinned_release", PINNED_RELEASE_SQL)
#: The waiter's try inside the name's room, on the room's connection: on the hand-off's path.
PREPARED_ROOM_ACQUIRE = Prepared("room_acquire", ROOM_ACQUIRE_SQL)

#: The shortest wait for a renewal's reply, however little of the grant is left.
MIN_RENEWAL_TIMEOUT = 0.05

DEPLOY_CHECK_SQL = "SELECT current_setting('synchronous_commit'), to_regclass('leases_lease')"


#: A name's room key (a hash) for every acquire and release: the same few names recur.
_room_of = functools.lru_cache(maxsize=4096)(room_key)


def _reading(name: str, holder: str, ttl: float, secret: str) -> dict[str, Any]:
    """What :data:`~._pg_shared.SHARED_ACQUIRE_SQL` takes: a reader starting a group defers
    to the name's waiting room as an exclusive caller outside it does (:func:`_asking`)."""
    return shared_acquire_params(name, holder, ttl, secret, _room_of(name), ROOM_GRACE)


def _asking(name: str, holder: str, ttl: float, secret: str) -> dict[str, Any]:
    """What :data:`ACQUIRE_SQL` takes, for a caller outside the name's waiting room."""
    return {
        "name": name,
        "holder": holder,
        "ttl": ttl,
        "secret": secret,
        "room": _room_of(name),
        "grace": ROOM_GRACE,
        "in_room": False,
        "group": GROUP,
    }


def _owner(grant: Grant) -> dict[str, Any]:
    """What renew and release present: the grant's holder, token and secret."""
    return {
        "name": grant.name,
        "holder": grant.holder,
        "token": grant.token,
        "secret": grant.secret,
    }


def _renewed(grant: Grant, ttl: float, sent_at: float, rows: list[tuple[Any, ...]]) -> Grant:
    """The renewed grant from :data:`RENEW_SQL`'s rows, or why it was refused."""
    if not rows:
        raise LeaseLost(grant.name, grant.token, "expired or taken over before renewal")
    if rows[0][0] is None:
        raise LeaseNotHeld(grant.name, FORGED)
    return replace(grant, ttl=ttl, sent_at=sent_at, expires_at=rows[0][0])


def _refused(grant: Grant, rows: list[tuple[Any, ...]]) -> None:
    """Why :data:`RELEASE_SQL` refused the release, from :data:`RELEASE_REFUSED_SQL`'s rows;
    returns when the grant's own earlier release freed the name (its reply was lost: the
    release is done, and calling that a loss would report work that ended in time as
    unprotected)."""
    if rows and rows[0][0]:
        return
    if rows and rows[0][1]:
        raise LeaseNotHeld(grant.name, FORGED)
    raise LeaseLost(grant.name, grant.token, "expired or taken over before release")


def _released(grant: Grant, rows: list[tuple[Any, ...]]) -> None:
    """Why a shared release's rows refused it, if they did (as :data:`RENEW_SQL`'s)."""
    if not rows:
        raise LeaseLost(grant.name, grant.token, "expired or taken over before release")
    if not rows[0][0]:
        raise LeaseNotHeld(grant.name, FORGED)


def _reader(
    name: str, holder: str, ttl: float, sent_at: float, secret: str, row: tuple[Any, ...]
) -> Grant:
    """A reader's grant from :data:`SHARED_ACQUIRE_SQL`'s row (sync and async alike)."""
    token, expires_at = row
    return Grant(
        name, holder, int(token), ttl, sent_at, expires_at, {"shared": True}, secret=secret
    )


def _info(row: tuple[Any, ...], backend: str) -> LeaseInfo:
    name, holder, token, acquired_at, expires_at, renewed_at, meta, held = row[:8]
    return LeaseInfo(
        name=name,
        holder=holder,
        token=int(token),
        held=bool(held),
        backend=backend,
        acquired_at=acquired_at,
        expires_at=expires_at,
        renewed_at=renewed_at,
        meta=public_meta(json.loads(meta) if isinstance(meta, str | bytes) else meta or {}),
    )


class Backend(LeaseBackend):
    """Leases in the ``leases_lease`` table; option ``DATABASE`` names the Django alias."""

    capabilities = frozenset(
        {
            Capability.NATIVE_FENCING,
            Capability.WAIT_WITHOUT_POLLING,
            Capability.FORCE_RELEASE,
            Capability.DURABLE,
            Capability.LEASE_ROWS,
            Capability.PRUNE,
            Capability.SHARED_LEASES,
        }
    )
    known_options = frozenset(
        {
            "DATABASE",
            "WAITING_ROOM",
            "ROOM_CONNECTIONS",
            "REQUEST_TIMEOUT",
            "PREPARED_STATEMENTS",
            "SESSION_POOLING",
        }
    )

    @classmethod
    def check_options(cls, alias: str, options: Mapping[str, Any]) -> list[str]:
        """Option types only: that ``DATABASE`` exists and is PostgreSQL is what
        :meth:`databases` reports to the system checks (``leases.E002``)."""
        problems = super().check_options(alias, options)
        if not isinstance(options.get("DATABASE", "default"), str):
            problems.append(f'LEASES["BACKENDS"][{alias!r}]["DATABASE"] must be a database alias')
        for flag in ("WAITING_ROOM", "PREPARED_STATEMENTS", "SESSION_POOLING"):
            if not isinstance(options.get(flag, True), bool):
                problems.append(f'LEASES["BACKENDS"][{alias!r}]["{flag}"] must be True or False')
        room = options.get("ROOM_CONNECTIONS", ROOM_CONNECTIONS)
        if isinstance(room, bool) or not isinstance(room, int) or room < 1:
            problems.append(
                f'LEASES["BACKENDS"][{alias!r}]["ROOM_CONNECTIONS"] must be a whole number, '
                "1 or more"
            )
        timeout = options.get("REQUEST_TIMEOUT", REQUEST_TIMEOUT)
        problems += seconds_problems(alias, "REQUEST_TIMEOUT", timeout)
        return problems

    @classmethod
    def databases(cls, options: Mapping[str, Any]) -> frozenset[str]:
        return frozenset({str(options.get("DATABASE", "default"))})

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.db_alias: str = self.options.get("DATABASE", "default")
        if self.db_alias not in connections.settings:
            raise LeasesImproperlyConfigured(
                f'LEASES["BACKENDS"][{alias!r}]["DATABASE"] = {self.db_alias!r} is not in DATABASES'
            )
        engine = connections.settings[self.db_alias]["ENGINE"]
        if "postgresql" not in engine and "postgis" not in engine:
            raise LeasesImproperlyConfigured(
                f"the database lease backend needs PostgreSQL; {self.db_alias!r} uses {engine}"
            )
        self._lock = threading.Lock()
        #: Seconds a statement waits for its reply before its connection is dropped.
        self.request_timeout = float(self.options.get("REQUEST_TIMEOUT", REQUEST_TIMEOUT))
        prepared = bool(self.options.get("PREPARED_STATEMENTS", True))
        #: A pooler in the way keeps each client's server session (see :mod:`~leases._pgpooler`).
        self.session_pooling = bool(self.options.get("SESSION_POOLING", False))
        self._conn = PrivateConnection(
            self.db_alias, self.request_timeout, prepared=prepared, alias=self.alias
        )
        self._listener: Listener | None = None
        #: Per thread, for the whole process: when its last failed try of a name was sent
        #: (for the wait that may follow), and when its release of a name saw waiters queued
        #: (a try of its own just after would be refused).
        self._failed = ThreadNotes()
        self._queued = ThreadNotes()
        enabled = bool(self.options.get("WAITING_ROOM", True))
        #: Room connections in use at once (waiters inside rooms): for the process's threads,
        #: and for each event loop's tasks.
        room_connections = int(self.options.get("ROOM_CONNECTIONS", ROOM_CONNECTIONS))
        self._room = WaitingRoom(
            self.db_alias,
            alias,
            enabled=enabled,
            timeout=self.request_timeout,
            prepared=prepared,
            session_pooling=self.session_pooling,
            connections=room_connections,
        )
        #: The tenure locks the own connection holds (waiters queue on them in the room).
        self._tenures = Tenures()
        self._async: PerLoop[AsyncState] = PerLoop(
            lambda: AsyncState(
                self.db_alias,
                self.request_timeout,
                prepared=prepared,
                alias=self.alias,
                session_pooling=self.session_pooling,
            ),
            lambda state: state.close(),
        )
        self._aroom: PerLoop[AsyncWaitingRoom] = PerLoop(
            lambda: AsyncWaitingRoom(
                self.db_alias,
                alias,
                enabled=self._room.enabled,
                timeout=self.request_timeout,
                prepared=prepared,
                session_pooling=self.session_pooling,
                connections=room_connections,
            ),
            lambda room: room.close(),
        )
        track(self)

    # -- the connection -------------------------------------------------------------------

    def _run(
        self, sql: str | Prepared, params: Mapping[str, Any], timeout: float | None = None
    ) -> list[tuple[Any, ...]]:
        """Run one statement on the backend's own connection: one round trip.

        Driver errors become :class:`BackendUnavailable`; a broken connection, or one whose
        reply did not come within ``timeout`` (default ``REQUEST_TIMEOUT``), is dropped and
        the next call reconnects (lease state lives in the table, not in the session).
        """
        try:
            return self._conn.run(sql, params, timeout)
        except psycopg.Error as exc:
            raise driver_failure(self.alias, exc) from exc

    def connection(self) -> psycopg.Connection[Any] | None:
        """The backend's own connection, if open (for diagnostics and round-trip tests)."""
        return self._conn.conn

    # -- the interface --------------------------------------------------------------------

    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        """One try: inside the name's waiting room on the room's connection (a grant leaves
        the room in the same trip), else on the backend's own connection."""
        sent_at = time.monotonic()
        if sent_at - self._queued.take(name, -math.inf) < ROOM_GRACE.total_seconds():
            # This thread's release just saw waiters queued: a try now would be refused.
            self._failed.note(name, sent_at)
            return None
        secret = new_secret()
        params = _asking(name, holder, ttl, secret)
        rows = self._room.run_inside(name, PREPARED_ROOM_ACQUIRE, {**params, "in_room": True})
        if rows is None and not self._room.behind(name):
            return self._try_own(params, sent_at)
        if not rows:
            self._failed.note(name, sent_at)
            return None
        token, expires_at = rows[0][:2]
        if len(rows[0]) == 2:
            return Grant(name, holder, int(token), ttl, sent_at, expires_at, secret=secret)
        # Queued on the holder's tenure lock: the lease's time starts when the server granted
        # it, not before the wait (the wait measured on the server's clock, never more than
        # this clock saw pass).
        sent_at += min(max(0.0, rows[0][2] or 0.0), time.monotonic() - sent_at)
        pin = self._room.pin(name)
        extra = {"tenure": pin} if pin is not None else {}
        return Grant(name, holder, int(token), ttl, sent_at, expires_at, extra, secret)

    def _try_own(self, params: dict[str, Any], sent_at: float) -> Grant | None:
        """A try on the backend's own connection (outside the name's room); granted, its
        session keeps the grant's tenure lock unless :class:`~._tenure.Tenures` says not."""
        name, ttl = params["name"], params["ttl"]
        tenure = self._tenure_wanted()
        try:
            rows, session = self._conn.run_here(PREPARED_OWN_ACQUIRE, {**params, "tenure": tenure})
        except psycopg.Error as exc:
            raise driver_failure(self.alias, exc) from exc
        if not self._room.probed:
            self._probe_pooler()  # the database answered just now: once per process
        if not rows:
            self._failed.note(name, sent_at)
            return None
        token, expires_at, took = rows[0]
        if took:
            self._tenures.taken(session, name, int(token), sent_at + ttl)
        return Grant(
            name, params["holder"], int(token), ttl, sent_at, expires_at, secret=params["secret"]
        )

    def _tenure_wanted(self) -> bool:
        """Whether the own connection's next grant takes its tenure lock (below the cap),
        first unlocking the locks of grants that ran out unreleased, if any did (one round
        trip, once per such grant: then a lease left to expire keeps no lock past the
        process's next acquire)."""
        tenures = self._tenures
        if not self._room.enabled or not self._room.probed:
            # Nobody queues on them (off, or turned off behind a pooler), or not known yet
            # whether this session's locks would outlive their unlocks (probed after the try).
            return False
        if not tenures.enabled:
            return False
        for session, overdue in tenures.overdue().items():
            params = {"names": [name for name, _ in overdue], "tokens": [t for _, t in overdue]}
            try:
                self._conn.run_on(session, UNLOCK_TENURES_SQL, params)
            except (psycopg.Error, BackendUnavailable) as exc:
                if self._conn.conn is not session:
                    continue  # the connection was dropped: its session's locks went with it
                # Unknown which it unlocked, on a session that lives on: take no more.
                logger.warning("leases: tenure locks not unlocked, taking no more: %s", exc)
                tenures.disable()
        return tenures.wanted()

    def renew(self, grant: Grant, ttl: float) -> Grant:
        sent_at = time.monotonic()
        timeout = self._renewal_timeout(grant, sent_at)
        if grant.extra.get("shared"):
            rows = self._run(SHARED_RENEW_SQL, shared_params(grant, ttl=ttl), timeout)
            return _renewed(grant, ttl, sent_at, rows)
        params = {**_owner(grant), "ttl": ttl}
        renewed = _renewed(grant, ttl, sent_at, self._run(PREPARED_RENEW, params, timeout))
        self._tenures.renewed(grant.name, grant.token, sent_at + ttl)
        return renewed

    def _renewal_timeout(self, grant: Grant, now: float) -> float:
        """At most half the grant's time left, so a renewal whose reply is lost leaves time
        to retry on a new connection before the lease runs out (a false loss otherwise)."""
        left = grant.sent_at + grant.ttl - now
        return min(self.request_timeout, max(MIN_RENEWAL_TIMEOUT, left / 2))

    def release(self, grant: Grant) -> None:
        if grant.extra.get("shared"):
            _released(grant, self._run(SHARED_RELEASE_SQL, shared_params(grant)))
            return
        params = {**_owner(grant), "room": _room_of(grant.name)}
        rows = self._release_pinned(grant, params)
        if rows is None:
            rows = self._release_own(grant, params)
        if rows is None:
            rows = self._run(PREPARED_RELEASE, params)
        if not rows or rows[0][0] is None:
            _refused(grant, self._run(RELEASE_REFUSED_SQL, _owner(grant)))
            return  # released by its own earlier try
        if rows[0][1]:
            self._queued.note(grant.name, time.monotonic())

    def _release_pinned(self, grant: Grant, params: dict[str, Any]) -> list[tuple[Any, ...]] | None:
        """Release on the connection the grant kept, unlocking its tenure lock there; ``None``
        when it kept none, or it is gone (with its session, and so the lock)."""
        pin = grant.extra.get("tenure")
        if pin is None:
            return None
        try:
            return self._room.release_pinned(pin, PREPARED_PINNED_RELEASE, params)
        except psycopg.Error as exc:
            raise driver_failure(self.alias, exc) from exc

    def _release_own(self, grant: Grant, params: dict[str, Any]) -> list[tuple[Any, ...]] | None:
        """Release on the own connection, unlocking the grant's tenure lock there, if its
        session took one and is still open; ``None`` (nothing sent) otherwise."""
        session = self._tenures.give_back(grant.name, grant.token)
        if session is None:
            return None
        try:
            rows = self._conn.run_on(session, PREPARED_PINNED_RELEASE, params)
        except psycopg.Error as exc:
            # Nothing of it took effect, the unlock neither: listed again, as run out, so the
            # lock goes at the cap's reclaim if the session is still open (else it went).
            self._tenures.taken(session, grant.name, grant.token, 0.0)
            raise driver_failure(self.alias, exc) from exc
        if rows and rows[0][-1] is not True:
            # Its session did not hold it, though the connection is the one that took it:
            # a transaction pooler's other server session. Take no more.
            self._tenures.disable()
        return rows

    def try_acquire_shared(self, name: str, holder: str, ttl: float) -> Grant | None:
        """Join or start the readers' group of ``name`` (see :mod:`._pg_shared`)."""
        sent_at, secret = time.monotonic(), new_secret()
        rows = self._run(SHARED_ACQUIRE_SQL, _reading(name, holder, ttl, secret))
        if not rows:
            self._failed.note(name, sent_at)
            return None
        return _reader(name, holder, ttl, sent_at, secret, rows[0])

    def stop_new_readers(self, name: str) -> bool:
        """Stop new readers, unless this waiter is inside the name's room and readers did not
        hold it at its last look (entering, or its last try): then there are none to stop,
        and no round trip is spent (``False``: ask again before the next try); nor while it
        waits in line behind this process's waiters inside the room, which stop them."""
        if self._room.behind(name) or self._room.readers_hold(name) is False:
            return False
        self._run(STOP_READERS_SQL, stop_readers_params(name))
        return True

    def wait_for_release(self, name: str, timeout: float) -> bool:
        since = self._failed.take(name, time.monotonic())
        woken = self._room.wait(name, timeout)
        if woken is not None:
            return woken
        with self._lock:
            if self._listener is None:
                self._listener = Listener(
                    self.db_alias, self.alias, session_pooling=self.session_pooling
                )
            listener = self._listener
        return listener.wait(name, since, max(0.0, timeout))

    # -- async: psycopg's AsyncConnection, one set per event loop (see ``_pgaio``) ----------

    async def _arun(
        self, sql: str | Prepared, params: Mapping[str, Any], timeout: float | None = None
    ) -> list[tuple[Any, ...]]:
        try:
            return await self._async.get().conn.run(sql, params, timeout)
        except psycopg.Error as exc:
            raise driver_failure(self.alias, exc) from exc

    async def atry_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        """:meth:`try_acquire`, awaited: inside the name's room on the task's room
        connection, else on the loop's own connection."""
        sent_at, secret = time.monotonic(), new_secret()
        params = _asking(name, holder, ttl, secret)
        room = self._aroom.get()
        rows = await room.run_inside(name, PREPARED_ROOM_ACQUIRE, {**params, "in_room": True})
        if rows is None and not room.behind(name):
            rows = await self._arun(PREPARED_ACQUIRE, params)
        if not rows:
            self._async.get().failed(name, sent_at)
            return None
        token, expires_at = rows[0][:2]
        return Grant(name, holder, int(token), ttl, sent_at, expires_at, secret=secret)

    async def arenew(self, grant: Grant, ttl: float) -> Grant:
        sent_at = time.monotonic()
        timeout = self._renewal_timeout(grant, sent_at)
        if grant.extra.get("shared"):
            rows = await self._arun(SHARED_RENEW_SQL, shared_params(grant, ttl=ttl), timeout)
            return _renewed(grant, ttl, sent_at, rows)
        params = {**_owner(grant), "ttl": ttl}
        return _renewed(grant, ttl, sent_at, await self._arun(PREPARED_RENEW, params, timeout))

    async def arelease(self, grant: Grant) -> None:
        if grant.extra.get("shared"):
            _released(grant, await self._arun(SHARED_RELEASE_SQL, shared_params(grant)))
            return
        if "tenure" in grant.extra or self._tenures.lists(grant.name, grant.token):
            # Won by a thread (in the room, or on the own connection): release in the session
            # that holds its tenure lock, which is a sync connection.
            await asyncio.to_thread(self.release, grant)
            return
        params = {**_owner(grant), "room": _room_of(grant.name)}
        if not await self._arun(PREPARED_RELEASE, params):
            _refused(grant, await self._arun(RELEASE_REFUSED_SQL, _owner(grant)))

    async def atry_acquire_shared(self, name: str, holder: str, ttl: float) -> Grant | None:
        sent_at, secret = time.monotonic(), new_secret()
        rows = await self._arun(SHARED_ACQUIRE_SQL, _reading(name, holder, ttl, secret))
        if not rows:
            self._async.get().failed(name, sent_at)
            return None
        return _reader(name, holder, ttl, sent_at, secret, rows[0])

    async def astop_new_readers(self, name: str) -> bool:
        """:meth:`stop_new_readers`, awaited (skipped likewise)."""
        room = self._aroom.get()
        if room.behind(name) or room.readers_hold(name) is False:
            return False
        await self._arun(STOP_READERS_SQL, stop_readers_params(name))
        return True

    async def await_for_release(self, name: str, timeout: float) -> bool:
        """Woken by the release's ``NOTIFY``: in the name's room on the task's room connection,
        else on the loop's listening connection."""
        state = self._async.get()
        since = state.failed_since(name)
        woken = await self._aroom.get().wait(name, timeout)
        if woken is not None:
            return woken
        return await state.listener.wait(name, since, max(0.0, timeout))

    def awaiting_room(self, name: str, timeout: float | None) -> AbstractAsyncContextManager[None]:
        """:meth:`waiting_room` for tasks: the same queue, on async connections."""
        return self._aroom.get().enter(name, timeout)

    async def aclose(self) -> None:
        await self._aroom.aclose()
        await self._async.aclose()

    def waiting_room(self, name: str, timeout: float | None) -> AbstractContextManager[None]:
        """The name's room (see :mod:`~leases.backends._waiting_room`): a release wakes the
        one waiter inside, the others sleep in the server's lock queue."""
        return self._room.enter(name, timeout)

    def _probe_pooler(self) -> None:
        """Once per process, before the own connection's first tenure lock: turn the rooms
        and tenure locks off behind a pooler (see :mod:`~leases._pgpooler`); asked again later if
        the database does not answer now."""
        if self._room.probed or not self._room.enabled:
            return
        try:
            rows, conn = self._conn.run_here(BACKEND_PID_SQL, ())
        except (psycopg.Error, BackendUnavailable) as exc:
            logger.debug("leases: pooler probe of %r not made: %s", self.alias, exc)
            return
        if rows:
            self._room.probed_on(conn, int(rows[0][0]))

    def inspect(self, name: str) -> LeaseInfo | None:
        rows = self._run(INSPECT_SQL, {"name": name})
        return _info(rows[0], self.alias) if rows else None

    def inspect_all(self) -> list[LeaseInfo]:
        return [_info(row, self.alias) for row in self._run(INSPECT_ALL_SQL, {})]

    def inspect_held_first(self, limit: int) -> list[LeaseInfo]:
        """Without ``meta``: see :data:`INSPECT_HELD_FIRST_SQL`."""
        rows = self._run(INSPECT_HELD_FIRST_SQL, {"limit": limit})
        return sorted((_info(row, self.alias) for row in rows), key=lambda i: i.rank)[:limit]

    def iter_held_first(self, batch: int = LIST_BATCH) -> Iterator[LeaseInfo]:
        """Every row, held first, ``batch`` rows a round trip, without ``meta``.

        Not a snapshot: each batch is read as of its own moment, so a name that changes state
        while the listing runs may be shown twice or not at all (as in any live view).
        """
        for sql in (LIST_HELD_BATCH_SQL, LIST_REST_BATCH_SQL):
            after = ""
            while True:
                rows = self._run(sql, {"after": after, "batch": batch})
                yield from (_info(row, self.alias) for row in rows)
                if len(rows) < batch:
                    break
                after = rows[-1][0]

    def internal_advisory_locks(self) -> dict[int, InternalLock]:
        """The waiting rooms of the names held now (a waiter only waits for a held name), and
        their grants' tenure locks (see :mod:`~._tenure`)."""
        held = self._run(HELD_NAMES_SQL, {})
        rooms = {room_key(name): InternalLock(name, "room") for name, _ in held}
        known = rooms | {tenure: InternalLock(name, "tenure") for name, tenure in held}
        own = self._run(PACKAGE_LOCKS_SQL, {"application": APPLICATION_NAME})
        return {key: InternalLock("", "internal") for (key,) in own} | known

    def force_release(self, name: str, token: int) -> LeaseInfo:
        row = self._run(FORCE_RELEASE_SQL, {"name": name, "token": token})[0]
        if row[0] is None:
            raise LeaseNotHeld(name, not_revoked(token, row[2]))
        return _info(row, self.alias)

    def prune(
        self,
        older_than: float,
        *,
        batch_size: int = PRUNE_BATCH,
        progress: Progress | None = None,
        dry_run: bool = False,
    ) -> int:
        """Delete the rows of names free for ``older_than`` seconds (see ``_pruning``)."""
        return prune_rows(self.db_alias, older_than, batch_size, progress, dry_run=dry_run)

    def deploy_checks(self) -> list[str]:
        try:
            ((sync, table),) = self._run(DEPLOY_CHECK_SQL, {})
        except BackendUnavailable as exc:
            return [str(exc)]
        problems = []
        if table is None:
            problems.append(f"{self.db_alias!r} has no leases_lease table: run migrate")
        if sync in ("off", "local"):
            problems.append(f"synchronous_commit is {sync!r} even when set on per session")
        return problems

    def close(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()
        self._conn.close()
        self._room.close()

    # -- internals ------------------------------------------------------------------------

    def forget_after_fork(self) -> None:
        """In a forked child: drop (never close) the parent's listener; its thread is gone.

        The backend's own connection and room connections are dropped by their own owners.
        """
        self._lock = threading.Lock()
        self._failed, self._queued = ThreadNotes(), ThreadNotes()  # their locks may be held
        listener, self._listener = self._listener, None
        inherit(listener.conn if listener else None)
        self._tenures.forget_after_fork()
