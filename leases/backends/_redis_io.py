"""redis-py plumbing shared by the Redis and Redlock backends.

Connections (a django-redis cache alias or a URL, never retried), commands sent without waiting
and read later (so Redlock talks to all its nodes at once, and a ``BLPOP`` ends on the caller's
deadline, not the server's timer), option checks, the eviction-policy deploy check, and the one
place where redis-py's errors become :class:`~leases.errors.BackendUnavailable`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any

import redis
from django.utils import timezone
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import BackendUnavailable, LeasesImproperlyConfigured

__all__ = [
    "BLPOP_SLACK",
    "blpop",
    "blpop_command",
    "check_options",
    "check_prefix",
    "connect",
    "edge",
    "eviction_problems",
    "expires",
    "ms",
    "receive",
    "send",
    "text",
]

MAX_PREFIX_LENGTH = 64


def ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


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


def check_prefix(alias: str, prefix: object) -> str:
    if not isinstance(prefix, str) or not 0 < len(prefix) <= MAX_PREFIX_LENGTH:
        raise LeasesImproperlyConfigured(
            f'LEASES["BACKENDS"][{alias!r}]["PREFIX"] must be a string of 1 to '
            f"{MAX_PREFIX_LENGTH} characters, not {prefix!r}"
        )
    if any(c in prefix for c in "{}*?[]\\"):
        raise LeasesImproperlyConfigured(
            f'LEASES["BACKENDS"][{alias!r}]["PREFIX"] must not contain braces or glob characters'
        )
    return prefix


def check_options(alias: str, options: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(options) - known)
    if unknown:
        raise LeasesImproperlyConfigured(
            f'LEASES["BACKENDS"][{alias!r}] has unknown options {unknown} '
            f"(known: {', '.join(sorted(known))})"
        )


def connect(
    alias: str,
    cache: object,
    url: object,
    socket_timeout: float,
    *,
    cluster: bool = False,
    handshake: bool = True,
) -> Any:
    """A redis-py client for a django-redis cache alias or a URL (never both).

    A URL client never retries: a retried acquire could leave a grant nobody knows it holds
    until it expires, and a retried release would report a loss that did not happen.
    ``cluster`` makes a Redis Cluster client from the URL of any of its nodes. Without
    ``handshake`` a new connection sends nothing before its first command (no ``CLIENT
    SETINFO``), so connecting to a hung server cannot block: the first read is bounded by the
    caller's deadline instead (Redlock talks to all its nodes at once).
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

        return RedisCluster.from_url(str(url), **timeouts)
    quiet: dict[str, Any] = {} if handshake else {"driver_info": None, "protocol": 2}
    return redis.Redis.from_url(str(url), retry=Retry(NoBackoff(), 0), **timeouts, **quiet)


def send(client: Any, command: tuple[object, ...]) -> Any:
    """Send ``command`` on a pooled connection without waiting for the reply.

    With :func:`receive` this lets a caller talk to several servers at once (Redlock) or wait
    longer than the client's socket timeout for one blocking command. Errors propagate.
    """
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_command(*command)
    except BaseException:
        connection.disconnect()
        pool.release(connection)
        raise
    return connection


def receive(
    client: Any, connection: Any, command: tuple[object, ...], timeout: float | None = None
) -> Any:
    """The reply to ``command`` sent on ``connection``, which then goes back to the pool.

    ``timeout`` (seconds) replaces the socket timeout for this one read (``None`` keeps it);
    the reply is parsed as redis-py's method for the command would (``SET`` gives ``True``).
    """
    try:
        if timeout is None:
            response = connection.read_response()
        else:
            response = connection.read_response(timeout=timeout)
    except BaseException:
        connection.disconnect()
        raise
    finally:
        client.connection_pool.release(connection)
    parse = client.response_callbacks.get(str(command[0]).upper())
    return response if parse is None else parse(response)


#: How much longer than the caller's wait a ``BLPOP`` is told to block. Redis fires a blocked
#: client's timeout on its event loop's next turn, which an idle server takes only at its next
#: timer tick (``hz`` 10: up to 100 ms late), so the server's timeout must never be what ends a
#: wait: the socket's read timeout ends it, on time, and drops the connection with its pending
#: ``BLPOP``.
BLPOP_SLACK = 0.25


def blpop_command(key: str, wait: float) -> tuple[str, str, str]:
    """``BLPOP key`` with a server timeout :data:`BLPOP_SLACK` past the caller's deadline."""
    return ("BLPOP", key, f"{wait + BLPOP_SLACK:.3f}")


def blpop(client: Any, key: str, wait: float) -> Any:
    """``BLPOP key`` for at most ``wait`` seconds: ``None`` when nothing was pushed by then.

    The deadline is the socket read's (see :data:`BLPOP_SLACK`), so a short client socket
    timeout does not turn a long wait into an error either. A wake-up the server pops just as
    the dropped connection closes is lost, which costs the waiter one retry delay.
    """
    if not hasattr(client, "connection_pool"):  # a RedisCluster client routes by key itself
        return client.blpop([key], timeout=wait)
    command = blpop_command(key, wait)
    try:
        return receive(client, send(client, command), command, wait)
    except redis.TimeoutError:
        return None  # the deadline; ``receive`` dropped the connection and its BLPOP


class edge:
    """Translate redis-py's errors into :class:`BackendUnavailable` at the backend's edge.

    A class, not ``@contextmanager``: it wraps every round trip, and a generator-based context
    manager costs about a microsecond more each time.
    """

    __slots__ = ("alias", "what")

    def __init__(self, alias: str, what: str) -> None:
        self.alias, self.what = alias, what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, redis.RedisError):
            detail = f"{self.what}: {type(exc).__name__}: {exc}"
            raise BackendUnavailable(self.alias, detail) from exc


def eviction_problems(alias: str, client: Any) -> list[str]:
    """Why ``client``'s server could lose lease keys to eviction, if it can (deploy check)."""
    with edge(alias, "deploy check"):
        client.ping()
        try:
            policy = text(client.config_get("maxmemory-policy").get("maxmemory-policy", ""))
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
