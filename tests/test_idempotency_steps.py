"""Multi-step idempotency: recovery points, resumption after a crash, derived keys.

The in-process tests pin the contract (a step runs once, a failure keeps the steps before it,
a taken-over attempt records nothing). The crash tests run the workflow of
``tests/steps_workflow.py`` (charge at a stand-in provider, an order row, an email) in a real
process for each front end (an ``idempotency_key`` operation, a view under gunicorn, a Celery
task on a prefork worker), SIGKILL that process between steps or inside one, and retry: the
provider (a real HTTP server in its own process) must have made each effect once per derived
key, and the order row must exist once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client

from devservers.provider import Provider
from idempotency import (
    IdempotencyImproperlyConfigured,
    IdempotencyKeyLost,
    IdempotencyResultNotRecorded,
    idempotency_key,
    step,
)
from idempotency.models import IdempotencyKey
from idempotency.steps import derived_key
from idempotency.store import begin
from tests.celery_workers import Worker, celery_workers_fixture, new_queue  # noqa: F401
from tests.steps_workflow import PAUSE_ENV, PROVIDER_ENV
from tests.test_idempotency import identified, post, problem_type
from tests.test_idempotency_live import Gunicorn, send
from tests.testapp.models_idempotency import Charge
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def provider() -> Iterator[Provider]:
    started = Provider().start()
    try:
        yield started
    finally:
        started.stop()


def _orders() -> int:
    return Charge.objects.filter(key__startswith="order:").count()


# -- the contract, in process ------------------------------------------------------------------


def test_a_failed_step_keeps_the_steps_before_it_and_the_retry_resumes_there() -> None:
    calls: list[str] = []

    def run(fail: bool) -> Any:
        with idempotency_key("op-1", scope="steps", atomic=False) as op:
            if op.replayed:
                return op.result
            first = op.step("local", lambda key: _local(calls, "order:1"))
            if fail:
                raise RuntimeError("the second step failed")
            op.result = {"row": first, "second": op.step("second", lambda key: calls.append(key))}
        return op.result

    with pytest.raises(RuntimeError):
        run(fail=True)
    kept = IdempotencyKey.objects.get(scope="steps", key="op-1")
    assert kept.state == "started" and kept.owner is None and "local" in kept.steps
    result = run(fail=False)
    assert calls[0] == "local" and len(calls) == 2, "the recorded step ran again"
    assert _orders() == 1 and result["row"] == Charge.objects.get().pk
    assert run(fail=False) == result  # now a replay of the completed operation


def _outrun_ttl(key: str, *, fail: bool, pause: float = 0.0) -> None:
    """An operation with a TTL of 1 s whose step commits an order, then pauses ``pause``
    seconds (longer than the TTL: each step renews the lock) and fails or completes."""
    with idempotency_key(key, scope="steps", atomic=False, ttl=1, lock_timeout=1) as op:
        if op.replayed:
            return
        op.step("order", lambda k: Charge.objects.create(key=f"order:{key}", amount=1).pk)
        time.sleep(pause)
        if fail:
            raise RuntimeError("the next step failed")
        op.result = "done"


def test_a_retry_resumes_after_a_failed_step_of_an_operation_that_outran_its_ttl() -> None:
    """The TTL that bounds how long recorded steps are kept was counted from the claim: an
    operation that ran longer than it lost its recovery points as it failed, and the retry
    ran the committed step again. It counts from the last step or the failure."""
    with pytest.raises(RuntimeError):
        _outrun_ttl("ttl-1", fail=True, pause=1.3)
    row = IdempotencyKey.objects.get(key="ttl-1")
    assert row.state == "started" and "order" in row.steps
    assert row.locked_until is not None
    assert row.expires_at - row.locked_until >= timedelta(seconds=1)  # a TTL from the failure
    _outrun_ttl("ttl-1", fail=False)
    assert Charge.objects.filter(key="order:ttl-1").count() == 1, "the recorded step ran again"


def test_the_purge_keeps_the_steps_of_a_failed_operation_for_a_ttl_from_its_failure() -> None:
    """The purge deleted a failed operation's started row once the TTL from its claim had
    passed, steps and all, though a retry may resume for a TTL from the failure."""
    with pytest.raises(RuntimeError):
        _outrun_ttl("ttl-2", fail=True, pause=1.3)
    call_command("purge_idempotency_keys", verbosity=0)
    _outrun_ttl("ttl-2", fail=False)
    assert Charge.objects.filter(key="order:ttl-2").count() == 1, "the recorded step ran again"


def _local(calls: list[str], key: str) -> int:
    calls.append("local")
    return Charge.objects.create(key=key, amount=1).pk


def test_a_step_returns_what_was_recorded_so_a_resumed_run_sees_the_same_value() -> None:
    with idempotency_key("op-2", scope="steps", atomic=False) as op:
        value = op.step("tuple", lambda key: (1, "a"))
        again = op.step("tuple", lambda key: pytest.fail("a recorded step ran twice"))
    assert value == again == [1, "a"]


def test_a_float_step_result_is_the_same_on_the_first_run_and_a_resumed_one() -> None:
    """The first run read its result back as Python wrote it, a resumed run as ``jsonb`` gave
    it back (numbers kept as ``numeric``, printed without an exponent): a float of 1e16 or
    more was a float on the first run and an int on the retry."""
    seen = []
    with pytest.raises(RuntimeError), idempotency_key("fl", scope="steps", atomic=False) as op:
        seen.append(op.step("quote", lambda key: {"amount": 1e20, "rate": 2.5e16, "x": 0.5}))
        raise RuntimeError("a later step failed")
    with idempotency_key("fl", scope="steps", atomic=False) as op:
        seen.append(op.step("quote", lambda key: pytest.fail("the recorded step ran again")))
    first, resumed = seen
    assert repr(first) == repr(resumed)  # types and key order too


JSONB_SAMPLES = [
    1e20, -2.5e16, 1e16, 9999999999999998.0, 0.5, 1.0, 1.5e-07, -0.0, 5e-324, 1e300,
    1.7976931348623157e308, 123456789.123, 10**30, -7, "1e20",
    {"bb": 1, "a": 2, "é": 3, "ab": {"yy": 1.0, "x": 1e16}},
    [0.1, 1e15, [1e17, {}]],
]  # fmt: skip


def test_a_step_result_reads_as_jsonb_gives_it_back() -> None:
    """What the first run gets is what ``jsonb`` returns to a resumed one, value by value."""
    from idempotency.steps import _as_stored, _encode

    with connection.cursor() as cursor:
        for sample in JSONB_SAMPLES:
            text = _encode(sample)
            cursor.execute("SELECT %s::jsonb::text", [text])
            assert repr(_as_stored(text)) == repr(json.loads(cursor.fetchone()[0])), sample


def test_derived_keys_are_stable_per_request_and_step_and_differ_between_steps() -> None:
    seen: list[str] = []
    for _ in range(2):
        begun = begin("steps", "op-3", "f" * 64, ttl=60, lock_timeout=60)
        claim = begun.claim
        assert claim is not None
        seen += [derived_key(claim, "charge"), derived_key(claim, "email")]
        IdempotencyKey.objects.all().delete()
    other = begin("steps", "op-3", "0" * 64, ttl=60, lock_timeout=60).claim
    assert other is not None
    assert seen[0] == seen[2] and seen[1] == seen[3] and seen[0] != seen[1]
    assert derived_key(other, "charge") != seen[0], "another request under the key, same key"
    assert len(seen[0]) == 64 and "op-3" not in seen[0]


def test_a_step_outside_an_operation_or_on_a_replay_is_refused() -> None:
    with pytest.raises(IdempotencyImproperlyConfigured, match="outside an idempotent"):
        step("charge", lambda key: None)
    with idempotency_key("op-4", scope="steps") as op:
        op.result = 1
    with idempotency_key("op-4", scope="steps") as op:
        assert op.replayed
        with pytest.raises(IdempotencyImproperlyConfigured, match="replayed"):
            op.step("charge", lambda key: None)


def test_a_taken_over_attempt_records_no_step_and_its_effects_roll_back() -> None:
    with (
        pytest.raises(IdempotencyKeyLost),
        idempotency_key("op-5", scope="steps", atomic=False, lock_timeout=60) as op,
    ):
        IdempotencyKey.objects.filter(key="op-5").update(owner=None)  # as a take-over leaves it
        op.step("local", lambda key: _local([], "order:5"))
    assert _orders() == 0


def test_steps_in_an_atomic_operation_roll_back_with_it() -> None:
    with pytest.raises(RuntimeError), idempotency_key("op-6", scope="steps") as op:
        op.step("local", lambda key: Charge.objects.create(key="order:6", amount=1).pk)
        raise RuntimeError("after the step")
    assert _orders() == 0 and not IdempotencyKey.objects.filter(key="op-6").exists()


def test_a_duplicate_of_a_slow_atomic_operation_with_a_step_is_not_queued_behind_it() -> None:
    """An atomic attempt's step was written to the key row in the attempt's open transaction:
    the row stayed locked and the lock's renewal invisible, so once the committed lock lapsed
    a duplicate's claim queued on the row for as long as the attempt ran. Its steps are kept
    in memory: the duplicate takes the lapsed key over at once, as from an attempt without
    steps, and the slow attempt's outcome is refused, its step's effects rolled back."""
    stepped, finish = threading.Event(), threading.Event()
    lost: list[Exception] = []

    def first() -> None:
        try:
            with idempotency_key("slow", scope="steps", lock_timeout=0.5) as op:
                op.step("s", lambda key: _local([], "order:slow"))
                stepped.set()
                finish.wait(10)
                op.result = 1
        except IdempotencyKeyLost as exc:
            lost.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    timer = threading.Timer(3.0, finish.set)  # what a duplicate that queued would wait for
    try:
        assert stepped.wait(10)
        time.sleep(0.8)  # the lock committed with the claim has lapsed
        timer.start()
        sent = time.monotonic()
        with idempotency_key("slow", scope="steps", lock_timeout=0.5) as op:
            op.result = op.step("s", lambda key: 2)
        took = time.monotonic() - sent
    finally:
        finish.set()
        timer.cancel()
        thread.join(15)
    assert took < 1.5, f"the duplicate queued {took:.1f}s behind the running attempt"
    assert lost and _orders() == 0


def test_steps_in_async_code() -> None:
    from asgiref.sync import async_to_sync

    async def run() -> Any:
        async def remote(key: str) -> str:
            return f"remote:{key[:8]}"

        async with idempotency_key("op-7", scope="steps", atomic=False) as op:
            local = await op.astep(
                "local", lambda key: Charge.objects.create(key="order:7", amount=1).pk
            )
            op.result = {"local": local, "remote": await op.astep("remote", remote)}
        return op.result

    result = async_to_sync(run)()
    assert result["local"] == Charge.objects.get().pk and result["remote"].startswith("remote:")


def test_an_async_step_awaits_what_a_plain_function_returns() -> None:
    """``lambda key: client.post(...)`` on an ``httpx.AsyncClient`` (the guide's "an
    ``httpx.AsyncClient`` call") is a plain function returning a coroutine: it ran in the sync
    thread, its coroutine was never awaited (the call never happened), and the step failed
    with "not JSON" about a coroutine object. The awaitable is awaited, in the step."""
    from asgiref.sync import async_to_sync

    sent: list[str] = []

    async def send(key: str) -> dict[str, str]:
        await asyncio.sleep(0)
        sent.append(key)
        return {"sent": key[:8]}

    async def run() -> Any:
        async with idempotency_key("op-lambda", scope="steps", atomic=False) as op:
            first = await op.astep("send", lambda key: send(key))
            again = await op.astep("send", lambda key: send(key))
            op.result = [first, again]
        return op.result

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "coroutine ... was never awaited"
        result = async_to_sync(run)()
    assert len(sent) == 1 and result == [{"sent": sent[0][:8]}] * 2


def test_a_sync_step_refuses_a_coroutine_before_recording_anything() -> None:
    """``step`` cannot await: a function returning a coroutine is refused by name, pointing
    to ``astep``, and the coroutine is closed (never run), so nothing is recorded."""

    async def send(key: str) -> str:
        return key

    with idempotency_key("op-sync-coroutine", scope="steps", atomic=False) as op:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with pytest.raises(TypeError, match=r"step 'send' .*coroutine.*astep"):
                op.step("send", lambda key: send(key))
        assert IdempotencyKey.objects.get(key="op-sync-coroutine").steps == {}
        assert op.step("send", lambda key: "sync") == "sync"  # not recorded: runs now


def test_a_step_that_ran_but_whose_result_is_not_json_never_runs_again() -> None:
    """Outside atomic mode a step's effects stay done when its result cannot be recorded (a
    set): the step was left unrecorded and the key given up, so every retry resumed at it and
    ran the effect again. It is recorded as run without a result, its database effects
    committed with that record, and a retry is refused at it instead of running it."""
    calls: list[str] = []

    def receipt(key: str) -> Any:
        calls.append("receipt")
        Charge.objects.create(key="receipt:u", amount=1)
        return {"sent", key}

    def run() -> Any:
        with idempotency_key("op-unrecorded", scope="steps", atomic=False) as op:
            if op.replayed:
                return op.result
            op.step("order", lambda key: _local(calls, "order:u"))
            op.result = op.step("receipt", receipt)
        return op.result

    with pytest.raises(IdempotencyResultNotRecorded, match=r"step 'receipt'.*'op-unrecorded'"):
        run()
    for _ in range(2):
        with pytest.raises(IdempotencyResultNotRecorded, match=r"step 'receipt'.*not run again"):
            run()
    assert calls == ["local", "receipt"], "a step ran again"
    assert Charge.objects.filter(key="receipt:u").count() == 1 and _orders() == 1
    assert IdempotencyKey.objects.get(key="op-unrecorded").state == "started"


def test_a_step_whose_result_is_not_json_rolls_back_with_an_atomic_attempt() -> None:
    """In atomic mode nothing of the attempt stays: the step's effects roll back with it, the
    key is freed, and the retry runs the step again (outside calls get the same derived key)."""
    keys: list[str] = []

    def run(result: Any) -> Any:
        def effect(key: str) -> Any:
            keys.append(key)
            Charge.objects.create(key="order:atomic", amount=1)
            return result

        with idempotency_key("op-unrecorded-atomic", scope="steps") as op:
            op.result = op.step("s", effect)
        return op.result

    with pytest.raises(TypeError, match="step 's'"):
        run({1})
    assert IdempotencyKey.objects.count() == 0 and _orders() == 0
    assert run([1]) == [1] and keys[0] == keys[1] and _orders() == 1


def test_a_view_made_of_steps_runs_them_once_and_replays(
    provider: Provider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROVIDER_ENV, provider.url)
    session = Client()
    session.force_login(_user())
    body = json.dumps({"order": "v1", "amount": 3})
    first, again = (
        session.post(
            "/idem/order-steps/", body, content_type="application/json", HTTP_IDEMPOTENCY_KEY="v-1"
        )
        for _ in range(2)
    )
    assert first.status_code == again.status_code == 201 and again["Idempotent-Replayed"]
    assert first.content == again.content
    assert provider.ledger()["effects"] == {"/charges": 1, "/emails": 1}


def test_an_async_view_made_of_steps_resumes_after_a_failed_step() -> None:
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    from tests.testapp import views_idempotency

    user = _user()
    views_idempotency.FAILURES["raise"] = 1
    views_idempotency.REMOTE_CALLS.clear()

    async def run() -> list[Any]:
        client = AsyncClient(raise_request_exception=False)
        await client.aforce_login(user)
        headers = {"Idempotency-Key": "a-1"}
        url = "/idem/async-steps/"
        return [await client.post(url, "{}", "application/json", headers=headers) for _ in "123"]

    failed, resumed, replayed = async_to_sync(run)()
    assert failed.status_code == 500 and resumed.status_code == 201
    assert replayed["Idempotent-Replayed"] == "true" and replayed.content == resumed.content
    assert _orders() == 1
    assert len(views_idempotency.REMOTE_CALLS) == 1, "the recorded remote step ran again"


def _user() -> Any:
    from tests.factories import UserFactory

    return UserFactory(username="steps")


# -- crashes between and inside steps, three front ends ------------------------------------------

# Between two steps, and inside one after its outside call (the Celery test takes "after-order").
POINTS = ["after-charge", "in-charge"]


def _assert_each_effect_once(provider: Provider, point: str) -> None:
    ledger = provider.ledger()
    assert ledger["effects"] == {"/charges": 1, "/emails": 1}, ledger
    by_path: dict[str, set[str]] = {}
    for call in ledger["received"]:
        by_path.setdefault(call["path"], set()).add(call["key"])
    assert all(len(keys) == 1 for keys in by_path.values()), "a step's key changed on retry"
    charges = [c for c in ledger["received"] if c["path"] == "/charges"]
    # Between steps the recorded charge is never called again; inside the step it is, with
    # the same key, and the provider answers it once.
    assert len(charges) == (2 if point == "in-charge" else 1), ledger
    assert _orders() == 1


def _paused(directory: Path, point: str, proc: Callable[[], bool]) -> None:
    marker = directory / f"paused-{point}"
    wait_until(lambda: marker.exists() or not proc(), 60, f"the worker to pause at {point}")
    assert (directory / f"paused-{point}").exists(), "the worker died before its pause point"


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("point", POINTS)
def test_an_operation_killed_at_a_step_resumes_in_the_next_process(
    point: str, provider: Provider, child_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**child_env, PROVIDER_ENV: provider.url}
    command = [sys.executable, "-m", "tests.steps_workflow", "o1"]
    paused_env = {**env, PAUSE_ENV: f"{point}:{tmp_path}"}
    victim = subprocess.Popen(command, env=paused_env, start_new_session=True)
    try:
        _paused(tmp_path, point, lambda: victim.poll() is None)
    finally:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
    retry = subprocess.run(command, env=env, capture_output=True, text=True, timeout=90)
    assert retry.returncode == 0, retry.stderr[-2000:]
    done = json.loads(retry.stdout)
    assert not done["replayed"] and done["result"]["charge"] == "ch_1"
    _assert_each_effect_once(provider, point)
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=90)
    assert json.loads(again.stdout) == {"replayed": True, "result": done["result"]}


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("point", ["after-charge", "in-charge"])
def test_a_view_killed_at_a_step_resumes_on_the_clients_retry(
    point: str, provider: Provider, child_env: dict[str, str], tmp_path: Path
) -> None:
    session = _session_cookie()
    env = {**child_env, PROVIDER_ENV: provider.url}
    paused_env = {**env, PAUSE_ENV: f"{point}:{tmp_path}"}
    first = Gunicorn(paused_env, tmp_path / "first.log", workers=1, threads=2).start()
    second: Gunicorn | None = None
    body = {"order": "w1", "amount": 9}
    client = threading.Thread(target=_quietly, args=(first.port, body, session), daemon=True)
    try:
        client.start()
        _paused(tmp_path, point, lambda: True)
        first.kill()
        client.join(30)
        second = Gunicorn(env, tmp_path / "second.log", workers=1, threads=2).start()
        retry = send(second.port, "/idem/order-steps/", "w-1", body, cookie=session)
        assert retry.status == 201 and not retry.replayed, retry.body
        _assert_each_effect_once(provider, point)
        again = send(second.port, "/idem/order-steps/", "w-1", body, cookie=session)
        assert again.replayed and again.body == retry.body
    finally:
        first.kill()
        if second is not None:
            second.stop()


def _quietly(port: int, body: dict[str, Any], cookie: str) -> None:
    """The first request, whose server is SIGKILLed under it on purpose."""
    with contextlib.suppress(OSError):
        send(port, "/idem/order-steps/", "w-1", body, cookie=cookie, timeout=150)


def _session_cookie() -> str:
    from importlib import import_module

    from django.conf import settings

    session = import_module(settings.SESSION_ENGINE).SessionStore()
    session.create()
    return f"{settings.SESSION_COOKIE_NAME}={session.session_key}"


@pytest.mark.slow
@pytest.mark.fault
def test_a_celery_task_killed_between_steps_resumes_on_redelivery(
    provider: Provider,
    celery_workers: Callable[..., Worker],
    redis_server: Any,
    tmp_path: Path,
) -> None:
    from tests.celery_app import place_order_once
    from tests.test_celery import broker_env, producer_on

    queue, point = new_queue(), "after-order"
    extra = {**broker_env(redis_server.url, visibility=2), PROVIDER_ENV: provider.url}
    victim = celery_workers(
        [queue], name="a", extra_env={**extra, PAUSE_ENV: f"{point}:{tmp_path}"}
    )
    victim.wait_ready()
    with producer_on(redis_server.url) as producer:
        result = place_order_once.apply_async(("t1", 7), queue=queue, producer=producer)
    _paused(tmp_path, point, lambda: victim.proc.poll() is None)
    victim.kill()
    celery_workers([queue], name="b", extra_env=extra).wait_ready()
    done = result.get(timeout=90)
    assert done["charge"] == "ch_1" and done["email"] == "em_1"
    _assert_each_effect_once(provider, point)


def test_a_step_of_an_attempt_nested_in_a_transaction_commits_with_it() -> None:
    """Inside a caller's transaction a step is a savepoint: nothing commits before it does."""
    with transaction.atomic():
        with idempotency_key("op-8", scope="steps", atomic=False) as op:
            op.result = op.step("local", lambda key: _local([], "order:8"))
        assert connection.in_atomic_block
    assert _orders() == 1


