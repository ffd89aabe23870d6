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
value ``epoch:counter:sha1(secret):holder``, expiring by Redis's clock), ``:fence`` (the name's
counter, no TTL) and ``:wake`` (a list a release pushes to, so a waiter's ``BLPOP`` wakes
without polling).
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

import asyncio
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..errors import FencingUnavailable, LeaseLost, LeaseNotHeld
from ._aio import PerLoop
from ._counter import DurableCounter
from ._redis_io import (
    Edge,
    ablpop,
    aconnect,
    blpop,
    cache_problems,
    connect,
    eviction_problems,
    expires,
    ms,
    positive_problems,
    prefix_problems,
    text,
    url_problems,
)
from ._redis_scripts import RELEASE_LUA, RENEW_LUA, WAKE_TTL_MS, LeaseKeys, Reply, lua
from ._redis_shared import (
    GROUP,
    NEXT_GRANT_LUA,
    SHARED_ACQUIRE_LUA,
    SHARED_RELEASE_LUA,
    SHARED_RENEW_LUA,
    STOP_READERS_LUA,
    WRITER_INTENT_MS,
)
from ._redis_waiters import WaitClock, label, waiters
from .base import (
    FORGED,
    Capability,
    Grant,
    LeaseBackend,
    LeaseInfo,
    LeaseWaiter,
    new_secret,
    not_revoked,
)

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


