"""Shared (reader) grants in the ``leases_lease`` table, for the database backend.

Readers of a name hold its one row together, as a *group*: ``holder`` is :data:`GROUP`,
``secret_hash`` is NULL (no exclusive grant ever has one NULL, so no user's holder name can pass
for a group), ``expires_at`` is the latest reader's expiry, and ``meta->'readers'`` maps each
reader's token to its holder, the SHA-256 of its secret and its own expiry (epoch seconds). So the
exclusive statements need no change: to them a live group is a held row, and an exclusive
acquire waits for it to end. Every reader's grant bumps the row's token, so tokens stay one
sequence per name: a writer's token is above every reader's before it, and a resource it
fenced refuses a write from any reader of the earlier group.

A waiting writer stops new readers: :data:`STOP_READERS_SQL` stamps ``meta->'writer_until'`` a
moment ahead (refreshed on each of the writer's retries, so a writer that gave up blocks nobody
for long), and a reader may not join, nor start a group, while it lies ahead. The writer stamps
only a live group: behind an exclusive holder, it is the waiting room that keeps the name for
it. A reader starting a group obeys the room as an exclusive caller outside it does (see
``ACQUIRE_SQL`` in the backend): a free name goes to the exclusive waiters in or queued for
its room first, so a reader that came after a writer cannot start a group the moment the
holder ahead of both leaves. That costs the exclusive path nothing: the room is there anyway.

Expiry is judged by ``clock_timestamp()`` per reader: a reader that stopped renewing is out of
the group when its own expiry passes, even while others keep the row alive.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ..holders import SHARED_HOLDER
from ._counter import TIMELINE_FLOOR_SQL
from ._pruning import FLOOR_SQL
from .base import Grant

__all__ = [
    "GROUP",
    "SHARED_ACQUIRE_SQL",
    "SHARED_RELEASE_SQL",
    "SHARED_RENEW_SQL",
    "STOP_READERS_SQL",
    "WRITER_INTENT_SECONDS",
    "shared_acquire_params",
    "shared_params",
    "stop_readers_params",
]

#: The ``holder`` of a row held by readers (U+241F is in no holder anyone passes).
GROUP = SHARED_HOLDER
#: How long a waiting writer's stamp stops new readers; it retries well within this.
WRITER_INTENT_SECONDS = 1.0

_NOW = "extract(epoch from clock_timestamp())::float8"
_UNTIL = "extract(epoch from clock_timestamp() + make_interval(secs => %(ttl)s))::float8"
#: The row is a live group of readers.
_LIVE_GROUP = (
    "(l.holder = %(group)s AND l.secret_hash IS NULL AND l.expires_at > clock_timestamp())"
)
#: A writer waits: no reader may join or start a group.
_WRITER_WAITS = f"(COALESCE((l.meta->>'writer_until')::float8, 0) > {_NOW})"
#: The readers of the row still within their own expiry, but the one with key ``%(key)s``.
_OTHER_LIVE_READERS = f"""(
    SELECT COALESCE(jsonb_object_agg(r.k, r.v), '{{}}'::jsonb)
    FROM jsonb_each(COALESCE(l.meta->'readers', '{{}}'::jsonb)) AS r(k, v)
    WHERE (r.v->>'e')::float8 > {_NOW} AND r.k <> %(key)s
)"""  # noqa: S608
_ENTRY = (
    "jsonb_build_object('h', %(holder)s::text, 's', encode(sha256(%(secret)s::bytea), 'hex'), "
    f"'e', {_UNTIL})"
)
_MINE = "l.meta->'readers'->%(key)s"
#: This reader's entry is live and names this holder; with ``_SECRET``, it is this grant.
_ENTRY_LIVE = f"({_MINE}->>'h' = %(holder)s AND ({_MINE}->>'e')::float8 > {_NOW})"
_SECRET = f"({_MINE}->>'s' = encode(sha256(%(secret)s::bytea), 'hex'))"

#: A new row's first token and a held row's next: above every pruned token
#: (:data:`~._pruning.FLOOR_SQL`) and never below the timeline's floor (a promoted standby,
#: :data:`~._counter.TIMELINE_FLOOR_SQL`), exactly as the exclusive acquire counts.
_FIRST = f"GREATEST({FLOOR_SQL}, {TIMELINE_FLOOR_SQL})"
_NEXT = f"GREATEST(l.token + 1, {TIMELINE_FLOOR_SQL})"

#: Join the live group of ``name``, or start one on a free or expired row, unless a writer
#: waits; the reader's token is the row's next (:data:`_FIRST`, :data:`_NEXT`). Like the
#: exclusive acquire, a held row (or a waiting writer) makes the probe false and nothing is
#: locked or written. Joining a live group is governed by the writer's stamp alone; starting
#: a group, like an exclusive try from outside the name's waiting room, takes the name only if
#: nobody is in or queued for the room (``%(room)s``: the shared try-lock fails while an
#: exclusive waiter is) or if it has been free for longer than ``%(grace)s`` (the waiter
#: inside is paused or gone: it must not keep readers out for good).
SHARED_ACQUIRE_SQL = f"""
INSERT INTO leases_lease AS l
    (name, holder, token, acquired_at, expires_at, renewed_at, meta, secret_hash)
SELECT %(name)s::text, %(group)s::text, {_FIRST}, clock_timestamp(),
       clock_timestamp() + make_interval(secs => %(ttl)s), NULL,
       jsonb_build_object('readers', jsonb_build_object(({_FIRST})::text, {_ENTRY})), NULL
