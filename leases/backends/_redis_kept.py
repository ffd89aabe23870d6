"""``redis.asyncio`` connections kept between round trips, for both async Redis backends.

Checking a connection out of a ``redis.asyncio`` pool and back in costs more client time (and
event-loop turns: the pool's lock) than the loopback round trip it serves, so the async Redis
backend and the async Redlock (one :class:`Kept` per node) keep the connections they checked
out: the async twin of :class:`~._redis_conn.Connections`. Only :mod:`~._redis_async` and
:mod:`~._redlock_async` use this module.

The rule that makes keeping safe: a kept connection only ever serves round trips read to their
end. Any error, timeout or cancellation before the reply was read drops the connection
(disconnected, never used again), so a reply that arrives late can never be read as the answer
to a later command; one handed back owing a reply, or with anything to read while idle (the
server closed it, or sent what nobody asked for), is dropped rather than used (:func:`stale`).
"""

from __future__ import annotations

import asyncio
import select
from typing import Any

import redis

from ._redis_conn import pack
from ._redis_io import name_back_due, parsed

__all__ = ["Kept", "fileno", "stale"]


def fileno(connection: Any) -> int:
    """The socket of a connected ``redis.asyncio`` connection (its stream's transport)."""
    sock = connection._writer.get_extra_info("socket")
    return int(sock.fileno())


def stale(connection: Any) -> bool:
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
        return bool(select.select([fileno(connection)], [], [], 0)[0])
    except (OSError, ValueError, AttributeError):
        return True


class Kept:
    """Connections checked out of one ``redis.asyncio`` pool and kept between round trips.

    :meth:`take` gives one to a single round trip, :meth:`give` takes it back once its reply
    was read to its end, :meth:`drop` when it was not; at most :attr:`KEEP` are kept idle
    (concurrent round trips each take their own), the others go back to the pool. A new
    connection comes from the pool in a task of its own: redis-py bounds connecting with
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
            if not stale(connection):
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

    async def call(self, client: Any, command: tuple[object, ...], packed: bytes = b"") -> Any:
        """The reply to ``command`` on a kept connection of ``client``'s pool, parsed as
        redis-py's method for it would (:func:`~._redis_io.parsed`); ``packed`` is ``command``
        already packed (:func:`~._redis_conn.pack`: once for every node). The caller bounds it
        (``asyncio.timeout``); a round trip that ends any way but with its reply read drops
        its connection."""
        connection = await self.take()
        try:
            await connection.send_packed_command([packed or pack(command)], check_health=False)
            response = await connection.read_response()
        except BaseException:
            await self.drop(connection)
            raise
        await self.give(connection)
        return parsed(client, command, response)
