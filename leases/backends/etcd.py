"""Leases in etcd: a key attached to an etcd lease, its create revision as the fencing token.

Configuration (``LEASES["BACKENDS"][alias]``)::

    {"ENGINE": "leases.backends.etcd", "ENDPOINTS": ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]}

Options: ``ENDPOINTS`` (the members' client URLs, tried in turn), ``PREFIX`` (default
``"leases/"``), ``REQUEST_TIMEOUT`` (seconds per request and member, default 2),
``CONNECT_TIMEOUT`` (default 0.5), TLS ``CA_CERT``, ``CERT_CERT``, ``CERT_KEY`` and auth
``USERNAME``, ``PASSWORD``, passed through to the gateway. Needs etcd >= 3.4 (``/v3`` gateway).

Keys of one name: ``<prefix>lock/<name>`` (the grant, attached to an etcd lease so the cluster's
leader expires it, value ``sha256(secret):holder``) and ``<prefix>name/<name>`` (no lease: it
says the name exists, and its mod revision is the name's token while it is free).

**The token** is the lock key's create revision: etcd's revision is cluster-wide, 64-bit, raised
by every write and kept across restarts, leader changes and compaction, so a later grant of a
name always has a higher one. Nothing to keep durable on our side.

**Round trips.** etcd cannot attach a new lease and write in one request, and cannot keep a lease
alive inside a transaction, so each operation is two or three: acquire = lease grant +
transaction ``create_revision(lock) == 0 -> put lock with the lease, put name`` (a third,
revoking the unused lease, when the name is taken); renew = a read-only transaction proving
holder, token and secret, the keepalive, and the proof again (see
:meth:`Backend.renew`); release = transaction ``create_revision == token and value == ours ->
delete``, then the lease revoke. Renewing to a *different* TTL moves the key to a new lease
(grant, transaction, revoke), since an etcd lease's TTL is fixed when it is granted.

**TTL.** etcd leases count whole seconds and the server raises a TTL below its minimum
(``1.5 x election timeout``, rounded up); the grant reports the TTL the server granted, so the
renewer and the client's validity follow the real expiry, never the wished one.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django.utils import timezone

from ..errors import BackendUnavailable, LeaseLost, LeaseNotHeld
from ._etcd_io import EtcdRefused, Gateway, Reply, b64, unb64
from ._options import seconds_problems
from .base import FORGED, Capability, Grant, LeaseBackend, LeaseInfo, new_secret, not_revoked

__all__ = [
    "Backend",
    "acquire_txn",
    "force_release_txn",
    "owner_txn",
    "release_txn",
    "revokes_live_leases",
]

logger = logging.getLogger(__name__)

#: etcd refuses leases longer than this (``MaxLeaseTTL``, about 285 years).
MAX_LEASE_TTL = 9_000_000_000
#: Display bound for expiries (``datetime`` ends at year 9999).
_LATEST = timedelta(days=365 * 1000)
#: etcd releases whose old leader, resumed after a pause (a long GC or disk stall, a frozen
#: VM, SIGSTOP), revokes the leases it saw expire: their renewals went to the new leader
#: meanwhile, but its lessor still thinks it leads, and the revocation, forwarded to the new
#: leader, is applied (etcd #15247). Held leases all vanish at once although every renewal
#: succeeded. Fixed in 3.4.31 (etcd #17465) and 3.5.13 (#17425): (major, minor) -> the first
#: patch release without it. Fencing keeps writes safe; leases are lost before their time.
REVOKES_LIVE_LEASES_BEFORE = {(3, 4): 31, (3, 5): 13}


# Every request that reads or changes a lease, in one place (gateway JSON bodies).
def acquire_txn(lock: str, name_key: str, value: str, lease: int) -> dict[str, Any]:
    """Create the lock only if it does not exist; also touch the name key (the free name's
    token). The range after the put returns the new key's create revision: the token."""
    return {
        "compare": [{"key": lock, "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
        "success": [
            {"request_put": {"key": lock, "value": value, "lease": lease}},
            {"request_put": {"key": name_key, "value": ""}},
            {"request_range": {"key": lock}},
        ],
        "failure": [{"request_range": {"key": lock}}],
    }


def owner_txn(
    lock: str, token: int, value: str, then: list[Any], lease: object = None
) -> dict[str, Any]:
    """Do ``then`` only while the lock is the grant's: same create revision (token) and the
    same value (holder and secret hash), and attached to ``lease`` when given. Otherwise read
    the lock, to say why."""
    compare = [
        {"key": lock, "target": "CREATE", "result": "EQUAL", "create_revision": token},
        {"key": lock, "target": "VALUE", "result": "EQUAL", "value": value},
    ]
    if lease is not None:
        compare.append({"key": lock, "target": "LEASE", "result": "EQUAL", "lease": lease})
    return {
        "compare": compare,
        "success": [*then, {"request_range": {"key": lock}}],
        "failure": [{"request_range": {"key": lock}}],
    }


def release_txn(lock: str, token: int, value: str) -> dict[str, Any]:
    """Compare-and-delete, because an expired holder must never delete its successor's key."""
    return owner_txn(lock, token, value, [{"request_delete_range": {"key": lock, "prev_kv": True}}])


def force_release_txn(lock: str, name_key: str, token: int) -> dict[str, Any]:
    """Compare-and-revoke: only while the lock's create revision is ``token``, delete it and
    touch the name key, whose new mod revision is the name's token from then on."""
    return {
        "compare": [{"key": lock, "target": "CREATE", "result": "EQUAL", "create_revision": token}],
        "success": [
            {"request_delete_range": {"key": lock, "prev_kv": True}},
            {"request_put": {"key": name_key, "value": ""}},
            {"request_range": {"key": name_key}},
        ],
        "failure": [{"request_range": {"key": lock}}, {"request_range": {"key": name_key}}],
    }


def read_txn(*keys: str, prefix: bool = False) -> dict[str, Any]:
    """Read several keys (or prefixes) at one revision."""
    ranges = [{"key": key, **({"range_end": _range_end(key)} if prefix else {})} for key in keys]
    return {"compare": [], "success": [{"request_range": r} for r in ranges], "failure": []}


def _range_end(key: str) -> str:
    raw = bytearray(unb64(key))
    raw[-1] += 1  # the prefix ends in "/", never 0xff
    return b64(bytes(raw))


def _kvs(reply: Mapping[str, Any], index: int) -> list[dict[str, Any]]:
    responses = reply.get("responses", [])
    if index >= len(responses):
        return []
    answer = next(iter(responses[index].values()))
    found: list[dict[str, Any]] = answer.get("kvs", []) or answer.get("prev_kvs", [])
    return found


def _lock_value(secret: str, holder: str) -> str:
    return f"{hashlib.sha256(secret.encode()).hexdigest()}:{holder}"


def _holder(kv: Mapping[str, Any]) -> str:
    return unb64(kv.get("value", "")).decode().partition(":")[2]


def _seconds(ttl: float) -> int:
    """The TTL etcd is asked for: whole seconds, rounded up (never shorter than wished)."""
    return min(MAX_LEASE_TTL, max(1, math.ceil(ttl)))


def _counted(asked: float, granted: str | int) -> float:
    """The TTL a grant reports: what the server granted, but never more than was asked.

    The server only ever lengthens a short TTL (to its minimum, to whole seconds), and a holder
    that counts on the shorter one merely gives up early: the client's view of its validity
    must never exceed the server's, and never exceed what the caller planned for. When the
    server grants less (etcd's maximum, ~285 years), the grant reports that.
    """
    return min(float(asked), float(granted))


def revokes_live_leases(version: str) -> bool:
    """Whether etcd ``version`` (``"3.4.23"``, as a member's status reports it) is a release
    whose resumed old leader revokes live leases (:data:`REVOKES_LIVE_LEASES_BEFORE`). A
    version that does not parse is not judged."""
    parts = version.split("-", 1)[0].split(".")
    try:
        major, minor, patch = (int(part) for part in parts[:3])
    except ValueError:
        return False
    if (major, minor) < (3, 4):
        return True  # older than any fix (and than the /v3 gateway this backend needs)
    fixed_in = REVOKES_LIVE_LEASES_BEFORE.get((major, minor))
    return fixed_in is not None and patch < fixed_in


def _expires(seconds: float) -> datetime:
    """Wall-clock estimate of an expiry, for display only (the leader's clock decides)."""
    return timezone.now() + min(timedelta(seconds=max(0.0, seconds)), _LATEST)


#: How long a waiter's watch lasts at least, unless the deletion it waits for comes first
#: (the release, the holder's expiry, a force release: each wakes it at once). A try is three
#: requests, two of them raft writes; cut at the backoff's first delays (milliseconds), the
#: watch made a waiter try about ten times a second while the name stayed held. Not longer:
#: an async wait holds a worker thread of the loop's default executor for the watch's length
#: (2 s made twenty tasks on one name queue for the six threads of a 2-core machine: 1.5 s a
#: hand-off), and a semaphore's waiter watches one slot while another may free.
WATCH_AT_LEAST = 0.25


class Backend(LeaseBackend):
    """Leases on an etcd v3 cluster, through its HTTP/JSON gateway (etcd3gw)."""

    capabilities = frozenset(
        {
            Capability.NATIVE_FENCING,
            Capability.WAIT_WITHOUT_POLLING,
            Capability.FORCE_RELEASE,
            Capability.DURABLE,
        }
    )
    wait_at_least = WATCH_AT_LEAST

    known_options = frozenset(
        {
            "ENDPOINTS",
            "PREFIX",
            "REQUEST_TIMEOUT",
            "CONNECT_TIMEOUT",
            "CA_CERT",
            "CERT_CERT",
            "CERT_KEY",
            "USERNAME",
            "PASSWORD",
        }
    )

    @classmethod
    def check_options(cls, alias: str, options: Mapping[str, Any]) -> list[str]:
        """Also: a non-empty list of http(s) endpoint URLs, a prefix, positive timeouts, and
        credentials in pairs (a certificate with its key, a user with a password)."""
        problems = super().check_options(alias, options)
        where = f'LEASES["BACKENDS"][{alias!r}]'
        endpoints = options.get("ENDPOINTS")
        if not isinstance(endpoints, list | tuple) or not endpoints:
            problems.append(f'{where}["ENDPOINTS"] must be a non-empty list of etcd client URLs')
        else:
            for url in endpoints:
                parts = urlsplit(str(url))
                try:
                    parts.port  # noqa: B018 - parsed here: out of range, it raised at first use
                except ValueError:
                    problems.append(f'{where}["ENDPOINTS"] has {url!r}: its port is not valid')
                    continue
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    problems.append(f'{where}["ENDPOINTS"] has {url!r}: not an http(s):// URL')
        prefix = options.get("PREFIX", "leases/")
        if not isinstance(prefix, str) or not prefix or not prefix.endswith("/"):
            problems.append(f'{where}["PREFIX"] must be a non-empty string ending in "/"')
        for option in ("REQUEST_TIMEOUT", "CONNECT_TIMEOUT"):
            problems += seconds_problems(alias, option, options.get(option, 1.0))
        for first, second in (("CERT_CERT", "CERT_KEY"), ("USERNAME", "PASSWORD")):
            if (options.get(first) is None) != (options.get(second) is None):
                problems.append(f'{where}: "{first}" and "{second}" go together')
        return problems

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.prefix: str = options.get("PREFIX", "leases/")
        self.gateway = Gateway(alias, list(options["ENDPOINTS"]), options)

    def _keys(self, name: str) -> tuple[str, str]:
        return b64(f"{self.prefix}lock/{name}"), b64(f"{self.prefix}name/{name}")

    def _call(self, path: str, body: Mapping[str, Any], timeout: float | None = None) -> Reply:
        try:
            return self.gateway.call(path, body, timeout)
        except EtcdRefused as exc:
            raise BackendUnavailable(self.alias, f"{path}: {exc.message}") from exc

    def _revoke(self, lease: object) -> None:
        """Best effort: the lease's keys are gone or never written, so a failure only leaves
        a lease that expires by itself."""
        try:
            self.gateway.call("kv/lease/revoke", {"ID": lease})
        except (EtcdRefused, BackendUnavailable) as exc:
            logger.debug("leases: revoking etcd lease %s failed: %s", lease, exc)

    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        lock, name_key = self._keys(name)
        secret = new_secret()
        value = _lock_value(secret, holder)
        sent_at = time.monotonic()  # before the lease exists: validity can only be undercounted
        granted = self._call("lease/grant", {"TTL": _seconds(ttl)}).body
        lease, granted_ttl = granted["ID"], _counted(ttl, granted["TTL"])
        try:
            reply = self._call("kv/txn", acquire_txn(lock, name_key, b64(value), lease))
        except BackendUnavailable:
            self._revoke(lease)  # also deletes the lock if the txn was applied unseen
            raise
        kvs = _kvs(reply.body, 2 if reply.body.get("succeeded") else 0)
        mine = bool(kvs) and unb64(kvs[0].get("value", "")).decode() == value
        if not mine:  # taken (or our put was refused): nobody will use this lease
            self._revoke(lease)
            return None
        if time.monotonic() - sent_at >= float(granted["TTL"]):
            # Paused between grant and put: the lease may have expired before the key joined
            # it (etcd #11456, Jepsen 3.4.3). Never hand out a grant that may be gone already.
            self._revoke(lease)
            return None
        extra = {"lease": lease, "asked": _seconds(ttl)}
        token = int(kvs[0]["create_revision"])
        expires_at = _expires(granted_ttl)
        return Grant(name, holder, token, granted_ttl, sent_at, expires_at, extra, secret)

    def _refusal(self, grant: Grant, reply: Mapping[str, Any], what: str) -> Exception:
        kvs = _kvs(reply, 0)
        same = kvs and int(kvs[0]["create_revision"]) == grant.token
        if same and _holder(kvs[0]) == grant.holder:
            return LeaseNotHeld(grant.name, FORGED)
        return LeaseLost(grant.name, grant.token, f"expired or taken over before the {what}")

    def renew(self, grant: Grant, ttl: float) -> Grant:
        """Prove ownership, keep the lease alive, then prove that the key is still the
        grant's, on that lease; to a new TTL, move to a new lease.

        The first proof keeps a forged grant (right token and holder, wrong secret) from
        extending anyone's lease. The second closes the window between the first and the
        keepalive: a force release deletes the key, then revokes its lease, and a keepalive
        between the two succeeds on a lease that no longer carries the key (etcd before
        3.4.38, 3.5.23 and 3.6.5 even answers a keepalive racing the revocation itself with
        success, etcd #20590). A third round trip per renewal, against a holder believing for
        another TTL that it holds a name it lost.

        Both proofs are reads, never writes: a renewal that wrote would add a revision to the
        cluster's history every TTL/3 for every held lease, and etcd keeps every revision
        until it is compacted (not by default), so an idle holder would grow the database
        toward its space quota, past which the cluster refuses every write. A linearizable
        read has its own hazard, fixed in etcd 3.4.42, 3.5.28 and 3.6.9: before those, a member
        resumed from a pause could answer one stale (etcd #20418).
        """
        if grant.extra.get("asked", _seconds(ttl)) != _seconds(ttl):
            return self._relet(grant, ttl)
        lock, _ = self._keys(grant.name)
        value = b64(_lock_value(grant.secret, grant.holder))
        reply = self._call("kv/txn", owner_txn(lock, grant.token, value, [])).body
        if not reply.get("succeeded"):
            raise self._refusal(grant, reply, "renewal")
        lease = _kvs(reply, 0)[0].get("lease", "0")
        sent_at = time.monotonic()
        kept = self._call("lease/keepalive", {"ID": lease}).body.get("result", {})
        if int(kept.get("TTL", 0)) <= 0:
            raise LeaseLost(grant.name, grant.token, "its etcd lease expired before the renewal")
        still = self._call("kv/txn", owner_txn(lock, grant.token, value, [], lease)).body
        if not still.get("succeeded"):
            raise self._refusal(grant, still, "renewal")
        granted = _counted(ttl, kept["TTL"])
        return replace(grant, ttl=granted, sent_at=sent_at, expires_at=_expires(granted))

    def _relet(self, grant: Grant, ttl: float) -> Grant:
        lock, _ = self._keys(grant.name)
        value = b64(_lock_value(grant.secret, grant.holder))
        sent_at = time.monotonic()
        granted = self._call("lease/grant", {"TTL": _seconds(ttl)}).body
        put = {"request_put": {"key": lock, "value": value, "lease": granted["ID"]}}
        try:
            reply = self._call("kv/txn", owner_txn(lock, grant.token, value, [put])).body
        except BackendUnavailable:
            self._revoke(granted["ID"])
            raise
        if not reply.get("succeeded"):
            self._revoke(granted["ID"])
            raise self._refusal(grant, reply, "renewal")
        self._revoke(grant.extra.get("lease", 0))
        extra = {"lease": granted["ID"], "asked": _seconds(ttl)}
        ttl = _counted(ttl, granted["TTL"])
        return replace(grant, ttl=ttl, sent_at=sent_at, expires_at=_expires(ttl), extra=extra)

    def release(self, grant: Grant) -> None:
        lock, _ = self._keys(grant.name)
        value = b64(_lock_value(grant.secret, grant.holder))
        reply = self._call("kv/txn", release_txn(lock, grant.token, value))
        if reply.body.get("succeeded"):
            deleted = _kvs(reply.body, 0)
            self._revoke(deleted[0].get("lease", "0") if deleted else grant.extra.get("lease"))
            return
        if reply.replayed and not _kvs(reply.body, 0) and self._deleted_by_us(grant):
            self._revoke(grant.extra.get("lease", 0))  # our first attempt deleted it
            return
        raise self._refusal(grant, reply.body, "release")

    def _deleted_by_us(self, grant: Grant) -> bool:
        """After a retried release found the lock gone: whether the first attempt deleted it.

        Otherwise it expired, or a force release deleted it first, and the release must be
        refused (it was reported done). etcd's history says which: the lock's first deletion
        after its creation (a watch from the grant's token replays it), then whether the name
        key was written in the same revision (a force release's transaction writes it; our
        deletion does not). An expiry cannot be told from our deletion there, so the grant's
        own validity decides (the server's TTL is never shorter than the client's). History
        compacted away: the outcome cannot be told (``BackendUnavailable``)."""
        lock, name_key = self._keys(grant.name)
        revision = self.gateway.deletion(lock, grant.token, self.gateway.request_timeout)
        if not revision:
            raise BackendUnavailable(
                self.alias,
                f"release of {grant.name!r}: a retry found the lease gone, and etcd's history "
                "no longer says whether this release or an expiry or revocation removed it",
            )
        then = self._call("kv/range", {"key": name_key, "revision": revision}).body
        found = then.get("kvs") or []
        if found and int(found[0].get("mod_revision", 0)) == revision:
            return False  # force-released
        return time.monotonic() < grant.sent_at + grant.ttl

    def wait_for_release(self, name: str, timeout: float) -> bool:
        """A watch on the lock's deletion from the revision it was last seen at, so a
        release between the caller's failed try and this wait still wakes it.

        The waiter holds no etcd lease while it waits: the try that follows grants a fresh
        one, and its validity counts from before that grant. So the hazard of etcd #11456
        (a lock returned after its session's lease expired during the wait) cannot arise;
        :meth:`try_acquire` still refuses a grant whose lease may have run out before its key
        was written.
        """
        if timeout < 0.001:
            return False
        deadline = time.monotonic() + timeout
        lock, _ = self._keys(name)
        reply = self._call("kv/range", {"key": lock}, timeout=timeout).body
        if not reply.get("kvs"):
            return True
        revision, left = int(reply["header"]["revision"]) + 1, deadline - time.monotonic()
        return left > 0.001 and self.gateway.watch_deletion(lock, revision, left)

    def _info(self, name: str, lock: dict[str, Any] | None, free: dict[str, Any] | None) -> Any:
        if lock is not None:
            left = self._call("kv/lease/timetolive", {"ID": lock.get("lease", "0")}).body
            token, expires_at = int(lock["create_revision"]), _expires(int(left.get("TTL", 0)))
            return LeaseInfo(name, _holder(lock), token, True, self.alias, expires_at=expires_at)
        if free is not None:
            return LeaseInfo(name, "", int(free["mod_revision"]), False, self.alias)
        return None

    def inspect(self, name: str) -> LeaseInfo | None:
        lock, name_key = self._keys(name)
        reply = self._call("kv/txn", read_txn(lock, name_key)).body
        found = [next(iter(_kvs(reply, i)), None) for i in (0, 1)]
        info: LeaseInfo | None = self._info(name, *found)
        return info

    def inspect_all(self) -> list[LeaseInfo]:
        """Every name key and every lock under the prefix, read at one revision."""
        locks, names = self._keys("")
        reply = self._call("kv/txn", read_txn(locks, names, prefix=True)).body
        held = {self._name_of(kv, "lock/"): kv for kv in _kvs(reply, 0)}
        free = {self._name_of(kv, "name/"): kv for kv in _kvs(reply, 1)}
        infos = (self._info(name, held.get(name), free.get(name)) for name in sorted(free))
        return [info for info in infos if info is not None]

    def _name_of(self, kv: Mapping[str, Any], kind: str) -> str:
        return unb64(kv["key"]).decode()[len(self.prefix) + len(kind) :]

    def force_release(self, name: str, token: int) -> LeaseInfo:
        lock, name_key = self._keys(name)
        reply = self._call("kv/txn", force_release_txn(lock, name_key, token)).body
        if not reply.get("succeeded"):
            held, free = _kvs(reply, 0), _kvs(reply, 1)
            current = (
                int(held[0]["create_revision"])
                if held
                else int(free[0]["mod_revision"])
                if free
                else None
            )
            raise LeaseNotHeld(name, not_revoked(token, current))
        deleted = _kvs(reply, 0)
        if deleted:
            self._revoke(deleted[0].get("lease", "0"))
        return LeaseInfo(name, "", int(_kvs(reply, 2)[0]["mod_revision"]), False, self.alias)

    def deploy_checks(self) -> list[str]:
        """Each member's status: a member that does not answer, or that runs an etcd release
        whose resumed old leader revokes live leases (:func:`revokes_live_leases`), is a
        warning; a cluster of which no member answers raises, as every store does
        (``leases.E003``: nothing can be held there)."""
        answers = self.gateway.ask_each("maintenance/status", {})
        silent = [f"etcd member {url}: {why}" for url, why in answers if isinstance(why, str)]
        if len(silent) == len(answers):
            raise BackendUnavailable(self.alias, "maintenance/status: " + "; ".join(silent))
        affected: dict[str, list[str]] = {}
        for url, answer in answers:
            version = "" if isinstance(answer, str) else str(answer.get("version", ""))
            if revokes_live_leases(version):
                affected.setdefault(version, []).append(url)
        return silent + [
            f"etcd {version} on {', '.join(urls)}: an old leader resumed after a pause "
            "revokes live leases (etcd #15247), so holders lose leases their renewals kept "
            "(their successors' tokens still fence them); upgrade to etcd 3.4.31, 3.5.13 or "
            "later"
            for version, urls in affected.items()
        ]

    def close(self) -> None:
        self.gateway.close()
