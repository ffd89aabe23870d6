"""Idempotent views inside a transaction that is already open (``ATOMIC_REQUESTS``), and
``transaction.on_commit`` callbacks registered by an idempotent view."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.test import Client, override_settings

from idempotency import ResponseNotStorable
from idempotency.models import IdempotencyKey
from idempotency.store import Status, begin
from tests.factories import UserFactory
from tests.test_idempotency import _basic, post, problem_type
from tests.testapp import views_idempotency
from tests.testapp.models_idempotency import Charge

ENTERED, RELEASE = views_idempotency.ENTERED, views_idempotency.RELEASE


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ATOMIC_REQUESTS = True`` for every thread's connection (they share the alias's dict)."""
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)


class Held:
    """``fn`` running in a thread of its own (with its own connection) until ``release``."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        finally:
            connection.close()

    def release(self) -> Any:
        RELEASE.set()
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self.result


@pytest.fixture
def held() -> Iterator[Callable[[Callable[[], Any]], Held]]:
    ENTERED.clear()
    RELEASE.clear()
    started: list[Held] = []

    def start(fn: Callable[[], Any]) -> Held:
        holder = Held(fn)
        started.append(holder)
        holder.thread.start()
        return holder

    yield start
    RELEASE.set()
    for holder in started:
        holder.thread.join(60)


def _clients_of_one_user() -> tuple[Client, Client]:
    """Two clients logged in as one user: one key space, two connections' worth of requests."""
    user = UserFactory()
    clients = Client(), Client()
    for client in clients:
        client.force_login(user)
    return clients


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("atomic_requests")
@pytest.mark.parametrize("url", ["/idem/held/", "/idem/held-wait/"])
def test_under_atomic_requests_a_duplicate_gets_409_instead_of_queueing(
    url: str, held: Callable[[Callable[[], Any]], Held]
) -> None:
    """The first request's key row is uncommitted while it runs (its transaction is the
    request's); a duplicate must not wait on that row unboundedly, tying up a worker."""
    first_client, second_client = _clients_of_one_user()
    first = held(lambda: post(first_client, url, "k-held"))
    assert ENTERED.wait(60)
    duplicate = post(second_client, url, "k-held")
    assert first.thread.is_alive(), "the duplicate must be answered while the first still runs"
    assert duplicate.status_code == 409 and problem_type(duplicate) == "idempotency-key-in-progress"
    assert first.release().status_code == 201
    retry = post(second_client, url, "k-held")
    assert retry["Idempotent-Replayed"] == "true" and retry.content == first.result.content
    assert Charge.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("atomic_requests")
