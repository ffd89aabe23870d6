"""redis-py plumbing shared by the Redis and Redlock backends.

Connections (a django-redis cache alias or a URL, never retried), commands sent without waiting
and read later (so Redlock talks to all its nodes at once, and a ``BLPOP`` ends on the caller's
deadline, not the server's timer), the option checks both backends make without connecting, the
eviction-policy deploy check, and the one place where redis-py's errors become
:class:`~leases.errors.BackendUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import redis
from django.conf import settings
from django.utils import timezone
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from ..errors import LeasesImproperlyConfigured
from ._edge import DriverEdge

__all__ = [
    "BLPOP_MARGIN",
    "BLPOP_SLACK",
    "BLPOP_WAIT",
    "CLOSED_UNDER",
    "POOL",
    "Edge",
    "ablpop",
    "aconnect",
    "blpop",
    "blpop_command",
    "cache_problems",
    "closed_under",
    "connect",
    "eviction_problems",
    "expires",
    "ms",
    "name_back_due",
    "parsed",
    "permission_problems",
    "pool_problems",
    "prefix_problems",
    "read_name_back",
    "read_timeout",
    "read_within",
    "receive",
    "send",
    "send_labelled",
    "server_of",
    "text",
    "url_problems",
]

MAX_PREFIX_LENGTH = 64
#: The port a Redis URL without one means.
DEFAULT_PORT = 6379


def ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


#: The most connections a client of ours opens to one server (a Redlock URL node's, and the
#: async clients): redis-py's pools refuse more than 100 by default since 8.0 (redis.asyncio's
#: too), and a contended process needs more (each contender's try and wait, and the replies a
#: drain has yet to read). A refused connection costs a try its node's vote, and a release or
#: give-back never sent holds the name for a whole TTL. (A django-redis cache alias's sync
#: client keeps its own pool and limit.)
POOL = 10_000

#: What tells a new connection to send no ``CLIENT SETINFO``: redis-py 7.2 names it
#: ``driver_info``, the releases before it ``lib_name`` and ``lib_version``.
_NO_SETINFO: dict[str, None] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(redis.connection.AbstractConnection.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)
#: Whether redis-py bounds one read by a deadline of its own (``read_response(timeout=...)``,
#: redis-py 8): before it, only the socket's timeout bounds a read.
_READ_TAKES_TIMEOUT = "timeout" in inspect.signature(redis.Connection.read_response).parameters

#: The latest expiry shown: any key can exist (``PX`` of 1e15 ms is year 33715), and reading it
#: must not raise ``OverflowError`` where ``datetime`` ends.
LATEST = datetime(9999, 12, 30, tzinfo=UTC)


def expires(seconds: float) -> datetime:
    """Wall-clock estimate of an expiry, for display only (Redis's clock decides)."""
    now = timezone.now()
    latest = LATEST if now.tzinfo is not None else LATEST.replace(tzinfo=None)
    try:
        return min(now + timedelta(seconds=seconds), latest)
    except OverflowError:
        return latest


def prefix_problems(alias: str, prefix: object) -> list[str]:
    """Why ``PREFIX`` cannot prefix lease keys: it must not move the hash tag or match more
    than its own keys in a ``SCAN`` pattern."""
    where = f'LEASES["BACKENDS"][{alias!r}]["PREFIX"]'
    if not isinstance(prefix, str) or not 0 < len(prefix) <= MAX_PREFIX_LENGTH:
        return [f"{where} must be a string of 1 to {MAX_PREFIX_LENGTH} characters, not {prefix!r}"]
    if any(c in prefix for c in "{}*?[]\\"):
        return [f"{where} must not contain braces or glob characters"]
    return []


def cache_problems(alias: str, option: str, cache: object) -> list[str]:
    """Why ``cache`` is not the alias of a django-redis cache (only those give a redis-py
    client), read from ``CACHES`` without connecting."""
    where = f'LEASES["BACKENDS"][{alias!r}]["{option}"] = {cache!r}'
    caches: dict[str, Any] = getattr(settings, "CACHES", {})
    if not isinstance(cache, str) or cache not in caches:
        return [f"{where} is not an alias of CACHES ({', '.join(sorted(caches)) or 'none'})"]
    backend = str(caches[cache].get("BACKEND", ""))
    if not backend.startswith("django_redis."):
        return [f"{where} is a {backend} cache, not a django-redis one"]
    return []


def pool_problems(alias: str, option: str, cache: str) -> list[str]:
    """Why the pool of django-redis alias ``cache`` is too small for lease traffic, if it is.

    Every sync try, renewal and release takes a connection from that pool, and every waiting
    acquire keeps one for its ``BLPOP``. Past its limit (redis-py's default is 100 since 8.0,
    none before) redis-py refuses a connection (``MaxConnectionsError``): a wait sleeps
    instead of being woken, and a try or release fails with
    :class:`~leases.errors.BackendUnavailable` (a name whose release failed stays held until
    its TTL ends). The clients made from a URL have room for :data:`POOL`, so a smaller cache
    pool is reported. The limit is read from the pool django-redis makes for the alias (also
    what later lease traffic uses), which connects to nothing; a cache whose client cannot be
    made is left to its first use to report.
    """
    try:
        pool = connect(alias, cache, None, 1.0).connection_pool  # the timeout is the cache's
    except Exception:  # a sharded client, a broken factory...: not this check's to report
        return []
    limit = getattr(pool, "max_connections", None)
    if not isinstance(limit, int) or limit >= POOL:
        return []
    return [
        f'LEASES["BACKENDS"][{alias!r}]["{option}"] = {cache!r}: that cache\'s connection pool '
        f"allows {limit} connections, fewer than the {POOL} the package gives the clients it "
        "makes from a URL; every try, renewal and release takes one and every waiting acquire "
        f"keeps one, so past {limit} at once in one process (less what the cache itself "
        "uses) they fail with BackendUnavailable (MaxConnectionsError); raise that cache's "
        f'OPTIONS["CONNECTION_POOL_KWARGS"]["max_connections"] to {POOL}, or give the backend '
        "a URL instead"
    ]


def url_problems(alias: str, option: str, url: str, *, cluster: bool = False) -> list[str]:
    """Why ``url`` is not a Redis URL redis-py can connect to as written (``redis://``,
    ``rediss://`` with a host, or ``unix://`` with a path), read without connecting.

    Parsed by redis-py's own :func:`~redis.connection.parse_url` too, so a query argument it
    cannot convert (``?socket_timeout=abc``) is reported here, not raised at the first grant.
    redis-py reads a path that is not a number as database 0, silently (``/db1``: two apps
    that meant separate databases would share one keyspace), so the path must be empty or a
    database number; and Redis Cluster (``cluster``) has only database 0.
    """
    where = f'LEASES["BACKENDS"][{alias!r}]["{option}"]: {url!r}'
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        kwargs = parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        return [f"{where} is not a URL redis-py can use ({exc})"]
    if parts.scheme == "unix" and parts.path:
        path = ""
    elif parts.scheme in ("redis", "rediss") and parts.hostname:
        path = parts.path
    else:
        return [f"{where} is not a redis://host:port/db, rediss://... or unix://path URL"]
    if not re.fullmatch(r"/?([0-9]+)?", path):
        return [
            f"{where}: the path {path!r} is not a database number; redis-py would silently "
            "use database 0 (write redis://host:port/N)"
        ]
    if cluster and kwargs.get("db", 0) != 0:
        return [f"{where}: Redis Cluster has only database 0 (CLUSTER is True)"]
    return []


def server_of(url: str) -> tuple[str, str | int, int]:
    """The keyspace a well-formed Redis URL (see :func:`url_problems`) names: its lowercased
    host and port (6379 when left out), or its socket path, and its database (0 when left
    out), however the URL spells them. Two URLs of one keyspace are one Redlock vote counted
    twice. Two databases of one server are independent keyspaces that fail together: a
    quorum that tolerates no failure, which a development setup may want (the demo's)."""
    parts = urlsplit(url)
    database = int(parse_url(url).get("db") or 0)  # type: ignore[no-untyped-call]
    if parts.scheme == "unix":
        return ("unix", parts.path, database)
    return (str(parts.hostname).lower(), parts.port or DEFAULT_PORT, database)


def connect(
    alias: str,
    cache: object,
    url: object,
    socket_timeout: float,
    *,
    cluster: bool = False,
    handshake: bool = True,
    max_connections: int | None = None,
) -> Any:
    """A redis-py client for a django-redis cache alias or a URL (never both).

    A URL client never retries, a Redis Cluster one included: a retried acquire could leave a
    grant nobody knows it holds until it expires, and a retried release would report a loss
    that did not happen.
    ``cluster`` makes a Redis Cluster client from the URL of any of its nodes. Without
    ``handshake`` a new connection sends nothing before its first command (no ``CLIENT
    SETINFO``), so connecting to a hung server cannot block: the first read is bounded by the
    caller's deadline instead (Redlock talks to all its nodes at once). ``max_connections``
    replaces the URL client's pool limit (redis-py's default is 100 since 8.0).
    """
    if (cache is None) == (url is None):
        raise LeasesImproperlyConfigured(
            f'LEASES["BACKENDS"][{alias!r}] needs exactly one of "CACHE" (a django-redis cache '
            'alias) or "URL"'
        )
    if cache is not None:
        import django_redis  # type: ignore[import-untyped]

        return django_redis.get_redis_connection(str(cache))
    timeouts = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout}
    if cluster:
        from redis.cluster import RedisCluster

        # The cluster client asks a node for the slot map as it is made, outside any Edge.
        # No retries: its command path would resend a script whose reply was lost.
        with Edge(alias, "connect"):
            return RedisCluster.from_url(str(url), retry=Retry(NoBackoff(), 0), **timeouts)
    quiet: dict[str, Any] = {} if handshake else {**_NO_SETINFO, "protocol": 2}
    if max_connections is not None:
        quiet["max_connections"] = max_connections
    return redis.Redis.from_url(str(url), retry=Retry(NoBackoff(), 0), **timeouts, **quiet)


