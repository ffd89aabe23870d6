"""Leases in Redis: ``SET NX PX`` inside Lua, one round trip per acquire, renew and release.

Configuration (``LEASES["BACKENDS"][alias]``)::

    {"ENGINE": "leases.backends.redis", "CACHE": "default"}       # a django-redis cache alias
    {"ENGINE": "leases.backends.redis", "URL": "redis://host:6379/0", "SOCKET_TIMEOUT": 1.0}

Options: ``CACHE`` or ``URL`` (one of them), ``PREFIX`` (default ``"leases:"``),
``EPOCH_DATABASE`` (the Django database alias epochs come from, default ``"default"``),
``SOCKET_TIMEOUT`` (seconds, ``URL`` only), ``CLUSTER`` (``True``: the URL names a node of
a Redis Cluster). A cache alias keeps its own connection settings (give it a socket timeout);
the scripts are sent on connections of its pool, never through redis-py's retrying command
path, so a timed-out release is not retried into a false "lost" (a ``URL`` client never
retries anything).

Keys of one name share a Redis Cluster hash tag, ``<prefix>{<name>}``: ``:lock`` (the grant,
value ``epoch:counter:sha1(secret):holder``, expiring by Redis's clock), ``:fence`` (the name's
counter, kept a day or ten TTLs after its latest grant: forgetting it costs a new epoch) and
``:wake`` (a list where a release leaves one wake-up, so a waiter's
``BLPOP`` wakes without polling; see :func:`~._redis_scripts.wake_lua`).
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
the next token is higher than every earlier one. The new epoch is installed only under a
reservation the refusal wrote in ``:fence``, which an install consumes and a wipe or restart
loses, so an epoch drawn before another client's and offered after Redis forgot the counter
is refused (see :data:`~._redis_shared.NEXT_GRANT_LUA`). The counter also names the epoch's
source (:meth:`Backend.source`): another project's epochs on the same Redis and ``PREFIX`` are
unrelated to ours, so its counter is not continued (its epoch still floors our new one). This
costs one extra database statement for the first grant of a name after such an event (and one
per process, for the source); if the database is unreachable then, the grant is refused with
:class:`~leases.errors.FencingUnavailable` instead of risking a repeated token.

Every acquire script reads the replication id (``INFO``, about 5 µs of server time, a few per
cent of an acquire + release on loopback) unless ``TRUST_SERVER_ID`` (seconds) lets a
connection remember the one it last learned: it forgets it when it reconnects (a restart or a
failover is always a new connection), after an error, and that many seconds after learning it
(:mod:`~leases.backends._redis_conn` says why only time bounds the rest: a server demoted,
resynced from a lagging replica and promoted again under an idle connection keeps the
connection). Each connection knows its own server: a process-wide memory could carry one
server's id to a failed-over successor that still holds the counters it replicated.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..errors import BackendUnavailable, FencingUnavailable, LeaseNotHeld
from ._counter import DurableCounter
from ._options import seconds_problems
from ._redis_async import AsyncRedis
from ._redis_conn import Connections, Script, run_on_cluster, run_script, server_run
from ._redis_io import (
    BLPOP_WAIT,
    POOL,
    Edge,
    blpop,
    cache_problems,
    connect,
    eviction_problems,
    expires,
    permission_problems,
    pool_problems,
    prefix_problems,
    text,
    url_problems,
)
from ._redis_protocol import (
    ACQUIRE_LUA,
    COUNTER_BITS,
    FORCE_RELEASE_LUA,
    MARK,
    MAX_COUNTER,
    MAX_EPOCH,
    TOKEN_SCRIPTS,
    ReadersSeen,
    Reservation,
    acquire_args,
    acquire_call,
    acquired,
    epoch_source,
    offer,
    owner_args,
    pack_token,
    release_call,
    released,
    renew_call,
    renewed,
    shared_acquire_keys,
    shared_release_call,
    shared_renew_call,
    stamp_next_try,
    stop_readers_call,
    token_of,
)
from ._redis_scripts import RELEASE_LUA, RENEW_LUA, WAKE_TTL_MS, KeyKind, LeaseKeys, Reply, lua
from ._redis_shared import (
    SHARED_ACQUIRE_LUA,
    SHARED_RELEASE_LUA,
    SHARED_RENEW_LUA,
    STOP_READERS_LUA,
)
from ._redis_waiters import WaitClock, label, waiters
from .base import (
    LIST_BATCH,
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
    "COUNTER_BITS",
    "FORCE_RELEASE_LUA",
    "MAX_COUNTER",
    "MAX_EPOCH",
    "RELEASE_LUA",
    "RENEW_LUA",
    "Backend",
    "LeaseKeys",
    "Reply",
    "lua",
    "owner_args",
    "token_of",
]

#: The scripts by the name :meth:`Backend._run` is given.
SCRIPTS = {
    "acquire": ACQUIRE_LUA,
    "renew": RENEW_LUA,
    "release": RELEASE_LUA,
    "force_release": FORCE_RELEASE_LUA,
    "shared_acquire": SHARED_ACQUIRE_LUA,
    "shared_renew": SHARED_RENEW_LUA,
    "shared_release": SHARED_RELEASE_LUA,
    "stop_readers": STOP_READERS_LUA,
}

#: How many name counters under ``PREFIX`` ``check --deploy`` reads for another project's
#: epochs (:meth:`Backend._foreign_counters`): another project sharing the prefix stamps the
#: counter of every name it grants, so a sample shows it, at a bounded cost.
SOURCE_SAMPLE = 100


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
    wait_at_least = BLPOP_WAIT

    known_options = frozenset(
        {"CACHE", "URL", "CLUSTER", "PREFIX", "EPOCH_DATABASE", "SOCKET_TIMEOUT", "TRUST_SERVER_ID"}
    )

    @classmethod
    def check_options(cls, alias: str, options: Mapping[str, Any]) -> list[str]:
        """Also: exactly one of ``CACHE`` (a django-redis alias in ``CACHES``) and ``URL``
        (well formed), a usable ``PREFIX``, a positive ``SOCKET_TIMEOUT`` and a
        ``TRUST_SERVER_ID`` of zero or more seconds (see :mod:`._redis_conn`)."""
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
            cluster = options.get("CLUSTER", False) is True
            problems += url_problems(alias, "URL", str(url), cluster=cluster)
        problems += prefix_problems(alias, options.get("PREFIX", "leases:"))
        problems += seconds_problems(alias, "SOCKET_TIMEOUT", options.get("SOCKET_TIMEOUT", 5.0))
        if not isinstance(options.get("CLUSTER", False), bool):
            problems.append(f'LEASES["BACKENDS"][{alias!r}]["CLUSTER"] must be True or False')
        trust = options.get("TRUST_SERVER_ID", 0)
        problems += seconds_problems(alias, "TRUST_SERVER_ID", trust, zero=True)
        return problems

    @classmethod
    def check_limits(cls, alias: str, options: Mapping[str, Any]) -> list[str]:
        """A ``CACHE`` whose pool is too small for the sync traffic (see
        :func:`~._redis_io.pool_problems`); a ``URL`` client's pool is ours."""
        cache = options.get("CACHE")
        return [] if cache is None else pool_problems(alias, "CACHE", str(cache))

    @classmethod
    def databases(cls, options: Mapping[str, Any]) -> frozenset[str]:
        """Where the epochs come from (see the module's docstring)."""
        return frozenset({str(options.get("EPOCH_DATABASE", "default"))})

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.prefix: str = options.get("PREFIX", "leases:")
        #: Seconds a connection may reuse the replication id it learned (0: read it per acquire).
        self.trust_server_id = float(options.get("TRUST_SERVER_ID", 0))
        (epochs,) = self.databases(options)
        self.epochs = DurableCounter(alias, epochs)
        self.epoch_resource = f"leases.redis-epoch:{self.prefix}"
        #: Which database and row the epochs come from (see :meth:`source`), once known.
        self._source: str | None = None
        self.scripts = {name: Script(lua_text) for name, lua_text in SCRIPTS.items()}
        self._lock = threading.Lock()
        self._client: Any = None
        #: The connections scripts run on, kept between round trips (not on a cluster).
        self._connections: Connections | None = None
        self.waits = WaitClock()
        #: Per name, whether the latest exclusive try that found it held found readers there
        #: (see :meth:`stop_new_readers`).
        self.readers_seen = ReadersSeen()
        self._async = AsyncRedis(self)

    def connect_options(self) -> dict[str, Any]:
        """What :func:`~leases.backends._redis_io.connect` (and its async twin) are given."""
        options = self.options
        return {
            "alias": self.alias,
            "cache": options.get("CACHE"),
            "url": options.get("URL"),
            "socket_timeout": float(options.get("SOCKET_TIMEOUT", 5.0)),
            "cluster": bool(options.get("CLUSTER", False)),
        }

    @property
    def client(self) -> Any:
        """The redis-py client, made on first use (never at import). A URL client's pool
        allows :data:`~._redis_io.POOL` connections: with redis-py's default of 100, the
        101st thread waiting on the server (each ``BLPOP`` holds a connection) failed at once
        (a django-redis cache alias keeps its own pool and limit)."""
        with self._lock:
            if self._client is None:
                client = connect(**self.connect_options(), max_connections=POOL)
                if hasattr(client, "connection_pool"):  # not Redis Cluster (see _run)
                    self._connections = Connections(client.connection_pool)
                self._client = client
            return self._client

    def _run(self, script: str, keys: list[str], args: list[object]) -> Any:
        """One round trip: ``script`` on a pooled connection checked out here.

        The acquire script is given the replication id the connection knows (see
        :mod:`~leases.backends._redis_conn`) and tells which one it used. A Redis Cluster
        client gives none, so every acquire there reads it (one ``INFO`` on the node).
        """
        client = self._client or self.client
        with Edge(self.alias, script):
            if not hasattr(client, "connection_pool"):  # Redis Cluster
                return run_on_cluster(client, self.scripts[script], keys, args)
            connections = self._connections
            assert connections is not None
            connection = connections.take()
            try:
                if script not in TOKEN_SCRIPTS:
                    return run_script(connection, self.scripts[script], keys, args)
                known = server_run(connection)
                sent = known.current(self.trust_server_id)
                reply = run_script(connection, self.scripts[script], keys, [*args, sent])
                known.learn(sent, text(reply[2]))
                return reply
            except BaseException:
                connection.disconnect()  # and so forget what it knew of its server
                raise
            finally:
                connections.give(connection)

    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        return self._acquire("acquire", name, holder, ttl, *acquire_call(self.prefix, name))

    def try_acquire_shared(self, name: str, holder: str, ttl: float) -> Grant | None:
        """Join or start the readers' group of ``name`` (see :mod:`._redis_shared`)."""
        keys = shared_acquire_keys(self.prefix, name)
        return self._acquire("shared_acquire", name, holder, ttl, keys, [MARK])

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
        offered, secret, source = "0", new_secret(), self.source()
        shared = {"shared": True} if script == "shared_acquire" else None
        for _ in range(3):
            sent_at = time.monotonic()
            args = acquire_args(holder, ttl, offered, secret, source, extra)
            reply = self._run(script, keys, args)
            outcome = acquired(reply, name, holder, ttl, sent_at, secret, shared)
            if not isinstance(outcome, Reservation):
                if shared is None:
                    self.readers_seen.note(name, reply)
                return outcome
            offered = offer(self.next_epoch(outcome.stored), outcome)
        raise FencingUnavailable(self.alias, f"no stable epoch for {name!r} after 3 tries")

    def stop_new_readers(self, name: str) -> bool:
        """Stop new readers. If the latest exclusive try found ``name`` held by an exclusive
        grant, readers cannot join that, but would start a group the moment it is released:
        the waiter's next try carries the stop sign (:func:`acquire_call`), so waiting for a
        name costs no round trip beyond the tries and waits while no reader holds it."""
        if self.readers_seen.none(name):
            stamp_next_try(self.prefix, name)
            return True
        self._run("stop_readers", *stop_readers_call(self.prefix, name))
        return True

    def source(self) -> str:
        """Which epochs this backend's counters are stamped with (:func:`epoch_source`): read
        from the epoch database once, by the first acquire (the first grant of a name takes an
        epoch from there anyway)."""
        source = self._source
        if source is None:
            source = self._source = epoch_source(self.epochs.source(), self.epoch_resource)
        return source

    async def asource(self) -> str:
        """:meth:`source`, read on the event loop's own database connection."""
        source = self._source
        if source is None:
            database = await self.epochs.asource()
            source = self._source = epoch_source(database, self.epoch_resource)
        return source

    def next_epoch(self, stored: int) -> int:
        """A new epoch above ``stored``, from the database (see the module's docstring)."""
        return self._usable_epoch(self.epochs.bump_fence(self.epoch_resource, stored + 1))

    async def anext_epoch(self, stored: int) -> int:
        """:meth:`next_epoch`, awaited on the event loop's own database connection (the same
        statement, row, reply deadline and errors), not on a worker thread: every new name's
        first grant takes one, so it is no rarer than the first acquire of a name."""
        return self._usable_epoch(await self.epochs.abump_fence(self.epoch_resource, stored + 1))

    def _usable_epoch(self, offered: int) -> int:
        if offered > MAX_EPOCH:
            raise FencingUnavailable(self.alias, "the epoch counter is exhausted")
        return offered

    def renew(self, grant: Grant, ttl: float) -> Grant:
        sent_at = time.monotonic()
        if grant.extra.get("shared"):
            reply = self._run("shared_renew", *shared_renew_call(self.prefix, grant, ttl))
            return renewed(grant, ttl, sent_at, reply)
        return renewed(
            grant, ttl, sent_at, self._run("renew", *renew_call(self.prefix, grant, ttl))
        )

    def release(self, grant: Grant) -> None:
        if grant.extra.get("shared"):
            released(grant, self._run("shared_release", *shared_release_call(self.prefix, grant)))
            return
        released(grant, self._run("release", *release_call(self.prefix, grant)))

    def wait_for_release(self, name: str, timeout: float) -> bool:
        """``BLPOP`` the name's wake-up list: one blocked request, no polling.

        A release between the caller's failed try and this wait is not missed: its wake-up
        waits in the list. A holder that dies without releasing wakes nobody; the caller's
        backoff (capped, a fraction of a second) bounds how long its expiry goes unnoticed.
        """
        if timeout < 0.001:  # nothing to wait for
            return False
        wake = LeaseKeys.of(self.prefix, name).wake
        named = label(wake, self.waits.since(name, timeout))
        with Edge(self.alias, "wait"):
            return blpop(self.client, wake, timeout, named) is not None

    # -- async: the same scripts through redis.asyncio (leases/backends/_redis_async.py) ---

    async def atry_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        return await self._async.try_acquire(name, holder, ttl)

    async def atry_acquire_shared(self, name: str, holder: str, ttl: float) -> Grant | None:
        keys = shared_acquire_keys(self.prefix, name)
        return await self._async.acquire("shared_acquire", name, holder, ttl, keys, [MARK])

    async def astop_new_readers(self, name: str) -> bool:
        if self.readers_seen.none(name):
            stamp_next_try(self.prefix, name)  # in this task's context, as its try reads it
            return True
        await self._async.run("stop_readers", *stop_readers_call(self.prefix, name))
        return True

    async def arenew(self, grant: Grant, ttl: float) -> Grant:
        return await self._async.renew(grant, ttl)

    async def arelease(self, grant: Grant) -> None:
        await self._async.release(grant)

    async def await_for_release(self, name: str, timeout: float) -> bool:
        return await self._async.wait_for_release(name, timeout)

    async def aclose(self) -> None:
        """The running loop's Redis client and epoch connection."""
        try:
            await self._async.aclose()
        finally:
            await self.epochs.aclose()

    def inspect(self, name: str) -> LeaseInfo | None:
        with Edge(self.alias, "inspect"):
            return self._inspected([name])[0]

    def _inspected(self, names: list[str]) -> list[LeaseInfo | None]:
        """What :meth:`inspect` says of each of ``names``, in one pipelined round trip."""
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            keys = LeaseKeys.of(self.prefix, name)
            pipe.get(keys.lock).pttl(keys.lock).hmget(keys.fence, "epoch", "counter")
        replies = pipe.execute()
        return [self._info(name, *replies[3 * i : 3 * i + 3]) for i, name in enumerate(names)]

    def _info(self, name: str, value: Any, pttl: int, fence: list[Any]) -> LeaseInfo | None:
        if value is not None:
            token, holder = token_of(text(value))
            at = expires(pttl / 1000) if pttl > 0 else None
            return LeaseInfo(name, holder, token, True, self.alias, expires_at=at)
        epoch, counter = fence
        if epoch is None or counter is None:
            return None
        return LeaseInfo(name, "", pack_token(epoch, counter), False, self.alias)

    def probe(self, name: str) -> None:
        """Redis and the epoch database: a name with no epoch in Redis yet (every new name,
        every name after Redis forgot its keys) is granted only after the database gives one,
        which :meth:`inspect` never asks it for."""
        self.inspect(name)
        problems = permission_problems(self.alias, self.client)
        if problems:
            raise BackendUnavailable(self.alias, problems[0])
        self.epochs.ping()

    def inspect_all(self) -> list[LeaseInfo]:
        """Every name with a counter or a grant, by ``SCAN`` (never ``KEYS``): operators' views
        only. Grants too: one held longer than its counter is kept has only its lock.

        One pass over the keyspace for both kinds (``SCAN MATCH`` reads every key of the
        database and filters after, so a pass per kind read a cache's millions of keys twice),
        then the names inspected :data:`~.base.LIST_BATCH` to a pipelined round trip (one trip
        a name made a page of a few thousand leases take seconds)."""
        kinds: tuple[KeyKind, ...] = ("fence", "lock")
        with Edge(self.alias, "inspect_all"):
            found = {
                name
                for key in self.client.scan_iter(
                    match=LeaseKeys.any_pattern(self.prefix), count=1000
                )
                if (name := LeaseKeys.name_if(self.prefix, text(key), kinds)) is not None
            }
            names = sorted(found)
            infos = [
                info
                for start in range(0, len(names), LIST_BATCH)
                for info in self._inspected(names[start : start + LIST_BATCH])
            ]
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
            current = None if epoch is None or counter is None else pack_token(epoch, counter)
            raise LeaseNotHeld(name, not_revoked(token, current))
        return LeaseInfo(name, "", pack_token(epoch, counter), False, self.alias)

    def store_checks(self) -> list[str]:
        return eviction_problems(self.alias, self.client)

    def deploy_checks(self) -> list[str]:
        """Reachable, and the user may run what every acquire runs (see
        :func:`~._redis_io.permission_problems`)."""
        with Edge(self.alias, "deploy check"):
            self.client.ping()
        return permission_problems(self.alias, self.client)

    def deploy_advice(self) -> list[str]:
        """No other project's counters under ``PREFIX`` (:meth:`_foreign_counters`)."""
        return self._foreign_counters()

    def _foreign_counters(self) -> list[str]:
        """A warning when name counters under ``PREFIX`` carry epochs of another source
        (:meth:`source`) than ours, from a sample of :data:`SOURCE_SAMPLE` found by ``SCAN``.

        Another project on this Redis with the same ``PREFIX`` shares every name's lock with
        this one, and each grant after one of its own draws a new epoch: it works, so nothing
        else says so. The other cause, this database restored into a new cluster, fades as
        names are granted again (their counters take the new source)."""
        pattern = LeaseKeys.pattern(self.prefix, "fence")
        with Edge(self.alias, "deploy check"):
            found = self.client.scan_iter(match=pattern, count=1000)  # (Redis's default: 10)
            keys = list(itertools.islice(found, SOURCE_SAMPLE))
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hget(key, "source")
            stamps = [text(stamp) for stamp in pipe.execute() if stamp]
        if not stamps:  # nothing to compare: the epoch database need not be asked
            return []
        ours = self.source()
        foreign = sum(stamp != ours for stamp in stamps)
        if not foreign:
            return []
        return [
            f"{foreign} of {len(keys)} name counters read under PREFIX {self.prefix!r} carry "
            "epochs of another database: another project using this Redis with the same "
            "PREFIX shares every name's lock with this one, and each grant after one of its "
            "own draws a new epoch. Give each project its own PREFIX. (After this database "
            "was restored into a new cluster, this fades as names are granted again.)"
        ]

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            connections, self._connections = self._connections, None
        if connections is not None:
            connections.close()
        if client is not None and self.options.get("URL") is not None:
            client.close()
        self.epochs.close()
