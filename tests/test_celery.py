"""Celery integration against a real Redis broker and real prefork ``celery worker`` processes.

No ``task_always_eager``, no in-memory broker: each test starts its workers as subprocesses
(:mod:`tests.celery_workers`), sends tasks through Redis, and checks what the bodies recorded in
the database (:mod:`tests.celery_app`), including the shared fenced-register history checker.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
import redis
from celery import Task, chain, group
from celery.result import AsyncResult
from django.conf import settings

from devservers import RedisServer
from idempotency.http import digest
from idempotency.models import IdempotencyKey
from idempotency.store import begin
from leases import acquire
from leases.backends import get_backend
from leases.celery import SKIPPED, partition_for, partition_queues, resign_leaderships
from leases.celery.leader import LEADER_HEADER
from leases.election import elect, leader_of
from leases.errors import BackendUnavailable, LeaseUnavailable
from tests.celery_app import (
    BACKENDS,
    LOCKED_WRITE,
    SINGLETON_HOLD,
    SingletonFailed,
    add_once,
    app,
    idempotent_failing,
    keyed_locked_once,
    leader_tick,
    limited_write,
    locked_failing,
    locked_retrying,
    locked_skip,
    locked_slow,
    locked_until_lost,
    partitioned_touch,
    retries_seen,
    singleton_failing,
    singleton_hold,
    singleton_late,
    singleton_retrying,
    singleton_strict,
    singleton_strict_twin,
)
from tests.celery_workers import Worker, celery_workers_fixture, new_queue  # noqa: F401
from tests.checker import check_history, history, new_register
from tests.testapp.models_celery import Delivery, Effect, TaskRun
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]

DONE = {"SUCCESS", "FAILURE", SKIPPED}


def wait_states(results: Iterable[AsyncResult[Any]], timeout: float = 60) -> list[str]:
    """The final states of ``results`` (SKIPPED counts as final), polling until ``timeout``."""
    pending = list(results)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states: list[str] = [r.state for r in pending]
        if all(s in DONE for s in states):
            return states
        time.sleep(0.1)
    raise AssertionError(f"tasks not done in {timeout}s: {[r.state for r in pending]}")


def tokens(runs: Iterable[TaskRun]) -> list[int]:
    """The fencing tokens runs held, in the given order (every locked run has one)."""
    return [r.token for r in runs if r.token is not None]


def assert_runs_never_overlap(runs: list[TaskRun]) -> None:
    """Body runs (database clock) form a sequence: each starts after the previous one ended."""
    ordered = sorted(runs, key=lambda r: r.started_at)
    for before, after in itertools.pairwise(ordered):
        assert before.ended_at is not None, f"{before} never ended"
        assert after.started_at >= before.ended_at, f"{after} started while {before} still ran"


def ready(start: Callable[..., Worker], *specs: dict[str, Any]) -> list[Worker]:
    """Start several workers at once, then wait until each consumes."""
    workers = [start(**spec) for spec in specs]
    return [worker.wait_ready() for worker in workers]


@pytest.fixture(params=["redis", "amqp"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """The session Redis, then RabbitMQ (``amqp_url``: configured, or started on first use)."""
    if request.param == "redis":
        return str(settings.CELERY_BROKER_URL)
    return str(request.getfixturevalue("amqp_url"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_locked_bodies_never_overlap_and_all_complete(
    celery_workers: Callable[..., Worker], broker_url: str, backend: str
) -> None:
    task = LOCKED_WRITE[backend]
    queue = new_queue()
    extra = {"LEASES_TEST_BROKER_URL": broker_url}
    ready(celery_workers, *({"queues": [queue], "name": n, "extra_env": extra} for n in "ab"))
    register = new_register("celery-locked")

    with producer_on(broker_url) as producer:
        results = [task.apply_async((register, 0.05), queue=queue, producer=producer)
                   for _ in range(20)]  # fmt: skip

    assert [r.get(timeout=90) for r in results] == [True] * 20  # every closing write accepted
    runs = list(TaskRun.objects.filter(label=register))
    assert len(runs) == 20
    assert {r.worker.split(":")[0] for r in runs} == {"a", "b"}, "both workers ran bodies"
    assert_runs_never_overlap(runs)
    summary = check_history(register, tokens(sorted(runs, key=lambda r: r.started_at)))
    assert summary.accepted == 40


def test_a_limited_task_runs_at_most_limit_bodies_at_once(
    celery_workers: Callable[..., Worker],
) -> None:
    """``locked_task(limit=2)`` on three worker processes: by the runs' database clock never
    more than two bodies at once, and each slot's register passes the checker."""
    queue = new_queue()
    ready(celery_workers, {"queues": [queue], "name": "a", "concurrency": 3})
    register = new_register("celery-limited")
    results = [limited_write.apply_async((register, 0.2), queue=queue) for _ in range(9)]
    assert [r.get(timeout=90) for r in results] == [True] * 9
    runs = sorted(
        TaskRun.objects.filter(label__startswith=f"{register}/"), key=lambda r: r.started_at
    )
    assert len(runs) == 9 and {r.label for r in runs} <= {f"{register}/0", f"{register}/1"}
    for slot in {r.label for r in runs}:
        slot_runs = [r for r in runs if r.label == slot]
        assert_runs_never_overlap(slot_runs)
        check_history(slot, tokens(slot_runs))
    starts = [(r.started_at, 1) for r in runs] + [(r.ended_at, -1) for r in runs]
    at_once = list(
        itertools.accumulate(step for _, step in sorted(starts, key=lambda e: (e[0], e[1])))
    )
    assert max(at_once) <= 2


