"""Scripts run on a pooled connection the backend picks itself, and what it knows of the server.

The Redis backend needs one fact per acquire that only the server can give: the replication id
of the server run it is talking to (see the module docstring of :mod:`leases.backends.redis`).
By default every acquire script reads it (``INFO``): that is the only answer that cannot be
stale. Reading it costs about a third of the script's server time (some 4 µs), so a deployment
may let each connection remember the id it last learned (:class:`ServerRun`) for at most the
backend's ``TRUST_SERVER_ID`` seconds, and the acquire script then reads it again only when the
connection does not know it.

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
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from redis.exceptions import NoScriptError

from ._redis_io import CLOSED_UNDER, closed_under

__all__ = ["Script", "ServerRun", "arun_script", "run_script", "server_run"]


class Script:
    """A Lua script known by its SHA1, loaded on a connection only when the server lacks it."""

    __slots__ = ("sha", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()

    def command(self, keys: list[str], args: list[object]) -> tuple[object, ...]:
        return ("EVALSHA", self.sha, len(keys), *keys, *args)


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
    command = script.command(keys, args)
    connection.send_command(*command, check_health=False)
    try:
        try:
            return connection.read_response()
        except NoScriptError:
            connection.send_command("SCRIPT", "LOAD", script.text, check_health=False)
            connection.read_response()
            connection.send_command(*command, check_health=False)
            return connection.read_response()
    except CLOSED_UNDER as exc:
        raise closed_under(exc) from exc


async def arun_script(connection: Any, script: Script, keys: list[str], args: list[object]) -> Any:
    """:func:`run_script` on a ``redis.asyncio`` connection."""
    command = script.command(keys, args)
    await connection.send_command(*command, check_health=False)
    try:
        return await connection.read_response()
    except NoScriptError:
        await connection.send_command("SCRIPT", "LOAD", script.text, check_health=False)
        await connection.read_response()
        await connection.send_command(*command, check_health=False)
        return await connection.read_response()
