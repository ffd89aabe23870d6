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

A round trip's bound is measured by the event loop, which may stall past it (a blocking call in
some coroutine, GIL-heavy worker threads) while the reply waits in the socket: so when the bound
passes, a round trip whose reply has come (buffered, or in the socket) is given more time to
read it (:class:`Bound`), as a blocking socket's timeout would have found the reply once the
process ran again; so is a round trip whose connect moved on (its socket became writable, its
handshake's reply came) while the loop stalled. Only a round trip to which nothing came is cut
off. Whoever counts on the reply judges its lease from when the request was sent, never from
the reply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar

import redis

from .._fdwait import readable
from ._redis_conn import Script, arun_script, pack
from ._redis_io import name_back_due, parsed

__all__ = ["Bound", "Kept", "bounded", "fileno", "stale"]

T = TypeVar("T")


def fileno(connection: Any) -> int:
    """The socket of a connected ``redis.asyncio`` connection (its stream's transport)."""
    sock = connection._writer.get_extra_info("socket")
    return int(sock.fileno())


def _in_socket(connection: Any, unknown: bool) -> bool:
    """Whether the socket of a connected connection has something to read (one ``poll``
    with no wait): a reply, more of one, or end-of-file; ``unknown`` when it cannot tell."""
    try:
        return readable(fileno(connection), 0)
    except (OSError, AttributeError):
        return unknown


def stale(connection: Any) -> bool:
    """Whether a kept connection must not be used: closed, owed a name given back (see
    :func:`~._redis_io.name_back_due`: its next read would be a stale reply), or with
    something to read while idle (the server closed it, or sent what nobody asked for),
    buffered by the loop already or still in the socket."""
    reader = connection._reader
    if reader is None or name_back_due(connection):
        return True
    if reader.at_eof() or reader.exception() is not None or len(reader._buffer):
        return True
    return _in_socket(connection, unknown=True)


class _Stepping(Generator[Any, Any, Any]):
    """Drives a coroutine (``await`` it) and calls ``moved`` at each of its steps, each time
    its task is woken by what it awaited: how a :class:`Bound` sees a connect move on, phase
    by phase (the TCP connect, the handshake's round trip), inside redis-py."""

    __slots__ = ("_coro", "_moved")

    def __init__(self, coro: Coroutine[Any, Any, Any], moved: Callable[[], None]) -> None:
        self._coro, self._moved = coro, moved

    def __await__(self) -> Generator[Any, Any, Any]:
        return self

    def send(self, value: Any) -> Any:
        self._moved()
        return self._coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self._moved()
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()


class Bound:
    """``asyncio.timeout(timeout)`` for one round trip on a kept connection, its connect
    included, which a stalled event loop cannot turn into a silent server.

    When ``timeout`` has passed on the loop's clock, the round trip is cut off (its task
    cancelled, ``TimeoutError`` out of the block, as ``asyncio.timeout``'s) only if nothing
    moved: nothing of its reply arrived since it last looked (nothing in the socket of its
    :attr:`connection`, its reader's buffer as it was), and its connect (:meth:`stepping`) took
    no step for ``timeout``. Otherwise the reply came, or the connect moved on, while the loop
    was not looking (it stalled), and the round trip gets ``timeout`` more. Steps are looked
    for one loop turn after the timer ran, so a connect that the loop, waking from a stall,
    found done (its socket writable, its handshake's reply in) takes its step, and it counts,
    before the bound decides. Each extension needs more of the reply or another step, so a
    hung server (one that accepts connections and never answers, or stops halfway through a
    reply) is cut off one ``timeout`` after the last thing it did. A reply is only ever read
    by the round trip that asked for it; one not read to its end still drops its connection
    (see :class:`Kept`).
    """

    __slots__ = (
        "_buffered",
        "_cancelling",
        "_handle",
        "_loop",
        "_task",
        "connection",
        "fired",
        "moved_at",
        "timeout",
    )

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        #: The connection the round trip runs on, once it has one (none: still connecting).
        self.connection: Any = None
        self.fired = False
        #: The loop's time of the last step (:meth:`moved`), or of the start.
        self.moved_at = 0.0
        self._buffered = 0
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.Handle | None = None
        self._cancelling = 0

    def start(self, task: asyncio.Task[Any]) -> None:
        """Bound ``task`` from now on (it is cancelled if cut off)."""
        self._task, self._loop = task, task.get_loop()
        self.moved_at = self._loop.time()
        self._handle = self._loop.call_at(self.moved_at + self.timeout, self._expire)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def moved(self) -> None:
        """The round trip took a step."""
        assert self._loop is not None
        self.moved_at = self._loop.time()

    def stepping(self, call: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """``call``, each of whose steps counts as the round trip moving on."""
        return _Stepping(call, self.moved)

    def _arrived(self) -> bool:
        """Whether more of the reply arrived, or was read, since the last look."""
        reader = getattr(self.connection, "_reader", None)
        if reader is None:
            return False
        buffered, self._buffered = self._buffered, len(reader._buffer)
        return buffered != self._buffered or _in_socket(self.connection, unknown=False)

    def _expire(self) -> None:
        assert self._loop is not None
        if self._arrived():
            self.moved()
            self._handle = self._loop.call_at(self.moved_at + self.timeout, self._expire)
        else:  # what woke with the loop steps first
            self._handle = self._loop.call_soon(self._decide)

    def _decide(self) -> None:
        assert self._loop is not None and self._task is not None
        due = self.moved_at + self.timeout
        if due > self._loop.time():
            self._handle = self._loop.call_at(due, self._expire)
        elif not self._task.done():
            self.fired = True
            self._task.cancel()

    async def __aenter__(self) -> Bound:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - always awaited in a task
            raise RuntimeError("Bound must be used inside a task")
        self._cancelling = task.cancelling()
        self.start(task)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """A cancellation of ours becomes ``TimeoutError``; the caller's stays one."""
        assert self._task is not None
        self.stop()
        ours = self.fired and self._task.uncancel() <= self._cancelling
        if ours and exc_type is asyncio.CancelledError:
            raise TimeoutError(f"no reply within {self.timeout} s")


async def bounded(call: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
    """``call``'s outcome, run in a task of its own and cut off as :class:`Bound` says when
    nothing moved (its every step counts): ``redis.TimeoutError`` naming ``what`` then.

    For a caller whose own task must not be cancelled to bound it (a step run by
    :func:`~leases._finishing.finish`), and for calls whose connection this module never sees
    (a Redis Cluster client's): ``asyncio.wait_for`` would cut them off by the loop's clock
    alone, so a stall of the loop would fail a server that answered in time."""
    bound = Bound(timeout)
    task: asyncio.Task[T] = asyncio.ensure_future(bound.stepping(call))
    bound.start(task)
    caller = asyncio.current_task()
    cancelling = caller.cancelling() if caller is not None else 0
    try:
        return await task
    except asyncio.CancelledError:
        if bound.fired and (caller is None or caller.cancelling() <= cancelling):
            raise redis.TimeoutError(f"{what} within {timeout} s") from None
        raise
    finally:
        bound.stop()


class Kept:
    """Connections checked out of one ``redis.asyncio`` pool and kept between round trips.

    :meth:`take` gives one to a single round trip, :meth:`give` takes it back once its reply
    was read to its end, :meth:`drop` when it was not; at most :attr:`KEEP` are kept idle
    (concurrent round trips each take their own), the others go back to the pool. A new
    connection is bounded as a round trip is (:class:`Bound`); outside one, in a task of its
    own, whose cancellation is never the caller's (see :mod:`leases._finishing`).
    """

    KEEP = 16

    __slots__ = ("_idle", "pool", "timeout")

    def __init__(self, pool: Any, timeout: float) -> None:
        self.pool = pool
        self.timeout = timeout
        self._idle: list[Any] = []

    async def take(self, bound: Bound | None = None) -> Any:
        """A kept connection, else a new one from the pool, its connect bounded by ``bound``
        (the round trip's, in whose task it then runs, each step of it counted) or else in a
        task of its own (:func:`bounded`): the client has no connect timeout of its own (see
        :func:`~._redis_io.aconnect`)."""
        while self._idle:
            connection = self._idle.pop()
            if not stale(connection):
                return connection
            await self.drop(connection)
        if bound is not None:
            return await bound.stepping(self.pool.get_connection())
        return await bounded(self.pool.get_connection(), self.timeout, "not connected")

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

    async def _round_trip(self, exchange: Callable[[Any], Awaitable[Any]]) -> Any:
        """``exchange``'s reply on a kept connection: connecting, sending and reading bounded
        by :attr:`timeout` as :class:`Bound` says (``TimeoutError`` past it); a round trip
        that ends any way but with its reply read drops its connection."""
        async with Bound(self.timeout) as bound:
            connection = bound.connection = await self.take(bound)
            try:
                response = await exchange(connection)
            except BaseException:
                await self.drop(connection)
                raise
        await self.give(connection)
        return response

    async def call(self, client: Any, command: tuple[object, ...], packed: bytes = b"") -> Any:
        """The reply to ``command`` on a kept connection of ``client``'s pool (see
        :meth:`_round_trip`), parsed as redis-py's method for it would
        (:func:`~._redis_io.parsed`); ``packed`` is ``command`` already packed
        (:func:`~._redis_conn.pack`: once for every node)."""

        async def exchange(connection: Any) -> Any:
            await connection.send_packed_command([packed or pack(command)], check_health=False)
            return await connection.read_response()

        return parsed(client, command, await self._round_trip(exchange))

    async def run(
        self, script: Script, keys: list[str], args: list[object], packed: bytes = b""
    ) -> Any:
        """The reply of ``script`` by its SHA1 on a kept connection (see :meth:`_round_trip`),
        loaded there first if the server lacks it (:func:`~._redis_conn.arun_script`);
        ``packed`` is the call already packed (:meth:`~._redis_conn.Script.packed`)."""
        return await self._round_trip(
            lambda connection: arun_script(connection, script, keys, args, packed)
        )
