"""Leases in a ZooKeeper ensemble, on kazoo: the lock recipe, one sequential znode per contender.

Configuration (``LEASES["BACKENDS"][alias]``)::

    {"ENGINE": "leases.backends.zookeeper", "HOSTS": "zk1:2181,zk2:2181,zk3:2181"}

Options: ``HOSTS`` (kazoo's connection string, a chroot suffix ``/path`` allowed, or a list of
``host:port``), ``PREFIX`` (the znode under which names live, default ``"/leases"``),
``SESSION_TIMEOUT`` (seconds, default 10; must lie within the servers' min/max session timeout,
2 and 20 ticks by default, or the server negotiates another and the client cannot see it),
``CONNECT_TIMEOUT`` and ``REQUEST_TIMEOUT`` (seconds, default 10 and 5), ``AUTH`` (a list of
``(scheme, credential)`` pairs handed to kazoo, e.g. ``[("digest", "user:password")]``).

Layout: ``<prefix>/names/<quoted name>`` is a persistent *name node*; its ephemeral sequential
children ``c-<guid>-<sequence>`` are the *line* of contenders (:mod:`._zookeeper_line`), and the
first of them holds the name once its data says ``"held": true``. A contender watches only its
predecessor, so a release wakes the next in line and nobody else (no herd). ``<prefix>/clock``
is written to read the leader's clock.

**The token is the holder's znode's ``czxid``**: the zxid of the transaction that created it,
``epoch << 32 | counter``, which the ensemble orders totally and never reuses, across leader
elections and restarts. The line is in creation order, so each holder's node is younger than
its predecessor's: tokens of a name strictly increase with no counter of ours to lose. Not the
32-bit sequence suffix, which is per parent and wraps.

**TTL.** A lease has two ends, whichever comes first: its session (the znode is ephemeral: a
dead or partitioned holder's session expires ``SESSION_TIMEOUT`` after the ensemble last heard
from it) and its TTL on the leader's clock (the node's ``mtime`` plus ``ttl_ms``). The granted
TTL is ``min(ttl, SESSION_TIMEOUT)`` and the grant says so: past the session timeout the server
may drop the znode while the holder, counting from its last renewal, would still trust it. Only
the contender right behind a lapsed head, having read the leader's clock, deletes it, in a multi
conditional on the version it read (a renewal meanwhile changes it).

**Sessions.** ``SUSPENDED`` (connection lost, the session perhaps alive) makes every grant of
the session untrusted (:meth:`Backend.doubts`: ``ensure_held()`` fails) until ``CONNECTED``
again within its validity; ``LOST`` (the session expired, its znodes are gone) loses them.

**Round trips.** An uncontended acquire, a renewal and a release are one each (a create
pipelined with the read of the line; a read pipelined with the write; a multi). A failed try
costs three (it leaves the line again); a waiter in the line costs none until its predecessor
changes, then two to promote itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, NoReturn
from urllib.parse import quote, unquote

from kazoo.client import KazooClient, KazooState  # type: ignore[import-untyped]
from kazoo.exceptions import (  # type: ignore[import-untyped]
    BadVersionError,
    ConnectionLoss,
    KazooException,
    NodeExistsError,
    NoNodeError,
)
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]
from kazoo.protocol.states import EventType, WatchedEvent  # type: ignore[import-untyped]

from ..errors import BackendUnavailable, LeaseLost, LeaseNotHeld
from ._zookeeper_line import (
    Queued,
    child_prefix,
    deadline_ms,
    guid_of,
    line_of,
    node_data,
    read_data,
)
from .base import FORGED, Capability, Grant, LeaseBackend, LeaseInfo, new_secret, not_revoked

__all__ = ["Backend"]

_LATEST = datetime(9999, 12, 31, tzinfo=UTC)
#: How long a queued waiter whose turn came may take to claim it (capped by the session
#: timeout) before the next in line dislodges it: a stalled waiter must not hold the line.
_CLAIM_WINDOW = 2.0
#: Bounded retries when the line changes under a step (someone released or joined meanwhile).
_ATTEMPTS = 4


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _when(epoch_ms: float) -> datetime:
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


class _Edge:
    """Translate kazoo's errors into :class:`BackendUnavailable` at the backend's edge."""

    __slots__ = ("alias", "what")

    def __init__(self, alias: str, what: str) -> None:
        self.alias, self.what = alias, what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, KazooException | KazooTimeoutError):
            detail = f"{self.what}: {type(exc).__name__}: {exc}"
            raise BackendUnavailable(self.alias, detail) from exc


class Backend(LeaseBackend):
    """Leases on a ZooKeeper ensemble: one kazoo session per backend instance."""

    capabilities = frozenset(
        {Capability.NATIVE_FENCING, Capability.WAIT_WITHOUT_POLLING, Capability.FORCE_RELEASE}
    )
    known_options = frozenset(
        {"HOSTS", "PREFIX", "SESSION_TIMEOUT", "CONNECT_TIMEOUT", "REQUEST_TIMEOUT", "AUTH"}
    )

    @classmethod
    def check_options(cls, alias: str, options: Mapping[str, Any]) -> list[str]:
        """Also: ``HOSTS`` given, an absolute ``PREFIX``, positive timeouts, ``AUTH`` pairs."""
        problems = super().check_options(alias, options)
        where = f'LEASES["BACKENDS"][{alias!r}]'
        hosts = options.get("HOSTS")
        if not hosts or not isinstance(hosts, str | list | tuple):
            problems.append(f'{where} needs "HOSTS", e.g. "zk1:2181,zk2:2181,zk3:2181"')
        prefix = options.get("PREFIX", "/leases")
        if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/"):
            problems.append(f'{where}["PREFIX"] must be an absolute znode path like "/leases"')
        for option, default in (("SESSION_TIMEOUT", 10.0), ("CONNECT_TIMEOUT", 10.0)):
            value = options.get(option, default)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                problems.append(f"{where}[{option!r}] must be a positive number of seconds")
        value = options.get("REQUEST_TIMEOUT", 5.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            problems.append(f"{where}['REQUEST_TIMEOUT'] must be a positive number of seconds")
        auth = options.get("AUTH", [])
        if not isinstance(auth, list | tuple) or not all(
            isinstance(pair, list | tuple) and len(pair) == 2 for pair in auth
        ):
            problems.append(f'{where}["AUTH"] must be a list of (scheme, credential) pairs')
        return problems

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        hosts = options["HOSTS"]
        self.hosts: str = hosts if isinstance(hosts, str) else ",".join(hosts)
        self.prefix: str = options.get("PREFIX", "/leases")
        self.session_timeout = float(options.get("SESSION_TIMEOUT", 10.0))
        self.request_timeout = float(options.get("REQUEST_TIMEOUT", 5.0))
        self._claim_ms = _ms(min(_CLAIM_WINDOW, self.session_timeout))
        self._lock = threading.Lock()
        self._client: Any = None
        #: kazoo's connection state, kept by its listener (``CONNECTED``/``SUSPENDED``/``LOST``).
        self._state: str = KazooState.LOST
        #: Each thread's places in lines, by name, while it is in a name's waiting room.
        self._places = threading.local()
        #: ``(name, guid)`` of creates whose outcome a connection loss hid: swept later.
        self._orphans: set[tuple[str, str]] = set()

    @property
    def client(self) -> Any:
        """The started kazoo client, made on first use (never at import or by checks).

        kazoo reconnects on its own (to any member in ``HOSTS``, resuming the session while it
        lives, else opening a new one); requests are never retried by it, so a timed-out
        write is reported, not repeated.
        """
        with self._lock:
            if self._client is None:
                client = KazooClient(
                    hosts=self.hosts,
                    timeout=self.session_timeout,
                    auth_data=[tuple(pair) for pair in self.options.get("AUTH", [])],
                    connection_retry={"max_tries": -1, "delay": 0.1, "max_delay": 1.0},
                )
                client.add_listener(self._on_state)
                with _Edge(self.alias, "connect"):
                    try:
                        client.start(timeout=float(self.options.get("CONNECT_TIMEOUT", 10.0)))
                        client.ensure_path(f"{self.prefix}/names")
                        client.ensure_path(f"{self.prefix}/clock")
                    except BaseException:
                        client.stop()
                        client.close()
                        raise
                self._state = KazooState.CONNECTED
                self._client = client
            return self._client

    def _on_state(self, state: str) -> None:
        """kazoo's listener (its thread; must not block): remember the state for :meth:`doubts`."""
        self._state = state

    def _session(self) -> int:
        ids = self.client.client_id
        return int(ids[0]) if ids else 0

    def doubts(self, grant: Grant) -> str | None:
        """Suspended: the ensemble may have expired the session (and our znode) without our
        hearing of it, so the grant is not trusted until the connection is back. A new session
        (the old one expired: ``LOST``) means the znode is gone."""
        session = grant.extra.get("session")
        if session is None:
            return None
        client = self._client
        if client is None:
            return "its ZooKeeper client was closed"
        if self._state != KazooState.CONNECTED:
            return (
                "the ZooKeeper connection is suspended: the session (and the lease's znode) may "
                "have expired on the ensemble; not trusted until reconnected"
            )
        ids = client.client_id
        if not ids or ids[0] != session:
            return "the ZooKeeper session that owned its znode expired"
        return None

    # -- paths and round trips ------------------------------------------------------------

    def _name_path(self, name: str) -> str:
        # Quoted so "/" and the path components "." and ".." cannot escape the name node.
        return f"{self.prefix}/names/{quote(name, safe='').replace('.', '%2E')}"

    def _node_path(self, grant: Grant) -> str | None:
        """The path of ``grant``'s znode, computable only with its secret (``None`` if the
        grant carries no sequence: it was not made by this backend)."""
        child = grant.extra.get("child")
        if not grant.secret or not isinstance(child, str):
            return None
        if not child.startswith(child_prefix(grant.secret)):
            return None
        return f"{self._name_path(grant.name)}/{child}"

    def _get(self, result: Any) -> Any:
        """Wait for one kazoo request, bounded by ``REQUEST_TIMEOUT``: every wait has a deadline."""
        return result.get(timeout=self.request_timeout)

    def _commit(self, ops: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Run one multi: all of ``ops`` or none; raises the operation's error if aborted."""
        txn = self.client.transaction()
        for op, args in ops:
            getattr(txn, op)(*args)
        results: list[Any] = self._get(txn.commit_async())
        error = _failed(results)
        if error is not None:
            raise error
        return results

    def _line(self, name: str) -> tuple[list[str], Any]:
        """The name's line (first first) and the name node's stat; raises ``NoNodeError``."""
        children, stat = self._get(
            self.client.get_children_async(self._name_path(name), include_data=True)
        )
        return line_of(children), stat

    def _server_now(self) -> int:
        """The leader's clock (ms since the epoch), read as the ``mtime`` of a write: the
        only clock a ZooKeeper client can read, and the one TTLs are measured on."""
        return int(self._get(self.client.set_async(f"{self.prefix}/clock", b"")).mtime)

    def _bump(self, name: str) -> tuple[str, tuple[Any, ...]]:
        """The name node write that goes with every delete of a head (see ``deadline_ms``)."""
        return ("set_data", (self._name_path(name), b""))

    # -- joining the line -----------------------------------------------------------------

    def _join(self, name: str, secret: str, data: bytes) -> tuple[str, Any, list[str], Any]:
        """Create our contender node and read the line, pipelined in one round trip: requests
        of a session are answered in order, so the line read includes our node.

        After a connection loss (or a timeout) the create may have been applied with its reply
        lost: the line is read again and our node found by its GUID, so no orphan contender
        is left behind; if even that fails, the GUID is kept for :meth:`_sweep`.
        """
        self._sweep()
        path = self._name_path(name)
        for _ in range(_ATTEMPTS):
            create = self.client.create_async(
                f"{path}/{child_prefix(secret)}", data, ephemeral=True, sequence=True,
                include_data=True,
            )  # fmt: skip
            line = self.client.get_children_async(path, include_data=True)
            try:
                created, stat = self._get(create)
            except NoNodeError:
                self.client.ensure_path(path)
                continue
            except (ConnectionLoss, KazooTimeoutError):
                found = self._find(name, secret)
                if found is None:
                    continue  # not applied: create again
                created, stat = found
            else:
                with contextlib.suppress(ConnectionLoss, KazooTimeoutError, NoNodeError):
                    children, node = self._get(line)
                    return created.rsplit("/", 1)[1], stat, line_of(children), node
            children, node = self._line(name)
            return created.rsplit("/", 1)[1], stat, children, node
        raise BackendUnavailable(self.alias, f"could not join the line of {name!r}")

    def _find(self, name: str, secret: str) -> tuple[str, Any] | None:
        """Our node in the line, found by its GUID after a create whose reply was lost."""
        try:
            children, _ = self._line(name)
            mine = [c for c in children if c.startswith(child_prefix(secret))]
            if not mine:
                return None
            path = f"{self._name_path(name)}/{mine[0]}"
            return path, self._get(self.client.exists_async(path))
        except (ConnectionLoss, KazooTimeoutError):
            self._orphans.add((name, guid_of(secret)))
            raise

    def _sweep(self) -> None:
        """Delete nodes left by creates whose outcome was unknown (best effort, rare)."""
        for name, guid in list(self._orphans):
            with contextlib.suppress(KazooException, KazooTimeoutError):
                children, _ = self._line(name)
                for child in children:
                    if guid in child:
                        self._get(self.client.delete_async(f"{self._name_path(name)}/{child}"))
                self._orphans.discard((name, guid))

    def _leave(self, name: str, child: str) -> None:
        with contextlib.suppress(NoNodeError):
            self._get(self.client.delete_async(f"{self._name_path(name)}/{child}"))

    def _dislodge(self, name: str, line: list[str], node: Any) -> int | None:
        """Delete the head if it lapsed on the leader's clock. Returns the live head's deadline
        (ms, leader's clock), or ``None`` when the line changed (the head deleted by us, or
        meanwhile by someone else) and must be read again.

        The delete is conditional on the version read, so a renewal or promotion that lands
        first wins; the local clock only spares the clock round trip while the head is alive.
        """
        head = f"{self._name_path(name)}/{line[0]}"
        try:
            raw, stat = self._get(self.client.get_async(head))
        except NoNodeError:
            return None
        deadline = deadline_ms(stat, read_data(raw), node)
        if time.time() * 1000 < deadline or self._server_now() < deadline:
            return deadline
        with contextlib.suppress(BadVersionError, NoNodeError):
            self._commit([("delete", (head, stat.version)), self._bump(name)])
        return None

    def _granted(
        self, name: str, holder: str, ttl: float, sent_at: float, child: str, secret: str, stat: Any
    ) -> Grant:
        extra = {"child": child, "session": self._session()}
        expires = _when(stat.mtime + _ms(ttl))
        return Grant(name, holder, stat.czxid, ttl, sent_at, expires, extra, secret)

    # -- the interface --------------------------------------------------------------------

    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        granted = min(ttl, self.session_timeout)
        place = self._place(name)
        with _Edge(self.alias, "acquire"):
            if place is not None:
                return self._claim(place, holder, granted)
            secret = new_secret()
            sent_at = time.monotonic()
            data = node_data(held=True, ttl_ms=_ms(granted), holder=holder)
            child, stat, line, node = self._join(name, secret, data)
            try:
                for _ in range(_ATTEMPTS):
                    if line and line[0] == child:
                        return self._granted(name, holder, granted, sent_at, child, secret, stat)
                    if child not in line[1:2] or self._dislodge(name, line, node) is not None:
                        break
                    line, node = self._line(name)
            except BaseException:
                self._leave(name, child)
                raise
            self._leave(name, child)  # a failed try leaves nothing behind
        return None

    def _claim(self, place: Queued, holder: str, ttl: float) -> Grant | None:
        """A queued waiter's try: free of round trips until its predecessor changed (or may
        have lapsed); then, if first in line, promote its node to the grant."""
        if (
            place.checked
            and not place.woken.is_set()
            and (place.check_at_ms is None or time.time() * 1000 < place.check_at_ms)
            and self._state == KazooState.CONNECTED
            and self._session() == place.session
        ):
            return None
        place.checked, place.check_at_ms = True, None
        place.woken.clear()
        path = self._name_path(place.name)
        for _ in range(_ATTEMPTS):
            line, node = self._line(place.name)
            if place.child not in line:
                self._requeue(place)  # revoked, dislodged, or its session expired
                return None
            ahead = line.index(place.child)
            if ahead == 0:
                sent_at = time.monotonic()
                data = node_data(held=True, ttl_ms=_ms(ttl), holder=holder)
                try:
                    stat = self._get(self.client.set_async(f"{path}/{place.child}", data))
                except NoNodeError:
                    self._requeue(place)
                    return None
                place.granted = True
                child, secret = place.child, place.secret
                return self._granted(place.name, holder, ttl, sent_at, child, secret, stat)
            deadline = self._dislodge(place.name, line, node) if ahead == 1 else None
            if ahead == 1 and deadline is None:
                continue  # the head lapsed and is gone: look again
            # Only the predecessor is watched: its deletion wakes us and nobody else. A head
            # predecessor may also lapse without a deletion: look again at its deadline.
            if self._get(self._watch(f"{path}/{line[ahead - 1]}", place)) is None:
                continue
            place.check_at_ms = deadline
            return None
        return None

    def _watch(self, path: str, place: Queued) -> Any:
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

    def _requeue(self, place: Queued) -> None:
        """Join the line again at its end (our node is gone); a new node, a new secret."""
        place.secret = new_secret()
        data = node_data(held=False, ttl_ms=self._claim_ms)
        place.child, stat, _, _ = self._join(place.name, place.secret, data)
        place.czxid, place.session, place.checked = stat.czxid, self._session(), False

    def _place(self, name: str) -> Queued | None:
        places: dict[str, Queued] = getattr(self._places, "by_name", {})
        return places.get(name)

    @contextlib.contextmanager
    def _queued(self, name: str) -> Iterator[None]:
        places: dict[str, Queued] = self._places.__dict__.setdefault("by_name", {})
        if name in places:
            yield
            return
        secret = new_secret()
        try:
            with _Edge(self.alias, "queue"):
                data = node_data(held=False, ttl_ms=self._claim_ms)
                child, stat, _, _ = self._join(name, secret, data)
        except BackendUnavailable:
            yield  # best effort: without a place, tries join and leave the line each time
            return
        place = places[name] = Queued(name, child, secret, stat.czxid, self._session())
        try:
            yield
        finally:
            del places[name]
            if not place.granted:
                with contextlib.suppress(KazooException, KazooTimeoutError):
                    self._leave(name, place.child)

    def waiting_room(
        self, name: str, timeout: float | None
    ) -> contextlib.AbstractContextManager[None]:
        """A place in the name's line for this thread while it waits: tries cost nothing until
        the predecessor changes, and a release wakes only the next in line."""
        return self._queued(name)

    def renew(self, grant: Grant, ttl: float) -> Grant:
        """One round trip: a read of our node pipelined with its write. The leader accepts the
        write only on a live session; the read says whether it had lapsed just before."""
        granted = min(ttl, self.session_timeout)
        path = self._node_path(grant)
        with _Edge(self.alias, "renew"):
            if path is None:
                self._refuse(grant, "renewal")
            data = node_data(held=True, ttl_ms=_ms(granted), holder=grant.holder)
            sent_at = time.monotonic()
            before = self.client.get_async(path)
            write = self.client.set_async(path, data)
            try:
                raw, stat = self._get(before)
                renewed = self._get(write)
            except NoNodeError:
                self._refuse(grant, "renewal")
            if renewed.mtime > deadline_ms(stat, read_data(raw), stat):
                # It had lapsed on the leader's clock; a contender may be dislodging it.
                with contextlib.suppress(NoNodeError, BadVersionError):
                    self._commit([("delete", (path, renewed.version)), self._bump(grant.name)])
                raise LeaseLost(grant.name, grant.token, "expired before the renewal")
        expires = _when(renewed.mtime + _ms(granted))
        return replace(grant, ttl=granted, sent_at=sent_at, expires_at=expires)

    def _refuse(self, grant: Grant, what: str) -> NoReturn:
        """Why ``grant``'s node is not where its secret says: a forgery of the current
        holder's public data (``LeaseNotHeld``), or a grant that is gone (``LeaseLost``)."""
        try:
            line, _ = self._line(grant.name)
            raw, stat = self._get(self.client.get_async(f"{self._name_path(grant.name)}/{line[0]}"))
        except (NoNodeError, IndexError):
            raise LeaseLost(
                grant.name, grant.token, f"expired or taken over before the {what}"
            ) from None
        data = read_data(raw)
        if data.get("held") and stat.czxid == grant.token and data.get("holder") == grant.holder:
            raise LeaseNotHeld(grant.name, FORGED)
        raise LeaseLost(grant.name, grant.token, f"expired or taken over before the {what}")

    def release(self, grant: Grant) -> None:
        """Delete our node (the path proves the secret) and write the name node, in one
        multi; the deletion wakes only the next in line (its watch on us)."""
        path = self._node_path(grant)
        with _Edge(self.alias, "release"):
            if path is None:
                self._refuse(grant, "release")
            try:
                self._commit([("delete", (path,)), self._bump(grant.name)])
            except NoNodeError:
                self._refuse(grant, "release")

    def wait_for_release(self, name: str, timeout: float) -> bool:
        """In the waiting room: until the watch on our predecessor fires (or a head
        predecessor may lapse). Outside it: a watch on the head, bounded by its TTL."""
        if timeout < 0.001:
            return False
        place = self._place(name)
        if place is not None and place.checked:
            wait = timeout
            if place.check_at_ms is not None:
                wait = min(wait, max(place.check_at_ms - time.time() * 1000, 1) / 1000)
            return place.woken.wait(wait) or wait < timeout
        woken = threading.Event()
        path = self._name_path(name)
        with _Edge(self.alias, "wait"):
            try:
                line, node = self._line(name)
                if not line:
                    return True
                head = f"{path}/{line[0]}"
                watched = self.client.exists_async(head, watch=lambda _: woken.set())
                raw, stat = self._get(self.client.get_async(head))
                self._get(watched)
            except NoNodeError:
                return True
        lapse = deadline_ms(stat, read_data(raw), node) / 1000 - time.time()
        wait = min(timeout, max(lapse, 0.001))
        return woken.wait(wait) or wait < timeout

    def _head(self, name: str) -> tuple[Any, Any, dict[str, Any]] | None:
        """``(name node stat, head stat or None, head data)``, or ``None`` if never granted."""
        try:
            line, node = self._line(name)
        except NoNodeError:
            return None
        for child in line[:_ATTEMPTS]:
            with contextlib.suppress(NoNodeError):
                raw, stat = self._get(self.client.get_async(f"{self._name_path(name)}/{child}"))
                return node, stat, read_data(raw)
        return node, None, {}

    def inspect(self, name: str) -> LeaseInfo | None:
        with _Edge(self.alias, "inspect"):
            found = self._head(name)
        if found is None:
            return None
        node, stat, data = found
        if stat is None or not data.get("held"):
            return LeaseInfo(name, "", max(node.pzxid, node.mzxid), False, self.alias)
        expires = stat.mtime + int(data["ttl_ms"])
        return LeaseInfo(
            name,
            str(data["holder"]),
            stat.czxid,
            expires > time.time() * 1000,
            self.alias,
            acquired_at=_when(stat.ctime),
            expires_at=_when(expires),
            renewed_at=_when(stat.mtime),
        )

    def inspect_all(self) -> list[LeaseInfo]:
        with _Edge(self.alias, "inspect_all"):
            quoted = self._get(self.client.get_children_async(f"{self.prefix}/names"))
        infos = (self.inspect(unquote(child)) for child in sorted(quoted))
        return [info for info in infos if info is not None]

    def force_release(self, name: str, token: int) -> LeaseInfo:
        """Compare the head's ``czxid`` with ``token``, then delete it, every queued waiter's
        node, and write the name node, in one multi: the revocation's zxid is the new token,
        and the waiters queue again behind it, so every later grant's token is higher."""
        path = self._name_path(name)
        with _Edge(self.alias, "force_release"):
            for _ in range(_ATTEMPTS):
                found = self._head(name)
                if found is None:
                    raise LeaseNotHeld(name, not_revoked(token, None))
                node, stat, data = found
                if stat is None or not data.get("held") or stat.czxid != token:
                    current = stat.czxid if stat is not None and data.get("held") else None
                    raise LeaseNotHeld(name, not_revoked(token, current or node.pzxid))
                line, _ = self._line(name)
                ops = [("delete", (f"{path}/{child}",)) for child in line]
                try:
                    bumped = self._commit([*ops, self._bump(name)])[-1]
                except (NoNodeError, NodeExistsError):
                    continue  # the line changed meanwhile: compare again
                return LeaseInfo(name, "", bumped.mzxid, False, self.alias)
        detail = "its line kept changing during the revocation; nothing was done"
        raise LeaseNotHeld(name, detail)

    def deploy_checks(self) -> list[str]:
        try:
            with _Edge(self.alias, "deploy check"):
                self._get(self.client.exists_async(self.prefix))
        except BackendUnavailable as exc:
            return [str(exc)]
        return []

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.stop()
            client.close()
