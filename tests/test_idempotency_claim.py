"""Keys claimed in the attempt's transaction (``CLAIM_IN_TRANSACTION``): an advisory lock
instead of a committed started row, the key row written once, with the outcome.

The guarantees are the ones of the default claim (one effect under concurrent duplicates, a
byte-equal replay, 422 for another request, nothing kept by a failed attempt), plus: nothing is
written before the outcome, and a crashed attempt leaves nothing its retry has to wait for.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext

from idempotency import IdempotencyKeyInProgress, IdempotencyKeyLost, idempotency_key
from idempotency.models import IdempotencyKey
from idempotency.store import Attempt, Begun, Outcome, Status, begin, release
from tests import test_idempotency as views_tests
from tests.testapp.models_idempotency import Charge

pytestmark = pytest.mark.django_db(transaction=True)

FP = "f" * 64
OTHER_FP = "0" * 64
OUTCOME = Outcome(status=201, headers=[("Content-Type", "text/plain")], body=b"\x00done\xff")


def claim(key: str = "k", fingerprint: str = FP, **options: Any) -> Begun:
    return begin("s", key, fingerprint, ttl=60, lock_timeout=60, in_transaction=True, **options)


def advisory_locks_held() -> int:
    """Advisory locks this session holds (pg_locks lists a session's locks, granted or not)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
            "AND pid = pg_backend_pid() AND granted"
        )
        return int(cursor.fetchone()[0])


