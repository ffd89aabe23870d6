"""The database backend's hand-off through the holder's tenure lock (``_tenure``): a thread
waiting in the room queues on the lock the holder's kept connection holds, and the release
grants it within that one try; every way the lock outlives its grant only delays the waiter
by at most ``ROOM_TIMEOUT``, and the row alone decides who holds the name."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

import pytest

from leases import LeaseLost, acquire
from leases.backends import _tenure, _waiting_room
from leases.backends._tenure import Pin
from leases.errors import BackendUnavailable
from leases.handle import Lease
from tests.lease_backends import lease_name
from tests.test_lease_database import (
    database_backend,
    own_connection,
    queued_tries_sent,
    traced_room_connections,
)
from tests.waiting import wait_until

__all__ = ["lease_name"]

pytestmark = pytest.mark.django_db

ROOM_TIMEOUT = _waiting_room.ROOM_TIMEOUT


@pytest.fixture(autouse=True)
def probed() -> None:
    """The default backend asked whether a pooler is in the way (its first grant in a process
    takes no tenure lock until it did)."""
    database_backend()._probe_pooler()


def tenure_sessions(name: str, token: int, *, granted: bool) -> int:
    """Sessions holding (``granted``) or waiting on the tenure lock of ``name``'s grant
    ``token``, from ``pg_locks``."""
    with own_connection() as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted = %s"
            " AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint)"
            "   = hashtextextended('leases:tenure:' || %s, %s)",
            [granted, name, token],
        ).fetchone()
    return int(row[0]) if row else 0


def tenure_waiters(name: str, token: int) -> int:
    return tenure_sessions(name, token, granted=False)


def tenure_held(name: str, token: int) -> bool:
    return tenure_sessions(name, token, granted=True) > 0


class Waiter:
    """A thread that acquires ``name`` (as a holder of its own: a thread's identity may be
    reused once it ended) and hands the lease to the test."""

    count = 0

    def __init__(self, name: str, *, ttl: float = 30, timeout: float = 30) -> None:
        Waiter.count += 1
        self.holder = f"waiter-{Waiter.count}"
        self.lease: Lease | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.granted_at = 0.0
        self._thread = threading.Thread(target=self._run, args=(name, ttl, timeout), daemon=True)
        self._thread.start()

    def _run(self, name: str, ttl: float, timeout: float) -> None:
        try:
            self.lease = acquire(
                name, ttl=ttl, timeout=timeout, keepalive=False, holder=self.holder
            )
            self.granted_at = time.monotonic()
        except BaseException as exc:  # reported by granted()
            self.error = exc

    def granted(self, within: float) -> Lease:
        self._thread.join(within)
        assert self.error is None, self.error
        assert self.lease is not None, f"not granted within {within} s"
        return self.lease


def pinned(lease: Lease) -> Pin | None:
    pin = lease.grant.extra.get("tenure")
    return pin if isinstance(pin, Pin) else None


@pytest.fixture
def traced_rooms(monkeypatch: pytest.MonkeyPatch) -> Iterator[IO[str]]:
    with traced_room_connections(monkeypatch) as trace:
        yield trace


def won_in_the_room(name: str, *, ttl: float = 30) -> Lease:
    """A lease a thread won inside ``name``'s room (so it kept its connection and holds its
    tenure lock): a first holder from outside the room, released once the thread waits."""
    first = acquire(name, ttl=30, keepalive=False, holder="first")
    waiter = Waiter(name, ttl=ttl)
    wait_until(lambda: _in_room(name), 15, "the waiter in the room")
    first.release()
    lease = waiter.granted(15)
    assert pinned(lease) is not None and tenure_held(name, lease.token)
    return lease


def _in_room(name: str) -> bool:
    from tests.test_lease_database import room_locks

    return room_locks(name).get(True, 0) == 1


def test_the_waiter_queues_on_the_holders_tenure_lock_and_the_release_grants_it_there(
    lease_name: str, traced_rooms: Any
) -> None:
    """The next waiter's one try waits on the server, on the tenure lock of the grant that
    holds the name; the release (here from another thread than the one that acquired) frees
    it, and that same try takes the name: no second try, no client wake-up in between."""
    holder = won_in_the_room(lease_name)
    waiter = Waiter(lease_name)
    wait_until(lambda: tenure_waiters(lease_name, holder.token) == 1, 15, "queued on the tenure")
    before = queued_tries_sent(traced_rooms)
    time.sleep(0.3)  # room for a try that should not be sent while the name is held
    assert queued_tries_sent(traced_rooms) == before
    holder.release()
    second = waiter.granted(15)
    assert second.token > holder.token
    assert queued_tries_sent(traced_rooms) == before, "the waiter's one try did not take it"
    assert not tenure_held(lease_name, holder.token)
    assert pinned(second) is not None and tenure_held(lease_name, second.token)
    second.release()
    assert not tenure_held(lease_name, second.token)


def test_a_holder_paused_past_its_expiry_holds_up_its_waiter_at_most_the_room_timeout(
    lease_name: str,
) -> None:
    """A paused holder still holds its tenure lock when its grant runs out: the waiter's
    queueing ends by ``ROOM_TIMEOUT``, and its next try takes the expired name by the row.
    The late release is refused (the lease was lost) and lets the lock go all the same."""
    paused = won_in_the_room(lease_name, ttl=0.6)
    waiter = Waiter(lease_name)
    second = waiter.granted(0.6 + ROOM_TIMEOUT + 5)
    assert second.token > paused.token
    assert waiter.granted_at - waiter.started < 0.6 + ROOM_TIMEOUT + 3
    assert tenure_held(lease_name, paused.token)  # the paused holder's session still has it
    with pytest.raises(LeaseLost):
        paused.release()
    assert not tenure_held(lease_name, paused.token)
    second.release()


def test_a_forced_release_frees_a_queued_waiter_within_the_room_timeout(lease_name: str) -> None:
    """``force_release`` advances the token on the row, but the evicted holder's session keeps
    its tenure lock until it hears of it: the waiter queued there takes the name once its
    queueing ends (``ROOM_TIMEOUT``), not at the grant's expiry (30 s here)."""
    evicted = won_in_the_room(lease_name)
    waiter = Waiter(lease_name)
    wait_until(lambda: tenure_waiters(lease_name, evicted.token) == 1, 15, "queued on the tenure")
    forced_at = time.monotonic()
    database_backend().force_release(lease_name, evicted.token)
    second = waiter.granted(ROOM_TIMEOUT + 10)
    assert second.token > evicted.token + 1  # the revocation took a token of its own
    assert waiter.granted_at - forced_at < ROOM_TIMEOUT + 5
    with pytest.raises(LeaseLost):
        evicted.release()
    assert not tenure_held(lease_name, evicted.token)
    second.release()