#: KEYS[1] lock, KEYS[2] fence. ARGV[1] holder, ARGV[2] ttl ms, ARGV[3] offered epoch (0: none
#: yet), ARGV[4] counter limit (a counter there needs a new epoch), ARGV[5] the grant's secret.
#: The value is ``epoch:counter:sha1(secret):holder``: Redis never holds the secret itself.
#: Returns {OK, value} | {BUSY, value} | {NEED_EPOCH, stored epoch}.
ACQUIRE_LUA = lua(
    """
if redis.replicate_commands then
  redis.replicate_commands()  -- Redis < 5: allow writes after INFO (no-op since 5)
end
local current = redis.call('GET', KEYS[1])
if current then
  return {BUSY, current}
end
"""
    + NEXT_GRANT_LUA
    + """
local value = string.format('%d:%d:%s:%s', epoch, counter, redis.sha1hex(ARGV[5]), ARGV[1])
redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2])
return {OK, value}
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


def _acquired(reply: Any, attempt: Grant) -> Grant | int | None:
    """What an acquire script's reply means: the grant, ``None`` (held by someone else), or
    the stored epoch when the script asks for a new one."""
    code, value = reply
    if code == Reply.OK:
        token = token_of(text(value))[0]
        return replace(attempt, token=token, expires_at=expires(attempt.ttl))
    if code == Reply.BUSY:
        return None
    return int(value)


#: The end of a readers' group's lock value (see :mod:`._redis_shared`).
_MARK = f"::{GROUP}"


def _reader_args(grant: Grant) -> list[object]:
    """A reader's key among the group's entries (``epoch:counter``), holder and secret."""
    return [
        f"{grant.token >> COUNTER_BITS}:{grant.token & MAX_COUNTER}",
        grant.holder,
        grant.secret,
    ]


def _renew_call(prefix: str, grant: Grant, ttl: float) -> tuple[list[str], list[object]]:
    return [LeaseKeys.of(prefix, grant.name).lock], [*owner_args(grant), ms(ttl)]


def _release_call(prefix: str, grant: Grant) -> tuple[list[str], list[object]]:
    keys = LeaseKeys.of(prefix, grant.name)
    return [keys.lock, keys.wake], [*owner_args(grant), WAKE_TTL_MS]


def _renewed(grant: Grant, ttl: float, sent_at: float, code: object) -> Grant:
    if code != Reply.OK:
        raise refusal(grant, code, "renewal")
    return replace(grant, ttl=ttl, sent_at=sent_at, expires_at=expires(ttl))


def _released(grant: Grant, code: object) -> None:
    if code != Reply.OK:
        raise refusal(grant, code, "release")


class Backend(LeaseBackend):
    """Leases on one Redis server (or cluster) reached through django-redis or a URL."""

    capabilities = frozenset(
        {
            Capability.NATIVE_FENCING,
            Capability.WAIT_WITHOUT_POLLING,
            Capability.FORCE_RELEASE,
            Capability.SHARED_LEASES,
        }
    )

    known_options = frozenset(
        {"CACHE", "URL", "CLUSTER", "PREFIX", "EPOCH_DATABASE", "SOCKET_TIMEOUT"}
    )

    @classmethod
    def check_options(cls, alias: str, options: Mapping[str, Any]) -> list[str]:
        """Also: exactly one of ``CACHE`` (a django-redis alias in ``CACHES``) and ``URL``
        (well formed), a usable ``PREFIX`` and a positive ``SOCKET_TIMEOUT``."""
        problems = super().check_options(alias, options)
        cache, url = options.get("CACHE"), options.get("URL")
        if (cache is None) == (url is None):
            problems.append(
                f'LEASES["BACKENDS"][{alias!r}] needs exactly one of "CACHE" (a django-redis '
                'cache alias) or "URL"'
            )
        elif cache is not None:
            problems += cache_problems(alias, "CACHE", cache)
        else:
            problems += url_problems(alias, "URL", str(url))
        problems += prefix_problems(alias, options.get("PREFIX", "leases:"))
        problems += positive_problems(alias, "SOCKET_TIMEOUT", options.get("SOCKET_TIMEOUT", 5.0))
        return problems

    @classmethod
    def databases(cls, options: Mapping[str, Any]) -> frozenset[str]:
        """Where the epochs come from (see the module's docstring)."""
        return frozenset({str(options.get("EPOCH_DATABASE", "default"))})

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.prefix: str = options.get("PREFIX", "leases:")
        (epochs,) = self.databases(options)
        self.epochs = DurableCounter(alias, epochs)
        self.epoch_resource = f"leases.redis-epoch:{self.prefix}"
        self._lock = threading.Lock()
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        self._waits = WaitClock()
        self._async: PerLoop[tuple[Any, dict[str, Any]]] = PerLoop(
            self._aclient, lambda made: made[0].aclose()
        )

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
                    "shared_acquire": client.register_script(SHARED_ACQUIRE_LUA),
                    "shared_renew": client.register_script(SHARED_RENEW_LUA),
                    "shared_release": client.register_script(SHARED_RELEASE_LUA),
                    "stop_readers": client.register_script(STOP_READERS_LUA),
                }
                self._client = client
            return self._client

    def _run(self, script: str, keys: list[str], args: list[object]) -> Any:
        client = self.client
        with Edge(self.alias, script):
            return self._scripts[script](keys=keys, args=args, client=client)

    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        keys = LeaseKeys.of(self.prefix, name)
        return self._acquire("acquire", name, holder, ttl, [keys.lock, keys.fence], [])

    def try_acquire_shared(self, name: str, holder: str, ttl: float) -> Grant | None:
        """Join or start the readers' group of ``name`` (see :mod:`._redis_shared`)."""
        keys = LeaseKeys.of(self.prefix, name)
        lua_keys = [keys.lock, keys.fence, keys.readers, keys.writer]
        return self._acquire("shared_acquire", name, holder, ttl, lua_keys, [_MARK])

    def _acquire(
        self,
        script: str,
        name: str,
        holder: str,
        ttl: float,
        keys: list[str],
        extra: list[object],
    ) -> Grant | None:
        """Run an acquire script, taking a new epoch from the database when it asks."""
        offered, secret = 0, new_secret()
        shared = {"shared": True} if script == "shared_acquire" else {}
        for _ in range(3):
            sent_at = time.monotonic()
            args = [holder, ms(ttl), offered, MAX_COUNTER, secret, *extra]
            reply = self._run(script, keys, args)
            attempt = Grant(name, holder, 0, ttl, sent_at, extra=shared, secret=secret)
            outcome = _acquired(reply, attempt)
            if not isinstance(outcome, int):
                return outcome
            offered = self._next_epoch(outcome)
        raise FencingUnavailable(self.alias, f"no stable epoch for {name!r} after 3 tries")

    def stop_new_readers(self, name: str) -> None:
        keys = LeaseKeys.of(self.prefix, name)
        self._run("stop_readers", [keys.lock, keys.writer], [_MARK, WRITER_INTENT_MS])

    def _next_epoch(self, stored: int) -> int:
        """A new epoch above ``stored``, from the database (see the module's docstring)."""
        offered = self.epochs.bump_fence(self.epoch_resource, stored + 1)
        if offered > MAX_EPOCH:
            raise FencingUnavailable(self.alias, "the epoch counter is exhausted")
        return offered

    def renew(self, grant: Grant, ttl: float) -> Grant:
        sent_at = time.monotonic()
        if grant.extra.get("shared"):
            keys = LeaseKeys.of(self.prefix, grant.name)
            args = [*_reader_args(grant), ms(ttl), _MARK]
            return _renewed(
                grant, ttl, sent_at, self._run("shared_renew", [keys.lock, keys.readers], args)
            )
        return _renewed(
            grant, ttl, sent_at, self._run("renew", *_renew_call(self.prefix, grant, ttl))
        )

    def release(self, grant: Grant) -> None:
        if grant.extra.get("shared"):
            keys = LeaseKeys.of(self.prefix, grant.name)
            args = [*_reader_args(grant), _MARK, WAKE_TTL_MS]
            _released(
                grant, self._run("shared_release", [keys.lock, keys.readers, keys.wake], args)
            )
            return
        _released(grant, self._run("release", *_release_call(self.prefix, grant)))

    def wait_for_release(self, name: str, timeout: float) -> bool:
        """``BLPOP`` the name's wake-up list: one blocked request, no polling.

        A release between the caller's failed try and this wait is not missed: its wake-up
        waits in the list. A holder that dies without releasing wakes nobody; the caller's
        backoff (capped, a fraction of a second) bounds how long its expiry goes unnoticed.
        """
        if timeout < 0.001:  # nothing to wait for
            return False
        wake = LeaseKeys.of(self.prefix, name).wake
        named = label(wake, self._waits.since(name, timeout))
        with Edge(self.alias, "wait"):
            return blpop(self.client, wake, timeout, named) is not None

    # -- async: the same scripts through redis.asyncio, one client per event loop ---------

    async def atry_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        """:meth:`try_acquire` over ``redis.asyncio``; the rare new epoch (a database
        statement, after a Redis restart or failover) is taken on a worker thread."""
        keys = LeaseKeys.of(self.prefix, name)
        offered, secret = 0, new_secret()
        for _ in range(3):
            sent_at = time.monotonic()
            args = [holder, ms(ttl), offered, MAX_COUNTER, secret]
            reply = await self._arun("acquire", [keys.lock, keys.fence], args)
            outcome = _acquired(reply, Grant(name, holder, 0, ttl, sent_at, secret=secret))
            if not isinstance(outcome, int):
                return outcome
            offered = await asyncio.to_thread(self._next_epoch, outcome)
        raise FencingUnavailable(self.alias, f"no stable epoch for {name!r} after 3 tries")

    async def arenew(self, grant: Grant, ttl: float) -> Grant:
        if grant.extra.get("shared"):  # shared leases are taken by sync code only, so far
            return await super().arenew(grant, ttl)
        sent_at = time.monotonic()
        reply = await self._arun("renew", *_renew_call(self.prefix, grant, ttl))
        return _renewed(grant, ttl, sent_at, reply)

    async def arelease(self, grant: Grant) -> None:
        if grant.extra.get("shared"):
            return await super().arelease(grant)
        _released(grant, await self._arun("release", *_release_call(self.prefix, grant)))

    async def await_for_release(self, name: str, timeout: float) -> bool:
        if timeout < 0.001:
            return False
        client, _ = self._async.get()
        wake = LeaseKeys.of(self.prefix, name).wake
        named = label(wake, self._waits.since(name, timeout))
        with Edge(self.alias, "wait"):
            return await ablpop(client, wake, timeout, named) is not None

    async def aclose(self) -> None:
        await self._async.aclose()

    def _aclient(self) -> tuple[Any, dict[str, Any]]:
        """A ``redis.asyncio`` client for the running loop, with its own scripts."""
        options = self.options
        client = aconnect(
            self.alias,
            options.get("CACHE"),
            options.get("URL"),
            float(options.get("SOCKET_TIMEOUT", 5.0)),
            cluster=bool(options.get("CLUSTER", False)),
        )
        scripts = {
            "acquire": client.register_script(ACQUIRE_LUA),
            "renew": client.register_script(RENEW_LUA),
            "release": client.register_script(RELEASE_LUA),
        }
        return client, scripts

    async def _arun(self, script: str, keys: list[str], args: list[object]) -> Any:
        client, scripts = self._async.get()
        with Edge(self.alias, script):
            return await scripts[script](keys=keys, args=args, client=client)

    def inspect(self, name: str) -> LeaseInfo | None:
        keys = LeaseKeys.of(self.prefix, name)
        pipe = self.client.pipeline(transaction=False)
        pipe.get(keys.lock).pttl(keys.lock).hmget(keys.fence, "epoch", "counter")
        with Edge(self.alias, "inspect"):
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
        with Edge(self.alias, "inspect_all"):
            found = {
                LeaseKeys.name_of(self.prefix, text(key), "fence")
                for key in self.client.scan_iter(
                    match=LeaseKeys.pattern(self.prefix, "fence"), count=1000
                )
            }
        infos = (self.inspect(name) for name in sorted(found))
        return [info for info in infos if info is not None]

    def waiters(self) -> list[LeaseWaiter]:
        """The waits blocked on the server now (see ``_redis_waiters``); none on a cluster."""
        client = self.client
        if not hasattr(client, "connection_pool"):
            return []
        with Edge(self.alias, "waiters"):
            listed = client.client_list(_type="normal")
        kwargs = client.connection_pool.connection_kwargs
        where = f"redis {kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        return waiters(self.alias, self.prefix, listed, where)

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
