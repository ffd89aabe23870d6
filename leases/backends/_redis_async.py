"""The Redis backend's async round trips: the same scripts through ``redis.asyncio``.

One client per event loop (:class:`~leases.backends._aio.PerLoop`), and the same connection-level
sending and per-connection replication id as the blocking half (see
:mod:`~leases.backends._redis_conn`). Only :mod:`leases.backends.redis` uses this module: it is
that backend's ``atry_acquire``, ``arenew``, ``arelease`` and ``await_for_release``.
"""

from __future__ import annotations

import asyncio
import select
import time
from typing import TYPE_CHECKING, Any

import redis

from ..errors import FencingUnavailable
from ._aio import PerLoop
from ._pgdeadline import Deadline, aarmed
from ._redis_conn import arun_script, server_run
from ._redis_io import Edge, ablpop, aconnect, name_back_due, read_timeout, text
from ._redis_protocol import (
    TOKEN_SCRIPTS,
    acquire_args,
    acquired,
    release_call,
    released,
    renew_call,
    renewed,
    shared_release_call,
    shared_renew_call,
)
from ._redis_scripts import LeaseKeys
from ._redis_waiters import label
from .base import Grant, new_secret

if TYPE_CHECKING:
    from .redis import Backend

__all__ = ["AsyncRedis"]

#: Per event loop: the client, (Redis Cluster only) its registered scripts, and (otherwise)
#: the connections kept between round trips.
_Client = tuple[Any, dict[str, Any], "_Kept | None"]


def _fileno(connection: Any) -> int:
    """The socket of a connected ``redis.asyncio`` connection (its stream's transport)."""
    sock = connection._writer.get_extra_info("socket")
    return int(sock.fileno())


def _stale(connection: Any) -> bool:
    """Whether a kept connection must not be used: closed, owed a name given back (see
    :func:`~._redis_io.name_back_due`: its next read would be a stale reply), or with
    something to read while idle (the server closed it, or sent what nobody asked for),
    buffered by the loop already or still in the socket (one ``select`` with no wait)."""
    reader = connection._reader
    if reader is None or name_back_due(connection):
        return True
    if reader.at_eof() or reader.exception() is not None or len(reader._buffer):
        return True
    try:
        return bool(select.select([_fileno(connection)], [], [], 0)[0])
    except (OSError, ValueError, AttributeError):
        return True


class _Kept:
    """Connections checked out of one ``redis.asyncio`` pool and kept between script round
    trips: the async twin of :class:`~._redis_conn.Connections`, for the same reason (the
    pool's checkout and check-in cost more client time than the loopback round trip).

    Only script round trips use them, each to its end (a reply not read to its end drops the
    connection), so a kept connection never holds a reply owed to anyone; one handed back
    owing a name, or with anything to read, is dropped rather than used (:func:`_stale`). A
    new connection comes from the pool in a task of its own: redis-py bounds connecting with
    ``asyncio.timeout``, which must cancel that task, never the caller's (see
    :mod:`leases._finishing`).
    """

    KEEP = 16

    __slots__ = ("_idle", "pool", "timeout")

    def __init__(self, pool: Any, timeout: float) -> None:
        self.pool = pool
        self.timeout = timeout
        self._idle: list[Any] = []

    async def take(self) -> Any:
        while self._idle:
            connection = self._idle.pop()
            if not _stale(connection):
                return connection
            await self.drop(connection)
        try:
            return await asyncio.wait_for(self.pool.get_connection(), self.timeout)
        except TimeoutError as exc:  # asyncio's: the client has no timeout of its own
            raise redis.TimeoutError(f"not connected within {self.timeout} s") from exc

    async def give(self, connection: Any) -> None:
        """Back from a round trip whose reply was read to its end."""
        if len(self._idle) < self.KEEP:
            self._idle.append(connection)
        else:
            await self.pool.release(connection)

    async def drop(self, connection: Any) -> None:
        """Disconnect (its reply unread, or stale) and hand it back to the pool."""
        await connection.disconnect(nowait=True)
        await self.pool.release(connection)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await self.pool.release(connection)


async def _aclose(made: _Client) -> None:
    if made[2] is not None:
        await made[2].close()
    await made[0].aclose()


class AsyncRedis:
    """``backend``'s round trips on the running event loop."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._clients: PerLoop[_Client] = PerLoop(self._make, _aclose)
        options = backend.connect_options()
        self._timeout = read_timeout(options["cache"], options["socket_timeout"])

    def _make(self) -> _Client:
        """A ``redis.asyncio`` client for the running loop (and a cluster client's scripts)."""
        client = aconnect(**self.backend.connect_options())
        if hasattr(client, "connection_pool"):
            return client, {}, _Kept(client.connection_pool, self._timeout)
        scripts = {name: client.register_script(s.text) for name, s in self.backend.scripts.items()}
        return client, scripts, None

    async def run(self, script: str, keys: list[str], args: list[object]) -> Any:
        """:meth:`Backend._run <leases.backends.redis.Backend._run>` on the event loop; a
        round trip whose reply was not read to its end drops its connection."""
        client, cluster, kept = self._clients.get()
        with Edge(self.backend.alias, script):
            if kept is None:  # Redis Cluster: bounded in a task of its own (wait_for)
                try:
                    call = cluster[script](keys=keys, args=args, client=client)
                    return await asyncio.wait_for(call, self._timeout)
                except TimeoutError as exc:  # the client has no read timeout of its own
                    raise redis.TimeoutError(f"no reply within {self._timeout} s") from exc
            return await self._on_connection(kept, script, keys, args)

    async def _on_connection(
        self, kept: _Kept, script: str, keys: list[str], args: list[object]
    ) -> Any:
        """One script round trip on a kept connection (see ``_redis_conn`` and :class:`_Kept`).

        Bounded by cutting the connection's socket when no reply came in time (a
        :class:`~._pgdeadline.Deadline` on a timer of the loop), not by ``asyncio.timeout``:
        the round trip may run inside :func:`~leases._finishing.finish`, in the caller's
        task, whose cancellation is held back until the round trip ends."""
        started = time.monotonic()
        connection = await kept.take()
        due: Deadline | None = None
        try:  # one bound for the whole round trip, connecting included
            due = Deadline(_fileno(connection), self._timeout - (time.monotonic() - started))
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
        keys = LeaseKeys.of(self.backend.prefix, name)
        return await self.acquire("acquire", name, holder, ttl, [keys.lock, keys.fence], [])

    async def acquire(
        self, script: str, name: str, holder: str, ttl: float, keys: list[str], extra: list[object]
    ) -> Grant | None:
        """The backend's ``_acquire`` on the event loop. The rare new epoch (a database
        statement, after a Redis restart or failover) is taken on a worker thread."""
        offered, secret = 0, new_secret()
        shared = {"shared": True} if script == "shared_acquire" else None
        for _ in range(3):
            sent_at = time.monotonic()
            args = acquire_args(holder, ttl, offered, secret, extra)
            reply = await self.run(script, keys, args)
            outcome = acquired(reply, name, holder, ttl, sent_at, secret, shared)
            if not isinstance(outcome, int):
                if shared is None:
                    self.backend.readers_seen.note(name, reply)
                return outcome
            offered = await asyncio.to_thread(self.backend.next_epoch, outcome)
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
        named = label(wake, self.backend._waits.since(name, timeout))
        with Edge(self.backend.alias, "wait"):
            return await ablpop(client, wake, timeout, named) is not None

    async def aclose(self) -> None:
        await self._clients.aclose()