def test_an_operations_step_is_recorded_under_that_operation_inside_another() -> None:
    with idempotency_key("outer", scope="steps", atomic=False) as outer:
        with idempotency_key("inner", scope="steps", atomic=False) as inner:
            outer.step("s", lambda key: 1)
            inner.result = 2
        assert IdempotencyKey.objects.get(key="outer").steps == {"s": 1}
        outer.result = 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("url", ["/idem/lost-at-a-step/", "/idem/alost-at-a-step/"])
def test_a_view_whose_step_finds_its_key_taken_over_answers_409(url: str) -> None:
    """The documented answer to a request that ran past its lock (``IdempotencyKeyLost``) is a
    409 problem, as when the key is found lost at the end of the view; found lost while a step
    recorded, the exception left the view and the client got a bare 500 page."""
    client = identified(Client())
    response = post(client, url, "k-lost-step")
    assert response.status_code == 409, response.content[:200]
    assert problem_type(response) == "idempotency-key-in-progress"
    assert Charge.objects.count() == 0  # the attempt's effects rolled back


@pytest.mark.parametrize(
    "result", [float("nan"), float("inf"), {"v": "a\x00b"}, "\ud800", ["ok", "\\u0000"]]
)
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "not_atomic"])
def test_a_step_result_jsonb_would_refuse_is_a_type_error_not_a_lost_key(
    result: object, atomic: bool
) -> None:
    """NaN and infinities (which Python writes as JSON), a NUL and an unpaired surrogate
    (which jsonb refuses) failed the step's write with SQLSTATE 22P02, the code the owned
    write raises on purpose for a key taken over: reported as ``IdempotencyKeyLost`` (and a
    ``conflict`` signal). Refused before the write, with the step named; a backslash
    followed by ``u0000`` is text, not a NUL, and is recorded."""
    with idempotency_key("op-jsonb", scope="steps", atomic=atomic):
        if isinstance(result, list):
            assert step("text", lambda key: result) == result
            return
        with pytest.raises(TypeError, match="step 'bad'"):
            step("bad", lambda key: result)
