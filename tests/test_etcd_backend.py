"""The etcd backend on real 3-member clusters: round trips, TTLs, and members killed or paused.

The conformance, fencing, revocation, fault and election suites already run on the session's
cluster (alias ``"etcd"``); the fault tests here own a cluster (``etcd_cluster``) so they can
SIGKILL its leader and SIGSTOP members, and every writer's history goes through the checker.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
from django.conf import settings
from django.db import connection
from django.test import override_settings

from devservers.etcd import EtcdCluster
from leases import LeaseError, LeaseLost, LeaseUnavailable, acquire, lease
from leases.backends import get_backend
from leases.backends.etcd import force_release_txn, revokes_live_leases
from tests.checker import ACCEPTED, check_history, history, new_register, record_write
from tests.clusters import etcd_member_versions, etcd_ready
from tests.lease_backends import lease_name

__all__ = ["lease_name"]  # fixture, re-exported for pytest

ALIAS = "etcd-fault"


@pytest.fixture
def etcd_store(db: None) -> str:
    """The session cluster's alias (started on first use), skipped without etcd."""
    return etcd_ready()


@contextlib.contextmanager
def cluster_alias(endpoints: list[str]) -> Iterator[str]:
    """Alias ``etcd-fault`` on ``endpoints`` (the first is the member the client tries first)."""
    leases: dict[str, Any] = settings.LEASES
    backends: dict[str, Any] = {**leases["BACKENDS"]}
    backends[ALIAS] = {
        "ENGINE": "leases.backends.etcd",
        "ENDPOINTS": endpoints,
        "REQUEST_TIMEOUT": 0.5,
        "CONNECT_TIMEOUT": 0.2,
    }
    with override_settings(LEASES={**leases, "BACKENDS": backends}):
        yield ALIAS


def first(cluster: EtcdCluster, index: int) -> list[str]:
    """The cluster's endpoints, member ``index`` first."""
    urls = cluster.endpoints
    return [urls[index], *urls[:index], *urls[index + 1 :]]


