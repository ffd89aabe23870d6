"""What the Redis backend sends and what the replies mean, shared by its sync and async halves.

No I/O here: the acquire and revoke scripts, how a token packs an epoch and a counter, the
arguments renew and release present, and what each reply means. :mod:`leases.backends.redis`
runs them on blocking connections, :mod:`leases.backends._redis_async` on ``redis.asyncio``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, NamedTuple

from ..errors import LeaseLost, LeaseNotHeld
from ._redis_io import expires, ms, text
from ._redis_scripts import WAKE_TTL_MS, LeaseKeys, Reply, lua, wake_lua
from ._redis_shared import GROUP, NEXT_GRANT_LUA, WRITER_INTENT_MS
from .base import FORGED, Grant

__all__ = [
    "ACQUIRE_LUA",
    "COUNTER_BITS",
    "FORCE_RELEASE_LUA",
    "MARK",
    "MAX_COUNTER",
    "MAX_EPOCH",
    "TOKEN_SCRIPTS",
    "ReadersSeen",
    "Reservation",
    "acquire_args",
    "acquire_call",
    "acquired",
    "epoch_source",
    "offer",
    "owner_args",
    "pack_token",
    "refusal",
    "release_call",
    "released",
    "renew_call",
    "renewed",
    "shared_acquire_keys",
    "shared_release_call",
    "shared_renew_call",
    "stamp_next_try",
    "stop_readers_call",
    "token_of",
]

#: Epochs and counters are packed into one signed 64-bit token (``FencedModel``'s bigint).
COUNTER_BITS = 32
MAX_COUNTER = 2**COUNTER_BITS - 1
MAX_EPOCH = 2**31 - 1

#: KEYS[1] lock, KEYS[2] fence, KEYS[3] writer. ARGV[1] holder, ARGV[2] ttl ms, ARGV[3] the
#: offer (``0``: none yet, else ``epoch:nonce``: see :func:`offer`), ARGV[4] counter limit (a
#: counter there needs a new epoch), ARGV[5] the grant's secret, ARGV[6] the epoch source
#: (:func:`epoch_source`), ARGV[7] how long a refusal stamps ``:writer`` (ms; ``0`` or absent:
#: no stamp, see :func:`acquire_call`), ARGV[8] the server's replication id as this connection
#: last learned it ('' or absent: not known, read it now). The value is
#: ``epoch:counter:sha1(secret):holder``: Redis never holds the secret itself.
#:
#: A refused waiting writer's stamp stops new readers (:mod:`._redis_shared`) only where readers
#: ever started a group (the ``shared`` field of ``:fence``, which they set): a name readers
#: never use costs its waiters one ``HEXISTS`` per stamp asked for, and no write.
#:
#: The replication id is read (``INFO``) only when the caller does not know it or the counter
#: was stamped with another one; otherwise the caller's is trusted (see the Redis backend's
#: module docstring for when a connection's knowledge is renewed). Every reply ends with the id
#: the script used, for the caller to remember. The token step is the shared acquire's too
#: (:data:`~leases.backends._redis_shared.NEXT_GRANT_LUA`).
#: Returns {OK, value, run} | {BUSY, value, run} | {NEED_EPOCH, stored epoch, run, nonce}.
ACQUIRE_LUA = lua(
    """
local source, known_run = ARGV[6], ARGV[8] or ''
local current = redis.call('GET', KEYS[1])
if current then
  local stamp = tonumber(ARGV[7] or '0')
  if stamp > 0 and redis.call('HEXISTS', KEYS[2], 'shared') == 1 then
    redis.call('SET', KEYS[3], '1', 'PX', stamp)
  end
  return {BUSY, current, known_run}
end
"""
    + NEXT_GRANT_LUA
    + """
local value = string.format('%d:%d:%s:%s', epoch, counter, redis.sha1hex(ARGV[5]), ARGV[1])
redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2])
return {OK, value, run}
"""
)

#: KEYS: lock, wake, fence. ARGV: epoch, counter (the token to revoke), wake ttl ms, the lock
#: value's prefix for that token (``epoch:counter:``).
#: Compare-and-revoke: only while the stored token is still the one given, free the name (if
#: that grant still holds it), advance the counter so the evicted holder's renewals fail, and
#: wake one waiter. A grant held longer than its counter is kept (a keepalive through the day
#: :data:`~._redis_shared.FENCE_KEEP_MS`) has only its lock to compare: it is freed and the
#: counter left missing, so the next grant takes a new epoch, above the revoked token anyway.
#: Returns {OK, epoch, new counter} | {LOST, stored epoch, stored counter}.
FORCE_RELEASE_LUA = lua(
    """
