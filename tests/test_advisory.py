"""Advisory lock helpers in one process: scope, lifetime, timeouts, shared vs exclusive.

"Another session" is a plain psycopg connection to the test database; it holds locks the code
under test must wait for, and reads ``pg_locks`` to see what the code under test holds.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import psycopg
import pytest
from django.db import DEFAULT_DB_ALIAS, DataError, connection, connections, transaction

from leases import _session_leaks, advisory
from leases.errors import (
    InvalidLeaseName,
    InvalidLeaseOption,
    LeaseNotHeld,
    LeaseUnavailable,
    NotInTransaction,
)
from leases.keys import advisory_key
from tests.advisory_support import holders, interrupted_while_waiting, other_session
from tests.factories import UserFactory
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def other() -> Iterator[psycopg.Connection[Any]]:
    with other_session() as conn:
        yield conn


def lock_timeout() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        return str(cursor.fetchone()[0])


def test_xact_lock_outside_a_transaction_raises_not_in_transaction() -> None:
    with pytest.raises(NotInTransaction), advisory.xact_lock("autocommit"):
        pass
    with pytest.raises(NotInTransaction):
        advisory.try_xact_lock("autocommit")


def test_xact_lock_lives_until_the_outermost_atomic_ends(other: psycopg.Connection[Any]) -> None:
    with transaction.atomic():
        with transaction.atomic(), advisory.xact_lock("outermost") as lock:
            assert lock.held()
        assert holders(other, "outermost") == 1  # the inner savepoint was released, lock stays
    assert holders(other, "outermost") == 0


def test_xact_lock_is_released_when_the_outer_transaction_rolls_back(
    other: psycopg.Connection[Any],
) -> None:
    with transaction.atomic():
        advisory.xact_lock("rolled-back").__enter__()
        transaction.set_rollback(True)
    assert holders(other, "rolled-back") == 0


def test_xact_lock_taken_in_a_rolled_back_savepoint_is_released(
    other: psycopg.Connection[Any],
) -> None:
    """Pinned: Postgres releases xact advisory locks with the subtransaction that took them."""
    with transaction.atomic():
        with transaction.atomic():
            advisory.xact_lock("savepoint").__enter__()
            assert holders(other, "savepoint") == 1
            transaction.set_rollback(True)
        assert holders(other, "savepoint") == 0


def test_try_xact_lock_is_false_while_another_session_holds_it(
    other: psycopg.Connection[Any],
) -> None:
    other.execute("SELECT pg_advisory_lock(%s)", [advisory_key("busy")])
    with transaction.atomic():
        assert advisory.try_xact_lock("busy") is False
        assert advisory.try_xact_lock("free") is True
    other.execute("SELECT pg_advisory_unlock(%s)", [advisory_key("busy")])
    with transaction.atomic():
        assert advisory.try_xact_lock("busy") is True


def test_shared_locks_coexist_and_exclude_exclusive(other: psycopg.Connection[Any]) -> None:
    key = advisory_key("readers")
    other.execute("SELECT pg_advisory_lock_shared(%s)", [key])
    with transaction.atomic():
        with advisory.xact_lock("readers", shared=True, timeout=0) as lock:
            assert lock.held()
        assert advisory.try_xact_lock("readers") is False
        with pytest.raises(LeaseUnavailable), advisory.xact_lock("readers", timeout=0.05):
            pass
    other.execute("SELECT pg_advisory_unlock_shared(%s)", [key])
    other.execute("SELECT pg_advisory_lock(%s)", [key])
    with transaction.atomic():
        assert advisory.try_xact_lock("readers", shared=True) is False


def test_blocking_lock_waits_for_the_holder(other: psycopg.Connection[Any]) -> None:
    other.execute("SELECT pg_advisory_lock(%s)", [advisory_key("wait")])
    seen_waiting = threading.Event()

    def release_once_waited_for() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not holders(other, "wait", granted=False):
            time.sleep(0.02)
        seen_waiting.set()
        other.execute("SELECT pg_advisory_unlock(%s)", [advisory_key("wait")])

    releaser = threading.Thread(target=release_once_waited_for)
    releaser.start()
    try:
        with transaction.atomic(), advisory.xact_lock("wait") as lock:
            assert seen_waiting.is_set()  # it really waited, and got the lock once released
            assert lock.held()
    finally:
        releaser.join(timeout=15)


class Interruption(Exception):
    """What a signal handler raises mid-wait, like Celery's ``SoftTimeLimitExceeded``."""