def elsewhere(fn: Callable[[], Any]) -> Any:
    """``fn``'s result (or exception), run in a thread with a database connection of its own."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # handed to the test, which asserts on it
            out.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    return out[0]


def test_a_claim_writes_nothing_and_a_duplicate_is_answered_at_once() -> None:
    first = claim()
    assert first.status is Status.NEW and first.claim is not None
    assert first.claim.gate is not None and first.claim.session_gate
    assert (
        IdempotencyKey.objects.count() == 0 and advisory_locks_held() == 2
    )  # the gate and the request's lock
    duplicate = elsewhere(claim)
    assert duplicate.status is Status.IN_PROGRESS and duplicate.retry_after == 1.0
    release(first.claim)
    assert advisory_locks_held() == 0
    retry = elsewhere(claim)
    assert retry.status is Status.NEW  # the gate was given back with nothing written


def test_the_outcome_commits_with_the_effects_and_replays_byte_for_byte() -> None:
    begun = claim()
    assert begun.claim is not None
    attempt = Attempt(begun.claim, atomic=True, ttl=60)
    attempt.start()
    Charge.objects.create(key="k", amount=1)
    attempt.commit(OUTCOME)
    assert advisory_locks_held() == 0
    row = IdempotencyKey.objects.get()
    assert row.state == "completed" and row.owner is None and row.fingerprint == FP
    replay = elsewhere(claim)
    assert replay.status is Status.COMPLETED and replay.outcome == OUTCOME
    assert elsewhere(lambda: claim(fingerprint=OTHER_FP)).status is Status.MISMATCH
    assert Charge.objects.count() == 1


def test_a_replay_a_mismatch_or_a_started_key_leaves_no_lock_held() -> None:
    done = claim("done")
    assert done.claim is not None
    attempt = Attempt(done.claim, atomic=True, ttl=60)
    attempt.start()
    attempt.commit(OUTCOME)
    started = begin("s", "started", FP, ttl=60, lock_timeout=60)  # the default, row claim
    assert started.claim is not None
    assert claim("done").status is Status.COMPLETED
    assert claim("done", OTHER_FP).status is Status.MISMATCH
    assert claim("started").status is Status.IN_PROGRESS
    assert advisory_locks_held() == 0


def test_a_failed_attempt_keeps_nothing_and_gives_its_key_back() -> None:
    begun = claim()
    assert begun.claim is not None
    attempt = Attempt(begun.claim, atomic=True, ttl=60)
    attempt.start()
    Charge.objects.create(key="k", amount=1)
    attempt.abort()
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
    assert advisory_locks_held() == 0
    assert elsewhere(claim).status is Status.NEW


def test_concurrent_duplicates_run_the_block_once() -> None:
    """Eight callers at once, each on its own connection: one runs the block (and holds its
    key while it runs), the others are refused or replay; one effect in all."""
    barrier = threading.Barrier(8)
    ran: list[int] = []

    def call() -> Any:
        barrier.wait(30)
        with idempotency_key("race", scope="s", claim_in_transaction=True) as op:
            if not op.replayed:
                Charge.objects.create(key="race", amount=1)
                ran.append(1)
                threading.Event().wait(0.3)  # long enough for every duplicate to arrive
                op.result = "charged"
        return op.result

    results: list[Any] = []

    def run() -> None:
        try:
            results.append(call())
        except Exception as exc:
            results.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 8 and len(ran) == 1 and Charge.objects.count() == 1
    assert all(r == "charged" or isinstance(r, IdempotencyKeyInProgress) for r in results)
    with idempotency_key("race", scope="s", claim_in_transaction=True) as later:
        assert later.replayed and later.result == "charged"


def test_a_crashed_attempt_leaves_nothing_and_its_retry_runs_at_once() -> None:
    """A worker whose connection dies mid-attempt (killed, or its server session ended) takes
    its effects and its key with it: the retry needs no LOCK_TIMEOUT to lapse."""
    entered, resume = threading.Event(), threading.Event()
    pid: list[int] = []

    def crashing() -> Any:
        begun = claim()
        assert begun.claim is not None
        attempt = Attempt(begun.claim, atomic=True, ttl=60)
        attempt.start()
        Charge.objects.create(key="k", amount=1)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid.append(cursor.fetchone()[0])
        entered.set()
        resume.wait(60)
        attempt.commit(OUTCOME)  # its session is gone: this cannot commit anything

    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(crashing())
        except Exception as exc:
            outcome.append(exc)
        finally:
            connection.close()

    worker = threading.Thread(target=run)
    worker.start()
    assert entered.wait(60)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid[0]])
    retry = claim()  # polled only until the server has ended the killed session
    for _ in range(100):
        if retry.status is Status.NEW:
            break
        threading.Event().wait(0.05)
        retry = claim()
    assert retry.status is Status.NEW and retry.claim is not None
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
    attempt = Attempt(retry.claim, atomic=True, ttl=60)
    attempt.start()
    Charge.objects.create(key="k", amount=2)
    attempt.commit(OUTCOME)
    resume.set()
    worker.join(60)
    assert outcome and isinstance(outcome[0], Exception)
    assert Charge.objects.count() == 1 and IdempotencyKey.objects.get().state == "completed"


def test_a_key_stored_by_another_attempt_first_rolls_this_ones_effects_back() -> None:
    """The unique key row, written in the attempt's transaction, is what allows one commit per
    key whatever the locks did (here: a row-claim attempt stored the key meanwhile)."""
    begun = claim()
    assert begun.claim is not None
    attempt = Attempt(begun.claim, atomic=True, ttl=60)
    attempt.start()
    Charge.objects.create(key="k", amount=1)

    def other_attempt_stores_first() -> None:
        other = begin("s", "k", FP, ttl=60, lock_timeout=60)
        assert other.claim is not None
        row_attempt = Attempt(other.claim, atomic=True, ttl=60)
        row_attempt.start()
        row_attempt.commit(Outcome(status=201, headers=[], body=b"other"))

    assert elsewhere(other_attempt_stores_first) is None
    with pytest.raises(IdempotencyKeyLost):
        attempt.commit(OUTCOME)
    assert Charge.objects.count() == 0 and advisory_locks_held() == 0
    assert claim().outcome == Outcome(status=201, headers=[], body=b"other")


def test_a_lapsed_started_key_is_taken_over_with_its_recorded_steps() -> None:
    crashed = begin("s", "k", FP, ttl=60, lock_timeout=0.05)
    assert crashed.claim is not None
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE idempotency_key SET steps = '{\"charge\": 7}', "
            "locked_until = clock_timestamp() - interval '1 second'"
        )
    assert claim(fingerprint=OTHER_FP).status is Status.MISMATCH
    begun = claim()
    assert begun.claim is not None and begun.claim.taken_over
    assert begun.claim.steps == {"charge": 7}
    attempt = Attempt(begun.claim, atomic=True, ttl=60)
    attempt.start()
    attempt.commit(OUTCOME)
    row = IdempotencyKey.objects.get()
    assert row.state == "completed" and row.steps == {}
    assert claim().outcome == OUTCOME


def _claim_and_store(key: str) -> None:
    begun = claim(key)
    assert begun.claim is not None
    attempt = Attempt(begun.claim, atomic=True, ttl=60)
    attempt.start()
    attempt.commit(OUTCOME)
    assert claim(key).outcome == OUTCOME


def test_a_session_that_lost_its_prepared_statements_takes_its_gate_once() -> None:
    """The claim is sent again after the session lost the look's prepared statement; the gate
    the first try took is given back first, so one unlock after the commit frees the key."""
    _claim_and_store("k-before")
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")  # what a pooler's server reset does
    _claim_and_store("k-after")
    assert advisory_locks_held() == 0


@pytest.mark.parametrize(
    "options",
    [{"server_side_binding": True}, {}],
    ids=["server_side_binding", "plain_sql"],
)
def test_the_gate_is_given_back_whatever_way_the_statements_are_sent(
    options: dict[str, Any], monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    """Server-side binding sends one statement per query (no COMMIT riding on the store; it
    takes no SQL-level prepared statements, whose EXECUTE has no bind parameters); without
    prepared statements the SQL goes as it is."""
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    settings.IDEMPOTENCY = {"CLAIM_IN_TRANSACTION": True, "PREPARED_STATEMENTS": False}
    connection.close()
    try:
        _claim_and_store("k-sent")
        assert advisory_locks_held() == 0
        assert elsewhere(lambda: claim("k-sent")).status is Status.COMPLETED
    finally:
        connection.close()


@pytest.mark.parametrize("in_transaction", [True, False], ids=["gated", "row"])
def test_server_side_binding_works_with_the_default_prepared_statements(
    in_transaction: bool, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    """A connection binding on the server sends ``EXECUTE name(...)`` with bind parameters,
    which PostgreSQL refuses (a utility statement takes none): every claim failed with the
    default ``PREPARED_STATEMENTS = True``. Such a connection gets the plain SQL (psycopg
    prepares it itself, by its ``prepare_threshold``)."""
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", {"server_side_binding": True})
    settings.IDEMPOTENCY = {"CLAIM_IN_TRANSACTION": in_transaction}
    connection.close()
    try:
        client = views_tests.identified(Client())
        first = views_tests.post(client, "/idem/charge/", "k-ssb")
        again = views_tests.post(client, "/idem/charge/", "k-ssb")
        assert first.status_code == again.status_code == 201, first.content
        assert first.content == again.content
        assert IdempotencyKey.objects.get().state == "completed"
    finally:
        connection.close()


def test_inside_an_open_transaction_a_duplicate_is_answered_without_waiting() -> None:
    """Under ATOMIC_REQUESTS the gate is the transaction's: it lasts until the caller's
    transaction ends, which is when the key row commits."""
    with transaction.atomic():
        begun = claim()
        assert begun.claim is not None and not begun.claim.session_gate
        attempt = Attempt(begun.claim, atomic=True, ttl=60)
        attempt.start()
        Charge.objects.create(key="k", amount=1)
        attempt.commit(OUTCOME)
        assert elsewhere(claim).status is Status.IN_PROGRESS
    assert advisory_locks_held() == 0
    assert elsewhere(claim).status is Status.COMPLETED
    assert Charge.objects.count() == 1


@pytest.mark.parametrize(
    ("in_transaction", "inside"),
    [
        pytest.param(False, False, id="row_claim"),
        pytest.param(True, False, id="gated_claim"),
        pytest.param(True, True, id="gated_claim_in_atomic"),
        pytest.param(False, True, id="row_claim_in_atomic"),
    ],
)
def test_a_key_in_flight_reused_for_another_request_is_a_mismatch_in_either_claim(
    in_transaction: bool, inside: bool
) -> None:
    """The draft's 409 is for a retry of the same request that arrives while it runs (key and
    fingerprint seen); the same key with another payload is 422 whenever it comes, and a 409
    would tell the client to retry unchanged. The row claim read the running attempt's
    fingerprint and answered 422; the gated claim, which writes no row, answered 409, and so did
    a row claim inside an open transaction, which meets the running attempt's row uncommitted."""

    def claim_k(fingerprint: str) -> Begun:
        return begin("s", "k", fingerprint, ttl=60, lock_timeout=60, in_transaction=in_transaction)

    def duplicate(fingerprint: str) -> Begun:
        def run() -> Begun:
            with transaction.atomic() if inside else contextlib.nullcontext():
                return claim_k(fingerprint)

        begun: Begun = elsewhere(run)
        return begun

    with transaction.atomic() if inside else contextlib.nullcontext():
        first = claim_k(FP)
        assert first.claim is not None
        assert duplicate(OTHER_FP).status is Status.MISMATCH
        assert duplicate(FP).status is Status.IN_PROGRESS
        assert duplicate(OTHER_FP).status is Status.MISMATCH  # nothing kept by the refusals
        release(first.claim)  # a transaction's gate goes with the transaction
    assert advisory_locks_held() == 0
    assert duplicate(OTHER_FP).status is Status.NEW  # the key was never stored