local state = redis.call('HMGET', KEYS[3], 'epoch', 'counter')
local held = string.sub(redis.call('GET', KEYS[1]) or '', 1, #ARGV[4]) == ARGV[4]
if tonumber(state[1]) ~= tonumber(ARGV[1]) or tonumber(state[2]) ~= tonumber(ARGV[2]) then
  if state[1] or not held then
    return {LOST, state[1], state[2]}
  end
end
if string.sub(redis.call('GET', KEYS[1]) or '', 1, #ARGV[4]) == ARGV[4] then
  redis.call('DEL', KEYS[1])
end
local counter = tonumber(ARGV[2]) + 1
if state[1] then
  counter = redis.call('HINCRBY', KEYS[3], 'counter', 1)
end
"""
    + wake_lua("KEYS[2]", "ARGV[3]")
    + """
return {OK, ARGV[1], counter}
"""
)


def token_of(value: str) -> tuple[int, str]:
    """``(token, holder)`` from a lock value ``epoch:counter:secret hash:holder``."""
    epoch, counter, _, holder = value.split(":", 3)
    return int(epoch) << COUNTER_BITS | int(counter), holder


def pack_token(epoch: bytes | str | int, counter: bytes | str | int) -> int:
    return int(epoch) << COUNTER_BITS | int(counter)


def owner_args(grant: Grant) -> list[object]:
    """What renew and release present (see :data:`_OWNER_LUA`): the grant's token prefix,
    holder and secret, so a stale grant (other token) or a forged one (no secret) never
    matches the key."""
    prefix = f"{grant.token >> COUNTER_BITS}:{grant.token & MAX_COUNTER}:"
    return [prefix, grant.holder, grant.secret]


def refusal(grant: Grant, code: object, what: str) -> LeaseLost | LeaseNotHeld:
    """The error for a renewal or release the store refused with ``code``."""
    if code == Reply.NOT_OWNER:
        return LeaseNotHeld(grant.name, FORGED)
    return LeaseLost(grant.name, grant.token, f"expired or taken over before the {what}")


class Reservation(NamedTuple):
    """An acquire script's request for a new epoch: the stored one (0: none of ours), and the
    reservation's nonce the new epoch is offered with (see
    :data:`~leases.backends._redis_shared.NEXT_GRANT_LUA`)."""

    stored: int
    nonce: str


def offer(epoch: int, reservation: Reservation) -> str:
    """An acquire script's offer: a new ``epoch``, drawn after ``reservation`` was made."""
    return f"{epoch}:{reservation.nonce}"


def epoch_source(database: str, resource: str) -> str:
    """Which counter epochs come from: the epoch database's identity
    (:meth:`~._counter.DurableCounter.source`) and the row's name, hashed short, as the acquire
    scripts stamp it into ``:fence``. Two projects that share a Redis and a ``PREFIX`` have
    the same row name in different databases; only this tells their counters apart."""
    text = f"{database}\x00{resource}"
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]


#: The ``:writer`` key a waiting writer of this thread or task asked its next exclusive try to
#: stamp if refused ('' none): see :func:`acquire_call`.
_STAMP: ContextVar[str] = ContextVar("leases_redis_stamp", default="")


def stamp_next_try(prefix: str, name: str) -> None:
    """Have this thread's (or task's) next exclusive try of ``name`` stop new readers if it is
    refused (:func:`acquire_call`)."""
    _STAMP.set(LeaseKeys.of(prefix, name).writer)


def acquire_call(prefix: str, name: str) -> tuple[list[str], list[object]]:
    """The exclusive acquire's keys and extra argument: how long a refusal stamps ``:writer``.

    A waiting writer must stop new readers behind an exclusive holder too, or readers that came
    after it start a group the moment that holder leaves. A round trip of its own for that
    would be paid by every contended exclusive acquire: instead, when the writer's last try
    found an exclusive holder, its stop sign rides on its next try (:func:`stamp_next_try`),
    which stamps only if refused, and only on a name readers use (:data:`ACQUIRE_LUA`)."""
    keys = LeaseKeys.of(prefix, name)
    stamp = 0
    if _STAMP.get() == keys.writer:
        _STAMP.set("")
        stamp = WRITER_INTENT_MS
    return [keys.lock, keys.fence, keys.writer], [stamp]


