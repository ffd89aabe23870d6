"""Leases in Redis: ``SET NX PX`` inside Lua, one round trip per acquire, renew and release.

Configuration (``LEASES["BACKENDS"][alias]``)::

    {"ENGINE": "leases.backends.redis", "CACHE": "default"}       # a django-redis cache alias
    {"ENGINE": "leases.backends.redis", "URL": "redis://host:6379/0", "SOCKET_TIMEOUT": 1.0}

Options: ``CACHE`` or ``URL`` (one of them), ``PREFIX`` (default ``"leases:"``),
``EPOCH_DATABASE`` (the Django database alias epochs come from, default ``"default"``),
``SOCKET_TIMEOUT`` (seconds, ``URL`` only), ``CLUSTER`` (``True``: the URL names a node of
a Redis Cluster). A cache alias keeps its own connection settings:
give it a socket timeout, and mind that redis-py retries failed commands by default (a ``URL``
client here never retries, so a timed-out release is not retried into a false "lost").

Keys of one name share a Redis Cluster hash tag, ``<prefix>{<name>}``: ``:lock`` (the grant,
value ``epoch:counter:holder``, expiring by Redis's clock), ``:fence`` (the name's counter, no
TTL) and ``:wake`` (a list a release pushes to, so a waiter's ``BLPOP`` wakes without polling).
Renew and release compare the whole value before they touch the key, so a holder whose grant
expired can never extend or delete its successor's.

**Fencing that never regresses.** The counter lives in Redis, which can forget it: a restart
without persistence, a failover to a replica that missed the last increments, eviction. So the
token is ``epoch << 32 | counter``, and the epoch comes from the database: a durable counter row
in ``leases_fence`` bumped on its own connection. The ``:fence`` hash records the epoch and the
replication id (``master_replid``) of the Redis server that wrote it; Redis gives a server a new
replication id when it starts and when a replica is promoted. Whenever the acquire script finds
the counter missing, written by another server run, or exhausted, it refuses to grant and asks
for a new epoch, which the database guarantees is higher than every epoch handed out before, so
the next token is higher than every earlier one. This costs one extra database statement for the
first grant of a name after such an event; if the database is unreachable then, the grant is
refused with :class:`~leases.errors.FencingUnavailable` instead of risking a repeated token.
"""

from __future__ import annotations

import enum
import functools
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import FencingUnavailable, LeaseLost, LeaseNotHeld
from ..keys import validate_name
from ._counter import DurableCounter
from ._redis_io import (
    blpop,
    check_options,
    check_prefix,
    connect,
    edge,
    eviction_problems,
    expires,
    ms,
    text,
)
from .base import FORGED, Capability, Grant, LeaseBackend, LeaseInfo, new_secret, not_revoked

__all__ = [
    "ACQUIRE_LUA",
    "FORCE_RELEASE_LUA",
    "RELEASE_LUA",
    "RENEW_LUA",
    "Backend",
    "LeaseKeys",
    "Reply",
    "lua",
]

#: Epochs and counters are packed into one signed 64-bit token (``FencedModel``'s bigint).
COUNTER_BITS = 32
MAX_COUNTER = 2**COUNTER_BITS - 1
MAX_EPOCH = 2**31 - 1
#: How long a release's wake-up waits in the list for a waiter that is about to ``BLPOP``.
WAKE_TTL_MS = 5000
OPTIONS = frozenset({"CACHE", "URL", "CLUSTER", "PREFIX", "EPOCH_DATABASE", "SOCKET_TIMEOUT"})


class Reply(enum.IntEnum):
    """Return codes of the Lua scripts (injected into them as Lua constants by :func:`lua`)."""

    LOST = 0
    OK = 1
    BUSY = 2
    NEED_EPOCH = 3
    #: Holder and token are the current grant's, the secret is not: a grant forged from public
    #: data (``inspect()``), refused without touching the key.
    NOT_OWNER = 4