@contextmanager
def _in_atomic(lock: AbstractContextManager[object]) -> Iterator[object]:
    with transaction.atomic(), lock as held:
        yield held


WAITS: dict[str, Callable[[str], AbstractContextManager[object]]] = {
    "session": lambda name: advisory.session_lock(name),
    "session-timed": lambda name: advisory.session_lock(name, timeout=60),
    "session-in-atomic": lambda name: _in_atomic(advisory.session_lock(name)),
    "session-timed-in-atomic": lambda name: _in_atomic(advisory.session_lock(name, timeout=60)),
    "xact": lambda name: _in_atomic(advisory.xact_lock(name)),
    "xact-timed": lambda name: _in_atomic(advisory.xact_lock(name, timeout=60)),
}


@pytest.mark.parametrize("raised", [KeyboardInterrupt, Interruption])
@pytest.mark.parametrize("granted", [False, True], ids=["while-waiting", "once-granted"])
@pytest.mark.parametrize("wait", sorted(WAITS))
def test_an_interrupted_wait_leaves_no_lock_behind(
    other: psycopg.Connection[Any], wait: str, granted: bool, raised: type[BaseException]
) -> None:
    """An exception raised by a signal handler (Ctrl-C, a soft time limit) while the session
    waits: the block never ran, so the session must not hold the lock afterwards, whether the
    holder let go just before (the grant raced the interruption) or after it. The driver
    cancels the wait on ``KeyboardInterrupt`` only; any other exception left the statement
    running, to be granted later on a session that nothing would ever unlock; and a grant
    that beat the cancellation was dropped with its reply."""
    name = f"interrupted-{wait}-{granted}-{raised.__name__}"
    key = advisory_key(name)
    other.execute("SELECT pg_advisory_lock(%s)", [key])
    session = backend_pid()

    def handler() -> None:
        if granted:
            other.execute("SELECT pg_advisory_unlock(%s)", [key])
            wait_until(lambda: holders(other, name) == 1, 10, "the waiter to be granted")
        raise raised()

    try:
        with pytest.raises(raised), interrupted_while_waiting(name, handler), WAITS[wait](name):
            pytest.fail("the block ran")
        if not granted:
            other.execute("SELECT pg_advisory_unlock(%s)", [key])
        wait_until(lambda: not holders(other, name, granted=False), 10, "nobody waiting")
        wait_until(lambda: holders(other, name) == 0, 10, "no session to hold the lock")
        assert not _session_leaks._held.get(connections[DEFAULT_DB_ALIAS])
        if wait != "session-in-atomic":
            assert backend_pid() == session  # usable, and not by ending the session
        # Else the session may be ended: a cancelled statement aborts the caller's transaction,
        # which cannot be asked whether the lock was granted first (the test below).
    finally:
        connection.close()  # whatever state a failure left it in, the next test starts afresh


def test_an_interrupted_reentrant_call_ends_the_session_rather_than_guess(
    other: psycopg.Connection[Any],
) -> None:
    """Under a hold of the same lock, ``pg_locks`` cannot tell whether the interrupted call
    added a hold (one unlock too few leaks it, one too many frees the outer block's), so the
    session is ended, and the outer block learns at its exit that it no longer holds it."""

    def interrupted_after(execute: Any, sql: str, *args: Any) -> Any:
        execute(sql, *args)
        raise Interruption()

    with pytest.raises(LeaseNotHeld), advisory.session_lock("reentrant") as outer:
        with connection.execute_wrapper(interrupted_after), pytest.raises(Interruption):
            advisory.session_lock("reentrant").__enter__()
        assert not outer.held()
    assert holders(other, "reentrant") == 0
    assert not _session_leaks._held.get(connections[DEFAULT_DB_ALIAS])