@pytest.mark.parametrize(
    ("fingerprint", "answer", "wait"),
    [
        pytest.param(FP, Status.IN_PROGRESS, 0.0, id="same_request"),
        pytest.param(OTHER_FP, Status.MISMATCH, 0.0, id="another_request"),
        pytest.param(FP, Status.IN_PROGRESS, 0.5, id="same_request_waiting"),
        pytest.param(OTHER_FP, Status.MISMATCH, 0.5, id="another_request_waiting"),
    ],
)
def test_a_row_claim_in_autocommit_meets_a_key_held_in_an_open_transaction_without_queueing(
    fingerprint: str, answer: Status, wait: float
) -> None:
    """A row claim inside an open transaction leaves its started row uncommitted while it
    runs. A row claim in autocommit took no lock and its insert queued on that row for as long
    as the other transaction stayed open, whatever the time it was given to wait; it is
    answered within that time instead, 409 for the same request and 422 for another."""
    out: list[Any] = []

    def duplicate() -> None:
        try:
            out.append(begin("s", "k", fingerprint, ttl=60, lock_timeout=60, wait=wait))
        except Exception as exc:  # handed to the test, which asserts on it
            out.append(exc)
        finally:
            connection.close()

    worker = threading.Thread(target=duplicate)
    with transaction.atomic():
        first = begin("s", "k", FP, ttl=60, lock_timeout=60)
        assert first.claim is not None
        worker.start()
        worker.join(wait + 10)  # generous: the claim's own bound is ``wait``
        answered = not worker.is_alive()
    worker.join(60)  # the old claim was let go by the commit
    assert answered, "the autocommit claim queued on the open transaction's row"
    assert getattr(out[0], "status", out[0]) is answer
    assert advisory_locks_held() == 0


