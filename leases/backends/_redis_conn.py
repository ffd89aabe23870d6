"""Scripts run on a pooled connection the backend picks itself, and what it knows of the server.

The Redis backend needs one fact per acquire that only the server can give: the replication id
of the server run it is talking to (see the module docstring of :mod:`leases.backends.redis`).
By default every acquire script reads it (``INFO``): that is the only answer that cannot be
stale. Reading it costs a fifth to a quarter of the script's server time (5-10 µs), so a
deployment may let each connection remember the id it last learned (:class:`ServerRun`) for at
most the backend's ``TRUST_SERVER_ID`` seconds, and the acquire script then reads it again only
when the connection does not know it.

A connection forgets it when it (re)connects (a restarted or failed-over server is always a new
TCP connection: redis-py's connect callbacks), after any error (the connection is dropped, so
the next use reconnects), and ``TRUST_SERVER_ID`` after learning it. That last bound is the only
guard against the one change a live connection cannot see: its server demoted to a replica,
resynced from a lagging copy, and promoted again while the connection sat idle (Sentinel kills
every client of an instance it reconfigures; by hand or in a Redis Cluster fail-back it does not
happen). A guarantee bounded by time is the kind this package exists to avoid, so the default
is 0: no trust, one ``INFO`` per acquire.

Commands go out with redis-py's connection-level calls, not through ``client.evalsha``: a
client's command path may retry (django-redis caches do), and a retried acquire could win a
grant nobody knows it holds; it also costs more client time than the round trip itself.

The client's own share of a round trip is kept small on purpose, since it is most of what a
lease costs beyond the two round trips (``benchmarks/bench_redis.py``): a command is packed
here (:func:`pack`: a script's ``EVALSHA <sha>`` prefix once per script, redis-py's packer
costs more than the loopback round trip's server time), and :class:`Connections` keeps the
connections a backend checked out of its pool between round trips, so a round trip does not
pay the pool's locking and bookkeeping twice.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from .._fdwait import readable
from ._redis_io import CLOSED_UNDER, closed_under, read_within

__all__ = [
    "Connections",
    "Script",
    "ServerRun",
    "arun_on_cluster",
    "arun_script",
    "load_and_rerun",
    "pack",
    "run_on_cluster",
    "run_script",
    "server_run",
]


def _bulk(part: object) -> bytes:
    """One argument as a RESP bulk string (text as UTF-8, as redis-py's default encoder)."""
    if type(part) is str:
        data = part.encode()
    elif type(part) is bytes:
        data = part
    elif type(part) is int:
        data = b"%d" % part
    else:
        data = str(part).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


def pack(parts: Iterable[object], head: bytes = b"", count: int = 0) -> bytes:
    """A command as RESP: ``head`` (``count`` arguments already packed) then ``parts``."""
    packed = [_bulk(part) for part in parts]
    return b"".join((b"*%d\r\n" % (count + len(packed)), head, *packed))


class Script:
    """A Lua script known by its SHA1, loaded on a connection only when the server lacks it."""

    __slots__ = ("head", "sha", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
        self.head = _bulk("EVALSHA") + _bulk(self.sha)

    def command(self, keys: list[str], args: list[object]) -> tuple[object, ...]:
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def packed(self, keys: list[str], args: list[object]) -> bytes:
        """:meth:`command`, packed (see :func:`pack`)."""
        return pack((len(keys), *keys, *args), self.head, 2)


def _unusable(connection: Any) -> bool:
    """Whether a kept connection must be reconnected: closed, or readable while idle (the
    server closed it, or a reply was left unread). One ``poll`` with no wait; a socket it
    cannot watch is asked through redis-py instead."""
    sock = connection._sock
    if sock is None:
        return True
    try:
        return readable(sock.fileno(), 0)
    except (OSError, ValueError):
        try:
            return bool(connection.can_read())
        except (RedisError, OSError):
            return True


class Connections:
    """Connections checked out of one redis-py pool and kept between round trips.

    :meth:`take` gives one to a single round trip and :meth:`give` takes it back; at most
    :attr:`KEEP` are kept idle, the others go back to the pool, which also serves first uses.
    A kept connection is checked as the pool checks one it hands out: one the server closed
    (a restart) or that holds unread data is reconnected first, so a restart costs no failed
    round trip, and reconnecting runs its connect callbacks (:func:`server_run` forgets what
    it learned). A forked child never uses its parent's: it starts with none.
    """

    KEEP = 16

    __slots__ = ("_idle", "_pid", "pool")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._idle: list[Any] = []
        self._pid = os.getpid()

    def take(self) -> Any:
        if self._pid != os.getpid():  # forked: the parent's connections are the parent's
            self._idle, self._pid = [], os.getpid()
        try:
            connection = self._idle.pop()
        except IndexError:
            return self.pool.get_connection()
        if _unusable(connection):
            connection.disconnect()
            try:
                connection.connect()
            except BaseException:
                self._idle.append(connection)  # still checked out of the pool: keep it
                raise
        return connection

    def give(self, connection: Any) -> None:
        """Back from a round trip (the caller disconnected it if its reply went unread)."""
        if len(self._idle) < self.KEEP and self._pid == os.getpid():
            self._idle.append(connection)
        else:
            self.pool.release(connection)

    def close(self) -> None:
        """Every idle connection back to the pool."""
        idle, self._idle = self._idle, []
        if self._pid == os.getpid():
            for connection in idle:
                self.pool.release(connection)


class ServerRun:
    """The replication id of the server behind one connection, as the connection last learned
    it, and when; ``""`` when not known (never learned, reconnected since, or too old)."""

    __slots__ = ("__weakref__", "learned_at", "run")

    def __init__(self) -> None:
        self.run = ""
        self.learned_at = 0.0

    def forget(self, connection: object = None) -> None:
        """A connect callback: whatever was learned was about the previous connection."""
        self.run = ""

    def current(self, trust: float) -> str:
        """The id learned less than ``trust`` seconds ago, else ``""`` (the script reads it)."""
        if trust > 0 and self.run and time.monotonic() - self.learned_at < trust:
            return self.run
        return ""

    def learn(self, sent: str, used: str) -> None:
        """Remember the id a script ``used`` when it read it (it was sent none, or another)."""
        if used != sent or not sent:
            self.run, self.learned_at = used, time.monotonic()


def server_run(connection: Any) -> ServerRun:
    """``connection``'s :class:`ServerRun`, attached on first use and forgotten on reconnect.

    Only read it once the connection is connected (``connect()`` is a no-op then): connecting
    runs the callback, so what was learned is never sent to a server it was not learned from.
    """
    known: ServerRun | None = getattr(connection, "_leases_server_run", None)
    if known is None:
        known = ServerRun()
        connection._leases_server_run = known
        connection.register_connect_callback(known.forget)
    return known


def run_script(connection: Any, script: Script, keys: list[str], args: list[object]) -> Any:
    """The reply of ``script`` run on ``connection`` (connected, checked out by the caller).

    No health check before sending: it could reconnect, to another server, after the caller
    read what the connection knew. ``NOSCRIPT`` (a restarted server, ``SCRIPT FLUSH``) loads
    the script on the same connection and runs it again. A connection closed under the read
    (the backend closed on another thread) raises ``redis.ConnectionError`` (see
    :data:`~._redis_io.CLOSED_UNDER`).
    """
    command = [script.packed(keys, args)]
    connection.send_packed_command(command, check_health=False)
    try:
        try:
            return connection.read_response()
        except NoScriptError:
            return load_and_rerun(connection, script, command)
    except CLOSED_UNDER as exc:
        raise closed_under(exc) from exc


def load_and_rerun(
    connection: Any, script: Script, command: list[bytes], deadline: float | None = None
) -> Any:
    """After ``NOSCRIPT`` on ``connection``: load ``script`` there and send ``command`` (its
    packed call) again, on the same connection, so the text crosses the network only where a
    server lacks it. Each read is bounded by what is left of ``deadline`` (monotonic), else by
    the socket's timeout."""

    def read() -> Any:
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        return read_within(connection, left)

    connection.send_command("SCRIPT", "LOAD", script.text, check_health=False)
    read()
    connection.send_packed_command(command, check_health=False)
    return read()


def run_on_cluster(client: Any, script: Script, keys: list[str], args: list[object]) -> Any:
    """The reply of ``script`` run through a Redis Cluster ``client``, which routes it by key.

    ``NOSCRIPT`` runs the text (``EVAL``) on the node that said so, routed the same way, which
    also leaves the script loaded there. Not redis-py's ``Script``: on ``NOSCRIPT`` it loads the
    text on every primary, so one call waits on nodes that do not serve its key, and on the
    event loop (:func:`arun_on_cluster`) it does so in tasks of their own, whose progress the
    round trip's bound (:class:`~._redis_kept.Bound`) cannot see.
    """
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        return client.eval(script.text, len(keys), *keys, *args)


async def arun_on_cluster(client: Any, script: Script, keys: list[str], args: list[object]) -> Any:
    """:func:`run_on_cluster` through a ``redis.asyncio`` cluster client: every step of the
    call is the caller's own, so a bound that watches its steps sees each one."""
    try:
        return await client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        return await client.eval(script.text, len(keys), *keys, *args)


async def arun_script(
    connection: Any, script: Script, keys: list[str], args: list[object], packed: bytes = b""
) -> Any:
    """:func:`run_script` on a ``redis.asyncio`` connection; ``packed`` is the call already
    packed (:meth:`Script.packed`: Redlock packs it once for every node)."""
    command = [packed or script.packed(keys, args)]
    await connection.send_packed_command(command, check_health=False)
    try:
        return await connection.read_response()
    except NoScriptError:
        await connection.send_command("SCRIPT", "LOAD", script.text, check_health=False)
        await connection.read_response()
        await connection.send_packed_command(command, check_health=False)
        return await connection.read_response()