def aconnect(
    alias: str, cache: object, url: object, socket_timeout: float, *, cluster: bool = False
) -> Any:
    """The ``redis.asyncio`` twin of :func:`connect`, for the running event loop only.

    A URL gives the same client as :func:`connect` (no retries), async, but for its timeouts
    (``socket_timeout`` is the callers' to bound their round trips with, see below). A
    django-redis cache alias has no async client of its own, so one is made from the cache's
    ``LOCATION`` (its first, writable server) and its ``PASSWORD`` option: the same server the
    sync client talks to.

    The client has no read timeout (not even redis-py's default): every caller bounds its
    round trip with ``asyncio.timeout`` instead (``socket_timeout``, or the cache's
    ``SOCKET_TIMEOUT``, is what :func:`read_timeout` returns for it). A socket timeout would
    make redis.asyncio wrap each send in ``asyncio.wait_for``, a task and an event-loop turn
    per command. Nor a connect timeout: redis-py's runs on the loop's clock alone, so a stall
    of the loop would fail a live server; the callers bound connecting with the round trip
    (:class:`~._redis_kept.Bound`, :func:`~._redis_kept.bounded`, a wait's own deadline).

    Its pool allows :data:`POOL` connections, not redis.asyncio's default of 100: an event
    loop with that many waits blocked on the server (each ``BLPOP`` holds a connection) would
    have every further wait fail at once and, worse, a release or give-back refused a
    connection, leaving the name held for a whole TTL. The pool is ours even for a cache
    alias (made from its ``LOCATION``), so its cap is too.
    """
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry

    timeouts: dict[str, Any] = {"socket_timeout": None, "socket_connect_timeout": None}
    if cache is not None:
        config: dict[str, Any] = settings.CACHES[str(cache)]
        location = config["LOCATION"]
        url = (location if isinstance(location, str) else location[0]).split(",")[0]
        options = config.get("OPTIONS", {})
        if options.get("PASSWORD") is not None:
            timeouts["password"] = options["PASSWORD"]
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(str(url), retry=AsyncRetry(NoBackoff(), 0), **timeouts)
    return redis.asyncio.Redis.from_url(
        str(url), retry=AsyncRetry(NoBackoff(), 0), max_connections=POOL, **timeouts
    )