def test_locked_skip_is_reported_as_skipped(celery_workers: Callable[..., Worker]) -> None:
    queue = new_queue()
    ready(celery_workers, {"queues": [queue], "name": "a"}, {"queues": [queue], "name": "b"})
    register = new_register("celery-skip")

    results = [locked_skip.apply_async((register, 1.0), queue=queue) for _ in range(4)]
    states = wait_states(results)

    assert set(states) == {"SUCCESS", SKIPPED}, states
    ran = TaskRun.objects.filter(label=register)
    assert ran.count() == states.count("SUCCESS")
    skipped = [r for r in results if r.state == SKIPPED]
    assert all("busy" in r.info["reason"] for r in skipped)
    assert_runs_never_overlap(list(ran))
    check_history(register)


def test_locked_retry_is_not_blocked_by_its_own_attempt(
    celery_workers: Callable[..., Worker],
) -> None:
    queue = new_queue()
    ready(celery_workers, {"queues": [queue]})
    register = new_register("celery-retry")

    # on_busy="raise": had the retry found its own earlier attempt's lease, it would fail
    assert locked_retrying.apply_async((register,), queue=queue).get(timeout=60) == 1
    check_history(register)


def test_lost_lease_mid_task_fails_the_task_and_its_later_fenced_write(
    celery_workers: Callable[..., Worker],
) -> None:
    queue = new_queue()
    ready(celery_workers, {"queues": [queue]})
    register = new_register("celery-lost")

    result = locked_until_lost.apply_async((register,), queue=queue)

    assert wait_states([result]) == ["FAILURE"]
    assert type(result.result).__name__ == "LeaseLost"
    outcomes = [a.outcome for a in history(register)]
    assert outcomes[:2] == ["accepted", "accepted"] and outcomes[-1] in ("lost", "stale"), outcomes
    check_history(register)
    # on_lost runs on the worker's keepalive thread after ``lost`` is set (the order the
    # keepalive documents), so the task may fail before the callback's row is written: once,
    # on a loaded machine, this looked before it was.
    wait_until(
        lambda: TaskRun.objects.filter(label=f"lost:celery-test:{register}").exists(),
        15,
        "the on_lost callback's row",
    )
    assert get_backend().inspect("celery-test:" + register).token > min(  # type: ignore[union-attr]
        r.token or 0 for r in TaskRun.objects.filter(label=register)
    )


# -- retry budgets: waiting for a busy lease or key never spends the body's own ---------------