@pytest.mark.parametrize("in_transaction", [False, True], ids=["row_claim", "gated_claim"])
def test_transactions_claiming_each_others_keys_never_deadlock(in_transaction: bool) -> None:
    """Two open transactions, each holding a key, claim each other's while waiting for it to
    complete (``on_conflict="wait"``): both are told the key is in progress once their wait
    is over. The row claims used to queue on each other's uncommitted row, a deadlock that
    PostgreSQL broke by failing one of them with an error (a 500)."""
    barrier = threading.Barrier(2, timeout=30)
    results: dict[str, Any] = {}

    def hold_then_claim(mine: str, theirs: str) -> None:
        try:
            with transaction.atomic():
                held = begin("s", mine, FP, ttl=60, lock_timeout=60, in_transaction=in_transaction)
                assert held.claim is not None
                barrier.wait()
                results[mine] = begin(
                    "s",
                    theirs,
                    FP,
                    ttl=60,
                    lock_timeout=60,
                    wait=2.5,
                    in_transaction=in_transaction,
                )
                barrier.wait()  # both answered while both keys are still held
                transaction.set_rollback(True)  # a row claim's started row goes with it
        except Exception as exc:  # handed to the test, which asserts on it
            results.setdefault(mine, exc)
            barrier.abort()
        finally:
            connection.close()

    threads = [
        threading.Thread(target=hold_then_claim, args=keys) for keys in (("k1", "k2"), ("k2", "k1"))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    statuses = {key: getattr(begun, "status", begun) for key, begun in results.items()}
    assert statuses == {"k1": Status.IN_PROGRESS, "k2": Status.IN_PROGRESS}
    assert IdempotencyKey.objects.count() == 0 and advisory_locks_held() == 0


@pytest.fixture(autouse=True)
def _claim_in_transaction(settings: Any) -> None:
    settings.IDEMPOTENCY = {"CLAIM_IN_TRANSACTION": True}


def test_the_setting_reaches_the_views() -> None:
    """The view tests below run with the setting; check it is really the gated claim."""
    client = views_tests.identified(Client())
    with CaptureQueriesContext(connection) as queries:
        views_tests.post(client, "/idem/charge/", "k-setting")
    assert any("pg_try_advisory_lock" in q["sql"] for q in queries.captured_queries)
    assert IdempotencyKey.objects.get().state == "completed"


# The view-level guarantees, run again with CLAIM_IN_TRANSACTION (the fixture above).
_no_failures = views_tests._no_failures
client = views_tests.client
test_replay_returns_the_stored_response_byte_for_byte = (
    views_tests.test_replay_returns_the_stored_response_byte_for_byte
)
test_same_key_for_a_different_request_is_422 = (
    views_tests.test_same_key_for_a_different_request_is_422
)
test_same_key_while_the_first_runs_is_409_with_retry_after = (
    views_tests.test_same_key_while_the_first_runs_is_409_with_retry_after
)
test_another_request_under_a_key_in_flight_is_422 = (
    views_tests.test_another_request_under_a_key_in_flight_is_422
)
test_a_5xx_keeps_neither_response_nor_effect_and_the_retry_runs = (
    views_tests.test_a_5xx_keeps_neither_response_nor_effect_and_the_retry_runs
)
test_an_exception_keeps_nothing_and_the_retry_runs = (
    views_tests.test_an_exception_keeps_nothing_and_the_retry_runs
)
test_a_streaming_response_is_refused_and_rolled_back = (
    views_tests.test_a_streaming_response_is_refused_and_rolled_back
)
test_an_expired_key_can_be_reused = views_tests.test_an_expired_key_can_be_reused
test_async_views_are_guarded_atomically = views_tests.test_async_views_are_guarded_atomically


def test_an_idempotent_task_can_claim_its_key_in_the_transaction(settings: Any) -> None:
    from celery import Celery

    settings.IDEMPOTENCY = {}  # the task's own option, not the setting
    from idempotency.celery import idempotent_task

    app = Celery("claim-test", set_as_current=False)
    ran: list[int] = []

    @idempotent_task(key="task-{n}", claim_in_transaction=True, app=app, name="claim.charge")
    def charge(n: int) -> int:
        ran.append(n)
        return Charge.objects.create(key=f"task-{n}", amount=n).pk

    with CaptureQueriesContext(connection) as queries:
        first = charge.apply((5,)).get()
    assert any("pg_try_advisory_lock" in q["sql"] for q in queries.captured_queries)
    assert charge.apply((5,)).get() == first and ran == [5]
    assert Charge.objects.count() == 1 and advisory_locks_held() == 0


def test_under_atomic_requests_the_claim_is_in_the_transaction_by_default(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """There the row claim could not commit first anyway: one gated look replaces its
    savepoint and bounded lock wait, and the key still commits with the request."""
    settings.IDEMPOTENCY = {}
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    client = views_tests.identified(Client())
    with CaptureQueriesContext(connection) as queries:
        first = views_tests.post(client, "/idem/charge/", "k-atomic-requests")
    sent = [q["sql"] for q in queries.captured_queries]
    assert any("pg_try_advisory_xact_lock" in sql for sql in sent)
    assert not any("lock_timeout" in sql for sql in sent), sent
    again = views_tests.post(client, "/idem/charge/", "k-atomic-requests")
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert Charge.objects.count() == 1


def test_an_attempt_that_cannot_start_gives_its_key_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that fails (here: preparing its statements) leaves no session lock behind on a
    connection Django keeps for the next request."""
    from idempotency import statements

    begun = claim()
    assert begun.claim is not None

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the statements could not be prepared")

    monkeypatch.setattr(statements, "prepare", broken)
    with pytest.raises(RuntimeError):
        Attempt(begun.claim, atomic=True, ttl=60).start()
    assert advisory_locks_held() == 0
    assert elsewhere(claim).status is Status.NEW