WHERE NOT EXISTS (
    SELECT 1 FROM leases_lease AS l
    WHERE l.name = %(name)s::text AND (
        (l.holder <> '' AND l.expires_at > clock_timestamp() AND NOT {_LIVE_GROUP})
        OR {_WRITER_WAITS})
)
AND (EXISTS (SELECT 1 FROM leases_lease AS l WHERE l.name = %(name)s::text AND {_LIVE_GROUP})
    OR pg_try_advisory_xact_lock_shared(%(room)s::bigint)
    OR NOT EXISTS (
        SELECT 1 FROM leases_lease
        WHERE name = %(name)s::text AND expires_at > clock_timestamp() - %(grace)s::interval
))
ON CONFLICT (name) DO UPDATE
SET holder = EXCLUDED.holder, token = {_NEXT}, renewed_at = NULL, secret_hash = NULL,
    acquired_at = CASE WHEN {_LIVE_GROUP} THEN l.acquired_at ELSE clock_timestamp() END,
    expires_at = GREATEST(CASE WHEN {_LIVE_GROUP} THEN l.expires_at END, EXCLUDED.expires_at),
    meta = jsonb_build_object('readers',
        CASE WHEN {_LIVE_GROUP} THEN {_OTHER_LIVE_READERS} ELSE '{{}}'::jsonb END
        || jsonb_build_object(({_NEXT})::text, {_ENTRY}))
WHERE NOT {_WRITER_WAITS}
  AND (l.holder = '' OR l.expires_at IS NULL OR l.expires_at <= clock_timestamp() OR {_LIVE_GROUP})
RETURNING l.token, to_timestamp((l.meta->'readers'->(l.token)::text->>'e')::float8)
"""  # noqa: S608

#: Extend one reader's own expiry (and the group's, if it now lies further). One row back: the
#: reader's new expiry, or NULL for a forged grant (holder and token right, secret wrong).
SHARED_RENEW_SQL = f"""
WITH renewed AS (
    UPDATE leases_lease AS l
    SET meta = jsonb_set(l.meta, ARRAY['readers', %(key)s],
                         ({_MINE}) || jsonb_build_object('e', {_UNTIL})),
        expires_at = GREATEST(l.expires_at, clock_timestamp() + make_interval(secs => %(ttl)s)),
        renewed_at = clock_timestamp()
    WHERE l.name = %(name)s::text AND {_LIVE_GROUP} AND {_ENTRY_LIVE} AND {_SECRET}
    RETURNING to_timestamp(({_MINE}->>'e')::float8)
)
SELECT * FROM renewed
UNION ALL
SELECT NULL FROM leases_lease AS l
WHERE l.name = %(name)s::text AND {_LIVE_GROUP} AND {_ENTRY_LIVE} AND NOT {_SECRET}
  AND NOT EXISTS (SELECT FROM renewed)
"""  # noqa: S608

#: Leave the group; the last reader out frees the row (keeping the token) and wakes waiters.
#: One row back: ``true`` when left, ``false`` for a forged grant.
SHARED_RELEASE_SQL = f"""
WITH freed AS (
    UPDATE leases_lease AS l
    SET meta = jsonb_set(l.meta, '{{readers}}', {_OTHER_LIVE_READERS}),
        holder = CASE WHEN {_OTHER_LIVE_READERS} = '{{}}'::jsonb THEN '' ELSE l.holder END,
        expires_at = COALESCE((
            SELECT max(to_timestamp((r.v->>'e')::float8))
            FROM jsonb_each(l.meta->'readers') AS r(k, v)
            WHERE (r.v->>'e')::float8 > {_NOW} AND r.k <> %(key)s), clock_timestamp())
    WHERE l.name = %(name)s::text AND {_LIVE_GROUP} AND {_ENTRY_LIVE} AND {_SECRET}
    RETURNING l.name, l.holder
)
SELECT CASE WHEN holder = '' THEN pg_notify('leases_released', name)::text IS NOT NULL
            ELSE true END
FROM freed
UNION ALL
SELECT false FROM leases_lease AS l
WHERE l.name = %(name)s::text AND {_LIVE_GROUP} AND {_ENTRY_LIVE} AND NOT {_SECRET}
  AND NOT EXISTS (SELECT FROM freed)
"""  # noqa: S608

#: A writer waits for a live group: stop new readers for a moment (nothing written otherwise).
STOP_READERS_SQL = f"""
UPDATE leases_lease AS l
SET meta = jsonb_set(l.meta, '{{writer_until}}', to_jsonb({_NOW} + %(seconds)s))
WHERE l.name = %(name)s::text AND {_LIVE_GROUP}
"""  # noqa: S608


def shared_params(grant: Grant, **more: Any) -> dict[str, Any]:
    """What the shared renew and release present: the grant, its key among the readers."""
    return {
        "name": grant.name,
        "holder": grant.holder,
        "key": str(grant.token),
        "secret": grant.secret,
        "group": GROUP,
        **more,
    }


#: The shared acquire's constants: the group's holder, and no reader left out of the live ones.
_ACQUIRE_CONSTANTS = {"group": GROUP, "key": ""}


def shared_acquire_params(
    name: str, holder: str, ttl: float, secret: str, room: int, grace: timedelta
) -> dict[str, Any]:
    """What :data:`SHARED_ACQUIRE_SQL` is given (no reader's ``key`` is left out: ``""``):
    the name's waiting room key and how long its waiters have a freed name to themselves,
    as the exclusive acquire from outside the room is given them."""
    asked = {"name": name, "holder": holder, "ttl": ttl, "secret": secret}
    return asked | {"room": room, "grace": grace} | _ACQUIRE_CONSTANTS


def stop_readers_params(name: str) -> dict[str, Any]:
    """What :data:`STOP_READERS_SQL` is given: a waiting writer's stamp, a moment ahead."""
    return {"name": name, "group": GROUP, "seconds": WRITER_INTENT_SECONDS}
