"""Pruning the lease rows of unused names (``manage.py leases prune``) never lets a token go
backwards: a pruned name's next grant is above every token the name ever had, on the database
backend and on Redlock (whose tokens are the same rows' counters), also when the prune races an
acquire of the same name, and under revocation.

Transactional tests: the prune raises the token floor, which must not outlive the test (a later
test's first grant of a new name expects token 1), and the flush after each test empties it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.core.management.base import CommandError

from leases import (
    BackendNotSupported,
    BackendUnavailable,
    FencingTokenRevoked,
    LeaseLost,
    LeaseNotHeld,
    acquire,
)
from leases.backends import _pruning, get_backend
from leases.backends._counter import DurableCounter
from leases.backends._pgconn import connect
from leases.backends._pruning import delete_slice, prune_batch, raise_floor, wait_for_writers
from leases.backends.base import Grant
from leases.backends.database import PREPARED_OWN_ACQUIRE
from leases.models import Lease, TokenFloor
from leases.operations import force_release
from tests.factories import UserFactory
from tests.testapp.models_fencing import FencedDoc
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

DAY = 86400.0


def grant_cycles(name: str, times: int) -> Grant:
    """Acquire and release ``name`` ``times`` times on the database backend; the last grant."""
    backend = get_backend("default")
    grant = None
    for _ in range(times):
        grant = backend.try_acquire(name, "pruning-test", 30.0)
        assert grant is not None
        backend.release(grant)
    assert grant is not None
    return grant


def age(*names: str, days: float = 2) -> None:
    """Pretend ``names`` were last released ``days`` ago (on the database's clock)."""
    conn = connect("default")
    try:
        conn.execute(
            "UPDATE leases_lease SET expires_at = now() - make_interval(days => %s)"
            " WHERE name = ANY(%s)",
            [days, list(names)],
        )
    finally:
        conn.close()


def floor() -> int:
    row = TokenFloor.objects.filter(id=1).first()
    return row.token if row else 0


def test_a_pruned_names_next_grant_gets_a_higher_token_than_it_ever_had() -> None:
    last = grant_cycles("prune:job", 5)
    age("prune:job")
    assert get_backend("default").prune(DAY) == 1
    assert not Lease.objects.filter(name="prune:job").exists()
    assert floor() == last.token == 5

    again = get_backend("default").try_acquire("prune:job", "pruning-test", 30.0)
    assert again is not None and again.token == 6
    # a name never seen before starts above the floor too: the floor is not per name
    fresh = get_backend("default").try_acquire("prune:never-seen", "pruning-test", 30.0)
    assert fresh is not None and fresh.token == 6


def test_prune_leaves_held_recent_and_counter_rows_alone() -> None:
    backend = get_backend("default")
    held = backend.try_acquire("prune:held", "pruning-test", 3600.0)
    assert held is not None
    grant_cycles("prune:recent", 1)
    grant_cycles("prune:old", 3)
    age("prune:old")
    age("prune:held")  # a holder that never came back: its row keeps a holder, so it stays
    DurableCounter("redlock", "default").bump_lease("prune:redlock-counter")  # no expiry

    assert backend.prune(DAY, dry_run=True) == 1
    assert Lease.objects.filter(name="prune:old").exists()  # a dry run deletes nothing
    assert backend.prune(DAY, batch_size=1) == 1
    left = set(Lease.objects.values_list("name", flat=True))
    assert {"prune:held", "prune:recent", "prune:redlock-counter"} <= left
    assert "prune:old" not in left


def test_the_floor_only_rises() -> None:
    grant_cycles("prune:high", 7)
    age("prune:high")
    get_backend("default").prune(DAY)
    grant_cycles("prune:low", 1)  # token 8 (above the floor of 7)
    age("prune:low")
    Lease.objects.filter(name="prune:low").update(token=2)  # a lower token, pruned later
    get_backend("default").prune(DAY)
    assert floor() == 7
    assert TokenFloor.objects.get(id=1).pruned_rows == 2


def test_a_shared_lease_of_a_pruned_name_starts_above_the_floor() -> None:
    """Readers make a new row too (``lease(name, shared=True)``): above the floor as well."""
    last = grant_cycles("prune:readers", 4)
    age("prune:readers")
    get_backend("default").prune(DAY)
    reader = acquire("prune:readers", ttl=30, backend="default", keepalive=False, shared=True)
    try:
        assert reader.token > last.token
        second = acquire(
            "prune:readers", ttl=30, backend="default", keepalive=False, shared=True, holder="r2"
        )
        assert second.token == reader.token + 1  # the group's tokens go on from the row
        second.release()
    finally:
        reader.release()


def test_redlocks_counter_of_a_pruned_name_starts_above_the_floor() -> None:
    """Redlock takes its tokens from the same rows: a row the database backend left and a
    prune deleted must not restart Redlock's tokens either."""
    last = grant_cycles("prune:moved", 4)
    age("prune:moved")
    get_backend("default").prune(DAY)
    assert DurableCounter("redlock", "default").bump_lease("prune:moved") > last.token


PAUSE_KEY = 815
#: A trigger that pauses an acquire of ``prune:paused`` after it read the floor (the row it
#: proposes is formed, with its first token) and before it looks for the row it conflicts with,
#: for as long as the test holds the advisory lock :data:`PAUSE_KEY`: the window of the race.
PAUSE_TRIGGER_SQL = f"""
CREATE FUNCTION pruning_test_pause() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.name = 'prune:paused' THEN PERFORM pg_advisory_xact_lock_shared({PAUSE_KEY}); END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER pruning_test_pause BEFORE INSERT ON leases_lease
FOR EACH ROW EXECUTE FUNCTION pruning_test_pause();
"""
DROP_PAUSE_SQL = """
DROP TRIGGER IF EXISTS pruning_test_pause ON leases_lease;
DROP FUNCTION IF EXISTS pruning_test_pause();
"""


@pytest.fixture
def paused_acquire() -> Iterator[Callable[..., int]]:
    """``run(prune, waits=...)``: an acquire of ``prune:paused`` reads the floor and pauses;
    ``prune()`` runs in a thread of its own until the floor is raised, then (``waits``) is
    checked to be still waiting half a second later, or (not ``waits``) is let finish; then
    the acquire goes on. The acquire's token, once both are done."""
    conn = connect("default")
    conn.execute(PAUSE_TRIGGER_SQL)

    def run(prune: Callable[[], object], *, waits: bool) -> int:
        got: list[Grant | None] = []
        errors: list[BaseException] = []
        pruned = threading.Event()

        def acquirer() -> None:
            got.append(get_backend("default").try_acquire("prune:paused", "racing", 30.0))

        def pruner() -> None:
            try:
                prune()
            except BaseException as exc:
                errors.append(exc)
            finally:
                pruned.set()

        conn.execute("SELECT pg_advisory_lock(%s)", [PAUSE_KEY])
        acquiring = threading.Thread(target=acquirer)
        acquiring.start()

        def paused() -> bool:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pg_backend_pid() = ANY("
                "pg_blocking_pids(pid))"
            ).fetchone()
            return bool(row and row[0])

        wait_until(paused, 10, "the acquire to pause after reading the floor")
        pruning = threading.Thread(target=pruner)
        pruning.start()
        wait_until(lambda: floor() > 0, 10, "the prune to raise the floor")
        if waits:  # for the paused acquire: not done while it is paused
            assert not pruned.wait(0.5)
        else:
            assert pruned.wait(10)
        conn.execute("SELECT pg_advisory_unlock(%s)", [PAUSE_KEY])
        acquiring.join(10)
        pruning.join(10)
        assert not acquiring.is_alive() and not pruning.is_alive()
        assert not errors, errors
        (grant,) = got
        assert grant is not None
        return grant.token

    try:
        yield run
    finally:
        conn.execute("SELECT pg_advisory_unlock_all()")  # a failed test's paused acquire goes on
        conn.execute(DROP_PAUSE_SQL)
        conn.close()


def test_an_acquire_that_read_the_old_floor_is_waited_for(paused_acquire: Any) -> None:
    """The prune raises the floor, then waits for the paused acquire (it holds its table lock
    from before it read the floor) before it deletes: the acquire finds the row and bumps it.
    The acquire is the backend's prepared statement: the ``INSERT`` an ``EXECUTE`` runs takes
    its snapshot after its table locks, as the plain statement does."""
    last = grant_cycles("prune:paused", 3)
    own = get_backend("default").connection()  # type: ignore[attr-defined]
    assert own is not None
    prepared = own.execute("SELECT name FROM pg_prepared_statements").fetchall()
    assert (PREPARED_OWN_ACQUIRE.name,) in prepared
    age("prune:paused")
    token = paused_acquire(lambda: get_backend("default").prune(DAY), waits=True)
    assert token == last.token + 1
    assert Lease.objects.get(name="prune:paused").holder == "racing"  # taken, so not pruned


def test_without_the_wait_the_race_hands_out_token_1_again(paused_acquire: Any) -> None:
    """What step 2 is for: deleting right after raising the floor, the acquire (which read the
    floor before) finds no row and inserts one with the old floor."""

    def raise_and_delete() -> None:
        conn = connect("default")
        try:
            _, _, names, bound = raise_floor(conn, "", DAY, 1000)
            assert names == ["prune:paused"] and bound == 3
            assert delete_slice(conn, names, bound, DAY) == 1
        finally:
            conn.close()

    grant_cycles("prune:paused", 3)
    age("prune:paused")
    assert paused_acquire(raise_and_delete, waits=False) == 1


def test_an_acquire_does_not_wait_for_a_batch_deleting_other_names() -> None:
    """A batch locks only the rows it deletes: an acquire of another name, and one of a new
    name, go through while the batch's delete is still uncommitted (a table lock held them until
    the batch committed)."""
    grant_cycles("prune:going", 2)
    grant_cycles("prune:staying", 2)
    age("prune:going")
    conn = connect("default")
    try:
        _, _, names, bound = raise_floor(conn, "", DAY, 1000)
        assert names == ["prune:going"] and bound is not None
        with conn.transaction():
            assert delete_slice(conn, names, bound, DAY) == 1
            backend = get_backend("default")
            for name in ("prune:staying", "prune:brand-new"):
                grant = backend.try_acquire(name, "beside-the-prune", 30.0)
                assert grant is not None
                backend.release(grant)
    finally:
        conn.close()
    assert not Lease.objects.filter(name="prune:going").exists()


def test_prunes_racing_acquires_never_lower_a_token() -> None:
    """Threads acquire and release a few names while prunes delete every free row again and
    again: each name's tokens, in the order granted, strictly increase."""
    names = [f"prune:busy-{i}" for i in range(3)]
    seen: dict[str, list[int]] = {name: [] for name in names}
    stop = threading.Event()
    errors: list[BaseException] = []

    def contend(name: str) -> None:
        backend = get_backend("default")
        try:
            for _ in range(150):
                if stop.is_set():
                    return
                grant = backend.try_acquire(name, "busy", 30.0)
                if grant is not None:
                    seen[name].append(grant.token)
                    backend.release(grant)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    pruned = 0
    try:
        for _ in range(40):
            pruned += get_backend("default").prune(0.0, batch_size=2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors, errors
    assert pruned > 0
    for name, tokens in seen.items():
        assert tokens, name
        assert all(a < b for a, b in itertools.pairwise(tokens)), (name, tokens)


@pytest.fixture
def operator() -> Any:
    user: Any = UserFactory(username="pruning-operator")
    user.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    return user


def test_a_revoked_then_pruned_name_stays_fenced(operator: Any) -> None:
    held = acquire("prune:revoked", ttl=30, backend="default", keepalive=False)
    doc = FencedDoc(title="held")
    doc.save(fence=held)
    force_release(held.name, backend="default", token=held.token, user=operator, via="test")
    age("prune:revoked")
    assert get_backend("default").prune(DAY) == 1

    doc.title = "evicted"
    with pytest.raises(FencingTokenRevoked):
        doc.save(fence=held)
    successor = acquire(
        "prune:revoked", ttl=30, backend="default", keepalive=False, holder="successor"
    )
    assert successor.token > held.token + 1  # above the revoked token and its advance
    doc.title = "successor"
    doc.save(fence=successor)
    successor.release()
    with pytest.raises(LeaseNotHeld):
        force_release(held.name, backend="default", token=held.token, user=operator, via="test")
    with pytest.raises(LeaseLost):  # now, not from the watchdog inside a later test
        held.release()


def test_the_command_prunes_with_a_progress_line() -> None:
    grant_cycles("prune:cmd", 2)
    age("prune:cmd", days=40)
    out = StringIO()
    call_command("leases", "prune", "--older-than", "30d", "--dry-run", stdout=out)
    assert "1 lease row(s) free for 30d or more" in out.getvalue()
    out = StringIO()
    call_command("leases", "prune", "--older-than", "30d", "--batch-size", "1", stdout=out)
    assert "rows read, 0 pruned" in out.getvalue() or "rows read, 1 pruned" in out.getvalue()
    assert "rows/s ETA" in out.getvalue()
    assert "pruned 1 lease row(s) on 'default'" in out.getvalue()
    quiet = StringIO()
    call_command("leases", "prune", "--older-than", "P30D", "-v", "0", stdout=quiet)
    assert quiet.getvalue() == ""


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--older-than=-1d"], "--older-than must be a duration"),
        (["--older-than", "soon"], "--older-than must be a duration"),
        (["--older-than", "1d", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["--older-than", "1d", "--backend", "nope"], "unknown backend 'nope'"),
        (["--older-than", "1d", "--backend", "redis"], "prune"),
    ],
)
def test_the_command_refuses_bad_input_in_one_line(arguments: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        call_command("leases", "prune", *arguments, stdout=StringIO())


def test_stores_that_forget_by_themselves_do_not_prune() -> None:
    with pytest.raises(BackendNotSupported):
        get_backend("redis").prune(DAY)


def test_a_batch_waits_for_an_open_writer_then_gives_up_having_deleted_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transaction that wrote ``leases_lease`` and stays open may have read the old floor:
    the batch waits for it, gives up after its timeout (the floor raised, nothing deleted) and
    deletes once the writer is gone."""
    grant_cycles("prune:waited", 2)
    age("prune:waited")
    writer = connect("default")
    pruner = connect("default")
    try:
        with writer.transaction():
            writer.execute("LOCK TABLE leases_lease IN ROW EXCLUSIVE MODE")
            _, _, names, bound = raise_floor(pruner, "", DAY, 1000)
            assert names == ["prune:waited"] and bound == 2 and floor() == 2
            with pytest.raises(TimeoutError):
                wait_for_writers(pruner, timeout=0.3)
            monkeypatch.setattr(_pruning, "WRITERS_TIMEOUT", 0.3)
            with pytest.raises(BackendUnavailable, match="stayed open"):
                _pruning.prune_rows("default", DAY, 1000)
            assert Lease.objects.filter(name="prune:waited").exists()
        wait_for_writers(pruner, timeout=10)
        assert prune_batch(pruner, "", DAY, 1000)[2] == 1
    finally:
        writer.close()
        pruner.close()