@pytest.mark.parametrize("url", ["/idem/held/", "/idem/held-row/"], ids=["gated", "row"])
def test_under_atomic_requests_another_request_under_a_key_in_flight_is_422(
    url: str, held: Callable[[Callable[[], Any]], Held]
) -> None:
    """A retry of the running request is 409, another request under its key 422, whichever
    way the key is claimed in the request's transaction. A row claim there met the first
    request's row uncommitted, could not read its fingerprint, and answered 409 to both."""
    first_client, second_client = _clients_of_one_user()
    first = held(lambda: post(first_client, url, "k-held"))
    assert ENTERED.wait(60)
    other = post(second_client, url, "k-held", body='{"amount": 43}')
    same = post(second_client, url, "k-held")
    assert first.thread.is_alive(), "the duplicates must be answered while the first still runs"
    assert other.status_code == 422 and problem_type(other) == "idempotency-key-mismatch"
    assert same.status_code == 409 and problem_type(same) == "idempotency-key-in-progress"
    assert first.release().status_code == 201
    assert post(second_client, url, "k-held", body='{"amount": 43}').status_code == 422
    retry = post(second_client, url, "k-held")
    assert retry["Idempotent-Replayed"] == "true" and retry.content == first.result.content
    assert Charge.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_bounded_claim_leaves_the_transaction_usable_and_its_lock_timeout_as_it_was(
    held: Callable[[Callable[[], Any]], Held],
) -> None:
    def hold_uncommitted() -> None:
        with transaction.atomic():
            begin("s", "k-row", "f", ttl=60, lock_timeout=60)
            ENTERED.set()
            RELEASE.wait(60)

    holder = held(hold_uncommitted)
    assert ENTERED.wait(60)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL lock_timeout = '7s'")
        busy = begin("s", "k-row", "f", ttl=60, lock_timeout=60, wait=0.2)
        assert busy.status is Status.IN_PROGRESS
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone() == ("7s",)
        assert IdempotencyKey.objects.count() == 0  # the transaction still answers
    holder.release()
    assert IdempotencyKey.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("options", "expected"),
    [({}, 4), ({"server_side_binding": True}, 7)],
    ids=["plain_sql", "server_side_binding"],
)
def test_a_row_claim_in_an_open_transaction_counts_its_round_trips_and_keeps_its_lock_timeout(
    options: dict[str, Any], expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The savepoint, the gated look, the claim with its bounded lock wait and the caller's
    ``lock_timeout`` put back (one query), the savepoint's release: it was six round trips, the
    bound and the restore each a query of its own. A connection binding on the server sends
    one statement a query (seven), the restore on a cursor of its own."""
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    connection.close()
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '7s'")
            with tempfile.TemporaryFile("w+") as trace:
                pgconn = connection.connection.pgconn
                pgconn.trace(trace.fileno())
                pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
                try:
                    claimed = begin("s", "k-trips", "f", ttl=60, lock_timeout=60)
                finally:
                    pgconn.untrace()
                trace.seek(0)
                sent = [line.split("\t") for line in trace.read().splitlines()]
            assert claimed.status is Status.NEW
            trips = sum(1 for parts in sent if parts[0] == "F" and parts[2] in ("Sync", "Query"))
            assert trips == expected, [parts[3][:60] for parts in sent if parts[0] == "F"]
            cursor.execute("SHOW lock_timeout")
            assert cursor.fetchone() == ("7s",)
        assert IdempotencyKey.objects.filter(key="k-trips", state="started").count() == 1
    finally:
        connection.close()


FAILURES = views_idempotency.FAILURES
committed = views_idempotency.COMMITTED  # a list the callbacks append to


@pytest.fixture(params=[False, True], ids=["autocommit", "atomic_requests"])
def on_commit_client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Client:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", request.param)
    committed.clear()
    FAILURES.update(dict.fromkeys(FAILURES, 0))
    client = Client()
    client.force_login(UserFactory())
    return client


@pytest.mark.django_db(transaction=True)
def test_on_commit_callbacks_run_once_after_the_key_and_effects_commit(
    on_commit_client: Client,
) -> None:
    first = post(on_commit_client, "/idem/flaky/", "k-commit")
    assert first.status_code == 201
    assert committed == [(int(first["X-Charge"]), 1)]  # the stored key was visible to it
    replay = post(on_commit_client, "/idem/flaky/", "k-commit")
    assert replay["Idempotent-Replayed"] == "true"
    assert len(committed) == 1  # a replay runs nothing, so registers nothing


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("failure", ["status", "raise", "refuse"])
def test_on_commit_callbacks_of_an_aborted_attempt_never_run(
    on_commit_client: Client, failure: str
) -> None:
    """A view that raises, answers 5xx or answers a refusal that is not stored (429) is rolled
    back; its callbacks go with it, and only the retry's run."""
    FAILURES[failure] = 1
    if failure == "raise":
        with pytest.raises(RuntimeError):
            post(on_commit_client, "/idem/flaky/", "k-abort")
    else:
        assert post(on_commit_client, "/idem/flaky/", "k-abort").status_code in (429, 503)
    assert committed == [] and Charge.objects.count() == 0
    retry = post(on_commit_client, "/idem/flaky/", "k-abort")
    assert retry.status_code == 201 and committed == [(int(retry["X-Charge"]), 1)]


@pytest.mark.django_db(transaction=True)
def test_a_view_that_rolls_its_writes_back_and_answers_400_gets_its_400_stored(
    on_commit_client: Client,
) -> None:
    """``transaction.set_rollback(True)`` then a 400: the writes are undone as the view asked,
    and its answer is the key's (the guard used to store it inside the rolled-back block:
    ``TransactionManagementError``, a 500)."""
    FAILURES["invalid"] = 1
    first = post(on_commit_client, "/idem/flaky/", "k-invalid")
    assert first.status_code == 400, first.content
    assert committed == [] and Charge.objects.count() == 0
    again = post(on_commit_client, "/idem/flaky/", "k-invalid")
    assert again.status_code == 400 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content and Charge.objects.count() == 0
    assert IdempotencyKey.objects.get().state == "completed"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("atomic_requests", [False, True], ids=["autocommit", "atomic_requests"])
@pytest.mark.parametrize("in_transaction", [False, True], ids=["row_claim", "claim_in_transaction"])
def test_a_drf_validation_error_is_a_stored_400_under_atomic_requests_too(
    monkeypatch: pytest.MonkeyPatch, atomic_requests: bool, in_transaction: bool
) -> None:
    """DRF's exception handler marks the transaction for rollback under ``ATOMIC_REQUESTS``
    (only then), which is the guard's block: the 400 must still be answered, and replayed.
    Without it the view's write before the error stays, as DRF leaves it."""
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", atomic_requests)
    UserFactory(username="carol")
    FAILURES.update(dict.fromkeys(FAILURES, 0), invalid=1)
    client, auth = Client(), _basic("carol")
    with override_settings(IDEMPOTENCY={"CLAIM_IN_TRANSACTION": in_transaction}):
        first = post(client, "/idem/drf-guarded/", "k-drf-400", HTTP_AUTHORIZATION=auth)
        assert first.status_code == 400, first.content
        kept = Charge.objects.count()
        again = post(client, "/idem/drf-guarded/", "k-drf-400", HTTP_AUTHORIZATION=auth)
    assert kept == (0 if atomic_requests else 1)
    assert again.status_code == 400 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content and Charge.objects.count() == kept


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("atomic_requests")
def test_a_non_atomic_attempt_in_a_request_rolled_back_answers_and_leaves_the_key_free() -> None:
    """Without a block of its own, the attempt's claim is in the request's transaction, which
    the view marked for rollback: nothing can be stored there (no 500 for trying), and the key
    goes with the undone writes, so the retry runs."""
    FAILURES.update(dict.fromkeys(FAILURES, 0), invalid=1)
    client = Client()
    client.force_login(UserFactory())
    first = post(client, "/idem/flaky-not-atomic/", "k-invalid-na")
    assert first.status_code == 400, first.content
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
    retry = post(client, "/idem/flaky-not-atomic/", "k-invalid-na")
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("atomic_requests")
def test_a_non_atomic_view_whose_response_cannot_be_stored_goes_with_the_request() -> None:
    """Outside ``ATOMIC_REQUESTS`` such a view is recorded as run and never runs again
    (``test_idempotency``); under it the record is written in the request's transaction, which
    the error rolls back with the view's writes: nothing kept, so the retry runs and fails the
    same way, writing nothing either."""
    client = Client()
    client.force_login(UserFactory())
    for _ in range(2):
        with pytest.raises(ResponseNotStorable, match="streamed"):
            post(client, "/idem/stream-not-atomic/", "k-stream-na")
        assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