def acquire_args(
    holder: str, ttl: float, offered: str, secret: str, source: str, extra: list[object]
) -> list[object]:
    """An acquire script's arguments, but for the replication id (the caller's, last)."""
    return [holder, ms(ttl), offered, MAX_COUNTER, secret, source, *extra]


def acquired(
    reply: Any,
    name: str,
    holder: str,
    ttl: float,
    sent_at: float,
    secret: str,
    extra: Mapping[str, Any] | None = None,
) -> Grant | Reservation | None:
    """What an acquire script's reply means: the :class:`Grant` (with ``extra``: a shared
    grant's mark), ``None`` (held by someone else), or a :class:`Reservation` when the script
    asks for a new epoch."""
    code, value = reply[0], reply[1]
    if code == Reply.OK:
        won = token_of(text(value))[0]
        return Grant(name, holder, won, ttl, sent_at, expires(ttl), extra or {}, secret=secret)
    if code == Reply.BUSY:
        return None
    return Reservation(int(value), text(reply[3]))


class ReadersSeen:
    """Per name, whether the latest exclusive try refused for ``name`` found readers holding it.

    An exclusive waiter's stop sign for new readers (:data:`STOP_READERS_LUA`) is a round trip
    worth paying only while readers hold the name: while an exclusive grant does, no reader can
    join, and the waiter's next try carries the sign instead (:func:`acquire_call`), so readers
    cannot start a group ahead of it once that grant is released. Any thread's try of the name
    informs it; unknown (never tried, forgotten) counts as readers.
    """

    LIMIT = 4096

    def __init__(self) -> None:
        self._seen: dict[str, bool] = {}

    def note(self, name: str, reply: Any) -> None:
        """After an exclusive acquire script's ``reply`` (busy: held by whom; granted: free)."""
        if reply[0] == Reply.BUSY:
            if len(self._seen) >= self.LIMIT:
                self._seen.clear()
            self._seen[name] = text(reply[1]).endswith(MARK)
        else:
            self._seen.pop(name, None)

    def none(self, name: str) -> bool:
        """The latest try found an exclusive holder, so there are no readers to stop."""
        return self._seen.get(name) is False


def renew_call(prefix: str, grant: Grant, ttl: float) -> tuple[list[str], list[object]]:
    return [LeaseKeys.of(prefix, grant.name).lock], [*owner_args(grant), ms(ttl)]


def release_call(prefix: str, grant: Grant) -> tuple[list[str], list[object]]:
    keys = LeaseKeys.of(prefix, grant.name)
    return [keys.lock, keys.wake], [*owner_args(grant), WAKE_TTL_MS]


def renewed(grant: Grant, ttl: float, sent_at: float, code: object) -> Grant:
    if code != Reply.OK:
        raise refusal(grant, code, "renewal")
    return replace(grant, ttl=ttl, sent_at=sent_at, expires_at=expires(ttl))


def released(grant: Grant, code: object) -> None:
    if code != Reply.OK:
        raise refusal(grant, code, "release")


#: The scripts that take a token: they read (or are given) the server's replication id.
TOKEN_SCRIPTS = frozenset({"acquire", "shared_acquire"})

#: The end of a readers' group's lock value (see :mod:`._redis_shared`).
MARK = f"::{GROUP}"


def _reader_args(grant: Grant) -> list[object]:
    """A reader's key among the group's entries (``epoch:counter``), holder and secret."""
    return [
        f"{grant.token >> COUNTER_BITS}:{grant.token & MAX_COUNTER}",
        grant.holder,
        grant.secret,
    ]


def shared_acquire_keys(prefix: str, name: str) -> list[str]:
    keys = LeaseKeys.of(prefix, name)
    return [keys.lock, keys.fence, keys.readers, keys.writer]


def shared_renew_call(prefix: str, grant: Grant, ttl: float) -> tuple[list[str], list[object]]:
    keys = LeaseKeys.of(prefix, grant.name)
    return [keys.lock, keys.readers], [*_reader_args(grant), ms(ttl), MARK]


def shared_release_call(prefix: str, grant: Grant) -> tuple[list[str], list[object]]:
    keys = LeaseKeys.of(prefix, grant.name)
    return [keys.lock, keys.readers, keys.wake], [*_reader_args(grant), MARK, WAKE_TTL_MS]


def stop_readers_call(prefix: str, name: str) -> tuple[list[str], list[object]]:
    keys = LeaseKeys.of(prefix, name)
    return [keys.lock, keys.writer], [MARK, WRITER_INTENT_MS]
