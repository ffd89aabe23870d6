"""Redlock's nodes: a request sent to every Redis server at once, replies read by one deadline.

Sending never waits on a node (connections make no handshake), so the nodes work in parallel
and a hung one costs no more than a live one until the replies are read; replies nobody waits
for (a failed try's unlock, the nodes beyond a quorum that already decided) are read by one
persistent thread, never a thread per call.
Commands are packed here and go out on connections each node keeps between round trips
(:class:`~leases.backends._redis_conn.Connections`): with N nodes a try pays the client's share
of a round trip N times, so that share is kept small.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis
from redis.exceptions import NoScriptError

from .._fdwait import readable_among
from ._redis_conn import Connections, Script, load_and_rerun, pack
from ._redis_io import (
    CLOSED_UNDER,
    POOL,
    connect,
    name_back_due,
    parsed,
    read_name_back,
    read_within,
    send_labelled,
)

__all__ = ["FAILED", "Node", "OnReply", "Pending", "ReplyDrain", "gather", "node_value"]

logger = logging.getLogger("leases")

#: What :meth:`Node.answer` returns for a node that failed or did not answer in time.
FAILED = object()


def node_value(holder: str, secret: str) -> str:
    """What a grant sets on the nodes: ``sha1(secret):holder``. Unique per grant, and only the
    secret's owner can prove it is theirs (the scripts hash what renew and release present,
    as :data:`~leases.backends._redis_scripts.RENEW_LUA` does): the nodes never hold the secret."""
    return f"{hashlib.sha1(secret.encode(), usedforsecurity=False).hexdigest()}:{holder}"


class Node:
    """One Redis server's client (no retries, the short node timeout, no connect handshake).

    ``scripts`` are the scripts sent to it by SHA1 (``EVALSHA``, see :meth:`answer`)."""

    def __init__(
        self, alias: str, location: str, timeout: float, scripts: Iterable[Script] = ()
    ) -> None:
        url = location if "://" in location else None
        self.location = location
        self.client: Any = connect(
            alias, None if url else location, url, timeout, handshake=False, max_connections=POOL
        )
        self.connections = Connections(self.client.connection_pool)
        self.scripts = {script.sha: script for script in scripts}

    def send(
        self, command: tuple[object, ...], label: str | None = None, packed: bytes = b""
    ) -> Any:
        """Send ``command`` without waiting; ``None`` if the node could not be reached.
        ``label`` names the connection first (see :func:`~._redis_io.send`); ``packed`` is
        ``command`` already packed (:func:`~._redis_conn.pack`: once for every node).

        On one of the node's kept connections, whatever the command: a labelled one (a wait)
        taken from the pool instead went back to the kept ones after its reply, so until
        :attr:`~._redis_conn.Connections.KEEP` were kept, each wait made a new connection."""
        try:
            connection = self.connections.take()
        except (redis.RedisError, OSError):
            return None
        try:
            if label is None:
                connection.send_packed_command([packed or pack(command)], check_health=False)
            else:
                send_labelled(connection, command, label)
        except BaseException as exc:
            connection.disconnect()
            self.connections.give(connection)
            if isinstance(exc, (redis.RedisError, OSError, *CLOSED_UNDER)):
                return None
            raise
        return connection

    def answer(self, connection: Any, command: tuple[object, ...], deadline: float) -> Any:
        """The reply to ``command`` sent on ``connection`` by ``deadline``, or :data:`FAILED`.

        A reply that arrived while an earlier node was awaited is read at once (the last
        millisecond is granted even past the deadline, for one already in the socket).
        ``NOSCRIPT`` to an ``EVALSHA`` of one of :attr:`scripts` (a restarted server, ``SCRIPT
        FLUSH``) loads it on this connection and runs it again, by the same deadline."""
        if connection is None:
            return FAILED
        name_back = name_back_due(connection)
        try:
            response = self._reply(connection, command, deadline)
            if name_back:
                read_name_back(connection, None)
        except BaseException as exc:
            connection.disconnect()  # its reply, if any, is never read
            # A connection closed under the read (close() on another thread) is a node that
            # did not answer, never redis-py's raw ValueError/AttributeError (see CLOSED_UNDER).
            if isinstance(exc, (redis.RedisError, OSError, *CLOSED_UNDER)):
                return FAILED
            raise
        finally:
            self.connections.give(connection)
        return parsed(self.client, command, response)

    def _reply(self, connection: Any, command: tuple[object, ...], deadline: float) -> Any:
        """The raw reply, its script loaded and run again where the server lacked it."""
        try:
            return read_within(connection, max(0.001, deadline - time.monotonic()))
        except NoScriptError:
            script = self.scripts.get(str(command[1])) if command[0] == "EVALSHA" else None
            if script is None:
                raise
            return load_and_rerun(connection, script, [pack(command)], deadline)

    def close(self) -> None:
        self.connections.close()
        if "://" in self.location:
            self.client.close()


class ReplyDrain:
    """One thread per backend and process that reads the replies no caller waits for.

    A try that failed gives its key back on every node, but must not wait another node
    timeout for hung nodes to confirm: it sends the unlock and hands the connections here,
    where the replies are read (bounded by the same deadline) and the connections returned to
    their pools. Persistent, never a thread per call; made again in a forked child.

    :meth:`later` hands it a request to *send* (a give-back): it goes out once the replies
    queued before it are read, so on each node it runs after the commands those replies answer
    (a node orders only the commands of one connection), and on the connections their reading
    gave back rather than on new ones a busy pool may refuse.

    A job may come with ``on_reply``, called with each node and the reply read from it (or
    :data:`FAILED`): the only place that learns when a command left unread has run, since a
    node runs the commands of different connections in no promised order (see
    :meth:`~leases.backends.redlock.Backend.try_acquire`).
    """

    def __init__(self, alias: str) -> None:
        self._name = f"leases-redlock-{alias}"
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Job | Callable[[], Pending] | None] = queue.SimpleQueue()
        self._pid = 0

    def put(self, pending: Pending, on_reply: OnReply | None = None) -> None:
        """Read the replies of ``pending`` (telling ``on_reply`` of each, if given)."""
        self._enqueue((pending, on_reply))

    def later(self, send: Callable[[], Pending]) -> None:
        """Call ``send`` on this thread after every job queued before, then read its replies."""
        self._enqueue(send)

    def _enqueue(self, item: Job | Callable[[], Pending]) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._queue, self._pid = queue.SimpleQueue(), os.getpid()
                reader = threading.Thread(
                    target=self._run, args=(self._queue,), name=self._name, daemon=True
                )
                reader.start()
            self._queue.put(item)

    @staticmethod
    def _run(jobs: queue.SimpleQueue[Job | Callable[[], Pending] | None]) -> None:
        while (job := jobs.get()) is not None:
            if callable(job):  # sent now, read once the jobs queued meanwhile are
                try:
                    jobs.put((job(), None))
                except Exception as exc:
                    logger.debug("leases: a give-back could not be sent: %r", exc)
                continue
            (sent, command, deadline), on_reply = job
            for node, connection in sent:
                reply = FAILED
                try:
                    reply = node.answer(connection, command, deadline)
                except Exception as exc:  # e.g. its client was closed meanwhile: never die
                    logger.debug("leases: unlock reply from %s lost: %r", node.location, exc)
                if on_reply is not None:
                    try:
                        on_reply(node, reply)
                    except Exception as exc:
                        logger.debug("leases: after the reply from %s: %r", node.location, exc)

    def stop(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                self._queue.put(None)
            self._pid = 0


#: Commands in flight: (node, connection) pairs, the command, and the deadline for replies.
Pending = tuple[list[tuple[Node, Any]], tuple[object, ...], float]
#: Called by the drain with each node and the reply it read from it.
OnReply = Callable[[Node, Any], None]
#: A drain job: what is pending, and who is told of each reply.
Job = tuple[Pending, OnReply | None]


def _ready(waiting: list[tuple[Node, Any]], deadline: float) -> list[tuple[Node, Any]]:
    """The pairs whose reply has begun to arrive, waiting for one until ``deadline``; all of
    them when that cannot be told (a connection closed under it) or the deadline passed:
    :meth:`Node.answer` then bounds each read itself."""
    try:
        fds = [connection._sock.fileno() for _, connection in waiting]
        if min(fds, default=0) < 0:
            return waiting  # a socket closed under it
        ready = readable_among(fds, max(0.0, deadline - time.monotonic()))
    except (OSError, ValueError, TypeError, AttributeError):
        return waiting
    if not ready:
        return waiting
    return [pair for pair, fd in zip(waiting, fds, strict=True) if fd in ready]


def gather(
    pending: Pending,
    decided: Callable[[list[Any]], bool],
    said: list[tuple[Node, Any]] | None = None,
) -> tuple[list[Any], list[tuple[Node, Any]]]:
    """The replies of ``pending`` in the order they arrive, until ``decided`` says the ones
    read so far settle the outcome (a quorum granted), or all are read.

    Returns the replies read and the (node, connection) pairs left unread: the caller hands
    those to :class:`ReplyDrain`, so a grant or a release waits for the fastest quorum, not
    for the slowest node (on a loaded machine the last node's reply can come a scheduler
    slice later; a hung node costs a whole node timeout). Replies are read as they become
    readable, so a slow first node does not hold up the others. ``said``, if given, gets each
    node read and its reply.
    """
    sent, command, deadline = pending
    answers: list[Any] = []
    waiting: list[tuple[Node, Any]] = []
    for node, connection in sent:
        if connection is None:
            answers.append(FAILED)
        else:
            waiting.append((node, connection))
    while waiting and not decided(answers):
        for pair in _ready(waiting, deadline):
            waiting.remove(pair)
            node, connection = pair
            answers.append(node.answer(connection, command, deadline))
            if said is not None:
                said.append((node, answers[-1]))
            if decided(answers):
                break
    return answers, waiting