def read_within(connection: Any, timeout: float | None) -> Any:
    """The reply to what was sent on ``connection``, each wait for its bytes bounded by
    ``timeout`` seconds instead of the connection's socket timeout: a Redlock node's round trip
    by the node timeout, a ``BLPOP`` by the caller's deadline (``None``: the socket timeout
    bounds it, as any read of redis-py's).

    redis-py 8 takes the bound as an argument. Before it, the socket's own timeout is set for the
    read and put back after, which bounds the same waits: redis-py's readers wait on the socket
    with whatever timeout it has. A read that runs out raises ``redis.TimeoutError`` and drops
    the connection either way, so no late reply is left for its next user."""
    if timeout is None:
        return connection.read_response()
    if _READ_TAKES_TIMEOUT:
        return connection.read_response(timeout=timeout)
    sock = connection._sock
    if sock is None:  # not connected: redis-py's own error
        return connection.read_response()
    sock.settimeout(timeout)
    try:
        return connection.read_response()
    finally:
        if connection._sock is sock:  # still connected: its own timeout again
            sock.settimeout(connection.socket_timeout)


def read_timeout(cache: object, socket_timeout: float) -> float:
    """How long an async round trip may take (see :func:`aconnect`): a cache alias's own
    ``SOCKET_TIMEOUT`` when it has one, else ``socket_timeout``."""
    if cache is None:
        return socket_timeout
    config: dict[str, Any] = settings.CACHES[str(cache)]
    return float(config.get("OPTIONS", {}).get("SOCKET_TIMEOUT") or socket_timeout)