def lua(body: str) -> str:
    """A script with :class:`Reply`'s names defined, so Python and Lua share one set of codes."""
    return "".join(f"local {r.name} = {r.value}\n" for r in Reply) + body


#: KEYS: lock, fence. ARGV: holder, ttl ms, offered epoch ("0": none), counter limit, secret.
#: The value is ``epoch:counter:sha1(secret):holder``: Redis never holds the secret itself.
#: Returns {OK, value} | {BUSY, value} | {NEED_EPOCH, stored epoch}.
ACQUIRE_LUA = lua("""
if redis.replicate_commands then
  redis.replicate_commands()  -- Redis < 5: allow writes after INFO (no-op since 5)
end
local current = redis.call('GET', KEYS[1])
if current then
  return {BUSY, current}
end
local run = string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)') or ''
local state = redis.call('HMGET', KEYS[2], 'epoch', 'counter', 'run')
local epoch, counter = tonumber(state[1]), tonumber(state[2])
if epoch == nil or counter == nil or state[3] ~= run or counter >= tonumber(ARGV[4]) then
  local offered = tonumber(ARGV[3])
  if offered <= (epoch or 0) then
    return {NEED_EPOCH, tostring(epoch or 0)}
  end
  epoch, counter = offered, 0
end
counter = counter + 1
redis.call('HSET', KEYS[2], 'epoch', epoch, 'counter', counter, 'run', run)
local value = string.format('%d:%d:%s:%s', epoch, counter, redis.sha1hex(ARGV[5]), ARGV[1])
redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2])
return {OK, value}
""")

#: The owner's proof, shared by renew and release (and Redlock's nodes, whose values have no
#: token prefix). ARGV: the value's token prefix (``epoch:counter:``, or "" on Redlock), holder,
#: secret. ``owned`` is the value only the secret's owner can name; ``refused()`` tells a
#: forged grant (token prefix and holder match, hash does not: :attr:`Reply.NOT_OWNER`) from
#: a grant that expired or was taken over (:attr:`Reply.LOST`).
_OWNER_LUA = """
local owned = ARGV[1] .. redis.sha1hex(ARGV[3]) .. ':' .. ARGV[2]
local function refused()
  local current = redis.call('GET', KEYS[1]) or ''
  if string.sub(current, 1, #ARGV[1]) == ARGV[1]
      and string.sub(current, #ARGV[1] + 41) == ':' .. ARGV[2] then
    return NOT_OWNER
  end
  return LOST
end
"""

#: KEYS: lock. ARGV: token prefix, holder, secret, ttl ms. Compare-and-PEXPIRE.
RENEW_LUA = lua(
    _OWNER_LUA
    + """
if redis.call('GET', KEYS[1]) == owned then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return OK
end
return refused()
"""
)

#: KEYS: lock, wake. ARGV: token prefix, holder, secret, wake ttl ms.
#: Compare-and-delete, then wake one waiter; the counter in ``fence`` is never deleted.
RELEASE_LUA = lua(
    _OWNER_LUA
    + """
if redis.call('GET', KEYS[1]) == owned then
  redis.call('DEL', KEYS[1])
  redis.call('RPUSH', KEYS[2], '1')
  redis.call('LTRIM', KEYS[2], 0, 0)
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
  return OK
end
return refused()
"""
)

#: KEYS: lock, wake, fence. ARGV: epoch, counter (the token to revoke), wake ttl ms, the lock
#: value's prefix for that token (``epoch:counter:``).
#: Compare-and-revoke: only while the stored token is still the one given, free the name (if
#: that grant still holds it), advance the counter so the evicted holder's renewals fail, and
#: wake one waiter. Returns {OK, epoch, new counter} | {LOST, stored epoch, stored counter}.
FORCE_RELEASE_LUA = lua("""
local state = redis.call('HMGET', KEYS[3], 'epoch', 'counter')
if tonumber(state[1]) ~= tonumber(ARGV[1]) or tonumber(state[2]) ~= tonumber(ARGV[2]) then
  return {LOST, state[1], state[2]}
end
if string.sub(redis.call('GET', KEYS[1]) or '', 1, #ARGV[4]) == ARGV[4] then
  redis.call('DEL', KEYS[1])
end
local counter = redis.call('HINCRBY', KEYS[3], 'counter', 1)
redis.call('RPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], 0, 0)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return {OK, state[1], counter}
""")