def test_a_holder_whose_kept_connection_died_releases_on_its_own_and_wakes_the_waiter(
    lease_name: str,
) -> None:
    """The kept connection's session ends (a restart, ``pg_terminate_backend``): its tenure
    lock goes with it, so the queued waiter's try is refused (the name is still held) and it
    waits for the release's ``NOTIFY``; the release, finding its connection dead, goes out on
    the backend's own connection, and the waiter takes the name."""
    holder = won_in_the_room(lease_name)
    pin = pinned(holder)
    assert pin is not None and pin.conn is not None
    pid = pin.conn.info.backend_pid
    waiter = Waiter(lease_name)
    wait_until(lambda: tenure_waiters(lease_name, holder.token) == 1, 15, "queued on the tenure")
    with own_connection() as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", [pid])
    wait_until(lambda: tenure_waiters(lease_name, holder.token) == 0, 15, "the queue let go")
    time.sleep(0.2)
    assert waiter.lease is None  # the name is still held: the row decides
    released_at = time.monotonic()
    holder.release()
    second = waiter.granted(ROOM_TIMEOUT + 10)
    assert second.token > holder.token
    assert waiter.granted_at - released_at < ROOM_TIMEOUT + 5
    second.release()


def test_operators_see_a_tenure_lock_as_the_leases_not_as_a_bare_key(lease_name: str) -> None:
    """The admin's advisory-lock page and ``manage.py leases`` label the holder's tenure lock
    and the waiter queued on it with the lease's name, as they do its waiting room."""
    from leases import operations

    holder = won_in_the_room(lease_name)
    waiter = Waiter(lease_name)
    wait_until(lambda: tenure_waiters(lease_name, holder.token) == 1, 15, "queued on the tenure")
    rows = [row for row in operations.advisory_locks() if row.tenure_of == lease_name]
    assert sorted(row.granted for row in rows) == [False, True]
    assert {row.label for row in rows} == {f"tenure of lease {lease_name!r}"}
    assert not any(row.room_of for row in rows)
    holder.release()
    waiter.granted(15).release()


