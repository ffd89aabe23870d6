"""Leases in a ZooKeeper ensemble, on kazoo: the lock recipe, one sequential znode per contender.

Configuration (``LEASES["BACKENDS"][alias]``)::

    {"ENGINE": "leases.backends.zookeeper", "HOSTS": "zk1:2181,zk2:2181,zk3:2181"}

Options: ``HOSTS`` (kazoo's connection string, a chroot suffix ``/path`` allowed, or a list of
``host:port``), ``PREFIX`` (the znode under which names live, default ``"/leases"``),
``SESSION_TIMEOUT`` (seconds, default 10; must lie within the servers' min/max session timeout,
2 and 20 ticks by default, or the server negotiates another and the client cannot see it),
``CONNECT_TIMEOUT`` and ``REQUEST_TIMEOUT`` (seconds, default 10 and 5; a renewal or release
waits for a new connection at most its grant's validity left, an acquisition its TTL), ``AUTH``
(a list of ``(scheme, credential)`` pairs handed to kazoo, e.g. ``[("digest", "user:pw")]``).

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
costs two (it leaves the line again), three when it stands right behind the holder and reads
the holder's expiry; and it writes, unlike the base contract's wish (a sequential create is
the only way into the line). A waiter in the line costs none until its predecessor changes,
then two to promote itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextvars import ContextVar, Token
from dataclasses import replace
from types import MappingProxyType
from typing import Any, NoReturn
from urllib.parse import unquote

from kazoo.client import KazooState  # type: ignore[import-untyped]
from kazoo.exceptions import (  # type: ignore[import-untyped]
    BadVersionError,
    KazooException,
    NodeExistsError,
    NoNodeError,
)
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]
from kazoo.security import Permissions  # type: ignore[import-untyped]

from .._finishing import finish
from ..errors import BackendUnavailable, LeaseLost, LeaseNotHeld
from ._options import seconds_problems
from ._zookeeper_line import (
    Queued,
    child_prefix,
    deadline_ms,
    line_of,
    node_data,
    read_data,
)
from ._zookeeper_session import ATTEMPTS, Edge, Session, ms, when
from .base import (
    FORGED,
    LIST_BATCH,
    Capability,
    Grant,
    LeaseBackend,
    LeaseInfo,
    new_secret,
    not_revoked,
    try_deadline,
)

__all__ = ["Backend"]

#: How long a queued waiter whose turn came may take to claim it (capped by the session
#: timeout) before the next in line dislodges it: a stalled waiter must not hold the line.
_CLAIM_WINDOW = 2.0

#: Nobody's places: outside every waiting room.
_NO_PLACES: Mapping[str, Queued] = MappingProxyType({})


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
        if (
            not hosts
            or not isinstance(hosts, str | list | tuple)
            or (not isinstance(hosts, str) and not all(isinstance(h, str) for h in hosts))
        ):
            problems.append(
                f'{where} needs "HOSTS", a string or a list of strings, e.g. '
                '"zk1:2181,zk2:2181,zk3:2181"'
            )
        prefix = options.get("PREFIX", "/leases")
        if (
            not isinstance(prefix, str)
            or not prefix.startswith("/")
            or any(part in ("", ".", "..") for part in prefix[1:].split("/"))
        ):
            problems.append(
                f'{where}["PREFIX"] must be an absolute znode path like "/leases" (no empty, '
                '"." or ".." parts, no trailing "/")'
            )
        for option, default in (
            ("SESSION_TIMEOUT", 10.0),
            ("CONNECT_TIMEOUT", 10.0),
            ("REQUEST_TIMEOUT", 5.0),
        ):
            problems += seconds_problems(alias, option, options.get(option, default))
        auth = options.get("AUTH", [])
        if not isinstance(auth, list | tuple) or not all(
            isinstance(pair, list | tuple) and len(pair) == 2 for pair in auth
        ):
            problems.append(f'{where}["AUTH"] must be a list of (scheme, credential) pairs')
        return problems

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.zk = Session(alias, options)
        self.session_timeout = self.zk.session_timeout
        self.prefix = self.zk.prefix
        self._claim_ms = ms(min(_CLAIM_WINDOW, self.session_timeout))
        #: The places in lines, by name, of whoever is in a name's waiting room: a context
        #: variable, so a thread's (sync) or a task's (async: its tries on worker threads run
        #: in copies of its context) are its own. Replaced, never changed in place, so a
        #: context copied from one in a room does not share its later places.
        self._places: ContextVar[Mapping[str, Queued]] = ContextVar(
            f"leases_zookeeper_places_{alias}", default=_NO_PLACES
        )

    @property
    def client(self) -> Any:
        """The started kazoo client (made on first use, never at import or by checks)."""
        return self.zk.client

    def doubts(self, grant: Grant) -> str | None:
        """Suspended: the ensemble may have expired the session (and our znode) without our
        hearing of it, so the grant is not trusted until the connection is back. A new session
        (the old one expired: ``LOST``) means the znode is gone."""
        session = grant.extra.get("session")
        if session is None:
            return None
        client = self.zk.opened
        if client is None:
            return "its ZooKeeper client was closed"
        if self.zk.state != KazooState.CONNECTED:
            return (
                "the ZooKeeper connection is suspended: the session (and the lease's znode) may "
                "have expired on the ensemble; not trusted until reconnected"
            )
        ids = client.client_id
        if not ids or ids[0] != session:
            return "the ZooKeeper session that owned its znode expired"
        return None

    # -- a grant's node -------------------------------------------------------------------

    def _node_path(self, grant: Grant) -> str | None:
        """The path of ``grant``'s znode, computable only with its secret (``None`` if the
        grant carries no sequence: it was not made by this backend)."""
        child = grant.extra.get("child")
        if not grant.secret or not isinstance(child, str):
            return None
        if not child.startswith(child_prefix(grant.secret)):
            return None
        return f"{self.zk.name_path(grant.name)}/{child}"

    def _granted(
        self, name: str, holder: str, ttl: float, sent_at: float, child: str, secret: str, stat: Any
    ) -> Grant:
        extra = {"child": child, "session": self.zk.session()}
        expires = when(stat.mtime + ms(ttl))
        return Grant(name, holder, stat.czxid, ttl, sent_at, expires, extra, secret)

    # -- the interface --------------------------------------------------------------------

    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        granted = min(ttl, self.session_timeout)
        place = self._place(name)
        # A reconnection longer than the TTL would make a grant with no validity left, and
        # one past the acquisition's deadline would break its timeout.
        until = try_deadline.get()
        within = granted if until is None else min(granted, until - time.monotonic())
        with Edge(self.alias, "acquire"), self.zk.bounded(max(0.0, within)):
            if place is not None:
                return self._claim(place, holder, granted)
            secret = new_secret()
            sent_at = time.monotonic()
            data = node_data(held=True, ttl_ms=ms(granted), holder=holder)
            child, stat, line, node = self.zk.join(name, secret, data)
            try:
                for _ in range(ATTEMPTS):
                    if line and line[0] == child:
                        return self._granted(name, holder, granted, sent_at, child, secret, stat)
                    if child not in line[1:2] or self.zk.dislodge(name, line, node) is not None:
                        break
                    line, node = self.zk.line(name)
            except BaseException:
                self.zk.leave(name, child)
                raise
            self.zk.leave(name, child)  # a failed try leaves nothing behind
        return None

    def _claim(self, place: Queued, holder: str, ttl: float) -> Grant | None:
        """A queued waiter's try: free of round trips until its predecessor changed (or may
        have lapsed); then, if first in line, promote its node to the grant."""
        if (
            place.checked
            and not place.woken.is_set()
            and (place.check_at_ms is None or time.time() * 1000 < place.check_at_ms)
            and self.zk.state == KazooState.CONNECTED
            and self.zk.session() == place.session
        ):
            return None
        place.checked, place.check_at_ms = True, None
        place.woken.clear()
        path = self.zk.name_path(place.name)
        for _ in range(ATTEMPTS):
            line, node = self.zk.line(place.name)
            if place.child not in line:
                self._requeue(place)  # revoked, dislodged, or its session expired
                return None
            ahead = line.index(place.child)
            if ahead == 0:
                sent_at = time.monotonic()
                data = node_data(held=True, ttl_ms=ms(ttl), holder=holder)
                try:
                    stat = self.zk.get(self.client.set_async(f"{path}/{place.child}", data))
                except NoNodeError:
                    self._requeue(place)
                    return None
                place.granted = True
                child, secret = place.child, place.secret
                return self._granted(place.name, holder, ttl, sent_at, child, secret, stat)
            deadline = self.zk.dislodge(place.name, line, node) if ahead == 1 else None
            if ahead == 1 and deadline is None:
                continue  # the head lapsed and is gone: look again
            # Only the predecessor is watched: its deletion wakes us and nobody else. A head
            # predecessor may also lapse without a deletion: look again at its deadline.
            if self.zk.get(self.zk.watch(f"{path}/{line[ahead - 1]}", place)) is None:
                continue
            place.check_at_ms = deadline
            return None
        return None

    def _requeue(self, place: Queued) -> None:
        """Join the line again at its end (our node is gone); a new node, a new secret."""
        place.secret = new_secret()
        data = node_data(held=False, ttl_ms=self._claim_ms)
        place.child, stat, _, _ = self.zk.join(place.name, place.secret, data)
        place.czxid, place.session, place.checked = stat.czxid, self.zk.session(), False

    def _place(self, name: str) -> Queued | None:
        return self._places.get().get(name)

    def _join_queue(self, name: str) -> Queued | None:
        """A new place at the end of the name's line (one round trip), or ``None``: without
        a place, tries join and leave the line each time (best effort)."""
        secret = new_secret()
        try:
            with Edge(self.alias, "queue"):
                data = node_data(held=False, ttl_ms=self._claim_ms)
                child, stat, _, _ = self.zk.join(name, secret, data)
        except BackendUnavailable:
            return None
        return Queued(name, child, secret, stat.czxid, self.zk.session())

    def _leave_queue(self, place: Queued) -> None:
        """Leave the line, unless the place became the grant (best effort: an abandoned
        place is dislodged by the next in line after its claim window)."""
        if not place.granted:
            with contextlib.suppress(KazooException, KazooTimeoutError, BackendUnavailable):
                self.zk.leave(place.name, place.child)

    def _enter(self, place: Queued) -> Token[Mapping[str, Queued]]:
        return self._places.set({**self._places.get(), place.name: place})

    @contextlib.contextmanager
    def _queued(self, name: str) -> Iterator[None]:
        place = None if self._place(name) else self._join_queue(name)
        if place is None:
            yield
            return
        entered = self._enter(place)
        try:
            yield
        finally:
            self._places.reset(entered)
            self._leave_queue(place)

    def waiting_room(
        self, name: str, timeout: float | None
    ) -> contextlib.AbstractContextManager[None]:
        """A place in the name's line for this thread while it waits: tries cost nothing until
        the predecessor changes, and a release wakes only the next in line. A reconnection
        inside it never waits past the acquisition's deadline."""
        return self._room(name, timeout)

    @contextlib.contextmanager
    def _room(self, name: str, timeout: float | None) -> Iterator[None]:
        bound = contextlib.nullcontext() if timeout is None else self.zk.bounded(timeout)
        with bound, self._queued(name):
            yield

    @contextlib.asynccontextmanager
    async def _aqueued(self, name: str) -> AsyncIterator[None]:
        place = None
        if not self._place(name):
            place = await finish(asyncio.to_thread(self._join_queue, name), self._aleave)
        if place is None:
            yield
            return
        entered = self._enter(place)
        try:
            yield
        finally:
            self._places.reset(entered)
            await finish(self._aleave(place))

    async def _aleave(self, place: Queued) -> None:
        await asyncio.to_thread(self._leave_queue, place)

    def awaiting_room(
        self, name: str, timeout: float | None
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """The same line for an async waiter, the place held by its task: its tries (on
        worker threads, in copies of the task's context) claim it as a thread's do, and its
        waits are woken by the watch on its predecessor without holding a thread."""
        return self._aqueued(name)

    def renew(self, grant: Grant, ttl: float) -> Grant:
        """One round trip: a read of our node pipelined with its write. The leader accepts the
        write only on a live session; the read says whether it had lapsed just before."""
        granted = min(ttl, self.session_timeout)
        path = self._node_path(grant)
        # Past its validity the renewal is useless (the holder must assume the lease gone):
        # a client found dead is not waited for longer than that.
        left = grant.sent_at + grant.ttl - time.monotonic()
        with Edge(self.alias, "renew"), self.zk.bounded(left):
            if path is None:
                self._refuse(grant, "renewal")
            data = node_data(held=True, ttl_ms=ms(granted), holder=grant.holder)
            sent_at = time.monotonic()
            before = self.client.get_async(path)
            write = self.client.set_async(path, data)
            try:
                raw, stat = self.zk.get(before)
                renewed = self.zk.get(write)
            except NoNodeError:
                self._refuse(grant, "renewal")
            if renewed.mtime > deadline_ms(stat, read_data(raw), stat):
                # It had lapsed on the leader's clock; a contender may be dislodging it.
                with contextlib.suppress(NoNodeError, BadVersionError):
                    self.zk.commit([("delete", (path, renewed.version)), self.zk.bump(grant.name)])
                raise LeaseLost(grant.name, grant.token, "expired before the renewal")
        expires = when(renewed.mtime + ms(granted))
        return replace(grant, ttl=granted, sent_at=sent_at, expires_at=expires)

    def _refuse(self, grant: Grant, what: str) -> NoReturn:
        """Why ``grant``'s node is not where its secret says: a forgery of the current
        holder's public data (``LeaseNotHeld``), or a grant that is gone (``LeaseLost``)."""
        try:
            line, _ = self.zk.line(grant.name)
            head = f"{self.zk.name_path(grant.name)}/{line[0]}"
            raw, stat = self.zk.get(self.client.get_async(head))
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
        multi; the deletion wakes only the next in line (its watch on us). A reconnection is
        bounded by the grant's validity left, as for :meth:`renew`."""
        path = self._node_path(grant)
        # The name is free by the end of the grant's validity anyway (its TTL, or its dead
        # session's expiry): a client found dead is not waited for longer than that.
        left = grant.sent_at + grant.ttl - time.monotonic()
        with Edge(self.alias, "release"), self.zk.bounded(left):
            if path is None:
                self._refuse(grant, "release")
            try:
                self.zk.commit([("delete", (path,)), self.zk.bump(grant.name)])
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
        path = self.zk.name_path(name)
        with Edge(self.alias, "wait"):
            try:
                line, node = self.zk.line(name)
                if not line:
                    return True
                head = f"{path}/{line[0]}"
                watched = self.client.exists_async(head, watch=lambda _: woken.set())
                raw, stat = self.zk.get(self.client.get_async(head))
                self.zk.get(watched)
            except NoNodeError:
                return True
        lapse = deadline_ms(stat, read_data(raw), node) / 1000 - time.time()
        wait = min(timeout, max(lapse, 0.001))
        return woken.wait(wait) or wait < timeout

    async def await_for_release(self, name: str, timeout: float) -> bool:
        """In the waiting room: until the watch on the task's predecessor fires (or a head
        predecessor may lapse), awaited on the loop, no thread held; a place not looked at
        yet returns at once (the next try looks, then waits). Outside it: as
        :meth:`wait_for_release`, on a worker thread."""
        place = self._place(name)
        if place is None:
            return await super().await_for_release(name, timeout)
        if timeout < 0.001:
            return False
        if not place.checked:
            return True
        wait = timeout
        if place.check_at_ms is not None:
            wait = min(wait, max(place.check_at_ms - time.time() * 1000, 1) / 1000)
        return await _woken(place, wait) or wait < timeout

    def _head(self, name: str) -> tuple[Any, Any, dict[str, Any]] | None:
        """``(name node stat, head stat or None, head data)``, or ``None`` if never granted."""
        try:
            line, node = self.zk.line(name)
        except NoNodeError:
            return None
        for child in line[:ATTEMPTS]:
            with contextlib.suppress(NoNodeError):
                raw, stat = self.zk.get(self.client.get_async(f"{self.zk.name_path(name)}/{child}"))
                return node, stat, read_data(raw)
        return node, None, {}

    def _heads(self, names: list[str]) -> list[tuple[Any, Any, dict[str, Any]] | None]:
        """:meth:`_head` of each of ``names``, each step's requests sent at once (kazoo
        pipelines them on its one connection): two round trips a batch, where a name at a time
        took two a name. A line whose first node went in between is looked at again alone."""
        lines = [
            self.client.get_children_async(self.zk.name_path(name), include_data=True)
            for name in names
        ]
        found: list[tuple[Any, Any, dict[str, Any]] | None] = []
        heads: list[tuple[int, Any, str]] = []  # (index, name node stat, the head's path)
        for index, (name, pending) in enumerate(zip(names, lines, strict=True)):
            try:
                children, node = self.zk.get(pending)
            except NoNodeError:
                found.append(None)
                continue
            line = line_of(children)
            found.append((node, None, {}))
            if line:
                heads.append((index, node, f"{self.zk.name_path(name)}/{line[0]}"))
        reads = [(index, node, self.client.get_async(path)) for index, node, path in heads]
        for index, node, read in reads:
            try:
                raw, stat = self.zk.get(read)
            except NoNodeError:  # released or expired since: as one name's look does
                found[index] = self._head(names[index])
                continue
            found[index] = (node, stat, read_data(raw))
        return found

    def inspect(self, name: str) -> LeaseInfo | None:
        with Edge(self.alias, "inspect"):
            found = self._head(name)
        return self._info(name, found)

    def _info(self, name: str, found: tuple[Any, Any, dict[str, Any]] | None) -> LeaseInfo | None:
        """What :meth:`inspect` says of ``name``, from its :meth:`_head`."""
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
            acquired_at=when(stat.ctime),
            expires_at=when(expires),
            renewed_at=when(stat.mtime),
        )

    def inspect_all(self) -> list[LeaseInfo]:
        """Every name node's head, :data:`~.base.LIST_BATCH` names at a time (:meth:`_heads`)."""
        with Edge(self.alias, "inspect_all"):
            quoted = self.zk.get(self.client.get_children_async(f"{self.prefix}/names"))
            names = [unquote(child) for child in sorted(quoted)]
            infos = [
                self._info(name, found)
                for start in range(0, len(names), LIST_BATCH)
                for name, found in zip(
                    names[start : start + LIST_BATCH],
                    self._heads(names[start : start + LIST_BATCH]),
                    strict=True,
                )
            ]
        return [info for info in infos if info is not None]

    def force_release(self, name: str, token: int) -> LeaseInfo:
        """Compare the head's ``czxid`` with ``token``, then delete it, every queued waiter's
        node, and write the name node, in one multi: the revocation's zxid is the new token,
        and the waiters queue again behind it, so every later grant's token is higher."""
        path = self.zk.name_path(name)
        with Edge(self.alias, "force_release"):
            for _ in range(ATTEMPTS):
                found = self._head(name)
                if found is None:
                    raise LeaseNotHeld(name, not_revoked(token, None))
                node, stat, data = found
                if stat is None or not data.get("held") or stat.czxid != token:
                    current = stat.czxid if stat is not None and data.get("held") else None
                    raise LeaseNotHeld(name, not_revoked(token, current or node.pzxid))
                line, _ = self.zk.line(name)
                ops = [("delete", (f"{path}/{child}",)) for child in line]
                try:
                    bumped = self.zk.commit([*ops, self.zk.bump(name)])[-1]
                except (NoNodeError, NodeExistsError):
                    continue  # the line changed meanwhile: compare again
                return LeaseInfo(name, "", bumped.mzxid, False, self.alias)
        detail = "its line kept changing during the revocation; nothing was done"
        raise LeaseNotHeld(name, detail)

    def deploy_checks(self) -> list[str]:
        """An ensemble that does not answer raises, as every store does (``leases.E003``:
        nothing can be held there); it was returned as a warning, so a deploy gated on the
        check passed without a reachable ZooKeeper."""
        problems = []
        with Edge(self.alias, "deploy check"):
            found = self.zk.get(self.client.exists_async(self.prefix))
            if found is not None and self.zk.options.get("AUTH"):
                acls, _ = self.zk.get(self.client.get_acls_async(self.prefix))
                if any(acl.id.scheme == "world" and acl.perms & ~Permissions.READ for acl in acls):
                    problems.append(
                        f"{self.alias}: AUTH is set but {self.prefix!r} lets anyone write (made "
                        "before AUTH, or by another client): a client with no credential can "
                        "release or keep any lease under it; recreate the prefix with AUTH, or "
                        "set its nodes' ACLs to the credential's"
                    )
        return problems

    def close(self) -> None:
        self.zk.close()


async def _woken(place: Queued, timeout: float) -> bool:
    """Whether ``place`` is woken within ``timeout``: the watch (on kazoo's thread) wakes the
    awaiting task's loop through ``on_wake``."""
    loop = asyncio.get_running_loop()
    woke: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not woke.done():
            woke.set_result(None)

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle)

    place.on_wake = wake
    try:
        if place.woken.is_set():  # after on_wake is set: a wake-up in between is not missed
            return True
        try:
            async with asyncio.timeout(timeout):
                await woke
        except TimeoutError:
            return False
        return True
    finally:
        place.on_wake = None