@dataclass(frozen=True)
class LeaseKeys:
    """The keys of one name; ``{...}`` is the Redis Cluster hash tag, so they share a slot."""

    lock: str
    fence: str
    wake: str

    @classmethod
    def of(cls, prefix: str, name: str) -> LeaseKeys:
        return _lease_keys(prefix, validate_name(name))

    @staticmethod
    def name_of(prefix: str, fence_key: str) -> str:
        escaped = fence_key[len(prefix) + 1 : -len("}:fence")]
        return escaped.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")


@functools.lru_cache(maxsize=1024)
def _lease_keys(prefix: str, name: str) -> LeaseKeys:
    """Cached: every acquire, renew and release needs the keys, and escaping the name costs
    more than the rest of building the call."""
    # Braces inside the name would move the hash tag; escaping keeps the mapping one-to-one.
    escaped = name.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    base = f"{prefix}{{{escaped}}}"
    return LeaseKeys(lock=f"{base}:lock", fence=f"{base}:fence", wake=f"{base}:wake")


def token_of(value: str) -> tuple[int, str]:
    """``(token, holder)`` from a lock value ``epoch:counter:secret hash:holder``."""
    epoch, counter, _, holder = value.split(":", 3)
    return int(epoch) << COUNTER_BITS | int(counter), holder


def _token(epoch: bytes | str | int, counter: bytes | str | int) -> int:
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