def test_a_wait_cancelled_after_its_grant_inside_a_transaction_leaves_no_lock(
    other: psycopg.Connection[Any],
) -> None:
    """Ctrl-C's cancellation can reach the server after the lock was granted but before the
    statement finished: the statement fails (its transaction aborted), the session lock
    stays (session locks outlive a failed statement), and inside ``atomic()`` the aborted
    transaction cannot be asked whether it holds it. Seen once in a fresh-clone run of the
    test above (``session-in-atomic``, once granted): the call took "the one statement
    failed" for "nothing held", and the lock stayed on the live session. Made certain here:
    the lock is granted, then the transaction aborted, then the interruption raised. The
    session is ended (the lock with it), and says why in the log."""

    def granted_then_cancelled(execute: Any, sql: str, *args: Any) -> Any:
        done = execute(sql, *args)
        if "pg_advisory_lock" not in sql:
            return done  # the pooler probe before it
        with contextlib.suppress(DataError):
            execute("SELECT 1 / 0", None, *args[1:])  # the transaction aborted after the grant
        raise KeyboardInterrupt

    name = f"cancelled-after-grant-{uuid.uuid4().hex[:8]}"
    session = backend_pid()
    wrapped = connection.execute_wrapper(granted_then_cancelled)
    with pytest.raises(KeyboardInterrupt), transaction.atomic(), wrapped:
        advisory.session_lock(name).__enter__()
    wait_until(lambda: holders(other, name) == 0, 10, "the lock to go with its session")
    assert not _session_leaks._held.get(connections[DEFAULT_DB_ALIAS])
    assert backend_pid() != session  # ended: the aborted transaction could not be asked


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def test_timeout_raises_and_leaves_the_outer_transaction_usable(
    other: psycopg.Connection[Any],
) -> None:
    from django.contrib.auth import get_user_model

    other.execute("SELECT pg_advisory_lock(%s)", [advisory_key("timeout")])
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '7s'")
        UserFactory(username="before")
        with pytest.raises(LeaseUnavailable) as info, advisory.xact_lock("timeout", timeout=0.05):
            pass
        assert isinstance(info.value, TimeoutError)
        assert lock_timeout() == "7s"  # the caller's own setting is back
        UserFactory(username="after")
    users = set(get_user_model().objects.values_list("username", flat=True))
    assert {"before", "after"} <= users


def test_timed_lock_restores_the_callers_lock_timeout() -> None:
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '3s'")
        with advisory.xact_lock("restore", timeout=0.5) as lock:
            assert lock.held()
            assert lock_timeout() == "3s"
    before = lock_timeout()
    with advisory.session_lock("restore", timeout=0.5):
        assert lock_timeout() == before


def test_session_lock_timeout_in_a_transaction_keeps_it_usable(
    other: psycopg.Connection[Any],
) -> None:
    other.execute("SELECT pg_advisory_lock(%s)", [advisory_key("session-busy")])
    with transaction.atomic():
        with pytest.raises(LeaseUnavailable), advisory.session_lock("session-busy", timeout=0.05):
            pass
        with pytest.raises(LeaseUnavailable), advisory.session_lock("session-busy", timeout=0):
            pass
        UserFactory(username="still-usable")
    with pytest.raises(LeaseUnavailable), advisory.session_lock("session-busy", timeout=0.05):
        pass


def test_session_lock_is_released_at_exit(other: psycopg.Connection[Any]) -> None:
    with advisory.session_lock("session") as lock:
        assert lock.held()
        assert holders(other, "session") == 1
    assert holders(other, "session") == 0
    assert not lock.held()


def test_session_lock_survives_the_rollback_of_the_transaction_that_took_it(
    other: psycopg.Connection[Any],
) -> None:
    """Pinned: session locks ignore transactions; only the unlock (or session end) frees them."""
    with ExitStack() as stack:
        with transaction.atomic():
            stack.enter_context(advisory.session_lock("sticky"))
            transaction.set_rollback(True)
        assert holders(other, "sticky") == 1
    assert holders(other, "sticky") == 0


def test_session_lock_unlocks_inside_a_transaction_marked_for_rollback(
    other: psycopg.Connection[Any],
) -> None:
    with transaction.atomic(), advisory.session_lock("marked"):
        transaction.set_rollback(True)
    assert holders(other, "marked") == 0


def test_session_lock_in_an_aborted_transaction_is_released_by_closing_the_session(
    other: psycopg.Connection[Any],
) -> None:
    with (
        pytest.raises(DataError),
        transaction.atomic(),
        advisory.session_lock("aborted"),
        connection.cursor() as cursor,
    ):
        cursor.execute("SELECT 1 / 0")
    # The server ends a closed session (and frees its locks) a moment after the client hangs
    # up: wait for it rather than read pg_locks in the same instant.
    wait_until(lambda: holders(other, "aborted") == 0, 10, "the closed session's lock to go")
    with connection.cursor() as cursor:  # Django reconnects: the process carries on
        cursor.execute("SELECT 1")


def test_unlock_on_a_changed_connection_raises_lease_not_held(
    other: psycopg.Connection[Any],
) -> None:
    with pytest.raises(LeaseNotHeld), advisory.session_lock("reconnected"):
        connection.close()  # what a reconnect or a transaction-pooling proxy does to a session
    assert holders(other, "reconnected") == 0


