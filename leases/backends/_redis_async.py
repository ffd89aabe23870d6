"""The Redis backend's async round trips: the same scripts through ``redis.asyncio``.

One client per event loop (:class:`~leases.backends._aio.PerLoop`), and the same connection-level
sending and per-connection replication id as the blocking half (see
:mod:`~leases.backends._redis_conn`). Only :mod:`leases.backends.redis` uses this module: it is
that backend's ``atry_acquire``, ``arenew``, ``arelease`` and ``await_for_release``.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import redis

from .._pgdeadline import Deadline, aarmed
from ..errors import FencingUnavailable
from ._aio import PerLoop
from ._redis_conn import Script, arun_on_cluster, arun_script, server_run
from ._redis_io import Edge, ablpop, aconnect, read_timeout, text
from ._redis_kept import Kept, bounded, fileno
from ._redis_protocol import (
    TOKEN_SCRIPTS,
    ReadersSeen,
    Reservation,
    acquire_args,
    acquire_call,
    acquired,
    offer,
    release_call,
    released,
    renew_call,
    renewed,
    shared_release_call,
    shared_renew_call,
)
from ._redis_scripts import LeaseKeys
from ._redis_waiters import WaitClock, label
from .base import Grant, new_secret

__all__ = ["AsyncRedis", "Owner"]


class Owner(Protocol):
    """What :class:`AsyncRedis` reads and calls on the backend it serves
    (:class:`leases.backends.redis.Backend`).

    Named by what is used rather than by the backend's class: the backend module imports this
    one to make its async half, so naming its class here would tie the two modules in a loop.
    """

    alias: str
    prefix: str
    scripts: dict[str, Script]
    trust_server_id: float
    readers_seen: ReadersSeen
    waits: WaitClock

    def connect_options(self) -> dict[str, Any]: ...
    async def asource(self) -> str: ...
    async def anext_epoch(self, stored: int) -> int: ...


#: Per event loop: the client and (not on a Redis Cluster) the connections kept between round
#: trips.
_Client = tuple[Any, Kept | None]


async def _aclose(made: _Client) -> None:
    if made[1] is not None:
        await made[1].close()
    await made[0].aclose()


class AsyncRedis:
    """``backend``'s round trips on the running event loop."""

    def __init__(self, backend: Owner) -> None:
        self.backend = backend
        self._clients: PerLoop[_Client] = PerLoop(self._make, _aclose)
        options = backend.connect_options()
        self._timeout = read_timeout(options["cache"], options["socket_timeout"])

    def _make(self) -> _Client:
        """A ``redis.asyncio`` client for the running loop."""
        client = aconnect(**self.backend.connect_options())
        if hasattr(client, "connection_pool"):
            return client, Kept(client.connection_pool, self._timeout)
        return client, None

    async def run(self, script: str, keys: list[str], args: list[object]) -> Any:
        """:meth:`Backend._run <leases.backends.redis.Backend._run>` on the event loop; a
        round trip whose reply was not read to its end drops its connection."""
        client, kept = self._clients.get()
        with Edge(self.backend.alias, script):
            if kept is None:  # Redis Cluster: bounded in a task of its own
                call = arun_on_cluster(client, self.backend.scripts[script], keys, args)
                return await bounded(call, self._timeout, "no reply")
            return await self._on_connection(kept, script, keys, args)

    async def _on_connection(
        self, kept: Kept, script: str, keys: list[str], args: list[object]
    ) -> Any:
        """One script round trip on a kept connection (see ``_redis_conn`` and ``_redis_kept``).

        Bounded by cutting the connection's socket when no reply came in time (a
        :class:`~leases._pgdeadline.Deadline` on a timer of the loop), not by ``asyncio.timeout``:
        the round trip may run inside :func:`~leases._finishing.finish`, in the caller's
        task, whose cancellation is held back until the round trip ends. A new connection is
        bounded on its own (:meth:`Kept.take <._redis_kept.Kept.take>`, which a stalled loop
        cannot fail), and the reply gets the whole timeout from when the connection is there,
        as a Redlock node's round trip does (:class:`~._redis_kept.Bound`): charged to the
        reply, a stall of the loop while connecting left it no time at all, and its socket
        was cut before the loop read the reply the server had sent at once."""
        connection = await kept.take()
        due: Deadline | None = None
        try:
            due = Deadline(fileno(connection), self._timeout)
            with aarmed(due):
                lua = self.backend.scripts[script]
                if script not in TOKEN_SCRIPTS:
                    reply = await arun_script(connection, lua, keys, args)
                else:
                    known = server_run(connection)
                    sent = known.current(self.backend.trust_server_id)
                    reply = await arun_script(connection, lua, keys, [*args, sent])
                    known.learn(sent, text(reply[2]))
        except BaseException as exc:
            await kept.drop(connection)
            if due is not None and due.fired and isinstance(exc, (redis.RedisError, OSError)):
                raise redis.TimeoutError(f"no reply within {self._timeout} s") from exc
            raise
        await kept.give(connection)
        return reply

    async def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        keys, extra = acquire_call(self.backend.prefix, name)
        return await self.acquire("acquire", name, holder, ttl, keys, extra)

    async def acquire(
        self, script: str, name: str, holder: str, ttl: float, keys: list[str], extra: list[object]
    ) -> Grant | None:
        """The backend's ``_acquire`` on the event loop, a new epoch (a database statement: a
        name's first grant, or after a Redis restart or failover) included."""
        offered, secret, source = "0", new_secret(), await self.backend.asource()
        shared = {"shared": True} if script == "shared_acquire" else None
        for _ in range(3):
            sent_at = time.monotonic()
            args = acquire_args(holder, ttl, offered, secret, source, extra)
            reply = await self.run(script, keys, args)
            outcome = acquired(reply, name, holder, ttl, sent_at, secret, shared)
            if not isinstance(outcome, Reservation):
                if shared is None:
                    self.backend.readers_seen.note(name, reply)
                return outcome
            offered = offer(await self.backend.anext_epoch(outcome.stored), outcome)
        raise FencingUnavailable(self.backend.alias, f"no stable epoch for {name!r} after 3 tries")

    async def renew(self, grant: Grant, ttl: float) -> Grant:
        sent_at = time.monotonic()
        prefix = self.backend.prefix
        if grant.extra.get("shared"):
            reply = await self.run("shared_renew", *shared_renew_call(prefix, grant, ttl))
        else:
            reply = await self.run("renew", *renew_call(prefix, grant, ttl))
        return renewed(grant, ttl, sent_at, reply)

    async def release(self, grant: Grant) -> None:
        prefix = self.backend.prefix
        if grant.extra.get("shared"):
            reply = await self.run("shared_release", *shared_release_call(prefix, grant))
        else:
            reply = await self.run("release", *release_call(prefix, grant))
        released(grant, reply)

    async def wait_for_release(self, name: str, timeout: float) -> bool:
        if timeout < 0.001:
            return False
        client = self._clients.get()[0]
        wake = LeaseKeys.of(self.backend.prefix, name).wake
        named = label(wake, self.backend.waits.since(name, timeout))
        with Edge(self.backend.alias, "wait"):
            return await ablpop(client, wake, timeout, named) is not None

    async def aclose(self) -> None:
        await self._clients.aclose()