def test_busy_retries_leave_the_bodys_retries_and_budget_alone(
    celery_workers: Callable[..., Worker],
) -> None:
    """Busy retries spent ``request.retries``: a task with ``max_retries=3`` that found its lease
    busy twice saw ``retries == 2`` on its first body run and got one body retry, not three."""
    queue, label = new_queue(), new_register("busy-budget")
    celery_workers([queue]).wait_ready()
    holder = acquire(f"celery-test:{label}", ttl=30)
    result = locked_failing.apply_async((label,), queue=queue)
    try:
        wait_until(lambda: len(deliveries(result.id)) >= 3, 30, "two busy retries")
    finally:
        holder.release()
    assert wait_states([result]) == ["FAILURE"]
    assert isinstance(result.result, ConnectionError), result.result
    assert retries_seen(label) == [0, 1, 2, 3]  # the first run and max_retries=3 retries


def test_in_flight_retries_leave_the_bodys_retries_and_budget_alone(
    celery_workers: Callable[..., Worker],
) -> None:
    """The same for an idempotent task whose key another copy holds: its in-flight retries
    spent the retry budget its body's ``autoretry_for`` counts on."""
    queue, label = new_queue(), new_register("in-flight-budget")
    celery_workers([queue]).wait_ready()
    scope = idempotent_failing.idempotency_scope()
    fingerprint = digest([idempotent_failing.fingerprint((label,), {}).encode()])
    begin(scope, label, fingerprint, ttl=60, lock_timeout=60)  # another copy runs this key
    result = idempotent_failing.apply_async((label,), queue=queue)
    try:
        wait_until(lambda: len(deliveries(result.id)) >= 3, 30, "two in-flight retries")
    finally:
        IdempotencyKey.objects.filter(scope=scope, key=label).delete()  # that copy gives up
    assert wait_states([result]) == ["FAILURE"]
    assert isinstance(result.result, ConnectionError), result.result
    assert retries_seen(label) == [0, 1, 2, 3]


def test_an_idempotent_task_with_a_lease_locks_each_key_apart(
    celery_workers: Callable[..., Worker],
) -> None:
    """``idempotent_task(base=LockedTask)`` took one lease named after the task: two keys never
    ran at once. Now two keys run side by side, each under its own lease, and a second call
    of a key (another task id) returns the first's result without running."""
    queue, label = new_queue(), new_register("keyed")
    celery_workers([queue], concurrency=3).wait_ready()
    first = keyed_locked_once.apply_async((label, 1, 2.0), queue=queue)
    other = keyed_locked_once.apply_async((label, 2, 2.0), queue=queue)
    again = keyed_locked_once.apply_async((label, 1, 2.0), queue=queue)
    scope = keyed_locked_once.idempotency_scope()
    assert [r.get(timeout=60) for r in (first, other, again)] == [
        f"{scope}:{label}:1",
        f"{scope}:{label}:2",
        f"{scope}:{label}:1",
    ]
    runs = list(TaskRun.objects.filter(label=label).order_by("sender"))  # key 1's, then 2's
    assert len(runs) == 2, [(r.sender, r.task_id) for r in runs]
    one, two = runs
    # Key 1 ran once, under whichever of its two calls a worker process took first (three
    # processes take the three messages at once, in no set order); the other replayed it.
    assert one.task_id in (first.id, again.id) and two.task_id == other.id
    assert one.ended_at is not None and two.ended_at is not None
    assert one.started_at < two.ended_at and two.started_at < one.ended_at, "the keys ran apart"


# -- redelivery: a killed worker, a visibility timeout shorter than the task -------------------


@contextlib.contextmanager
def producer_on(url: str) -> Iterator[Any]:
    """A producer on a broker of the test's own (the app's default broker is the shared one)."""
    with app.connection_for_write(url) as connection:
        yield app.amqp.Producer(connection)


def broker_env(url: str, visibility: float) -> dict[str, str]:
    return {"LEASES_TEST_BROKER_URL": url, "LEASES_TEST_VISIBILITY_TIMEOUT": str(visibility)}


def claimed(task_id: str) -> bool:
    return IdempotencyKey.objects.filter(scope=f"celery:{add_once.name}", key=task_id).exists()


def deliveries(task_id: str) -> list[Delivery]:
    return list(Delivery.objects.filter(task_id=task_id))