def test_decorator_forms_take_the_lock_per_call(other: psycopg.Connection[Any]) -> None:
    @advisory.xact_lock("decorated")
    def in_transaction() -> int:
        return holders(other, "decorated")

    @advisory.session_lock("decorated-session")
    def anywhere() -> int:
        return holders(other, "decorated-session")

    with transaction.atomic():
        assert in_transaction() == 1
    assert anywhere() == 1
    assert anywhere() == 1
    assert holders(other, "decorated-session") == 0
    with pytest.raises(NotInTransaction):
        in_transaction()


def test_explicit_int_and_pair_keys(other: psycopg.Connection[Any]) -> None:
    with transaction.atomic():
        with advisory.xact_lock(-(2**63)) as big, advisory.xact_lock((7, -8)) as pair:
            assert big.held() and pair.held()
        assert advisory.try_xact_lock((7, -8), shared=True) is True


@pytest.mark.parametrize("bad", ["", "x" * 256, "nul\x00", 2**64, (1, 2, 3), None, 1.5])
@pytest.mark.parametrize("helper", ["xact_lock", "try_xact_lock", "session_lock"])
def test_bad_names_are_rejected_before_any_sql(bad: Any, helper: str) -> None:
    def no_sql(*args: Any) -> None:
        raise AssertionError("SQL was sent for a bad name")

    with connection.execute_wrapper(no_sql), pytest.raises(InvalidLeaseName):
        getattr(advisory, helper)(bad)


@pytest.mark.parametrize("bad", [(1, 2), 5, "", "nul\x00", None])
def test_remember_advisory_names_rejects_what_is_no_name_before_any_sql(bad: Any) -> None:
    """A key pair failed a bare ``assert`` (gone under ``python -O``, where the pair reached
    the database) and an ``int`` was stored as its text, not the typed error of every other
    advisory entry point."""
    from leases.operations import remember_advisory_names

    def no_sql(*args: Any) -> None:
        raise AssertionError("SQL was sent for a bad name")

    with connection.execute_wrapper(no_sql), pytest.raises(InvalidLeaseName):
        remember_advisory_names(bad)


@pytest.mark.parametrize("bad", ["false", "no", 0, 1, None])
@pytest.mark.parametrize("helper", ["xact_lock", "try_xact_lock", "session_lock"])
def test_a_shared_flag_that_is_not_a_bool_is_rejected_before_any_sql(bad: Any, helper: str) -> None:
    """``shared="false"`` is truthy: two "exclusive" writers were both let in (a shared lock
    each). ``acquire()`` refused it already."""

    def no_sql(*args: Any) -> None:
        raise AssertionError("SQL was sent for a bad flag")

    with connection.execute_wrapper(no_sql), pytest.raises(InvalidLeaseOption, match="shared"):
        getattr(advisory, helper)("t", shared=bad)


@pytest.mark.parametrize("bad", ["nope", "", None, 5])
@pytest.mark.parametrize("helper", ["xact_lock", "try_xact_lock", "session_lock"])
def test_an_unknown_database_alias_is_rejected_before_any_sql(bad: Any, helper: str) -> None:
    """A misspelt ``using=`` used to surface only when the lock was entered, as Django's
    ``ConnectionDoesNotExist`` from deep inside a query (and a decorator only at its first
    call): the typed error of every other bad argument, where it is written."""

    def no_sql(*args: Any) -> None:
        raise AssertionError("SQL was sent for a bad alias")

    with connection.execute_wrapper(no_sql), pytest.raises(InvalidLeaseOption, match="using"):
        getattr(advisory, helper)("t", using=bad)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "1", True, 10**9])
def test_bad_timeouts_are_rejected_at_construction(bad: Any) -> None:
    """Like lease()'s: InvalidLeaseOption (a ValueError), before any SQL."""
    with pytest.raises(InvalidLeaseOption, match="timeout"):
        advisory.xact_lock("t", timeout=bad)
    with pytest.raises(InvalidLeaseOption, match="timeout"):
        advisory.session_lock("t", timeout=bad)


def test_a_failed_wait_without_timeout_marks_the_transaction_for_rollback(
    other: psycopg.Connection[Any],
) -> None:
    """No savepoint was taken, so the server aborted the transaction; Django is told so."""
    other.execute("SELECT pg_advisory_lock(%s)", [advisory_key("canceled")])
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL statement_timeout = '50ms'")
        with pytest.raises(LeaseUnavailable, match="canceled"), advisory.xact_lock("canceled"):
            pass
        assert transaction.get_rollback()
    with connection.cursor() as cursor:  # the atomic block rolled back; the connection is fine
        cursor.execute("SELECT 1")