async def ablpop(client: Any, key: str, wait: float, label: str | None = None) -> Any:
    """:func:`blpop` for ``redis.asyncio``: at most ``wait`` seconds, ``None`` when nothing was
    pushed. The server's timer ends a wait that runs out, and the client's deadline
    (``asyncio.timeout``) one the server did not answer in time (see :func:`blpop_timing`);
    redis-py drops a connection whose command was cancelled. ``label`` names the connection
    first, and its own name is given back after, in the same round trip (see :func:`send`)."""
    server, deadline = blpop_timing(wait)
    try:
        async with asyncio.timeout(deadline):
            if label is None or not hasattr(client, "connection_pool"):
                return await client.blpop([key], timeout=server)
            own = client.connection_pool.connection_kwargs.get("client_name") or ""
            pipe = client.pipeline(transaction=False)
            pipe.client_setname(label).blpop([key], timeout=server)
            pipe.client_setname(own)
            reply = (await pipe.execute(raise_on_error=False))[1]
            if isinstance(reply, Exception):  # the wait's own error; the name's is ignored
                raise reply
            return reply
    except TimeoutError:
        return None


#: What redis-py raises when a connection is closed under a thread reading from it (the
#: backend's ``close()`` on another thread: a pool's ``disconnect()`` drops connections in use
#: too): the parser's buffer closed mid-read (``ValueError``) or already gone (``AttributeError``).
CLOSED_UNDER = (ValueError, AttributeError)


def closed_under(exc: BaseException) -> redis.ConnectionError:
    """The ``ConnectionError`` a read of a connection closed under it (:data:`CLOSED_UNDER`)
    stands for, so it meets the same handling as any lost connection: a node's
    :data:`~._redis_nodes.FAILED`, or :class:`~leases.errors.BackendUnavailable` at the
    :class:`Edge`, never a raw ``ValueError`` out of a renewal racing ``close()``."""
    detail = f"{type(exc).__name__}: {exc}"
    return redis.ConnectionError(f"the connection was closed while a reply was awaited ({detail})")


def send(client: Any, command: tuple[object, ...], label: str | None = None) -> Any:
    """Send ``command`` on a pooled connection without waiting for the reply.

    With :func:`receive` this lets a caller talk to several servers at once (Redlock) or wait
    longer than the client's socket timeout for one blocking command. Errors propagate.
    ``label`` names the connection first (``CLIENT SETNAME``, in the same packet), so
    ``CLIENT LIST`` can tell who waits (see ``_redis_waiters``); a server that refuses the name
    (an ACL) still runs ``command``.

    A labelled ``command`` is followed, in the same packet, by ``CLIENT SETNAME`` of the
    connection's own name (its pool's ``client_name``, else none), which the server runs once
    ``command`` is done and :func:`receive` reads after its reply: the connection may be a
    django-redis cache's, and goes back to the application's pool without the wait's name
    (``CLIENT LIST`` would show the application's later commands as a lease wait).
    """
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        if label is None:
            connection.send_command(*command)
        else:
            send_labelled(connection, command, label)
    except BaseException as exc:
        connection.disconnect()
        pool.release(connection)
        if isinstance(exc, CLOSED_UNDER):
            raise closed_under(exc) from exc
        raise
    return connection