def settle(*task_ids: str, dead: str = "-", quiet: float = 1.5, timeout: float = 60) -> None:
    """Wait until every delivered copy of the tasks finished and no new copy came for ``quiet`` s.

    A task's result is ready when one copy succeeds, while redelivered copies may still run.
    Copies delivered to the killed worker ``dead`` never finish and are not waited for.
    """
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        copies = Delivery.objects.filter(task_id__in=task_ids).exclude(worker__startswith=dead)
        count, running = copies.count(), copies.filter(finished_at=None).exists()
        if count != last or running:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.1)
    raise AssertionError(f"copies of {task_ids} still arriving or running after {timeout}s")


@pytest.mark.fault
def test_killed_worker_task_runs_elsewhere_after_lease_expiry_and_effect_once(
    celery_workers: Callable[..., Worker], redis_server: RedisServer
) -> None:
    queue, register, effect = new_queue(), new_register("celery-kill"), new_register("effect")
    Effect.objects.create(name=effect)
    extra = broker_env(redis_server.url, visibility=3)
    victim = celery_workers([queue], name="a", concurrency=2, extra_env=extra).wait_ready()
    with producer_on(redis_server.url) as producer:
        locked = locked_slow.apply_async((register, 60.0), queue=queue, producer=producer)
        once = add_once.apply_async((effect, 60.0), queue=queue, producer=producer)
    wait_until(lambda: TaskRun.objects.filter(label=register).exists() and claimed(once.id),
               30, "both bodies to start on the first worker")  # fmt: skip
    rescuer = celery_workers([queue], name="b", concurrency=2, extra_env=extra)
    victim.kill()
    expired_at = get_backend().inspect(f"celery-test:{register}").expires_at  # type: ignore[union-attr]
    rescuer.wait_ready()

    assert locked.get(timeout=60) is True, rescuer.tail()
    assert once.get(timeout=60) == 1
    settle(locked.id, once.id, dead="a:")
    runs = list(TaskRun.objects.filter(label=register))
    first, later = runs[0], runs[1:]
    assert first.worker.startswith("a:") and first.ended_at is None  # killed mid-body
    assert later and all(r.worker.startswith("b:") for r in later)
    assert expired_at is not None
    assert all(r.started_at >= expired_at for r in later), "took over before the lease expired"
    assert all(r.token > first.token for r in later)  # type: ignore[operator]
    assert_runs_never_overlap(later)
    check_history(register, tokens(runs))
    assert Effect.objects.get(name=effect).count == 1
    assert {d.worker[0] for d in deliveries(once.id)} == {"a", "b"}


@pytest.mark.fault
def test_visibility_timeout_duplicate_runs_concurrently_locked_apart_and_applied_once(
    celery_workers: Callable[..., Worker], redis_server: RedisServer
) -> None:
    queue, register, effect = new_queue(), new_register("celery-vis"), new_register("effect")
    Effect.objects.create(name=effect)
    extra = broker_env(redis_server.url, visibility=1.5)
    ready(celery_workers, *({"queues": [queue], "name": n, "concurrency": 2, "extra_env": extra}
                            for n in "ab"))  # fmt: skip
    with producer_on(redis_server.url) as producer:
        locked = locked_slow.apply_async((register, 5.0), queue=queue, producer=producer)
        once = add_once.apply_async((effect, 5.0), queue=queue, producer=producer)

    assert locked.get(timeout=60) is True
    assert once.get(timeout=60) == 1
    settle(locked.id, once.id)
    runs = list(TaskRun.objects.filter(label=register))
    assert len(runs) >= 2, "the duplicate ran after the first copy released the lease"
    for task_id, body_ended in ((locked.id, runs[0].ended_at),
                                (once.id, TaskRun.objects.get(label=effect).ended_at)):  # fmt: skip
        copies = deliveries(task_id)
        assert len(copies) >= 2 and copies[1].at < body_ended, (  # type: ignore[operator]
            f"no duplicate delivered while the first copy ran: {copies}"
        )
    assert_runs_never_overlap(runs)
    check_history(register, tokens(runs))
    assert Effect.objects.get(name=effect).count == 1
    assert TaskRun.objects.filter(label=effect).count() == 1


# -- singleton, partitioned, leader-only -------------------------------------------------------