def test_advisory_is_importable_from_the_package() -> None:
    from leases import advisory as module

    assert {"xact_lock", "try_xact_lock", "session_lock"} <= set(module.__all__)


def test_a_broken_atomic_block_is_reported_by_django_not_hidden() -> None:
    from django.db.transaction import TransactionManagementError

    with transaction.atomic():
        transaction.set_rollback(True)
        with pytest.raises(TransactionManagementError), advisory.xact_lock("broken"):
            pass


@pytest.fixture
def server_side_binding() -> Iterator[None]:
    """Reconnect the default alias with server-side binding and psycopg's statement preparing."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    connection.close()
    options.update(server_side_binding=True, prepare_threshold=1)
    try:
        yield
    finally:
        connection.close()
        del options["server_side_binding"], options["prepare_threshold"]


@pytest.mark.usefixtures("server_side_binding")
def test_timed_locks_work_with_server_side_binding(other: psycopg.Connection[Any]) -> None:
    """The timed message has several statements: it must not be sent as a prepared statement."""
    from django.db.backends.postgresql.base import ServerBindingCursor

    assert isinstance(connection.cursor().cursor, ServerBindingCursor)
    for _ in range(3):
        with transaction.atomic(), advisory.xact_lock("ssb", timeout=1):
            assert holders(other, "ssb") == 1
        with advisory.session_lock("ssb", timeout=1):
            assert holders(other, "ssb") == 1


@pytest.mark.parametrize("factory", [advisory.xact_lock, advisory.session_lock])
def test_a_bare_call_that_locks_nothing_is_reported_loudly(
    factory: Any, caplog: pytest.LogCaptureFixture, other: psycopg.Connection[Any]
) -> None:
    with transaction.atomic():
        with pytest.warns(RuntimeWarning, match="was never entered, so it locked nothing"):
            factory("advisory-bare-call")  # no `with`: no lock, and it must not pass silently
        assert not holders(other, "advisory-bare-call")
    assert "advisory-bare-call" in caplog.text and "never entered" in caplog.text


def test_entered_or_decorating_locks_are_not_reported(recwarn: pytest.WarningsRecorder) -> None:
    with transaction.atomic(), advisory.xact_lock("advisory-entered"):
        pass

    @advisory.xact_lock("advisory-decorating")
    def never_called() -> None:
        """A decorator that is never called is not a misuse."""

    del never_called
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_names_are_recorded_in_the_background_on_first_use(
    other: psycopg.Connection[Any],
) -> None:
    """No remember_advisory_names() call: the admin still shows the name, and the caller's
    transaction carried no extra statement (a rollback does not lose the record either)."""
    from django.test.utils import CaptureQueriesContext

    from leases.models import AdvisoryLockName

    name = f"recorded-{uuid.uuid4().hex[:8]}"
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        with advisory.xact_lock(name):
            pass
        transaction.set_rollback(True)
    assert not [q for q in queries if "leases_advisory_name" in q["sql"]]
    key = advisory_key(name)
    assert isinstance(key, int)  # a name's key is one int64
    wait_until(
        lambda: AdvisoryLockName.objects.filter(key=key, name=name).exists(),
        10,
        "the name to be recorded by the background writer",
    )


def test_a_name_that_cannot_be_recorded_does_not_stop_the_writer() -> None:
    """Recording is best effort, but it must stay that way for the process's life: a batch
    for a database alias that no longer exists (a test's, a reconfigured one) used to kill the
    writer thread (closing the alias raised), and no name was recorded after it."""
    from leases import _advisory_names
    from leases.models import AdvisoryLockName

    _advisory_names.note("for-a-gone-alias", "no-such-alias")
    name = f"recorded-after-{uuid.uuid4().hex[:8]}"
    time.sleep(0.2)  # let the writer take the bad batch alone
    _advisory_names.note(name, "default")
    wait_until(
        lambda: AdvisoryLockName.objects.filter(name=name).exists(),
        10,
        "a name noted after a bad batch to be recorded",
    )


@pytest.mark.parametrize("bad", ["bounced", [1]])
def test_session_pooling_must_list_database_aliases(bad: Any) -> None:
    """A bare string would read as a set of one-letter aliases."""
    from django.test import override_settings

    from leases import conf

    with override_settings(LEASES={"SESSION_POOLING": bad}):
        assert conf.problems() == ['LEASES["SESSION_POOLING"] must be a list of database aliases']
