"""Leases in a ZooKeeper ensemble, on kazoo: one ephemeral znode per held name.

Configuration (``LEASES["BACKENDS"][alias]``)::

    {"ENGINE": "leases.backends.zookeeper", "HOSTS": "zk1:2181,zk2:2181,zk3:2181"}

Options: ``HOSTS`` (kazoo's connection string, a chroot suffix ``/path`` allowed, or a list of
``host:port``), ``PREFIX`` (the znode under which names live, default ``"/leases"``),
``SESSION_TIMEOUT`` (seconds, default 10; must lie within the servers' min/max session timeout,
2 and 20 ticks by default, or the server negotiates another and the client cannot see it),
``CONNECT_TIMEOUT`` and ``REQUEST_TIMEOUT`` (seconds, default 10 and 5), ``AUTH`` (a list of
``(scheme, credential)`` pairs handed to kazoo, e.g. ``[("digest", "user:password")]``).

Layout: ``<prefix>/names/<quoted name>`` is a persistent *name node*; its child ``grant``,
ephemeral, exists while the name is held and holds ``{"holder", "hash", "ttl_ms"}`` (the
SHA-256 of the grant's secret, never the secret). ``<prefix>/clock`` is written to read the
leader's clock.

**The token is the grant node's ``czxid``**: the zxid of the transaction that created it,
``epoch << 32 | counter``, which the ensemble orders totally and never reuses, across leader
elections (the epoch grows) and restarts (it is in the transaction log). Every grant is a new
create, so tokens of a name strictly increase with no counter of ours to lose. Not the 32-bit
sequence suffix of a sequential znode: that is per parent and wraps.

**Who holds a name changes only with the name node's data version.** An acquire, a takeover
and a revocation each write the name node in the same multi as the create or delete, so a
renewal or release that checks the version it read cannot touch a successor's znode (a fresh
znode starts at version 0 again; its parent's version does not).

**TTL.** A ZooKeeper lease has two ends, whichever comes first: its session (the znode is
ephemeral: a dead or partitioned holder's session expires ``SESSION_TIMEOUT`` after the ensemble
last heard from it) and its TTL on the leader's clock (the grant node's ``mtime`` plus
``ttl_ms``; a contender reads the leader's clock by writing the clock node and takes over an
expired grant in one multi that checks the versions it read). The granted TTL is
``min(ttl, SESSION_TIMEOUT)`` and the grant says so: past the session timeout the server may
drop the znode while the holder, counting from its last renewal, would still trust it.

**Renewal proves the session.** A renewal is a conditional write of the grant node, which the
leader accepts only on a live session and the current version; a suspended or lost session
makes it fail (``BackendUnavailable``, then ``LeaseLost``) rather than report a lease the
server has dropped. Two round trips each for acquire-when-busy, renew and release (a read for
the secret's hash, then the conditional multi); one for an uncontended acquire.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from types import TracebackType
from typing import Any
from urllib.parse import quote, unquote

from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.exceptions import (  # type: ignore[import-untyped]
    BadVersionError,
    KazooException,
    NodeExistsError,
    NoNodeError,
)
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]

from ..errors import BackendUnavailable, LeaseLost, LeaseNotHeld
from .base import FORGED, Capability, Grant, LeaseBackend, LeaseInfo, new_secret, not_revoked

__all__ = ["Backend"]

_GRANT = "grant"
_LATEST = datetime(9999, 12, 31, tzinfo=UTC)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


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
        self._lock = threading.Lock()
        self._client: Any = None

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
                with _Edge(self.alias, "connect"):
                    try:
                        client.start(timeout=float(self.options.get("CONNECT_TIMEOUT", 10.0)))
                        client.ensure_path(f"{self.prefix}/names")
                        client.ensure_path(f"{self.prefix}/clock")
                    except BaseException:
                        client.stop()
                        client.close()
                        raise
                self._client = client
            return self._client

    def _name_path(self, name: str) -> str:
        # Quoted so "/" and the path components "." and ".." cannot escape the name node.
        return f"{self.prefix}/names/{quote(name, safe='').replace('.', '%2E')}"

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

    def _read(self, name: str) -> tuple[Any, Any, dict[str, Any] | None]:
        """``(name node stat, grant stat, grant data)``, pipelined in one round trip; the
        stats are ``None`` for a missing znode. Requests of one session are answered in order,
        so the name node's version read first is the one under the grant read second."""
        path = self._name_path(name)
        pending = [self.client.exists_async(path), self.client.get_async(f"{path}/{_GRANT}")]
        node = self._get(pending[0])
        try:
            raw, stat = self._get(pending[1])
        except NoNodeError:
            return node, None, None
        return node, stat, json.loads(raw)

    def _server_now(self) -> int:
        """The leader's clock (ms since the epoch), read as the ``mtime`` of a write: the
        only clock a ZooKeeper client can read, and the one TTLs are measured on."""
        return int(self._get(self.client.set_async(f"{self.prefix}/clock", b"")).mtime)

    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        granted = min(ttl, self.session_timeout)
        secret = new_secret()
        value = json.dumps({"holder": holder, "hash": _hash(secret), "ttl_ms": _ms(granted)})
        path = self._name_path(name)
        create = ("create", (f"{path}/{_GRANT}", value.encode(), None, True))
        with _Edge(self.alias, "acquire"):
            for _ in range(3):
                sent_at = time.monotonic()
                try:
                    stat = self._commit([create, ("set_data", (path, b""))])[1]
                except NoNodeError:
                    self.client.ensure_path(path)
                    continue
                except NodeExistsError:
                    node, grant, data = self._read(name)
                    if grant is None or data is None:
                        continue  # released meanwhile: try again
                    if self._server_now() < grant.mtime + int(data["ttl_ms"]):
                        return None
                    take_over = [
                        ("delete", (f"{path}/{_GRANT}", grant.version)),
                        create,
                        ("set_data", (path, b"", node.version)),
                    ]
                    try:
                        stat = self._commit(take_over)[2]
                    except (BadVersionError, NoNodeError, NodeExistsError):
                        continue  # renewed, released or taken by someone else meanwhile
                # The multi's zxid is both the name node's mzxid and the grant's czxid.
                extra = {"version": stat.version}
                expires = _when(stat.mtime + _ms(granted))
                return Grant(name, holder, stat.mzxid, granted, sent_at, expires, extra, secret)
        return None

    def _owned(self, grant: Grant, what: str) -> tuple[Any, Any, dict[str, Any]]:
        """The current state of ``grant``'s name, if it is still this grant's (else raises)."""
        node, stat, data = self._read(grant.name)
        if stat is None or data is None or stat.czxid != grant.token:
            raise LeaseLost(grant.name, grant.token, f"expired or taken over before the {what}")
        if data.get("holder") != grant.holder:
            raise LeaseLost(grant.name, grant.token, f"held by someone else at the {what}")
        if data.get("hash") != _hash(grant.secret):
            raise LeaseNotHeld(grant.name, FORGED)
        return node, stat, data

    def renew(self, grant: Grant, ttl: float) -> Grant:
        """A conditional write of the grant node: the leader's acceptance proves the session is
        alive now, and its ``mtime`` restarts the TTL on the leader's clock."""
        granted = min(ttl, self.session_timeout)
        path = self._name_path(grant.name)
        with _Edge(self.alias, "renew"):
            sent_at = time.monotonic()
            node, stat, data = self._owned(grant, "renewal")
            value = json.dumps({**data, "ttl_ms": _ms(granted)}).encode()
            ops = [
                ("check", (path, node.version)),
                ("set_data", (f"{path}/{_GRANT}", value, stat.version)),
            ]
            try:
                renewed = self._commit(ops)[1]
            except (BadVersionError, NoNodeError) as exc:
                raise LeaseLost(grant.name, grant.token, "taken over during the renewal") from exc
            if renewed.mtime > stat.mtime + int(data["ttl_ms"]):
                # It had expired on the leader's clock; a contender may already have trusted that.
                self._delete(path, node.version, renewed.version)
                raise LeaseLost(grant.name, grant.token, "expired before the renewal")
        expires = _when(renewed.mtime + _ms(granted))
        return replace(grant, ttl=granted, sent_at=sent_at, expires_at=expires)

    def _delete(self, path: str, node_version: int, grant_version: int) -> None:
        self._commit(
            [("check", (path, node_version)), ("delete", (f"{path}/{_GRANT}", grant_version))]
        )

    def release(self, grant: Grant) -> None:
        """Delete the grant node, conditional on the versions read with the secret's hash; the
        deletion is what wakes waiters (their child watch)."""
        path = self._name_path(grant.name)
        with _Edge(self.alias, "release"):
            node, stat, _ = self._owned(grant, "release")
            try:
                self._delete(path, node.version, stat.version)
            except (BadVersionError, NoNodeError) as exc:
                raise LeaseLost(grant.name, grant.token, "taken over during the release") from exc

    def wait_for_release(self, name: str, timeout: float) -> bool:
        """A child watch on the name node: woken by the grant's deletion (release, revocation,
        session expiry) or a takeover, never by polling. A TTL that lapses deletes nothing, so
        the wait also ends when the holder's TTL would, by the server's ``mtime``."""
        if timeout < 0.001:
            return False
        woken = threading.Event()
        path = self._name_path(name)
        with _Edge(self.alias, "wait"):
            try:
                children = self._get(
                    self.client.get_children_async(path, watch=lambda _: woken.set())
                )
                raw, stat = self._get(self.client.get_async(f"{path}/{_GRANT}"))
            except NoNodeError:
                return True
        if _GRANT not in children:
            return True
        lapse = (stat.mtime + int(json.loads(raw)["ttl_ms"])) / 1000 - time.time()
        wait = min(timeout, max(lapse, 0.001))
        return woken.wait(wait) or wait < timeout

    def inspect(self, name: str) -> LeaseInfo | None:
        with _Edge(self.alias, "inspect"):
            node, stat, data = self._read(name)
        if node is None:
            return None
        if stat is None or data is None:
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
        """Compare the grant's ``czxid`` with ``token``, then delete it and bump the name node
        in one multi checking both versions read: the revocation's zxid is the new token."""
        path = self._name_path(name)
        with _Edge(self.alias, "force_release"):
            node, stat, _ = self._read(name)
            if stat is None or stat.czxid != token:
                current = None if node is None else max(node.pzxid, node.mzxid)
                raise LeaseNotHeld(name, not_revoked(token, stat.czxid if stat else current))
            ops = [
                ("delete", (f"{path}/{_GRANT}", stat.version)),
                ("set_data", (path, b"", node.version)),
            ]
            try:
                bumped = self._commit(ops)[1]
            except (BadVersionError, NoNodeError) as exc:
                detail = "it changed hands during the revocation; nothing was done"
                raise LeaseNotHeld(name, detail) from exc
        return LeaseInfo(name, "", bumped.mzxid, False, self.alias)

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
