"""Celery's own ways of killing a task, against real prefork workers on a broker the test owns.

A hard ``time_limit`` kills the pool child; a child lost mid-body (the OOM killer) is either
redelivered (``task_reject_on_worker_lost=True``) or failed (``False``); a broker restart drops
every unacknowledged message back into the queue while its first copy still runs. In every
case the effect is applied at most once (exactly once when the task is redelivered), the
fenced register's history is clean, and no lease or idempotency claim stays stuck: the next
holder gets in within the lease's TTL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from celery.result import AsyncResult

from devservers import RedisServer
from idempotency.models import IdempotencyKey
from tests.celery_app import (
    _LEASE_TTL,
    ADD_ONCE_DYING,
    LOCKED_DYING,
    add_once,
    app,
    locked_past_time_limit,
    locked_slow,
    locked_write,
)
from tests.celery_workers import Worker, celery_workers_fixture, new_queue  # noqa: F401
from tests.checker import check_history, new_register
from tests.rabbitmq_server import RabbitMQServer, rabbitmq_binary
from tests.test_celery import (
    assert_runs_never_overlap,
    broker_env,
    claimed,
    deliveries,
    producer_on,
    settle,
    tokens,
)
from tests.testapp.models_celery import Delivery, Effect, TaskRun
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.fault, pytest.mark.slow]

#: Seconds allowed, beyond the TTL, for a freed lease to be taken on a loaded machine.
SLACK = 10


def no_new_copies(*task_ids: str, quiet: float = 1.5, timeout: float = 30) -> None:
    """Wait until no new copy of the tasks was delivered for ``quiet`` seconds (copies given to
    a child that died never finish, so :func:`~tests.test_celery.settle` cannot be used)."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"copies of {task_ids} still arriving"
        count = Delivery.objects.filter(task_id__in=task_ids).count()
        if count != last:
            last, since = count, time.monotonic()
        time.sleep(0.1)