def send_labelled(connection: Any, command: tuple[object, ...], label: str) -> None:
    """Send ``command`` on ``connection`` named ``label`` for its duration (see :func:`send`),
    reading the name's reply; errors propagate (the caller drops the connection)."""
    named = ("CLIENT", "SETNAME", label)
    own = ("CLIENT", "SETNAME", getattr(connection, "client_name", None) or "")
    connection.send_packed_command(connection.pack_commands([named, command, own]))
    with contextlib.suppress(redis.ResponseError):  # the name's OK: ``command`` is sent
        connection.read_response()
    connection._leases_name_back_due = True


def parsed(client: Any, command: tuple[object, ...], response: Any) -> Any:
    """``response`` to ``command`` as redis-py's method for the command would give it (``SET``
    gives ``True``): for replies read off a connection rather than through the client."""
    parse = client.response_callbacks.get(str(command[0]).upper())
    return response if parse is None else parse(response)


def name_back_due(connection: Any) -> bool:
    """Whether ``connection`` carries a labelled command (see :func:`send`), whose reply is
    followed by that of the name given back; forgotten as it is asked, so a connection whose
    read failed (and was dropped) never makes a later user read a reply it is not owed.

    Whoever reads the command's reply and keeps or returns the connection must then read the
    name's (:func:`read_name_back`), or the connection's next command reads a stale ``OK`` and
    every reply after it is one late (a refused try read as granted)."""
    return bool(connection.__dict__.pop("_leases_name_back_due", False))


def read_name_back(connection: Any, timeout: float | None) -> None:
    """Read the reply of the name given back (sent right behind the command: due at once)."""
    with contextlib.suppress(redis.ResponseError):  # an ACL refused both names
        read_within(connection, timeout or connection.socket_timeout)


def receive(
    client: Any, connection: Any, command: tuple[object, ...], timeout: float | None = None
) -> Any:
    """The reply to ``command`` sent on ``connection``, which then goes back to the pool.

    ``timeout`` (seconds) replaces the socket timeout for this one read (``None`` keeps it);
    the reply is parsed as redis-py's method for the command would (``SET`` gives ``True``).
    After a labelled command (see :func:`send`) the reply of the name given back is read too,
    so no reply is left for the connection's next user.
    """
    name_back = name_back_due(connection)
    try:
        response = read_within(connection, timeout)
        if name_back:
            read_name_back(connection, timeout)
    except BaseException as exc:
        connection.disconnect()
        if isinstance(exc, CLOSED_UNDER):
            raise closed_under(exc) from exc
        raise
    finally:
        client.connection_pool.release(connection)
    return parsed(client, command, response)


#: How late Redis may fire a blocked client's timeout: on its event loop's next turn, which an
#: idle server takes only at its next timer tick (``hz`` 10, the default: up to 100 ms late;
#: measured 51-91 ms on Redis 7.0.15).
SERVER_TICK = 0.1
#: How long after the caller's wait the server's reply that ended it may still come (a
#: loaded machine): past it the client's deadline ends the wait and drops the connection.
#: Within the slack ``aacquire`` allows a backend's wait past its bound (``leases.aio``), so
#: the wait's own deadline, not that guard's cancellation, ends an async wait too.
BLPOP_MARGIN = 0.04
#: How much longer than the caller's wait a ``BLPOP`` too short to leave the server its tick
#: is told to block: that wait ends on the client's deadline, never the server's timer.
BLPOP_SLACK = 0.25

#: How long each wait for a release is asked to last at least (the backends'
#: ``wait_at_least``: the backoff's shortest delay, never past the caller's deadline); one
#: that runs out ends on the server up to a tick earlier (:func:`blpop_timing`). A lost
#: wake-up or a holder gone without its release costs a waiter at most this long, as the
#: backoff's cap (the same 0.25 s) did before. The backoff's first delays (a few
#: milliseconds) made every waiter of a busy name run out and reconnect again and again:
#: with 32 threads on one name, 1.6 new connections and 28 commands per grant, 330-400
#: grants/s; waiting this long, none and 19, 1,300-1,700 grants/s.
BLPOP_WAIT = 0.25


