"""One kazoo session on a ZooKeeper ensemble, and the round trips the backend makes on it.

The connection and its state (which :meth:`leases.backends.zookeeper.Backend.doubts` reads),
every request bounded by ``REQUEST_TIMEOUT``, multis that apply whole or not at all, and the
steps on a name's line of contenders (:mod:`._zookeeper_line`): join it (finding our own node
again after a create whose reply was lost), leave it, dislodge a lapsed head, watch a
predecessor. What these mean for a lease is the backend's business (:mod:`.zookeeper`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from kazoo.client import KazooClient, KazooState  # type: ignore[import-untyped]
from kazoo.exceptions import (  # type: ignore[import-untyped]
    BadVersionError,
    ConnectionLoss,
    KazooException,
    NoNodeError,
)
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]
from kazoo.protocol.states import EventType, KeeperState, WatchedEvent  # type: ignore[import-untyped]
from kazoo.security import CREATOR_ALL_ACL, READ_ACL_UNSAFE  # type: ignore[import-untyped]

from ..errors import BackendUnavailable
from ._edge import DriverEdge
from ._zookeeper_line import Queued, child_prefix, deadline_ms, guid_of, line_of, read_data

__all__ = ["ATTEMPTS", "Edge", "Session", "ms", "when"]

_LATEST = datetime(9999, 12, 31, tzinfo=UTC)
#: Bounded retries when the line changes under a step (someone released or joined meanwhile).
ATTEMPTS = 4


def ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def when(epoch_ms: float) -> datetime:
    """A server timestamp for display; absurd expiries (hand-written) clamp to year 9999."""
    try:
        return min(datetime.fromtimestamp(epoch_ms / 1000, UTC), _LATEST)
    except (OverflowError, ValueError, OSError):
        return _LATEST


def _failed(results: list[Any]) -> BaseException | None:
    """The error that aborted a kazoo multi (the others read ``RolledBackError``)."""
    errors = [r for r in results if isinstance(r, BaseException)]
    return next((e for e in errors if type(e).__name__ != "RolledBackError"), None) or (
        errors[0] if errors else None
    )


#: The ACL of every node the backend creates when ``AUTH`` is set: all permissions for the
#: authenticated identity (every app server configured with the same credential), reading
#: for anyone (holders and the line are public, as everywhere in the package). Without it
#: kazoo gives every node "anyone, every permission": ``AUTH`` then authenticated the session
#: but protected nothing, and a client with no credential could delete a holder's node
#: (releasing its lease) or write it (keeping a dead holder's lease alive).
AUTHENTICATED_ACL = [*READ_ACL_UNSAFE, *CREATOR_ALL_ACL]


class Edge(DriverEdge):
    """kazoo's errors become :class:`BackendUnavailable` at the backend's edge."""

    __slots__ = ()

    errors = (KazooException, KazooTimeoutError)


class Session:
    """The backend's kazoo client, made on first use; safe to share between threads."""

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        hosts = options["HOSTS"]
        self.alias = alias
        self.options = options
        self.hosts: str = hosts if isinstance(hosts, str) else ",".join(hosts)
        self.prefix: str = options.get("PREFIX", "/leases")
        self.session_timeout = float(options.get("SESSION_TIMEOUT", 10.0))
        self.request_timeout = float(options.get("REQUEST_TIMEOUT", 5.0))
        self.connect_timeout = float(options.get("CONNECT_TIMEOUT", 10.0))
        self._lock = threading.Lock()
        self._client: Any = None
        #: A client still connecting after its caller stopped waiting, and its start event.
        self._connecting: Any = None
        self._started: Any = None
        #: Set by :meth:`close`, for good: a closed backend never opens a client again.
        self._closed = False
        #: Per thread: the monotonic time past which the caller's call is useless (see
        #: :meth:`bounded`), so a reconnection never waits past it.
        self._bound = threading.local()
        #: kazoo's connection state, kept by its listener (``CONNECTED``/``SUSPENDED``/``LOST``).
        self.state: str = KazooState.LOST
        #: ``(name, guid)`` of creates whose outcome a connection loss hid: swept later.
        self._orphans: set[tuple[str, str]] = set()

    @contextlib.contextmanager
    def bounded(self, seconds: float) -> Iterator[None]:
        """Within the block, a reconnection this thread makes waits at most ``seconds`` (and
        never longer than ``CONNECT_TIMEOUT``): a renewal must not wait past its grant's
        validity, nor an acquisition past its deadline. Nested bounds keep the earliest."""
        outer: float | None = getattr(self._bound, "until", None)
        until = time.monotonic() + seconds
        self._bound.until = until if outer is None else min(outer, until)
        try:
            yield
        finally:
            self._bound.until = outer

    def _connect_within(self) -> float:
        """How long this thread may wait to (re)connect now: ``CONNECT_TIMEOUT`` or less."""
        until: float | None = getattr(self._bound, "until", None)
        if until is None:
            return self.connect_timeout
        return min(self.connect_timeout, until - time.monotonic())

    @property
    def client(self) -> Any:
        """The started kazoo client, made on first use (never at import or by checks).

        kazoo reconnects on its own (to any member in ``HOSTS``, resuming the session while it
        lives, else opening a new one); requests are never retried by it, so a timed-out
        write is reported, not repeated.

        A client whose connection loop ended without our :meth:`close` (kazoo ends it for good
        on an unexpected error, e.g. a reply out of sequence after one was lost on the way) is
        replaced: it would never reconnect, and every later call would fail until a restart.
        Its session, and with it every grant made on it, is over (:meth:`Backend.doubts`
        compares session ids); the server expires its znodes after the session timeout.

        Making a client waits at most ``CONNECT_TIMEOUT``, less within :meth:`bounded` (the
        wait for another thread that is connecting included); after :meth:`close` no client
        is made again and every call fails at once with :class:`BackendUnavailable`.
        """
        if self._closed:
            raise BackendUnavailable(self.alias, "connect: the backend was closed")
        client = self._client
        if client is not None and client.client_state != KeeperState.CLOSED:
            return client  # the common case: no lock, no wait
        if not self._lock.acquire(timeout=max(self._connect_within(), 0.0)):
            raise BackendUnavailable(
                self.alias, "connect: another thread is still connecting, and time is up"
            )
        try:
            return self._connected()
        finally:
            self._lock.release()

    def _connected(self) -> Any:
        """:attr:`client`'s work, under the lock."""
        if self._closed:
            raise BackendUnavailable(self.alias, "connect: the backend was closed")
        dead = self._client
        if dead is not None and dead.client_state == KeeperState.CLOSED:
            self._client = None
            with contextlib.suppress(Exception):  # already stopped: only release it
                dead.stop()
                dead.close()
        if self._client is not None:
            return self._client
        within = self._connect_within()
        if within <= 0:
            raise BackendUnavailable(self.alias, "connect: no time left to reconnect")
        client = self._connecting
        if client is None:  # a client left connecting by an earlier call is waited for again
            auth = [tuple(pair) for pair in self.options.get("AUTH", [])]
            client = KazooClient(
                hosts=self.hosts,
                timeout=self.session_timeout,
                auth_data=auth,
                default_acl=AUTHENTICATED_ACL if auth else None,
                connection_retry={"max_tries": -1, "delay": 0.1, "max_delay": 1.0},
            )
            client.add_listener(self._on_state)
            self._connecting, self._started = client, client.start_async()
        self._started.wait(within)
        if self._closed:  # closed while we waited: close() could not take the lock from us
            self._connecting = None
            client.stop()
            client.close()
            raise BackendUnavailable(self.alias, "connect: the backend was closed")
        if not client.connected:
            # Only this caller's wait ends: kazoo goes on connecting in its own thread, so a
            # connection slower than one call's bound still serves the next call.
            raise BackendUnavailable(
                self.alias,
                f"connect to {self.hosts}: not connected within {within:.3g}s (still trying)",
            )
        self._connecting = None
        with Edge(self.alias, "connect"):
            try:
                self.get(client.ensure_path_async(f"{self.prefix}/names"))
                self.get(client.ensure_path_async(f"{self.prefix}/clock"))
            except BaseException:
                client.stop()
                client.close()
                raise
        self.state = KazooState.CONNECTED
        self._client = client
        if self._closed:  # closed meanwhile, and close() could not take the lock from us
            self._client = None
            client.stop()
            client.close()
            raise BackendUnavailable(self.alias, "connect: the backend was closed")
        return client

    def _on_state(self, state: str) -> None:
        """kazoo's listener (its thread; must not block): remember the state for :meth:`doubts`."""
        self.state = state

    def session(self) -> int:
        ids = self.client.client_id
        return int(ids[0]) if ids else 0

    def name_path(self, name: str) -> str:
        # Quoted so "/" and the path components "." and ".." cannot escape the name node.
        return f"{self.prefix}/names/{quote(name, safe='').replace('.', '%2E')}"

    def get(self, result: Any) -> Any:
        """Wait for one kazoo request, bounded by ``REQUEST_TIMEOUT``: every wait has a deadline.

        When a reply is lost and the next one arrives out of sequence, kazoo fails the pending
        request with a bare ``RuntimeError`` ("xids do not match") and drops the connection.
        For the caller that is a connection loss (whether the request was applied is unknown),
        so it is raised as one: the callers' recovery (look for the node by its GUID) and the
        edge's translation to ``BackendUnavailable`` then apply, instead of a ``RuntimeError``
        escaping the package's exceptions.
        """
        try:
            return result.get(timeout=self.request_timeout)
        except RuntimeError as exc:
            raise ConnectionLoss(f"reply out of sequence: {exc.args}") from exc

    def commit(self, ops: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Run one multi: all of ``ops`` or none; raises the operation's error if aborted."""
        txn = self.client.transaction()
        for op, args in ops:
            getattr(txn, op)(*args)
        results: list[Any] = self.get(txn.commit_async())
        error = _failed(results)
        if error is not None:
            raise error
        return results

    def line(self, name: str) -> tuple[list[str], Any]:
        """The name's line (first first) and the name node's stat; raises ``NoNodeError``."""
        children, stat = self.get(
            self.client.get_children_async(self.name_path(name), include_data=True)
        )
        return line_of(children), stat

    def server_now(self) -> int:
        """The leader's clock (ms since the epoch), read as the ``mtime`` of a write: the
        only clock a ZooKeeper client can read, and the one TTLs are measured on."""
        return int(self.get(self.client.set_async(f"{self.prefix}/clock", b"")).mtime)

    def bump(self, name: str) -> tuple[str, tuple[Any, ...]]:
        """The name node write that goes with every delete of a head (see ``deadline_ms``)."""
        return ("set_data", (self.name_path(name), b""))

    def join(self, name: str, secret: str, data: bytes) -> tuple[str, Any, list[str], Any]:
        """Create our contender node and read the line, pipelined in one round trip: requests
        of a session are answered in order, so the line read includes our node.

        After a connection loss (or a timeout) the create may have been applied with its reply
        lost: the line is read again and our node found by its GUID, so no orphan contender
        is left behind; if even that fails, the GUID is kept for :meth:`_sweep`.
        """
        self.sweep()
        path = self.name_path(name)
        for _ in range(ATTEMPTS):
            create = self.client.create_async(
                f"{path}/{child_prefix(secret)}", data, ephemeral=True, sequence=True,
                include_data=True,
            )  # fmt: skip
            line = self.client.get_children_async(path, include_data=True)
            try:
                created, stat = self.get(create)
            except NoNodeError:
                self.client.ensure_path(path)
                continue
            except (ConnectionLoss, KazooTimeoutError):
                found = self.find(name, secret)
                if found is None:
                    continue  # not applied: create again
                created, stat = found
            else:
                with contextlib.suppress(ConnectionLoss, KazooTimeoutError, NoNodeError):
                    children, node = self.get(line)
                    return created.rsplit("/", 1)[1], stat, line_of(children), node
            children, node = self.line(name)
            return created.rsplit("/", 1)[1], stat, children, node
        raise BackendUnavailable(self.alias, f"could not join the line of {name!r}")

    def find(self, name: str, secret: str) -> tuple[str, Any] | None:
        """Our node in the line, found by its GUID after a create whose reply was lost."""
        try:
            children, _ = self.line(name)
            mine = [c for c in children if c.startswith(child_prefix(secret))]
            if not mine:
                return None
            path = f"{self.name_path(name)}/{mine[0]}"
            return path, self.get(self.client.exists_async(path))
        except NoNodeError:
            return None  # no name node: the create (a child of it) is not there to be found
        except (ConnectionLoss, KazooTimeoutError):
            self._orphans.add((name, guid_of(secret)))
            raise

    def sweep(self) -> None:
        """Delete nodes left by creates whose outcome was unknown (best effort, rare).

        Stops at the first request that fails: the creates were left unknown by an ensemble
        that did not answer, which most likely still does not, and each further read would
        cost the join a whole request timeout more (every failed try adding an orphan, every
        acquire took one timeout longer than the one before). The rest wait for a sweep that
        can reach it."""
        for name, guid in list(self._orphans):
            try:
                children, _ = self.line(name)
                for child in children:
                    if guid in child:
                        self.get(self.client.delete_async(f"{self.name_path(name)}/{child}"))
            except NoNodeError:
                pass  # no name node: nothing of ours under it
            except (KazooException, KazooTimeoutError):
                return
            self._orphans.discard((name, guid))

    def leave(self, name: str, child: str) -> None:
        with contextlib.suppress(NoNodeError):
            self.get(self.client.delete_async(f"{self.name_path(name)}/{child}"))

    def dislodge(self, name: str, line: list[str], node: Any) -> int | None:
        """Delete the head if it lapsed on the leader's clock. Returns the live head's deadline
        (ms, leader's clock), or ``None`` when the line changed (the head deleted by us, or
        meanwhile by someone else) and must be read again.

        The delete is conditional on the version read, so a renewal or promotion that lands
        first wins; the local clock only spares the clock round trip while the head is alive.
        """
        head = f"{self.name_path(name)}/{line[0]}"
        try:
            raw, stat = self.get(self.client.get_async(head))
        except NoNodeError:
            return None
        deadline = deadline_ms(stat, read_data(raw), node)
        if time.time() * 1000 < deadline or self.server_now() < deadline:
            return deadline
        with contextlib.suppress(BadVersionError, NoNodeError):
            self.commit([("delete", (head, stat.version)), self.bump(name)])
        return None

    def watch(self, path: str, place: Queued) -> Any:
        """Watch ``path`` for its deletion only: ZooKeeper's watch also fires when the node's
        data changes (its holder renews, or it is promoted), which is re-armed here instead of
        waking the waiter for nothing. Returns the ``exists`` request (its stat, or ``None``)."""

        def fired(event: WatchedEvent) -> None:
            if event.type != EventType.CHANGED:
                place.wake()
                return
            # On kazoo's thread: never block. Gone before the watch was set again: wake.
            self.client.exists_async(path, watch=fired).rawlink(rearmed)

        def rearmed(result: Any) -> None:
            if not result.successful() or result.value is None:
                place.wake()

        return self.client.exists_async(path, watch=fired)

    @property
    def opened(self) -> Any:
        """The kazoo client if it was started (``None`` before first use and after close)."""
        return self._client

    def close(self) -> None:
        """Stop the client, for good. A thread waiting for a connection keeps the lock: it
        sees the flag when its wait ends and stops that client itself, so close never waits
        out someone else's connection."""
        self._closed = True
        if not self._lock.acquire(timeout=0.1):
            return
        try:
            clients = [self._client, self._connecting]
            self._client = self._connecting = None
        finally:
            self._lock.release()
        for client in clients:
            if client is not None:
                client.stop()
                client.close()
