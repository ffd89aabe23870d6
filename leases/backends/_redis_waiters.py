"""Who waits for which lease on Redis and Redlock, and since when, for operators' pages.

A waiter blocks in ``BLPOP`` on the name's wake-up list. Just before, on the same connection
and in the same packet (no extra round trip), it names that connection with ``CLIENT
SETNAME``: :func:`label` puts the wake-up key, the waiting process (host, pid, thread) and when
its wait began into the name. ``CLIENT LIST`` then shows, for every connection blocked right
now (flag ``b``), whose wait it is: :func:`waiters` reads them back. Nothing is written to be
cleaned up later: a waiter that dies takes its connection, and with it its entry, along.

A wait is a loop of ``BLPOP``s (each one backoff delay long) between tries, so "since" is
kept per thread and name across the loop (:class:`WaitClock`), not reset by every ``BLPOP``.
Not listed: waiters on a Redis Cluster (``CLIENT LIST`` is per node and the cluster client
routes the wait itself) and clients whose ACL forbids ``CLIENT SETNAME`` (their wait still
works, unnamed).
"""

from __future__ import annotations

import base64
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from ._redis_scripts import LeaseKeys
from .base import LeaseWaiter

__all__ = ["LABEL_PREFIX", "WaitClock", "distinct", "label", "waiters"]

#: What every waiting connection's name starts with.
LABEL_PREFIX = "leases-wait:"
#: Waits of one thread for one name that follow each other within this many seconds are one
#: wait (the loop's try in between takes a round trip, not seconds).
SAME_WAIT = 2.0


def _process() -> str:
    # A client name may hold no spaces or control characters; a hostname holds neither.
    return f"{socket.gethostname()[:64]}:{os.getpid()}"


def label(key: str, since: float) -> str:
    """The connection name of a wait on wake-up key ``key`` that began at ``since`` (epoch
    seconds), by this process and thread."""
    encoded = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
    return f"{LABEL_PREFIX}{int(since)}:{_process()}:{threading.get_ident()}:{encoded}"


def _parse(name: str, prefix: str) -> tuple[str, datetime, str] | None:
    """(lease name, since, who) from a connection name made by :func:`label` for a key
    under ``prefix``; ``None`` for any other name.

    Any client of the server may name its connection so: ``since`` must be what
    :func:`label` writes (whole epoch seconds) and a date a ``datetime`` holds, or one foreign
    connection named ``leases-wait:1e20:...`` would fail every page listing the waiters.
    """
    if not name.startswith(LABEL_PREFIX):
        return None
    try:
        since, host, pid, thread, encoded = name[len(LABEL_PREFIX) :].split(":", 4)
        key = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
        if not (since.isascii() and since.isdigit()):
            return None
        started = datetime.fromtimestamp(int(since), UTC)
    except (ValueError, OverflowError, OSError):
        return None
    if not (key.startswith(prefix + "{") and key.endswith("}:wake")):
        return None
    return LeaseKeys.name_of(prefix, key, "wake"), started, f"{host}:{pid}:{thread}"


def distinct(found: Iterable[LeaseWaiter]) -> list[LeaseWaiter]:
    """One entry per wait: a thread waits for one name at a time, but the server may still
    list the connection of its previous ``BLPOP`` as blocked, dropped at its deadline and not
    yet reaped, beside the next one's (on the same server or, on Redlock, another node)."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for waiter in found:
        if (waiter.name, waiter.who) not in seen:
            seen.add((waiter.name, waiter.who))
            kept.append(waiter)
    return kept


def waiters(
    alias: str, prefix: str, clients: Iterable[Mapping[str, Any]], where: str
) -> list[LeaseWaiter]:
    """The waits among ``clients`` (``CLIENT LIST`` entries of one server at ``where``), one
    entry per wait (:func:`distinct`)."""
    found = []
    for client in clients:
        if "b" not in str(client.get("flags", "")):
            continue  # not blocked now: a connection named by a wait that has ended
        parsed = _parse(str(client.get("name", "")), prefix)
        if parsed is None:
            continue
        name, since, who = parsed
        found.append(
            LeaseWaiter(
                name=name,
                backend=alias,
                who=who,
                since=since,
                where=f"{where} (client {client.get('addr', '?')})",
            )
        )
    return distinct(found)


class WaitClock:
    """When each thread's current wait for a name began (epoch seconds)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def since(self, name: str, timeout: float) -> float:
        """The start of this thread's wait for ``name``, which lasts ``timeout`` more."""
        waits: dict[str, tuple[float, float]] | None = getattr(self._local, "waits", None)
        if waits is None:
            waits = self._local.waits = {}
        now = time.monotonic()
        began, until = waits.get(name, (0.0, 0.0))
        if now - until > SAME_WAIT:
            began = time.time()
            if len(waits) > 64:  # names waited for long ago
                waits.clear()
        waits[name] = (began, now + timeout)
        return began