def blpop_timing(wait: float) -> tuple[float, float]:
    """The server's ``BLPOP`` timeout and the client's deadline (seconds from sending) for a
    wait of at most ``wait`` seconds.

    A wait that runs out should end on the server, with a reply (``nil``), so its connection
    goes back to the pool: the server is told to time out one tick early
    (:data:`SERVER_TICK`), so its late timer still answers by ``wait``, and the client gives
    up only :data:`BLPOP_MARGIN` after. A wait ended by the client's deadline drops its
    connection with the ``BLPOP`` pending; ending every wait that way (as each did, told to
    block :data:`BLPOP_SLACK` past it) made each waiter of a name held for long reconnect
    four times a second: 404 new connections in 5 s for 20 waiters. A wait shorter than two
    ticks (the last before a caller's deadline) still ends on the client's deadline: the
    server's timer is too coarse to end it on time.
    """
    if wait >= 2 * SERVER_TICK:
        return wait - SERVER_TICK, wait + BLPOP_MARGIN
    return wait + BLPOP_SLACK, wait


def blpop_command(key: str, wait: float) -> tuple[str, str, str]:
    """``BLPOP key`` with the server's timeout of :func:`blpop_timing`."""
    return ("BLPOP", key, f"{blpop_timing(wait)[0]:.3f}")


def blpop(client: Any, key: str, wait: float, label: str | None = None) -> Any:
    """``BLPOP key`` for at most ``wait`` seconds (see :func:`blpop_timing`): ``None`` when
    nothing was pushed by then.

    The client's deadline is the socket read's, so a short client socket timeout does not
    turn a long wait into an error either. A wake-up the server pops just as a connection
    dropped at that deadline closes is lost, which costs the waiter one retry delay.
    """
    if not hasattr(client, "connection_pool"):  # a RedisCluster client routes by key itself
        return client.blpop([key], timeout=wait)
    command = blpop_command(key, wait)
    try:
        return receive(client, send(client, command, label), command, blpop_timing(wait)[1])
    except redis.TimeoutError:
        return None  # the deadline; ``receive`` dropped the connection and its BLPOP


class Edge(DriverEdge):
    """redis-py's errors become :class:`BackendUnavailable` at the backend's edge."""

    __slots__ = ()

    # RedisClusterException (no node reachable, not a cluster) is no RedisError.
    errors = (redis.RedisError, redis.exceptions.RedisClusterException)


def permission_problems(alias: str, client: Any) -> list[str]:
    """Why ``client``'s user cannot run what the acquire script runs, if it cannot.

    The script reads ``INFO replication`` (the server's replication id); an ACL without
    ``INFO`` (``+@all -@dangerous``, a common least-privilege recipe) passed ``PING`` and every
    check, and then refused every acquire. Asked the same way, so the ACL's answer is the
    script's."""
    with Edge(alias, "permission check"):
        try:
            client.info("replication")
        except redis.exceptions.NoPermissionError as exc:
            return [
                f"the Redis user may not run INFO ({exc}), which every acquire runs: grant it "
                "+info (see the Redis backend's ACL in the backends guide)"
            ]
    return []


def eviction_problems(alias: str, client: Any) -> list[str]:
    """Why ``client``'s server could lose lease keys to eviction, if it can (store check)."""
    with Edge(alias, "store check"):
        client.ping()
        try:
            policy = text(client.config_get("maxmemory-policy").get("maxmemory-policy", ""))
        except redis.exceptions.NoPermissionError:
            return [
                "cannot read maxmemory-policy (the Redis user may not run CONFIG GET); make "
                "sure it is 'noeviction' so lease keys are never evicted"
            ]
        except redis.ResponseError:
            return [
                "cannot read maxmemory-policy (CONFIG is disabled); make sure it is "
                "'noeviction' so lease keys are never evicted"
            ]
    if policy.startswith("allkeys"):
        return [
            f"maxmemory-policy is {policy!r}: Redis may evict lease keys, letting two holders in "
            "at once (fencing still rejects the stale one); use 'noeviction'"
        ]
    if policy.startswith("volatile"):
        return [
            f"maxmemory-policy is {policy!r}: Redis may evict held leases (they have a TTL) "
            "under memory pressure; use 'noeviction'"
        ]
    return []