def broker() -> Any:
    return redis.Redis.from_url(settings.CELERY_BROKER_URL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_singleton_50_concurrent_delays_queue_one_task(backend: str) -> None:
    queue, name, task = new_queue(), new_register("single"), SINGLETON_HOLD[backend]
    try:
        with ThreadPoolExecutor(max_workers=10) as pool:
            ids = list(pool.map(lambda _: task.apply_async((name, 0), queue=queue).id,
                                range(50)))  # fmt: skip
        assert len(set(ids)) == 1
        assert broker().llen(queue) == 1
    finally:
        broker().delete(queue)


def test_singleton_duplicate_raises_when_configured_to() -> None:
    queue, name = new_queue(), new_register("strict")
    try:
        first = singleton_strict.apply_async((name,), queue=queue)
        with pytest.raises(LeaseUnavailable, match=first.id):
            singleton_strict.apply_async((name,), queue=queue)
        assert broker().llen(queue) == 1
    finally:
        broker().delete(queue)


def test_two_singleton_tasks_with_the_same_key_are_guarded_apart() -> None:
    queue, name = new_queue(), new_register("twins")
    try:
        first = singleton_strict.apply_async((name,), queue=queue)
        twin = singleton_strict_twin.apply_async((name,), queue=queue)
        assert first.id != twin.id and broker().llen(queue) == 2
    finally:
        broker().delete(queue)


def test_a_duplicate_singleton_inside_a_group_is_refused_not_left_hanging() -> None:
    """A group freezes each call's task id; another task's result cannot stand in for it."""
    queue, name = new_queue(), new_register("canvas")
    try:
        with pytest.raises(LeaseUnavailable, match="inside a group, chord or chain"):
            group(singleton_hold.s(name, 0), singleton_hold.s(name, 0)).apply_async(queue=queue)
    finally:
        broker().delete(queue)


def test_a_singleton_message_without_its_guard_is_skipped_beside_the_guarded_copy(
    celery_workers: Callable[..., Worker],
) -> None:
    """``send_task`` (or a beat sending by name) sends no guard, and the worker ran such a
    message without looking at the guard, beside the guarded copy of the same key."""
    queue, name = new_queue(), new_register("single-sendtask")
    celery_workers([queue], concurrency=2).wait_ready()
    first = singleton_hold.apply_async((name, 4.0), queue=queue)
    wait_until(lambda: TaskRun.objects.filter(label=name).exists(), 30, "the first run")
    other = app.send_task(singleton_hold.name, (name, 0.5), queue=queue)
    assert wait_states([first, other]) == ["SUCCESS", SKIPPED]
    assert [r.task_id for r in TaskRun.objects.filter(label=name)] == [first.id]


def test_a_singleton_retry_takes_the_guard_again_and_runs(
    celery_workers: Callable[..., Worker],
) -> None:
    queue, name = new_queue(), new_register("single-retry")
    celery_workers([queue]).wait_ready()
    assert singleton_retrying.apply_async((name,), queue=queue).get(timeout=60) == 1
    assert TaskRun.objects.filter(label=name).count() == 2


@pytest.mark.fault
def test_a_redelivered_singleton_whose_guard_expired_never_runs_beside_a_newer_copy(
    celery_workers: Callable[..., Worker], redis_server: RedisServer
) -> None:
    """``acks_late`` and a worker SIGKILLed mid-body: the guard frees within its TTL, a new
    ``delay()`` queues copy B, then the broker redelivers the killed copy A, whose guard cannot
    be adopted any more; A ran anyway, unguarded, beside B. Now a copy that finds the guard
    taken ends SKIPPED (or is dropped, when it is a redelivery of the copy that holds it)."""
    queue, name = new_queue(), new_register("single-redeliver")
    guard, store = singleton_late.singleton_name((name, 6.0), {}), get_backend()
    extra = broker_env(redis_server.url, visibility=4)
    victim = celery_workers([queue], name="a", extra_env=extra).wait_ready()
    with producer_on(redis_server.url) as producer:
        a = singleton_late.apply_async((name, 6.0), queue=queue, producer=producer)
    wait_until(lambda: TaskRun.objects.filter(task_id=a.id).exists(), 30, "A to start")
    victim.kill()
    ttl = singleton_late.singleton_ttl or 0.0
    wait_until(lambda: not (info := store.inspect(guard)) or not info.held, ttl + 10,
               "the dead worker's guard to expire")  # fmt: skip
    with producer_on(redis_server.url) as producer:
        b = singleton_late.apply_async((name, 6.0), queue=queue, producer=producer)
    assert b.id != a.id
    celery_workers([queue], name="b", concurrency=2, extra_env=extra).wait_ready()
    wait_until(lambda: TaskRun.objects.filter(label=name, worker__startswith="b:").exists(),
               60, "a copy to run on b")  # fmt: skip
    settle(a.id, b.id, dead="a:", timeout=90)
    runs = list(TaskRun.objects.filter(label=name, worker__startswith="b:"))
    assert_runs_never_overlap(runs)
    assert set(wait_states([a, b])) <= {"SUCCESS", SKIPPED}


@pytest.mark.fault
def test_a_singleton_redelivered_while_it_runs_never_runs_twice_at_once(
    celery_workers: Callable[..., Worker], redis_server: RedisServer
) -> None:
    """``acks_late`` and a visibility timeout shorter than the body: the broker hands the
    running task to a second worker. That copy carries the same guard, which it adopted (a
    renewal with the sender's secret, as good as the first copy's), and ran beside it. Now it
    waits for the run lease, and finding the guard released by the copy that ran, is dropped."""
    queue, name = new_queue(), new_register("single-visible")
    extra = broker_env(redis_server.url, visibility=1.5)
    ready(celery_workers, *({"queues": [queue], "name": n, "concurrency": 2, "extra_env": extra}
                            for n in "ab"))  # fmt: skip
    with producer_on(redis_server.url) as producer:
        sent = singleton_late.apply_async((name, 5.0), queue=queue, producer=producer)
    assert sent.get(timeout=60) is None
    settle(sent.id, timeout=90)
    copies = deliveries(sent.id)
    runs = list(TaskRun.objects.filter(label=name))
    assert len(copies) >= 2 and copies[1].at < runs[0].ended_at, (  # type: ignore[operator]
        f"no duplicate delivered while the first copy ran: {copies}"
    )
    # Only overlapping is wrong: a copy the broker still holds when the first has ended (and
    # released the guard) is a new run, as any redelivery after the work is (at least once).
    assert_runs_never_overlap(runs)


@pytest.mark.fault
def test_a_singleton_redelivered_at_once_after_its_worker_died_runs_once_the_run_lease_lapses(
    celery_workers: Callable[..., Worker], amqp_url: str
) -> None:
    """RabbitMQ hands an ``acks_late`` message on as soon as its worker's connection drops,
    while the dead worker's guard and run lease are still valid: the copy adopts the guard,
    waits for the dead run's lease to lapse (it is no longer renewed), and runs: it is not
    taken for a copy beside a live run and dropped."""
    queue, name = new_queue(), new_register("single-rerun")
    extra = {"LEASES_TEST_BROKER_URL": amqp_url}
    victim = celery_workers([queue], name="a", extra_env=extra).wait_ready()
    with producer_on(amqp_url) as producer:
        sent = singleton_late.apply_async((name, 8.0), queue=queue, producer=producer)
    wait_until(lambda: TaskRun.objects.filter(task_id=sent.id).exists(), 30, "the first run")
    rescuer = celery_workers([queue], name="b", extra_env=extra).wait_ready()
    victim.kill()
    assert sent.get(timeout=60) is None, rescuer.tail()
    runs = list(TaskRun.objects.filter(label=name))
    assert [r.worker[0] for r in runs] == ["a", "b"] and runs[0].ended_at is None
    assert_runs_never_overlap(runs[1:])


@pytest.mark.parametrize("canvas", ["chain", "link", "link_error"])
def test_a_duplicate_singleton_carrying_more_work_is_refused_not_dropped(canvas: str) -> None:
    """Only groups and chords were refused: a duplicate at the head of a chain (or with
    callbacks) returned the first copy's result, and the chain's tail, which rides in the
    message never sent, was silently dropped; ``chain.apply_async()`` then returned the
    tail's frozen result, which nothing would ever complete."""
    queue, name, follow = new_queue(), new_register("chainhead"), new_register("follow")
    head, tail = singleton_hold.s(name, 0), singleton_strict.si(follow)
    try:
        first = singleton_hold.apply_async((name, 0), queue=queue)
        with pytest.raises(LeaseUnavailable, match=f"{first.id}.*{canvas}"):
            if canvas == "chain":
                chain(head, tail).apply_async(queue=queue)
            else:
                callbacks: dict[str, Any] = {canvas: tail}
                head.apply_async(queue=queue, **callbacks)
        assert broker().llen(queue) == 1
    finally:
        broker().delete(queue)


def test_a_singleton_whose_send_fails_raises_its_own_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The send's error (here the eager body's own) left ``apply_async`` through the release of
    the guard, and an error of that release (the store gone, or the guard the run had already
    released taken by another) replaced it: the caller saw a lease error, not what failed."""

    def release(self: Any, grant: Any) -> None:
        raise BackendUnavailable("default", "gone while the task was sent")

    monkeypatch.setattr(type(get_backend()), "release", release)
    before = app.conf.task_always_eager, app.conf.task_eager_propagates
    app.conf.task_always_eager = app.conf.task_eager_propagates = True
    try:
        with pytest.raises(SingletonFailed):
            singleton_failing.delay(new_register("eager"))
    finally:
        app.conf.task_always_eager, app.conf.task_eager_propagates = before


def test_singleton_guard_frees_within_its_ttl_after_worker_sigkill(
    celery_workers: Callable[..., Worker],
) -> None:
    queue, name, ttl = new_queue(), new_register("single"), singleton_hold.singleton_ttl or 0.0
    worker = celery_workers([queue]).wait_ready()
    try:
        first = singleton_hold.apply_async((name, 60.0), queue=queue)
        wait_until(lambda: TaskRun.objects.filter(label=name).exists(), 30, "the run to start")
        time.sleep(ttl + 0.5)  # past the sender's grant: the running worker keeps it alive
        assert singleton_hold.apply_async((name, 0), queue=queue).id == first.id

        worker.kill()
        killed = time.monotonic()
        again = first
        while again.id == first.id and time.monotonic() - killed < ttl + 5:
            again = singleton_hold.apply_async((name, 0), queue=queue)
            time.sleep(0.05)
        assert again.id != first.id
        slack = 1.5  # the polling loop's own latency on a loaded machine
        assert time.monotonic() - killed <= ttl + slack, "the guard outlived its TTL"
    finally:
        broker().delete(queue)


def test_partitioned_routes_one_key_to_one_queue_and_spreads_keys(python: str) -> None:
    queues = partition_queues(partitioned_touch)
    keys = [f"account-{n}" for n in range(30)]
    broker().delete(*queues)
    try:
        for key in [*keys, *keys, *["account-7"] * 5]:
            partitioned_touch.delay(key)
        seen: dict[str, set[str]] = {}
        for queue in queues:
            for raw in broker().lrange(queue, 0, -1):
                key = json.loads(raw)["headers"]["argsrepr"].strip("(),'")
                seen.setdefault(key, set()).add(queue)
        assert set(seen) == set(keys)
        assert all(len(found) == 1 for found in seen.values()), seen
        assert all(broker().llen(q) > 0 for q in queues), "a partition got no key"
        assert all(seen[k] == {queues[partition_for(k, 3)]} for k in keys)
        other = subprocess.run(  # another process, another hash seed: same partitions
            [python, "-c", "import sys; from leases.celery.partition import partition_for; "
             "print([partition_for(k, 3) for k in sys.argv[1:]])", *keys],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert json.loads(other.stdout) == [partition_for(k, 3) for k in keys]
    finally:
        broker().delete(*queues)


def test_leader_only_is_sent_only_by_the_leader() -> None:
    queue, election = new_queue(), leader_tick.election()
    rival: list[Any] = []
    thread = threading.Thread(target=lambda: rival.append(elect(election, ttl=5, timeout=0)))
    thread.start()
    thread.join(30)
    try:
        skipped = leader_tick.apply_async(("tick",), queue=queue)
        assert skipped.state == SKIPPED and broker().llen(queue) == 0
        rival[0].resign()
        sent = leader_tick.apply_async(("tick",), queue=queue)
        assert sent.state == "PENDING" and broker().llen(queue) == 1
        message = json.loads(broker().lindex(queue, 0))
        leader = leader_of(election)
        assert leader is not None and message["headers"][LEADER_HEADER] == leader.token
    finally:
        resign_leaderships()
        broker().delete(queue)


def test_leader_only_worker_skips_a_message_from_a_deposed_leader(
    celery_workers: Callable[..., Worker],
) -> None:
    queue, election, label = new_queue(), leader_tick.election(), new_register("tick")
    celery_workers([queue]).wait_ready()
    try:
        current = leader_tick.apply_async((label,), queue=queue)
        assert wait_states([current]) == ["SUCCESS"]
        stale_token = leader_of(election).token  # type: ignore[union-attr]
        resign_leaderships()
        successor: list[Any] = []
        thread = threading.Thread(target=lambda: successor.append(elect(election, ttl=5)))
        thread.start()
        thread.join(30)
        # a beat paused past its lease wakes up and sends with the token it had
        stale = Task.apply_async(leader_tick, (label,), queue=queue,
                                 headers={LEADER_HEADER: str(stale_token)})  # fmt: skip

        assert wait_states([stale]) == [SKIPPED]
        assert "former leader" in stale.info["reason"]
        assert TaskRun.objects.filter(label=label).count() == 1
    finally:
        resign_leaderships()
        for leadership in successor:
            leadership.resign()


@pytest.mark.fault
def test_leader_only_worker_skips_messages_without_a_valid_leader_token(
    celery_workers: Callable[..., Worker],
) -> None:
    """send_task, a beat sending by name, a header of 0: none shows it came from the leader."""
    queue, label = new_queue(), new_register("untokened")
    celery_workers([queue]).wait_ready()
    try:
        unstamped = [
            Task.apply_async(leader_tick, (label,), queue=queue),
            Task.apply_async(  # a header of 0, not the str Celery's stubs expect
                leader_tick,
                (label,),
                queue=queue,
                headers=cast("dict[str, str]", {LEADER_HEADER: 0}),
            ),
            Task.apply_async(leader_tick, (label,), queue=queue, headers={LEADER_HEADER: "x"}),
            app.send_task(leader_tick.name, (label,), queue=queue),
        ]
        assert wait_states(unstamped) == [SKIPPED] * len(unstamped)
        assert all("without a leadership token" in r.info["reason"] for r in unstamped)
        assert not TaskRun.objects.filter(label=label).exists()
    finally:
        resign_leaderships()


def test_two_beats_send_each_tick_once_and_the_survivor_leads_after_a_sigkill(
    celery_workers: Callable[..., Worker],
) -> None:
    queue, label, election = new_queue(), new_register("beat"), leader_tick.election()
    celery_workers([queue]).wait_ready()
    env = {"LEASES_TEST_BEAT_QUEUE": queue, "LEASES_TEST_BEAT_LABEL": label}
    beats = [celery_workers(name=f"beat-{n}", extra_env=env) for n in "xy"]
    for beat in beats:
        beat.wait_ready()
    ticks = TaskRun.objects.filter(label=label)
    wait_until(lambda: ticks.count() >= 6, 30, "ticks for 3 s")

    leader = leader_of(election)
    assert leader is not None
    victim = next(b for b in beats if b.proc.pid == leader.pid)
    survivor = next(b for b in beats if b is not victim)
    senders = {t.sender for t in ticks}
    assert senders == {f"{victim.role}:{leader.pid}"}, (
        f"ticks sent by {senders}: not only the leader"
    )
    assert {t.token for t in ticks} == {leader.token}

    victim.kill()
    killed = time.monotonic()
    later = ticks.exclude(token=leader.token)
    wait_until(later.exists, 20, "the survivor's ticks")
    assert time.monotonic() - killed <= leader_tick.leader_ttl + 3  # type: ignore[operator]
    assert {t.sender for t in later} == {f"{survivor.role}:{survivor.proc.pid}"}
    successor = leader_of(election)
    assert successor is not None and successor.token > leader.token
    assert successor.pid == survivor.proc.pid