def final_state(result: AsyncResult[object], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not result.ready():
        assert time.monotonic() < deadline, f"task {result.id} never finished"
        time.sleep(0.05)
    return str(result.state)


@pytest.mark.parametrize("reject", [True, False], ids=["redelivered", "failed"])
def test_a_pool_child_lost_mid_task_leaves_single_effects_and_no_stuck_lease(
    celery_workers: Callable[..., Worker], redis_server: RedisServer, reject: bool
) -> None:
    queue, register, effect = new_queue(), new_register("celery-lost"), new_register("effect")
    Effect.objects.create(name=effect)
    own_broker = broker_env(redis_server.url, visibility=3600)
    celery_workers([queue], name="a", concurrency=2, extra_env=own_broker).wait_ready()
    with producer_on(redis_server.url) as producer:
        locked = LOCKED_DYING[reject].apply_async((register,), queue=queue, producer=producer)
        once = ADD_ONCE_DYING[reject].apply_async((effect,), queue=queue, producer=producer)
    if reject:
        assert locked.get(timeout=60) is True
        assert once.get(timeout=60) == 1
    else:
        assert (final_state(locked), final_state(once)) == ("FAILURE", "FAILURE")
    no_new_copies(locked.id, once.id)
    runs = list(TaskRun.objects.filter(label=register).order_by("started_at"))
    assert runs[0].ended_at is not None  # the write before the kill; the child died after it
    if reject:
        first, rerun = runs[0], runs[-1]
        assert rerun.token > first.token  # type: ignore[operator]
        assert (rerun.started_at - first.started_at).total_seconds() <= _LEASE_TTL + SLACK
    else:
        with producer_on(redis_server.url) as producer:
            again = locked_write.apply_async((register, 0.0), queue=queue, producer=producer)
        assert again.get(timeout=_LEASE_TTL + SLACK) is True, "the dead child's lease stuck"
        runs = list(TaskRun.objects.filter(label=register).order_by("started_at"))
        # The claim outlives the dead child only until its lock runs out (``lock=3``); then a
        # retry of the same task id takes it over.
        claim = IdempotencyKey.objects.get(key=once.id)
        assert claim.locked_until is not None
        assert (claim.locked_until - claim.created_at).total_seconds() <= 3 + SLACK
    assert Effect.objects.get(name=effect).count == (1 if reject else 0)
    check_history(register, tokens(runs))


def test_a_hard_time_limit_kill_frees_the_lease_within_its_ttl(
    celery_workers: Callable[..., Worker], redis_server: RedisServer
) -> None:
    queue, register = new_queue(), new_register("celery-limit")
    own_broker = broker_env(redis_server.url, visibility=3600)
    celery_workers([queue], name="a", concurrency=2, extra_env=own_broker).wait_ready()
    with producer_on(redis_server.url) as producer:
        killed = locked_past_time_limit.apply_async((register, 30.0), queue=queue,
                                                    producer=producer)  # fmt: skip
        assert final_state(killed) == "FAILURE"
        assert "TimeLimitExceeded" in repr(killed.result)
        started = time.monotonic()
        after = locked_write.apply_async((register, 0.0), queue=queue, producer=producer)
        assert after.get(timeout=_LEASE_TTL + SLACK) is True, "the killed task's lease stuck"
    assert time.monotonic() - started <= _LEASE_TTL + SLACK
    runs = list(TaskRun.objects.filter(label=register).order_by("started_at"))
    assert runs[0].ended_at is None  # killed mid-body
    assert runs[-1].token > runs[0].token  # type: ignore[operator]
    check_history(register, tokens(runs))


@pytest.fixture
def rabbitmq() -> Iterator[RabbitMQServer]:
    """A RabbitMQ node of this test's own, to restart under a running task."""
    if rabbitmq_binary() is None:
        pytest.skip("RabbitMQ: no rabbitmq-server installed")
    server = RabbitMQServer().start()
    try:
        yield server
    finally:
        server.destroy()


def test_a_broker_restart_mid_task_keeps_effects_single_and_frees_the_lease(
    celery_workers: Callable[..., Worker], rabbitmq: RabbitMQServer
) -> None:
    """The broker dies (SIGKILL) and comes back while both bodies run: their messages, never
    acknowledged, are delivered again, yet the locked copies never overlap, the idempotent
    effect lands once, and both tasks finish."""
    queue, register, effect = new_queue(), new_register("celery-broker"), new_register("effect")
    Effect.objects.create(name=effect)
    env = {"LEASES_TEST_BROKER_URL": rabbitmq.url}
    celery_workers([queue], name="a", concurrency=2, extra_env=env).wait_ready()
    # Publisher confirms: RabbitMQ answers once the persistent message is on disk, so the
    # SIGKILL below cannot take the messages with it (only their unacknowledged delivery).
    confirmed = app.connection_for_write(rabbitmq.url, transport_options={"confirm_publish": True})
    with confirmed as connection:
        producer = app.amqp.Producer(connection)
        locked = locked_slow.apply_async((register, 10.0), queue=queue, producer=producer)
        once = add_once.apply_async((effect, 10.0), queue=queue, producer=producer)
    wait_until(lambda: TaskRun.objects.filter(label=register).exists() and claimed(once.id),
               60, "both bodies to start")  # fmt: skip
    rabbitmq.restart("kill")
    wait_until(lambda: all(len(deliveries(task.id)) >= 2 for task in (locked, once)), 90,
               "the restarted broker to redeliver both unacknowledged messages")  # fmt: skip
    assert locked.get(timeout=90) is True
    assert once.get(timeout=90) == 1
    settle(locked.id, once.id, timeout=90)
    runs = list(TaskRun.objects.filter(label=register))
    assert_runs_never_overlap(runs)
    check_history(register, tokens(runs))
    assert Effect.objects.get(name=effect).count == 1