def test_past_the_cap_on_kept_connections_a_grant_keeps_none_and_hands_off_by_notify(
    lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process keeps at most ``PINS`` room connections for the grants they won; past it a
    grant keeps none (no tenure lock), and its waiter is woken by the release's ``NOTIFY``."""
    monkeypatch.setattr(_waiting_room, "PINS", 0)
    first = acquire(lease_name, ttl=30, keepalive=False, holder="first")
    waiter = Waiter(lease_name)
    wait_until(lambda: _in_room(lease_name), 15, "the waiter in the room")
    first.release()
    held = waiter.granted(15)
    assert pinned(held) is None and not tenure_held(lease_name, held.token)
    third = Waiter(lease_name)
    wait_until(lambda: _in_room(lease_name), 15, "the next waiter in the room")
    held.release()
    assert third.granted(ROOM_TIMEOUT + 10).token > held.token
    assert third.lease is not None
    third.lease.release()


def test_a_lease_won_in_the_room_released_from_async_code_lets_its_tenure_go(
    lease_name: str,
) -> None:
    """``arelease()`` of a lease a thread won in the room releases on the connection it kept
    (from a worker thread: it is a sync connection), so its tenure lock goes with the release."""
    import asyncio

    holder = won_in_the_room(lease_name)
    asyncio.run(holder.arelease())
    assert not tenure_held(lease_name, holder.token)
    assert database_backend().inspect(lease_name).held is False  # type: ignore[union-attr]


def test_a_grant_after_a_long_queue_counts_its_time_from_about_when_it_was_granted(
    lease_name: str,
) -> None:
    """A queued try may wait a long time (for the room, then on the holder's tenure lock)
    before it is granted; the lease's time counts from about the grant, measured on the
    server from the try's first statement, never from before its queueing. Counted from its
    second statement alone, a waiter that queued long for the room got a grant that looked
    older than the one granted before it (a fencing checker ordering grants by it saw tokens
    go backwards); with a short TTL it would have been spent waiting."""
    from tests.test_lease_database import room_locks

    holder = won_in_the_room(lease_name)
    first = Waiter(lease_name)
    wait_until(lambda: tenure_waiters(lease_name, holder.token) == 1, 15, "queued on the tenure")
    second = Waiter(lease_name)
    wait_until(lambda: room_locks(lease_name) == {True: 1, False: 1}, 15, "queued for the room")
    time.sleep(0.6)  # the second waiter's first statement queues for the room all along
    holder.release()
    granted = first.granted(15)
    released_at = time.monotonic()
    granted.release()
    last = second.granted(15)
    assert last.token > granted.token
    assert last.grant.sent_at > released_at - 0.3, last.grant.sent_at - released_at
    assert last.grant.sent_at <= time.monotonic()
    last.release()


def own_tenure_locks(backend: Any) -> set[int]:
    """The advisory lock keys the backend's own connection's session holds."""
    conn = backend.connection()
    assert conn is not None
    with own_connection() as admin:
        rows = admin.execute(
            "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks"
            " WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND pid = %s",
            [conn.info.backend_pid],
        ).fetchall()
    return {int(row[0]) for row in rows}


def tenure_key(name: str, token: int) -> int:
    with own_connection() as admin:
        row = admin.execute(
            "SELECT hashtextextended('leases:tenure:' || %s, %s)", [name, token]
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_holder_that_won_outside_the_room_hands_off_within_the_waiters_one_try(
    lease_name: str, traced_rooms: Any
) -> None:
    """A grant won uncontended, on the backend's own connection, takes its tenure lock in
    that session too: the first waiter's one try queues on it and the release grants it
    there, as for a holder that won in the room (no ``NOTIFY``, no second try)."""
    from leases import operations

    holder = acquire(lease_name, ttl=30, keepalive=False, holder="uncontended")
    assert pinned(holder) is None and tenure_held(lease_name, holder.token)
    waiter = Waiter(lease_name)
    wait_until(lambda: tenure_waiters(lease_name, holder.token) == 1, 15, "queued on the tenure")
    before = queued_tries_sent(traced_rooms)
    rows = [row for row in operations.advisory_locks() if row.tenure_of == lease_name]
    assert sorted(row.granted for row in rows) == [False, True]
    time.sleep(0.3)  # room for a try that should not be sent while the name is held
    assert queued_tries_sent(traced_rooms) == before
    holder.release()
    second = waiter.granted(15)
    assert second.token == holder.token + 1
    assert queued_tries_sent(traced_rooms) == before, "the waiter's one try did not take it"
    assert not tenure_held(lease_name, holder.token)
    second.release()


def test_grants_left_to_run_out_keep_at_most_the_cap_of_tenure_locks(
    lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acquire-and-let-expire is supported: the own connection's session keeps at most
    ``OWN_TENURES`` tenure locks (past the cap a grant takes none), and the next grant after
    they ran out unreleased unlocks theirs first, and takes its own again."""
    monkeypatch.setattr(_tenure, "OWN_TENURES", 3)
    backend = database_backend()
    monkeypatch.setattr(backend, "_tenures", _tenure.Tenures())
    before = own_tenure_locks(backend) if backend.connection() is not None else set()
    names = [f"{lease_name}-{index}" for index in range(5)]
    leases = [acquire(name, ttl=0.5, keepalive=False) for name in names]  # never released
    keys = {tenure_key(lease.name, lease.token) for lease in leases}
    held = own_tenure_locks(backend) & keys
    assert held == {tenure_key(lease.name, lease.token) for lease in leases[:3]}
    time.sleep(0.6)  # every grant ran out
    later = acquire(f"{lease_name}-later", ttl=30, keepalive=False)
    after = own_tenure_locks(backend)
    assert not after & keys, "the locks of grants that ran out were kept"
    assert tenure_key(later.name, later.token) in after
    assert after - before == {tenure_key(later.name, later.token)}
    later.release()
    assert own_tenure_locks(backend) - before == set()


def test_a_release_after_the_own_connection_was_replaced_releases_plainly(
    lease_name: str,
) -> None:
    """The session that took the tenure lock ended (the lock with it): the release goes on a
    new connection without unlocking anything, and later grants take theirs again."""
    backend = database_backend()
    holder = acquire(lease_name, ttl=30, keepalive=False)
    conn = backend.connection()
    assert conn is not None and tenure_held(lease_name, holder.token)
    with own_connection() as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])
    wait_until(lambda: not tenure_held(lease_name, holder.token), 15, "the session gone")
    holder.release()
    info = backend.inspect(lease_name)
    assert info is not None and not info.held
    again = acquire(lease_name, ttl=30, keepalive=False)
    assert tenure_held(lease_name, again.token)
    again.release()
    assert not tenure_held(lease_name, again.token)


def test_a_release_whose_session_lost_the_lock_takes_no_more(
    lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unlock that finds no lock on the very connection that took it means another server
    session answered (a transaction pooler): the backend takes no more tenure locks there,
    and its grants and releases go on as before."""
    backend = database_backend()
    monkeypatch.setattr(backend, "_tenures", _tenure.Tenures())
    holder = acquire(lease_name, ttl=30, keepalive=False)
    conn = backend.connection()
    assert conn is not None and tenure_held(lease_name, holder.token)
    conn.execute("SELECT pg_advisory_unlock_all()")  # as if another session had taken it
    holder.release()
    info = backend.inspect(lease_name)
    assert info is not None and not info.held
    again = acquire(lease_name, ttl=30, keepalive=False)
    assert not tenure_held(lease_name, again.token)
    again.release()


def test_a_lease_won_uncontended_released_from_async_code_lets_its_tenure_go(
    lease_name: str,
) -> None:
    """``arelease()`` of a lease a thread won on the own connection unlocks its tenure lock
    in that connection's session (the async connection's session never held it)."""
    held = acquire(lease_name, ttl=30, keepalive=False)
    assert tenure_held(lease_name, held.token)
    asyncio.run(held.arelease())
    assert not tenure_held(lease_name, held.token)
    info = database_backend().inspect(lease_name)
    assert info is not None and not info.held


def test_a_release_that_failed_on_the_server_leaves_its_tenure_lock_to_the_reclaim(
    lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release statement failed (here: it waited on the row past ``statement_timeout``)
    on a connection that stays open: the unlock in it did not run either, so the lock is
    listed again, and the next grant at the cap unlocks it."""
    monkeypatch.setattr(_tenure, "OWN_TENURES", 1)
    backend = database_backend()
    monkeypatch.setattr(backend, "_tenures", _tenure.Tenures())
    held = acquire(lease_name, ttl=30, keepalive=False)
    key = tenure_key(held.name, held.token)
    assert key in own_tenure_locks(backend)
    conn = backend.connection()
    assert conn is not None
    with own_connection() as blocker:
        blocker.execute("BEGIN")
        blocker.execute("SELECT 1 FROM leases_lease WHERE name = %s FOR UPDATE", [lease_name])
        conn.execute("SET statement_timeout = '200ms'")
        try:
            with pytest.raises(BackendUnavailable):
                held.release()
        finally:
            conn.execute("RESET statement_timeout")
            blocker.execute("ROLLBACK")
    assert backend.connection() is conn, "the connection was dropped"
    assert key in own_tenure_locks(backend)  # the failed statement unlocked nothing
    later = acquire(f"{lease_name}-later", ttl=30, keepalive=False)
    locks = own_tenure_locks(backend)
    assert key not in locks and tenure_key(later.name, later.token) in locks
    later.release()
    held.release()  # the grant itself still holds: its retry frees it


def test_a_lease_left_to_expire_keeps_its_tenure_lock_only_until_the_next_acquire(
    lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the cap too: a grant dropped unreleased keeps no lock past its expiry and the
    process's next acquire, so no stale lock lingers on the own connection's session; a
    lease kept alive by renewals keeps its own all along."""
    backend = database_backend()
    monkeypatch.setattr(backend, "_tenures", _tenure.Tenures())
    dropped = acquire(f"{lease_name}-dropped", ttl=0.3, keepalive=False)
    kept = acquire(f"{lease_name}-kept", ttl=0.3, keepalive=False)
    dropped_key = tenure_key(dropped.name, dropped.token)
    kept_key = tenure_key(kept.name, kept.token)
    assert {dropped_key, kept_key} <= own_tenure_locks(backend)
    kept.renew(ttl=30)
    time.sleep(0.4)  # the dropped grant ran out; the kept one was renewed past it
    later = acquire(f"{lease_name}-later", ttl=30, keepalive=False)
    locks = own_tenure_locks(backend)
    assert dropped_key not in locks, "a grant left to run out kept its lock"
    assert kept_key in locks and tenure_key(later.name, later.token) in locks
    later.release()
    kept.release()
    assert not {kept_key, tenure_key(later.name, later.token)} & own_tenure_locks(backend)


def test_the_tenure_lock_of_a_force_released_grant_is_not_listed_as_a_bare_key(
    lease_name: str,
) -> None:
    """An operator's force release ends a grant whose holder never releases it: its tenure
    lock stays on the holder's session until that process's next acquire after the grant
    ran out. The row no longer names it, but it is the package's own session's: operators'
    listings leave it out (nobody waits on it), rather than show a bare key held by
    django-leases, which invites terminating the session."""
    from leases import operations

    held = acquire(lease_name, ttl=30, keepalive=False)
    key = tenure_key(held.name, held.token)
    database_backend().force_release(lease_name, held.token)
    assert key in own_tenure_locks(database_backend())  # still on the holder's session
    listed = [row for row in operations.advisory_locks() if row.key64 == key]
    assert not listed, [row.label for row in listed]