def counting(monkeypatch: pytest.MonkeyPatch, alias: str) -> list[str]:
    """Every request the backend sends, by path."""
    gateway = get_backend(alias).gateway  # type: ignore[attr-defined]
    sent: list[str] = []
    call: Callable[..., Any] = gateway.call

    def counted(path: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(path)
        return call(path, *args, **kwargs)

    monkeypatch.setattr(gateway, "call", counted)
    return sent


def test_round_trips_per_operation(
    etcd_store: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acquire: lease grant + create transaction. Renew: proof + keepalive + proof. Release:
    compare-and-delete + revoke. A taken name costs a third, revoking the unused lease."""
    sent = counting(monkeypatch, etcd_store)
    store = get_backend(etcd_store)
    grant = store.try_acquire(lease_name, "a", 5)
    assert grant is not None and sent == ["lease/grant", "kv/txn"]
    sent.clear()
    assert store.try_acquire(lease_name, "b", 5) is None
    assert sent == ["lease/grant", "kv/txn", "kv/lease/revoke"]
    sent.clear()
    grant = store.renew(grant, 5)
    assert sent == ["kv/txn", "lease/keepalive", "kv/txn"]
    sent.clear()
    store.release(grant)
    assert sent == ["kv/txn", "kv/lease/revoke"]


def test_a_waiter_waits_on_its_watch_instead_of_trying_every_few_milliseconds(
    etcd_store: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A try is three requests, two of them raft writes (a lease granted, then revoked): a
    waiter whose watch the backoff cut after its first few milliseconds tried about ten
    times a second (25 tries in this 2.5 s wait). The watch wakes it on the release or the
    holder's expiry; each wait now lasts at least ``WATCH_AT_LEAST``."""
    holder = acquire(lease_name, ttl=30, backend=etcd_store, keepalive=False)
    sent = counting(monkeypatch, etcd_store)
    with pytest.raises(LeaseUnavailable):
        acquire(lease_name, ttl=30, backend=etcd_store, timeout=2.5, holder="waiter")
    tries = sent.count("lease/grant")
    holder.release()
    assert 1 <= tries <= 14, sent  # about 2.5 s / WATCH_AT_LEAST (12 measured)


def _release_reply_lost(monkeypatch: pytest.MonkeyPatch, alias: str, *, applied: bool) -> None:
    """The release transaction's first attempt gets no reply (a read timeout), so the gateway
    retries it on the next member and calls the retry a replay; with ``applied`` the first
    attempt reached the cluster (its reply was what got lost), else it never left."""
    gateway = get_backend(alias).gateway  # type: ignore[attr-defined]
    post: Callable[..., Any] = gateway._post
    cut: list[bool] = []

    def losing(client: Any, path: str, body: Any, timeout: float) -> Any:
        if (
            path == "kv/txn"
            and not cut
            and any("request_delete_range" in op for op in body.get("success", []))
        ):
            cut.append(True)
            if applied:
                post(client, path, body, timeout)
            raise requests.ReadTimeout("the reply was lost")
        return post(client, path, body, timeout)

    monkeypatch.setattr(gateway, "_post", losing)


def test_a_retried_release_whose_first_attempt_deleted_the_lock_is_done(
    etcd_store: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = acquire(lease_name, ttl=30, backend=etcd_store, keepalive=False)
    _release_reply_lost(monkeypatch, etcd_store, applied=True)
    held.release()  # the retry finds the lock gone: by our own first attempt
    info = get_backend(etcd_store).inspect(lease_name)
    assert info is not None and not info.held


def test_a_retried_release_of_a_force_released_lease_is_refused(
    etcd_store: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry found the lock gone and took that for its own first attempt's work, so the
    release of a lease force-released meanwhile was reported done (seen from outside with the
    first member paused). etcd's history says who deleted it."""
    held = acquire(lease_name, ttl=30, backend=etcd_store, keepalive=False)
    get_backend(etcd_store).force_release(lease_name, held.token)
    _release_reply_lost(monkeypatch, etcd_store, applied=False)
    with pytest.raises(LeaseLost):
        held.release()


def test_a_ttl_below_the_servers_minimum_is_counted_as_asked(
    etcd_store: str, lease_name: str
) -> None:
    """etcd grants whole seconds, at least its minimum: the holder counts the shorter TTL it
    asked for (it gives up early, never late), and the server holds the name for its own."""
    store = get_backend(etcd_store)
    grant = store.try_acquire(lease_name, "a", 0.3)
    assert grant is not None and grant.ttl == 0.3
    gateway = store.gateway  # type: ignore[attr-defined]
    granted = gateway.call("kv/lease/timetolive", {"ID": grant.extra["lease"]}).body
    assert int(granted["grantedTTL"]) >= 1
    renewed = store.renew(grant, 2.5)  # another TTL: moved to a new lease, same token
    assert renewed.token == grant.token and renewed.ttl == 2.5
    assert renewed.extra["lease"] != grant.extra["lease"]
    store.release(renewed)


def test_a_renewal_racing_a_force_release_is_not_reported_renewed(
    etcd_store: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A force release deletes the key, then revokes its etcd lease. A renewal whose proof
    came before the deletion and whose keepalive came before the revocation kept alive a
    lease that no longer carries the key: reporting that as renewed would have the holder
    believe it holds for another TTL. (etcd before 3.4.38, 3.5.23 and 3.6.5 also answers a
    keepalive that races a revocation with success, etcd #20590: the same window.)"""
    store = get_backend(etcd_store)
    grant = store.try_acquire(lease_name, "a", 5)
    assert grant is not None
    gateway = store.gateway  # type: ignore[attr-defined]
    lock, name_key = store._keys(lease_name)  # type: ignore[attr-defined]
    call: Callable[..., Any] = gateway.call

    def racing(path: str, *args: Any, **kwargs: Any) -> Any:
        if path == "lease/keepalive":  # the force release's deletion lands first
            call("kv/txn", force_release_txn(lock, name_key, grant.token))
        return call(path, *args, **kwargs)

    monkeypatch.setattr(gateway, "call", racing)
    with pytest.raises(LeaseLost):
        store.renew(grant, 5)
    monkeypatch.undo()
    call("kv/lease/revoke", {"ID": grant.extra["lease"]})  # the force release's revocation
    assert store.inspect(lease_name).held is False  # type: ignore[union-attr]


def test_renewals_add_nothing_to_the_clusters_history(etcd_store: str, lease_name: str) -> None:
    """A held lease's renewals write nothing: etcd keeps every revision until it is compacted
    (not by default), so a renewal that wrote (a closing proof that put the key again, tried
    and dropped) would grow the database of a cluster holding idle leases toward its space
    quota. The key's mod revision and version do not move across three renewals (the
    cluster's revision may: other tests' leases expire meanwhile); no waiter wakes."""
    store = get_backend(etcd_store)
    gateway = store.gateway  # type: ignore[attr-defined]
    lock, _ = store._keys(lease_name)  # type: ignore[attr-defined]
    grant = store.try_acquire(lease_name, "a", 5)
    assert grant is not None
    woken: list[bool] = []
    waiter = threading.Thread(target=lambda: woken.append(store.wait_for_release(lease_name, 2)))
    waiter.start()
    before = gateway.call("kv/range", {"key": lock}).body
    for _ in range(3):
        grant = store.renew(grant, 5)
    after = gateway.call("kv/range", {"key": lock}).body
    waiter.join(10)
    assert woken == [False]
    assert after["kvs"] == before["kvs"]  # create, mod revision, version, value, lease
    store.release(grant)


@pytest.mark.fault
@pytest.mark.django_db(transaction=True)
def test_leader_killed_while_held_renewals_fail_over(
    etcd_cluster: EtcdCluster, lease_name: str
) -> None:
    """SIGKILL the leader the client talks to: renewals move to the survivors and the lease
    is kept past its TTL; nobody else gets it; after release a new grant has a higher token."""
    register = new_register()
    leader = etcd_cluster.wait_for_leader()
    with cluster_alias(first(etcd_cluster, leader)) as alias:
        held = acquire(lease_name, ttl=3, backend=alias)
        assert record_write(register, held, "holder")
        etcd_cluster.kill(leader)
        etcd_cluster.wait_for_leader(15)
        time.sleep(4)  # past the TTL: only renewals through the other members keep it
        held.ensure_held()
        assert record_write(register, held, "holder")
        with pytest.raises(LeaseUnavailable):
            acquire(lease_name, ttl=3, backend=alias, timeout=0.5, holder="other")
        held.release()
        successor = acquire(lease_name, ttl=3, backend=alias, timeout=5, holder="successor")
        assert successor.token > held.token
        assert record_write(register, successor, "successor")
        successor.release()
    check_history(register, grants=[held.token, successor.token])


@pytest.mark.fault
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("role", ["leader", "follower"])
def test_paused_member_is_skipped_and_the_lease_kept(
    etcd_cluster: EtcdCluster, lease_name: str, role: str
) -> None:
    """SIGSTOP the member the client tries first (it hangs: connections open, no answers):
    every request waits at most REQUEST_TIMEOUT there, then goes to the next member.

    The release goes through the other members too, before the member resumes: on etcd
    before 3.4.31 and 3.5.13 (Debian 12 ships 3.4.23) a resumed old leader revokes the
    leases whose renewals it missed (etcd #15247; about one run in twelve on a loaded
    machine), so a release after the resume could find the lease gone although every
    renewal succeeded. That server bug is ``revokes_live_leases``'s; what it costs a holder is
    ``test_a_lease_revoked_behind_the_holders_back_is_reported_lost_and_fenced``'s.
    """
    leader = etcd_cluster.wait_for_leader()
    paused = leader if role == "leader" else (leader + 1) % 3
    register = new_register()
    with cluster_alias(first(etcd_cluster, paused)) as alias:
        # A TTL of several renewal periods: each renewal first waits REQUEST_TIMEOUT at the
        # paused member, and a paused leader also costs an election, so on a loaded machine a
        # 3 s lease could lapse between two renewals that both did their job.
        held = acquire(lease_name, ttl=6, backend=alias)
        etcd_cluster.pause(paused)
        try:
            time.sleep(7)  # past the TTL: only renewals through the other members keep it
            held.ensure_held()
            assert record_write(register, held, "holder")
            with pytest.raises(LeaseUnavailable):
                acquire(lease_name, ttl=3, backend=alias, timeout=0.5, holder="other")
            held.release()
        finally:
            etcd_cluster.resume(paused)
    check_history(register, grants=[held.token])


@pytest.mark.django_db(transaction=True)
def test_a_lease_revoked_behind_the_holders_back_is_reported_lost_and_fenced(
    etcd_store: str, lease_name: str
) -> None:
    """What a resumed old leader does on the releases ``revokes_live_leases`` names: the
    holder's etcd lease revoked while the holder renews it. The next renewal finds the key
    gone and reports the loss; the successor's token is higher; the old holder's write is
    refused."""
    register = new_register()
    old = acquire(lease_name, ttl=2, backend=etcd_store)
    assert record_write(register, old, "old")
    gateway = get_backend(etcd_store).gateway  # type: ignore[attr-defined]
    gateway.call("kv/lease/revoke", {"ID": old.grant.extra["lease"]})
    assert old.lost.wait(2 + 1), "the revocation was never reported"
    with pytest.raises(LeaseError):
        old.ensure_held()
    new = acquire(lease_name, ttl=2, backend=etcd_store, timeout=1, holder="new")
    assert new.token > old.token
    assert record_write(register, new, "new")
    assert not record_write(register, old.token, "old")
    new.release()
    check_history(register, grants=[old.token, new.token])


@pytest.mark.parametrize(
    ("version", "revokes"),
    [
        ("3.4.23", True),  # Debian 12's etcd-server
        ("3.4.30", True),
        ("3.4.31", False),
        ("3.5.0", True),
        ("3.5.12", True),
        ("3.5.13", False),
        ("3.5.17", False),
        ("3.6.0", False),
        ("3.6.0-rc.1", False),
        ("4.0.0", False),
        ("3.3.27", True),
        ("", False),
        ("unknown", False),
    ],
)
def test_releases_whose_old_leader_revokes_live_leases(version: str, revokes: bool) -> None:
    assert revokes_live_leases(version) is revokes


def test_the_deploy_check_names_the_members_on_a_release_that_revokes_live_leases(
    etcd_store: str,
) -> None:
    """Each member is asked, not one: a cluster mid-upgrade has members on either side of the
    fix. One warning per affected version, naming its members."""
    affected: dict[str, list[str]] = {}
    for url, version in etcd_member_versions(etcd_store).items():
        if revokes_live_leases(version):
            affected.setdefault(version, []).append(url)
    problems = get_backend(etcd_store).deploy_checks()
    assert len(problems) == len(affected), problems
    for (version, urls), problem in zip(affected.items(), problems, strict=True):
        assert problem.startswith(f"etcd {version} on {', '.join(urls)}:"), problem
        assert "#15247" in problem and "3.4.31, 3.5.13" in problem, problem


def test_a_member_that_does_not_answer_is_a_deploy_warning(etcd_store: str) -> None:
    """One silent member of three is worth a warning (the cluster still serves); none
    answering is ``leases.E003`` (``test_backend_checks.py``)."""
    leases: dict[str, Any] = settings.LEASES
    endpoints = leases["BACKENDS"][etcd_store]["ENDPOINTS"]
    with cluster_alias([*endpoints, "http://127.0.0.1:1"]) as alias:
        problems = get_backend(alias).deploy_checks()
    silent = [p for p in problems if "127.0.0.1:1:" in p]
    assert len(silent) == 1 and "no answer" in silent[0], problems


class HungMembers:
    """Listeners that accept a request's connection and never answer (a member whose process
    is stopped, or a proxy in front of a dead one), until :meth:`close` cuts every connection
    they took; :attr:`all_asked` is set once each has one."""

    def __init__(self, count: int) -> None:
        self.listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
        self.urls = [f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in self.listeners]
        self.taken: list[socket.socket] = []
        self.all_asked = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._accept, args=(listener,), daemon=True)
            for listener in self.listeners
        ]
        for thread in self._threads:
            thread.start()

    def _accept(self, listener: socket.socket) -> None:
        with contextlib.suppress(OSError):  # closed
            conn, _ = listener.accept()
            with self._lock:
                self.taken.append(conn)
                if len(self.taken) == len(self.listeners):
                    self.all_asked.set()

    def close(self) -> None:
        for sock in [*self.listeners, *self.taken]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(5)


def test_the_deploy_check_asks_the_members_at_once(etcd_store: str) -> None:
    """Hung members cost the check one reply timeout together, not one each: every member is
    asked before any of them answers (asked in turn, the second hung member would be asked
    only once the first timed out, 30 s here)."""
    leases: dict[str, Any] = settings.LEASES
    endpoints = leases["BACKENDS"][etcd_store]["ENDPOINTS"]
    hung = HungMembers(3)
    backends: dict[str, Any] = {**leases["BACKENDS"]}
    backends[ALIAS] = {
        "ENGINE": "leases.backends.etcd",
        "ENDPOINTS": [*hung.urls, *endpoints],
        "REQUEST_TIMEOUT": 30.0,
    }
    problems: list[str] = []
    try:
        with override_settings(LEASES={**leases, "BACKENDS": backends}):
            checking = threading.Thread(
                target=lambda: problems.extend(get_backend(ALIAS).deploy_checks()), daemon=True
            )
            checking.start()
            all_asked = hung.all_asked.wait(10)
            hung.close()
            checking.join(20)
    finally:
        hung.close()
    assert all_asked, f"only {len(hung.taken)} of 3 hung members asked within 10 s"
    assert not checking.is_alive()
    silent = [p for p in problems if "no answer" in p]
    assert [p.split(": no answer")[0] for p in silent] == [
        f"etcd member {url}" for url in hung.urls
    ], problems


@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_contenders_through_leader_kill_and_member_pause_never_share_a_token(
    etcd_cluster: EtcdCluster, lease_name: str
) -> None:
    """Three contenders take turns writing the fenced register while the leader is killed and
    a member paused; the checker finds no two writers accepted with one token."""
    register = new_register()
    stop = threading.Event()
    tokens: list[int] = []

    def contend(writer: str, alias: str) -> None:
        while not stop.is_set():
            try:
                with lease(lease_name, ttl=2, backend=alias, timeout=1, holder=writer) as held:
                    tokens.append(held.token)
                    record_write(register, held, writer)
                    time.sleep(0.05)
            except LeaseError:
                time.sleep(0.05)
        connection.close()  # the test database is dropped at the end: leave no session on it

    with cluster_alias(etcd_cluster.endpoints) as alias:
        get_backend(alias)  # made once, here, not by three threads at once
        threads = [threading.Thread(target=contend, args=(f"w{i}", alias)) for i in range(3)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(1)
            etcd_cluster.kill(etcd_cluster.wait_for_leader())
            time.sleep(2)
            pausing = next(i for i, m in enumerate(etcd_cluster.members) if m.proc is not None)
            etcd_cluster.pause(pausing)
            time.sleep(2)
            etcd_cluster.resume(pausing)
            time.sleep(1.5)
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
    accepted = [a for a in history(register) if a.outcome == ACCEPTED]
    assert len(accepted) >= 5, accepted
    assert tokens == sorted(tokens)
    check_history(register)
