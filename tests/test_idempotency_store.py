"""The key state machine, ``idempotency_key`` operations and the purge command, on Postgres."""

from __future__ import annotations

import io
import os
import subprocess
import threading
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core.management import CommandError, call_command
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from idempotency import (
    IdempotencyClientUnidentified,
    IdempotencyImproperlyConfigured,
    IdempotencyKeyInProgress,
    IdempotencyKeyLost,
    IdempotencyKeyMismatch,
    IdempotencyResultNotRecorded,
    idempotency_key,
    scopes,
)
from idempotency.management.commands import purge_idempotency_keys
from idempotency.models import IdempotencyKey
from idempotency.store import Attempt, Outcome, Status, begin, finish, release
from tests.harness import ROOT, manage
from tests.testapp.models_idempotency import Charge

pytestmark = pytest.mark.django_db

FP = "f" * 64
OTHER_FP = "0" * 64
OUTCOME = Outcome(status=201, headers=[("Content-Type", "text/plain")], body=b"\x00done\xff")


def sql(statement: str, params: Any = None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def rows(statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return list(cursor.fetchall())


@pytest.mark.django_db(transaction=True)
def test_begin_claims_reports_and_replays_in_one_round_trip_each() -> None:
    """In autocommit, the hot path. Inside an open transaction the claim also bounds its lock
    wait (savepoint, set and restore ``lock_timeout``): see ``test_idempotency_transactions``."""
    with CaptureQueriesContext(connection) as first:
        claimed = begin("s", "k", FP, ttl=60, lock_timeout=60)
    assert claimed.status is Status.NEW and claimed.claim and not claimed.claim.taken_over
    running = begin("s", "k", FP, ttl=60, lock_timeout=60)
    assert running.status is Status.IN_PROGRESS and 0 < running.retry_after <= 60
    assert begin("s", "k", OTHER_FP, ttl=60, lock_timeout=60).status is Status.MISMATCH
    finish(claimed.claim, OUTCOME, ttl=60)
    with CaptureQueriesContext(connection) as replay:
        done = begin("s", "k", FP, ttl=60, lock_timeout=60)
    assert done.status is Status.COMPLETED and done.outcome == OUTCOME
    assert len(first.captured_queries) == 1 and len(replay.captured_queries) == 1


def test_a_lapsed_lock_is_taken_over_and_the_old_attempt_cannot_finish() -> None:
    old = begin("s", "k", FP, ttl=60, lock_timeout=0.05).claim
    assert old is not None
    sql("SELECT pg_sleep(0.1)")
    assert begin("s", "k", OTHER_FP, ttl=60, lock_timeout=60).status is Status.MISMATCH
    new = begin("s", "k", FP, ttl=60, lock_timeout=60).claim
    assert new is not None and new.taken_over and new.owner != old.owner
    with pytest.raises(IdempotencyKeyLost):
        finish(old, OUTCOME, ttl=60)
    release(old)
    assert IdempotencyKey.objects.get().owner == new.owner
    finish(new, OUTCOME, ttl=60)
    assert begin("s", "k", FP, ttl=60, lock_timeout=60).status is Status.COMPLETED


def test_an_expired_completed_key_is_claimed_again_with_any_fingerprint() -> None:
    claim = begin("s", "k", FP, ttl=60, lock_timeout=60).claim
    assert claim is not None
    finish(claim, OUTCOME, ttl=60)
    sql("UPDATE idempotency_key SET expires_at = clock_timestamp() - interval '1 second'")
    again = begin("s", "k", OTHER_FP, ttl=60, lock_timeout=60)
    assert again.status is Status.NEW and again.claim and again.claim.taken_over


LEGACY_FP = "1" * 64


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("in_transaction", [False, True], ids=["row_claim", "gated_claim"])
def test_a_crashed_attempt_fingerprinted_before_the_upgrade_resumes_with_its_steps(
    in_transaction: bool,
) -> None:
    """Fingerprints gained the media type: a started row an earlier version wrote holds the
    fingerprint without it (the request's ``legacy_fingerprint``). Its retry after the
    upgrade takes it over and resumes after its recorded steps, keeping the fingerprint the
    steps' derived keys were made from, so a provider sees the same key as before the crash
    and answers it once. Another request meets it as a mismatch."""
    sql(
        "INSERT INTO idempotency_key (scope, key, fingerprint, state, owner, locked_until, "
        "response_headers, steps, created_at, expires_at) VALUES ('s', 'k', %s, 'started', "
        "gen_random_uuid(), clock_timestamp() - interval '1 second', '[]', '{\"charge\": 7}', "
        "clock_timestamp(), clock_timestamp() + interval '1 hour')",
        [LEGACY_FP],
    )

    def claim(fingerprint: str, legacy: str) -> Any:
        return begin(
            "s",
            "k",
            fingerprint,
            legacy_fingerprint=legacy,
            ttl=60,
            lock_timeout=60,
            in_transaction=in_transaction,
        )

    assert claim(OTHER_FP, "2" * 64).status is Status.MISMATCH
    assert claim(FP, FP).status is Status.MISMATCH  # the new fingerprint alone is another
    resumed = claim(FP, LEGACY_FP)
    assert resumed.status is Status.NEW and resumed.claim is not None
    assert resumed.claim.steps == {"charge": 7} and resumed.claim.fingerprint == LEGACY_FP
    if in_transaction:
        attempt = Attempt(resumed.claim, atomic=True, ttl=60)
        attempt.start()
        attempt.commit(OUTCOME)
    else:
        finish(resumed.claim, OUTCOME, ttl=60)
    assert claim(FP, LEGACY_FP).status is Status.COMPLETED


def test_scopes_are_separate_key_spaces() -> None:
    assert begin("alice", "k", FP, ttl=60, lock_timeout=60).status is Status.NEW
    assert begin("bob", "k", OTHER_FP, ttl=60, lock_timeout=60).status is Status.NEW


def test_an_operation_runs_once_and_replays_its_recorded_result() -> None:
    with idempotency_key("import-1", scope="cmd") as op:
        assert not op.replayed
        Charge.objects.create(amount=1)
        op.result = {"imported": 1}
    with idempotency_key("import-1", scope="cmd") as again:
        assert again.replayed and again.result == {"imported": 1}
    assert Charge.objects.count() == 1


def test_a_failed_operation_keeps_nothing_and_runs_again() -> None:
    with pytest.raises(ZeroDivisionError), idempotency_key("import-2") as op:
        Charge.objects.create(amount=1)
        op.result = 1 / 0
    assert Charge.objects.count() == 0 and IdempotencyKey.objects.count() == 0
    with idempotency_key("import-2") as op:
        assert not op.replayed


@pytest.mark.django_db(transaction=True)
def test_a_result_that_is_not_json_is_refused_and_keeps_nothing() -> None:
    """The result is stored as JSON: one that is not (a set) raises a ``TypeError`` naming the
    operation, and the attempt ends as a failed one (effects rolled back, key freed). It used
    to raise before the commit and outside the abort: the attempt's transaction stayed open
    on the connection, swallowing every later write of the thread."""
    with (
        pytest.raises(TypeError, match=r"'cmd' key 'import-set' is not JSON"),
        idempotency_key("import-set", scope="cmd") as op,
    ):
        Charge.objects.create(amount=1)
        op.result = {"ids": {1, 2}}
    assert not connection.in_atomic_block
    assert IdempotencyKey.objects.count() == 0 and Charge.objects.count() == 0
    with idempotency_key("import-set", scope="cmd") as again:
        assert not again.replayed
        again.result = {"ids": [1, 2]}
    with idempotency_key("import-set", scope="cmd") as replay:
        assert replay.replayed and replay.result == {"ids": [1, 2]}


@pytest.mark.django_db(transaction=True)
def test_a_non_atomic_operation_whose_result_is_not_json_never_runs_again() -> None:
    """Outside atomic mode the block's effects have committed by the time its result turns
    out not to be JSON: the key was freed all the same, so every retry ran the effect again
    (and failed the same way). The key is recorded as run without a result: the first run
    and every retry get ``IdempotencyResultNotRecorded`` (a ``TypeError``), and the block
    never runs again under the key."""
    runs: list[int] = []

    @idempotency_key(lambda n: f"import-set-{n}", scope="cmd", atomic=False)
    def run(n: int) -> Any:
        runs.append(n)
        Charge.objects.create(amount=n)
        return {"ids": {1, 2}}

    with pytest.raises(IdempotencyResultNotRecorded, match=r"'cmd' key 'import-set-1' is not JSON"):
        run(1)
    assert not connection.in_atomic_block
    for _ in range(2):
        with pytest.raises(IdempotencyResultNotRecorded, match=r"ran once.*not run again"):
            run(1)
    assert runs == [1] and Charge.objects.count() == 1
    assert IdempotencyKey.objects.get().state == "completed"
    with (
        pytest.raises(IdempotencyResultNotRecorded, match="'import-set-2' is not JSON"),
        idempotency_key("import-set-2", scope="cmd", atomic=False) as op,
    ):
        op.result = {"ids": {1, 2}}
    with (
        pytest.raises(IdempotencyResultNotRecorded, match="not run again"),
        idempotency_key("import-set-2", scope="cmd", atomic=False),
    ):
        pytest.fail("the block ran again")


def test_the_decorator_form_skips_the_call_on_a_repeat() -> None:
    calls: list[int] = []

    @idempotency_key(lambda n: f"job-{n}", scope="jobs")
    def job(n: int) -> int:
        calls.append(n)
        Charge.objects.create(amount=n)
        return n * 10

    assert [job(1), job(1), job(2)] == [10, 10, 20]
    assert calls == [1, 2] and Charge.objects.count() == 2


def test_a_first_run_returns_what_its_replays_return() -> None:
    """The decorator returned the function's own value on the first call and its JSON form
    on every replay (tuples became lists, ``Decimal`` strings, int keys strings): code that
    worked on the first call broke only on a retry."""

    @idempotency_key("types", scope="jobs")
    def invoice() -> dict[object, object]:
        return {"lines": (1, 2), "total": Decimal("9.50"), 7: "by id"}

    first, replay = invoice(), invoice()
    assert first == replay == {"lines": [1, 2], "total": "9.50", "7": "by id"}


def test_the_decorator_form_tells_two_operations_and_two_calls_apart() -> None:
    """Every decorated operation shared one scope and one empty fingerprint: an unrelated
    function whose key came out as the same string returned the other's result and never ran,
    and the same key with other arguments replayed instead of being refused."""

    @idempotency_key(lambda pk, amount=1: f"{pk}")
    def send_invoice(pk: int, amount: int = 1) -> str:
        Charge.objects.create(amount=amount)
        return f"invoice {pk} sent"

    @idempotency_key(lambda pk: f"{pk}")
    def ship_order(pk: int) -> str:
        return f"order {pk} shipped"

    assert send_invoice(7) == "invoice 7 sent"
    assert send_invoice(7, amount=1) == send_invoice(pk=7) == "invoice 7 sent"  # one call
    with pytest.raises(IdempotencyKeyMismatch):
        ship_order(7)
    with pytest.raises(IdempotencyKeyMismatch):
        send_invoice(7, 2)
    assert Charge.objects.count() == 1


def test_blocks_that_do_not_nest_each_finish_their_own_key() -> None:
    """``__exit__`` finished the innermost open operation, not its own: a generator's block
    ending while its caller's was still open finished the caller's key with the
    generator's result (and the other way round), which then replayed for its TTL."""

    def export() -> Iterator[int]:
        with idempotency_key("export", scope="cmd", atomic=False) as op:
            yield 1
            op.result = "export-result"

    rows = export()
    next(rows)
    with idempotency_key("row", scope="cmd", atomic=False) as row:
        next(rows, None)  # the generator's block ends while "row" is still open
        row.result = "row-result"
    for key in ("export", "row"):
        with idempotency_key(key, scope="cmd", atomic=False) as again:
            assert again.replayed and again.result == f"{key}-result"


@pytest.mark.parametrize(
    "options",
    [
        {"key": ""},
        {"key": "x" * 256},
        {"key": None},
        {"key": 5},
        {"key": "a\x00b"},
        {"scope": ""},
        {"scope": 5},
        {"fingerprint": 5},
        {"atomic": "no"},
        {"claim_in_transaction": "yes"},
    ],
    ids=["empty", "256", "none", "int", "nul", "empty-scope", "int-scope", "int-fp", "no", "yes"],
)
def test_an_operation_refuses_bad_options_before_any_round_trip(options: dict[str, Any]) -> None:
    """Only the numbers were checked: a key or scope the header guard refuses (empty, over
    255 characters, a NUL) failed in the database (claimed in the transaction, only after
    the block ran), None broke a constraint, 5 was stored as "5" and met that key,
    ``fingerprint=5`` raised AttributeError, and ``atomic="no"`` meant atomic."""
    given = {"key": "fine", **options}
    with (
        CaptureQueriesContext(connection) as queries,
        pytest.raises(IdempotencyImproperlyConfigured),
        idempotency_key(**given),
    ):
        pass
    assert not queries.captured_queries


def test_a_computed_key_is_checked_before_any_round_trip() -> None:
    @idempotency_key(lambda length: "k" * length, scope="jobs")
    def job(length: int) -> int:
        return length

    for length in (0, 256):
        with (
            CaptureQueriesContext(connection) as queries,
            pytest.raises(IdempotencyImproperlyConfigured, match=f"key .* not {length}"),
        ):
            job(length)
        assert not queries.captured_queries
    assert job(255) == 255


def test_an_operation_refuses_a_key_in_use_or_used_differently() -> None:
    assert begin("cmd", "busy", idempotency_key_digest(""), ttl=60, lock_timeout=60).claim
    with pytest.raises(IdempotencyKeyInProgress), idempotency_key("busy", scope="cmd"):
        pass
    with idempotency_key("used", scope="cmd", fingerprint="a"):
        pass
    with (
        pytest.raises(IdempotencyKeyMismatch),
        idempotency_key("used", scope="cmd", fingerprint="b"),
    ):
        pass


def idempotency_key_digest(fingerprint: str) -> str:
    from idempotency.http import digest

    return digest([fingerprint.encode()])


def _rows(**ages: tuple[str, str, str | None]) -> None:
    """Rows named by key: (state, expires_at offset, locked_until offset) on the DB clock."""
    for key, (state, expires, locked) in ages.items():
        sql(
            "INSERT INTO idempotency_key (scope, key, fingerprint, state, locked_until, "
            "response_headers, created_at, expires_at) VALUES ('s', %s, %s, %s, "
            "clock_timestamp() + %s::interval, '[]', clock_timestamp(), "
            "clock_timestamp() + %s::interval)",
            [key, FP, state, locked, expires],
        )


def test_purge_deletes_only_expired_keys_by_the_database_clock() -> None:
    _rows(
        expired=("completed", "-1 second", None),
        live=("completed", "1 hour", None),
        crashed_but_fresh=("started", "1 hour", "-1 second"),
        expired_and_crashed=("started", "-1 second", "-1 second"),
        expired_but_still_running=("started", "-1 second", "1 hour"),
    )
    out = io.StringIO()
    call_command("purge_idempotency_keys", stdout=out)
    left = set(IdempotencyKey.objects.values_list("key", flat=True))
    assert left == {"live", "crashed_but_fresh", "expired_but_still_running"}
    assert "2 expired" in out.getvalue() and "deleted 2" in out.getvalue()
    for statement in (purge_idempotency_keys.COUNT_SQL, purge_idempotency_keys.PURGE_BATCH_SQL):
        assert "clock_timestamp()" in statement and "now()" not in statement


def test_purge_works_in_bounded_batches_with_progress() -> None:
    _rows(**{f"k{i}": ("completed", "-1 second", None) for i in range(25)})
    out = io.StringIO()
    call_command("purge_idempotency_keys", batch_size=10, stdout=out)
    lines = out.getvalue().splitlines()
    progress = [line.split() for line in lines if line.startswith("[")]
    assert [words[1] for words in progress] == ["10/25", "20/25", "25/25"]
    assert all(words[3:5] == ["keys/s", "ETA"] for words in progress)
    assert progress[-1][-1] == "0s"
    assert IdempotencyKey.objects.count() == 0
    call_command("purge_idempotency_keys", batch_size=10, max_batches=1, stdout=io.StringIO())


def test_purge_counts_up_to_a_bound_and_estimates_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counting every expired key before a purge of ten million scanned them all (seconds of
    both cores beside the requests the purge must not slow): past a bound, the progress bar's
    total is the planner's estimate, marked ``~``, and the last line is exact."""
    _rows(**{f"k{i}": ("completed", "-1 second", None) for i in range(25)})
    _rows(live=("completed", "1 hour", None))
    sql("ANALYZE idempotency_key")
    monkeypatch.setattr(purge_idempotency_keys, "EXACT_BELOW", 10)
    out = io.StringIO()
    with CaptureQueriesContext(connection) as queries:
        call_command("purge_idempotency_keys", batch_size=10, stdout=out)
    counts = [q["sql"] for q in queries.captured_queries if "count(*)" in q["sql"].lower()]
    assert counts and all("LIMIT 10" in statement for statement in counts), counts
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("~") and lines[0].endswith(" expired idempotency key(s)")
    progress = [line.split()[1] for line in lines if line.startswith("[")]
    assert all("/~" in step for step in progress[:-1]) and progress[-1] == "25/25"
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["live"]


def test_purge_sizes_batches_to_a_time() -> None:
    """A slow batch makes the next smaller in proportion; a quick one at most doubles it, up to
    ``--batch-size``; none goes below the smallest useful batch (or ``--batch-size``)."""
    next_size = purge_idempotency_keys.next_size
    smallest = purge_idempotency_keys.SMALLEST_BATCH
    assert next_size(1000, took=0.2, target=0.05, largest=1000) == 250
    assert next_size(250, took=0.01, target=0.05, largest=1000) == 500
    assert next_size(800, took=0.01, target=0.05, largest=1000) == 1000
    assert next_size(100, took=10.0, target=0.05, largest=1000) == smallest
    assert next_size(10, took=10.0, target=0.05, largest=10) == 10


@pytest.mark.django_db(transaction=True)
def test_purge_writes_no_row_lock_wal_records() -> None:
    """The purge's WAL is what stalls the commits beside it (a new WAL segment is zero-filled
    under the lock every commit waits for, each 16 MB): locking each row before deleting it
    wrote a WAL record per row on top of the delete's, twice the WAL. Counted here in the WAL
    itself (``pg_walinspect``): heap deletes of the purged keys, and not one row lock."""
    _rows(**{f"k{i}": ("completed", "-1 second", None) for i in range(40)})
    sql("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    ((start,),) = rows("SELECT pg_current_wal_insert_lsn()")
    call_command("purge_idempotency_keys", batch_size=10, stdout=io.StringIO())
    ((end,),) = rows("SELECT pg_current_wal_lsn()")
    records = rows(
        "SELECT record_type, count(*) FROM pg_get_wal_records_info(%s, %s)"
        " WHERE resource_manager = 'Heap' AND block_ref LIKE '%%/' || ("
        "  SELECT relfilenode FROM pg_class WHERE oid = 'idempotency_key'::regclass"
        ")::text || ' %%' GROUP BY record_type",
        [start, end],
    )
    counts = dict(records)
    assert IdempotencyKey.objects.count() == 0
    assert counts.get("DELETE", 0) >= 40, counts
    assert "LOCK" not in counts, counts


@pytest.mark.django_db(transaction=True)
def test_purge_skips_a_row_a_request_is_taking_over_instead_of_waiting() -> None:
    _rows(busy=("completed", "-1 second", None), idle=("completed", "-1 second", None))
    locked, release_it = threading.Event(), threading.Event()

    def take_over() -> None:
        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute("BEGIN")
                cursor.execute("SELECT 1 FROM idempotency_key WHERE key = 'busy' FOR UPDATE")
                locked.set()
                release_it.wait(10)
                cursor.execute("ROLLBACK")
        finally:
            other.close()

    thread = threading.Thread(target=take_over)
    thread.start()
    try:
        assert locked.wait(10)
        call_command("purge_idempotency_keys", stdout=io.StringIO())
        assert thread.is_alive()  # the purge finished while the row was still locked
        assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["busy"]
    finally:
        release_it.set()
        thread.join(10)


@pytest.mark.django_db(transaction=True)
def test_an_attempt_past_its_lock_is_rolled_back_when_a_retry_took_over() -> None:
    slow = begin("s", "k", FP, ttl=60, lock_timeout=0.2).claim
    assert slow is not None
    attempt = Attempt(slow, atomic=True, ttl=60)
    attempt.start()
    Charge.objects.create(amount=1)
    sql("SELECT pg_sleep(0.3)")  # inside the slow attempt's transaction: its lock lapses

    def retry() -> None:
        try:
            claim = begin("s", "k", FP, ttl=60, lock_timeout=60).claim
            assert claim is not None and claim.taken_over
            other = Attempt(claim, atomic=True, ttl=60)
            other.start()
            Charge.objects.create(amount=2)
            other.commit(OUTCOME)
        finally:
            connection.close()

    thread = threading.Thread(target=retry)
    thread.start()
    thread.join(30)
    with pytest.raises(IdempotencyKeyLost):
        attempt.commit(OUTCOME)
    assert list(Charge.objects.values_list("amount", flat=True)) == [2]
    assert begin("s", "k", FP, ttl=60, lock_timeout=60).outcome == OUTCOME


def test_secrets_are_hashed_before_they_become_scopes(rf: Any) -> None:
    request = rf.post("/", HTTP_X_API_KEY="sk_live_secret")
    request.session = type("S", (), {"session_key": "abcdef123"})()
    request.user = AnonymousUser()
    assert scopes.by_session(request).startswith("session:")
    assert "abcdef123" not in scopes.by_session(request)
    by_key = scopes.by_header("X-Api-Key")(request)
    assert by_key.startswith("header:x-api-key:") and "sk_live_secret" not in by_key
    assert scopes.by_user(request) == scopes.by_session(request)


def test_a_request_with_no_identity_has_no_scope(rf: Any) -> None:
    request = rf.post("/")
    request.user = AnonymousUser()
    for session in (None, type("S", (), {"session_key": None})()):
        request.session = session
        for scope in (scopes.by_user, scopes.by_session, scopes.by_header("X-Api-Key")):
            with pytest.raises(IdempotencyClientUnidentified):
                scope(request)
    assert scopes.anonymous(request) == scopes.ANONYMOUS  # the explicit opt-in


def test_without_atomic_mode_effects_stay_but_the_key_is_freed_for_a_retry() -> None:
    with pytest.raises(ZeroDivisionError), idempotency_key("loose", atomic=False):
        Charge.objects.create(amount=1)
        _ = 1 / 0
    assert Charge.objects.count() == 1 and IdempotencyKey.objects.count() == 0
    with idempotency_key("loose", atomic=False) as op:
        op.result = "done"
    assert IdempotencyKey.objects.get().state == "completed"


def test_importing_the_package_needs_no_settings_or_app_registry(python: str) -> None:
    code = (
        "import sys, idempotency; "
        "assert issubclass(idempotency.IdempotencyError, idempotency.errors.LeaseError); "
        "assert 'idempotency.models' not in sys.modules and 'django.apps' not in sys.modules"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    subprocess.run([python, "-c", code], env=env, check=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": 0}, "--batch-size must be at least 1, not 0"),
        ({"sleep": -1.0}, "--sleep must be at least 0, not -1"),
        # Passed, deleted a batch, then crashed in time.sleep() with a traceback.
        ({"sleep": float("inf")}, "--sleep must be at least 0 and finite, not inf"),
        ({"batch_time": float("inf")}, "--batch-time must be at least 0 and finite, not inf"),
        # Finite, yet past what time.sleep() takes: the same crash after the first batch.
        ({"sleep": 1e10, "batch_size": 1}, r"--sleep must be at most 86400 seconds \(a day\)"),
        ({"max_batches": -1}, "--max-batches must be at least 0, not -1"),
        ({"database": "nope"}, "unknown database 'nope'"),
    ],
)
def test_purge_refuses_bad_input_before_deleting_anything(
    options: dict[str, object], message: str
) -> None:
    _rows(expired=("completed", "-1 second", None))
    with pytest.raises(CommandError, match=message):
        call_command("purge_idempotency_keys", stdout=io.StringIO(), **options)
    assert IdempotencyKey.objects.count() == 1


def test_purge_at_verbosity_0_prints_nothing_but_a_dry_run_count() -> None:
    _rows(**{f"k{i}": ("completed", "-1 second", None) for i in range(3)})
    dry = io.StringIO()
    call_command("purge_idempotency_keys", dry_run=True, verbosity=0, stdout=dry)
    assert dry.getvalue().strip() == "3 expired idempotency key(s)"
    out = io.StringIO()
    call_command("purge_idempotency_keys", batch_size=1, verbosity=0, stdout=out)
    assert out.getvalue() == "" and IdempotencyKey.objects.count() == 0


def test_purge_bad_input_from_the_command_line_is_one_line_and_exit_1(
    child_env: dict[str, str],
) -> None:
    done = manage(child_env, "purge_idempotency_keys", "--batch-size", "0")
    assert done.returncode == 1
    assert done.stderr.strip() == "CommandError: --batch-size must be at least 1, not 0"