class Backend(LeaseBackend):
    """Leases on one Redis server (or cluster) reached through django-redis or a URL."""

    capabilities = frozenset(
        {Capability.NATIVE_FENCING, Capability.WAIT_WITHOUT_POLLING, Capability.FORCE_RELEASE}
    )

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        check_options(alias, options, OPTIONS)
        self.prefix = check_prefix(alias, options.get("PREFIX", "leases:"))
        self.epochs = DurableCounter(alias, str(options.get("EPOCH_DATABASE", "default")))
        self.epoch_resource = f"leases.redis-epoch:{self.prefix}"
        self._lock = threading.Lock()
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        connect_args = (options.get("CACHE"), options.get("URL"))
        if (connect_args[0] is None) == (connect_args[1] is None):
            connect(alias, *connect_args, 1.0)  # raises the configuration error now

    @property
    def client(self) -> Any:
        """The redis-py client, made on first use (never at import), with its own scripts."""
        with self._lock:
            if self._client is None:
                options = self.options
                client = connect(
                    self.alias,
                    options.get("CACHE"),
                    options.get("URL"),
                    float(options.get("SOCKET_TIMEOUT", 5.0)),
                    cluster=bool(options.get("CLUSTER", False)),
                )
                # Registered per client: a Script object is bound to the client that made it.
                self._scripts = {
                    "acquire": client.register_script(ACQUIRE_LUA),
                    "renew": client.register_script(RENEW_LUA),
                    "release": client.register_script(RELEASE_LUA),
                    "force_release": client.register_script(FORCE_RELEASE_LUA),
                }
                self._client = client
            return self._client

    def _run(self, script: str, keys: list[str], args: list[object]) -> Any:
        client = self.client
        with edge(self.alias, script):
            return self._scripts[script](keys=keys, args=args, client=client)

    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        keys = LeaseKeys.of(self.prefix, name)
        offered, secret = 0, new_secret()
        for _ in range(3):
            sent_at = time.monotonic()
            args = [holder, ms(ttl), offered, MAX_COUNTER, secret]
            code, value = self._run("acquire", [keys.lock, keys.fence], args)
            if code == Reply.OK:
                token = token_of(text(value))[0]
                return Grant(name, holder, token, ttl, sent_at, expires(ttl), secret=secret)
            if code == Reply.BUSY:
                return None
            offered = self.epochs.bump_fence(self.epoch_resource, int(value) + 1)
            if offered > MAX_EPOCH:
                raise FencingUnavailable(self.alias, "the epoch counter is exhausted")
        raise FencingUnavailable(self.alias, f"no stable epoch for {name!r} after 3 tries")

    def renew(self, grant: Grant, ttl: float) -> Grant:
        keys = LeaseKeys.of(self.prefix, grant.name)
        sent_at = time.monotonic()
        code = self._run("renew", [keys.lock], [*owner_args(grant), ms(ttl)])
        if code != Reply.OK:
            raise refusal(grant, code, "renewal")
        return replace(grant, ttl=ttl, sent_at=sent_at, expires_at=expires(ttl))

    def release(self, grant: Grant) -> None:
        keys = LeaseKeys.of(self.prefix, grant.name)
        code = self._run("release", [keys.lock, keys.wake], [*owner_args(grant), WAKE_TTL_MS])
        if code != Reply.OK:
            raise refusal(grant, code, "release")

    def wait_for_release(self, name: str, timeout: float) -> bool:
        """``BLPOP`` the name's wake-up list: one blocked request, no polling.

        A release between the caller's failed try and this wait is not missed: its wake-up
        waits in the list. A holder that dies without releasing wakes nobody; the caller's
        backoff (capped, a fraction of a second) bounds how long its expiry goes unnoticed.
        """
        if timeout < 0.001:  # nothing to wait for
            return False
        with edge(self.alias, "wait"):
            return blpop(self.client, LeaseKeys.of(self.prefix, name).wake, timeout) is not None

    def inspect(self, name: str) -> LeaseInfo | None:
        keys = LeaseKeys.of(self.prefix, name)
        pipe = self.client.pipeline(transaction=False)
        pipe.get(keys.lock).pttl(keys.lock).hmget(keys.fence, "epoch", "counter")
        with edge(self.alias, "inspect"):
            value, pttl, (epoch, counter) = pipe.execute()
        if value is not None:
            token, holder = token_of(text(value))
            at = expires(pttl / 1000) if pttl > 0 else None
            return LeaseInfo(name, holder, token, True, self.alias, expires_at=at)
        if epoch is None or counter is None:
            return None
        return LeaseInfo(name, "", _token(epoch, counter), False, self.alias)

    def inspect_all(self) -> list[LeaseInfo]:
        """Every name with a counter, by ``SCAN`` (never ``KEYS``): operators' views only."""
        with edge(self.alias, "inspect_all"):
            found = {
                LeaseKeys.name_of(self.prefix, text(key))
                for key in self.client.scan_iter(match=f"{self.prefix}{{*}}:fence", count=1000)
            }
        infos = (self.inspect(name) for name in sorted(found))
        return [info for info in infos if info is not None]

    def force_release(self, name: str, token: int) -> LeaseInfo:
        """Compare-and-revoke in one script: the stored counter decides, not a read before."""
        keys = LeaseKeys.of(self.prefix, name)
        epoch, counter = token >> COUNTER_BITS, token & MAX_COUNTER
        args = [epoch, counter, WAKE_TTL_MS, f"{epoch}:{counter}:"]
        code, epoch, counter = self._run("force_release", [keys.lock, keys.wake, keys.fence], args)
        if code != Reply.OK:
            current = None if epoch is None or counter is None else _token(epoch, counter)
            raise LeaseNotHeld(name, not_revoked(token, current))
        return LeaseInfo(name, "", _token(epoch, counter), False, self.alias)

    def deploy_checks(self) -> list[str]:
        return eviction_problems(self.alias, self.client)

    def close(self) -> None:
        with self._lock:
            client, self._client, self._scripts = self._client, None, {}
        if client is not None and self.options.get("URL") is not None:
            client.close()
        self.epochs.close()
