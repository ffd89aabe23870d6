"""The Celery app and the test tasks that real ``celery worker`` processes run.

Workers start as ``python -m celery -A tests.celery_app worker ...`` with ``child_env`` (see
:mod:`tests.celery_workers`). The broker and result backend are the session Redis on databases
of their own (``CELERY_*`` in ``tests/settings.py``); a test that needs a broker of its own (a
tiny ``visibility_timeout`` restores every unacked message of its Redis database) passes
``LEASES_TEST_BROKER_URL`` and ``LEASES_TEST_VISIBILITY_TIMEOUT`` to its workers.

Each task body records what it did in the database on the database clock (``TaskRun``,
``Delivery``, ``Effect``, and writes to the fenced register of :mod:`tests.checker`), so a test
can check the history after the workers are gone.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from celery import Celery, signals  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from django.db.models import F  # noqa: E402

from idempotency.celery import idempotent_task  # noqa: E402
from leases.celery import (  # noqa: E402
    LockedTask,
    leader_only,
    locked_task,
    partitioned,
    singleton_task,
)
from leases.lease import Lease  # noqa: E402

app = Celery("tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The prefixed name: Celery up to 5.6 reads a namespaced setting before a plain one, so a plain
# ``broker_url`` set here lost to the Django setting and every worker of a test with a broker of
# its own (RabbitMQ, a Redis it restarts) consumed the session Redis instead.
app.conf.update(
    CELERY_BROKER_URL=os.environ.get("LEASES_TEST_BROKER_URL") or settings.CELERY_BROKER_URL
)
if os.environ.get("LEASES_TEST_VISIBILITY_TIMEOUT"):
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["LEASES_TEST_VISIBILITY_TIMEOUT"]),
        "unacked_restore_interval": 0.5,  # look for overdue messages often, not every 10 s
        "unacked_restore_throttle": 1,
    }
app.conf.worker_prefetch_multiplier = 1
app.conf.task_default_queue = "leases-tests-unused"  # every test names its own queues
app.conf.result_expires = 600

_LEASE_TTL = 2.0  # seconds: short, so waiting for expiry costs little test time
_HOLDER = f"{socket.gethostname()}:{os.getpid()}"


@signals.worker_ready.connect
@signals.beat_init.connect
def _announce_ready(**_: Any) -> None:
    """Tell the test this worker consumes, or this beat schedules (``LEASES_TEST_READY_FILE``).

    A process on another broker than its test's stops instead: it would wait for messages that
    never reach it, and the test would time out on results far from the cause."""
    wanted = os.environ.get("LEASES_TEST_BROKER_URL")
    if wanted and app.conf.broker_url != wanted:
        print(f"on broker {app.conf.broker_url}, not the test's {wanted}: stopping",
              file=sys.stderr, flush=True)  # fmt: skip
        os.kill(os.getpid(), signal.SIGTERM)
        return
    path = os.environ.get("LEASES_TEST_READY_FILE")
    if path:
        Path(path).write_text(str(os.getpid()))


_SENDER = "leases_test_sender"


@signals.before_task_publish.connect
def _stamp_sender(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Name the sending process on every message (which beat sent a tick?)."""
    if headers is not None:
        headers[_SENDER] = _worker()


@signals.task_prerun.connect
def _record_delivery(task_id: str = "", task: Any = None, **_: Any) -> None:
    from tests.testapp.models_celery import Delivery

    Delivery.objects.create(task_id=task_id, task=getattr(task, "name", ""), worker=_worker(),
                            at=_now())  # fmt: skip


@signals.task_postrun.connect
def _record_finish(task_id: str = "", **_: Any) -> None:
    from tests.testapp.models_celery import Delivery

    Delivery.objects.filter(task_id=task_id, worker=_worker(), finished_at=None).update(
        finished_at=_now()
    )


def _worker() -> str:
    return f"{os.environ.get('LEASES_TEST_WORKER', 'worker')}:{os.getpid()}"


def _now() -> Any:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        row = cursor.fetchone()
    assert row is not None
    return row[0]


def _run(label: str, task_id: str, token: int | None, hold: float, sender: str = "") -> int:
    """Record a body run of ``hold`` seconds; returns the run's id."""
    from tests.testapp.models_celery import TaskRun

    run = TaskRun.objects.create(label=label, task_id=task_id, worker=_worker(), token=token,
                                 sender=sender, started_at=_now())  # fmt: skip
    time.sleep(hold)
    TaskRun.objects.filter(id=run.id).update(ended_at=_now())
    return run.id


def _first_delivery(task_id: str) -> bool:
    """Whether this is the task id's first delivery (redelivered copies and retries don't hold).

    Counted from ``Delivery`` rows, which commit at once, unlike a body's rows inside an
    idempotent task's transaction (rolled back when its worker is killed).
    """
    from tests.testapp.models_celery import Delivery

    return Delivery.objects.filter(task_id=task_id).count() <= 1


def _fenced_run(register: str, lease: Lease, task_id: str, hold: float) -> bool:
    """A body run under a lease: fenced writes at its start and end, to the shared checker."""
    from tests.checker import record_write

    writer = f"{_worker()}/{task_id[:8]}"
    record_write(register, lease, writer)
    _run(register, task_id, lease.token, hold)
    return record_write(register, lease, writer)


# -- locked ------------------------------------------------------------------------------------


#: Lease backends the locked and singleton tasks run on, one task per backend.
BACKENDS = ("default", "redis", "redlock")
#: The consensus backends, with a few core cases of their own (``tests/test_celery_consensus.py``:
#: their clusters start only when a test asks, and must be up before its workers start).
CONSENSUS_BACKENDS = ("etcd", "zookeeper")


def _locked_write(self: Any, register: str, hold: float, lease: Lease) -> bool:
    return _fenced_run(register, lease, self.request.id, hold)


LOCKED_WRITE = {
    alias: locked_task(key="celery-test:{register}", ttl=_LEASE_TTL, backend=alias, bind=True,
                       acks_late=True, busy_backoff=0.05, busy_backoff_max=0.3,
                       busy_max_retries=400, name=f"tests.locked_write.{alias}")(_locked_write)
    for alias in (*BACKENDS, *CONSENSUS_BACKENDS)
}  # fmt: skip
locked_write = LOCKED_WRITE["default"]


@locked_task(key="celery-test:{register}", ttl=_LEASE_TTL, on_busy="skip", bind=True)
def locked_skip(self: Any, register: str, hold: float, lease: Lease) -> bool:
    return _fenced_run(register, lease, self.request.id, hold)


@locked_task(key="celery-test:{register}", ttl=_LEASE_TTL, on_busy="raise", bind=True)
def locked_retrying(self: Any, register: str, lease: Lease) -> int:
    """Retries itself once while holding the lease: the retry must not find it busy."""
    _fenced_run(register, lease, self.request.id, 0)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return int(self.request.retries)


def _record_loss(lease: Lease) -> None:
    """``on_lost`` of ``locked_until_lost`` (runs on the worker's keepalive thread)."""
    from tests.testapp.models_celery import TaskRun

    TaskRun.objects.create(label=f"lost:{lease.name}", task_id="", worker=_worker(),
                           token=lease.token, started_at=_now())  # fmt: skip


@locked_task(key="celery-test:{register}", ttl=_LEASE_TTL, on_busy="raise", bind=True,
             on_lost=_record_loss)  # fmt: skip
def locked_until_lost(self: Any, register: str, lease: Lease) -> bool:
    """Writes, waits until its lease is revoked under it, then tries a last fenced write."""
    from leases.backends import get_backend

    _fenced_run(register, lease, self.request.id, 0)
    get_backend().force_release(lease.name, lease.token)  # an operator's revocation, mid-run
    lease.lost.wait(_LEASE_TTL * 2)
    _run(register, self.request.id, lease.token, 0)
    return _fenced_run(register, lease, self.request.id, 0)


def _until_revoked(self: Any, register: str, lease: Lease) -> bool:
    """``locked_until_lost`` on the lease's own backend."""
    from leases.backends import get_backend

    _fenced_run(register, lease, self.request.id, 0)
    get_backend(lease.backend).force_release(lease.name, lease.token)
    lease.lost.wait(_LEASE_TTL * 2)
    return _fenced_run(register, lease, self.request.id, 0)


LOCKED_UNTIL_REVOKED = {
    alias: locked_task(key="celery-test:{register}", ttl=_LEASE_TTL, backend=alias,
                       on_busy="raise", bind=True, on_lost=_record_loss,
                       name=f"tests.locked_until_revoked.{alias}")(
        _until_revoked)
    for alias in CONSENSUS_BACKENDS
}  # fmt: skip


@locked_task(key="celery-test:{register}", ttl=_LEASE_TTL * 2, timeout=30, bind=True,
             acks_late=True)  # fmt: skip
def locked_slow(self: Any, register: str, hold: float, lease: Lease) -> bool:
    """Holds only on its first run, so redelivered copies end quickly."""
    return _fenced_run(
        register, lease, self.request.id, hold if _first_delivery(self.request.id) else 0
    )


@locked_task(key="celery-test:{register}", ttl=_LEASE_TTL, limit=2, bind=True, busy_backoff=0.05,
             busy_backoff_max=0.3, busy_max_retries=400)  # fmt: skip
def limited_write(self: Any, register: str, hold: float, lease: Lease) -> bool:
    """Up to two bodies per register at once; each writes its slot's own register."""
    return _fenced_run(f"{register}/{lease.slot}", lease, self.request.id, hold)  # type: ignore[attr-defined]


def _failing_body(self: Any, label: str) -> None:
    """Records the ``request.retries`` its run sees, then fails.

    In the session Redis (``retries_seen``), not the database: an idempotent task's body runs in
    the key's transaction, which its failure rolls back.
    """
    import redis

    redis.Redis.from_url(settings.CELERY_BROKER_URL).rpush(f"retries-seen:{label}",
                                                           int(self.request.retries))  # fmt: skip
    raise ConnectionError("the provider is down")


def retries_seen(label: str) -> list[int]:
    """The ``request.retries`` each body run of ``label`` saw, in order (see ``_failing_body``)."""
    import redis

    return [int(n) for n in redis.Redis.from_url(settings.CELERY_BROKER_URL).lrange(
        f"retries-seen:{label}", 0, -1)]  # fmt: skip


#: Its body always fails and is retried by ``autoretry_for`` at most 3 times; busy retries, on a
#: budget of their own, must leave those 3 (and the ``request.retries`` the body sees) alone.
locked_failing = locked_task(key="celery-test:{label}", ttl=_LEASE_TTL, bind=True,
                             autoretry_for=(ConnectionError,), max_retries=3,
                             retry_kwargs={"countdown": 0}, busy_backoff=0.05,
                             busy_backoff_max=0.2,
                             name="tests.locked_failing")(_failing_body)  # fmt: skip


# -- idempotent --------------------------------------------------------------------------------


@idempotent_task(lock=3, bind=True, acks_late=True, in_flight_backoff=0.2)
def add_once(self: Any, effect: str, hold: float) -> int:
    """Increments ``effect`` in the key's transaction, then holds (on its first run only)."""
    from tests.testapp.models_celery import Effect

    Effect.objects.filter(name=effect).update(count=F("count") + 1)
    _run(effect, self.request.id, None, hold if _first_delivery(self.request.id) else 0)
    return Effect.objects.get(name=effect).count


@idempotent_task(key="order-{order}", lock=1, atomic=False, acks_late=True, in_flight_backoff=0.2)
def place_order_once(order: str, amount: int) -> Any:
    """The steps workflow (tests/steps_workflow.py): a redelivery resumes after its last step."""
    from tests.steps_workflow import place_order

    return place_order(order, amount)


#: ``locked_failing``'s twin for in-flight retries: its key held elsewhere, it retries on the
#: in-flight budget, never on the body's.
idempotent_failing = idempotent_task(key="{label}", bind=True, autoretry_for=(ConnectionError,),
                                     max_retries=3, retry_kwargs={"countdown": 0},
                                     in_flight_backoff=0.05,
                                     name="tests.idempotent_failing")(_failing_body)  # fmt: skip


@idempotent_task(key="{label}:{n}", base=LockedTask, bind=True, lease_ttl=_LEASE_TTL,
                 busy_backoff=0.05, busy_backoff_max=0.3, busy_max_retries=400,
                 name="tests.keyed_locked_once")  # fmt: skip
def keyed_locked_once(self: Any, label: str, n: int, hold: float, lease: Lease) -> str:
    """Once per key, under a lease of that key: records its run and the lease's name."""
    _run(label, self.request.id, lease.token, hold, sender=lease.name)
    return lease.name


# -- singleton, leader, partitioned -------------------------------------------------------------


def _singleton_hold(self: Any, name: str, hold: float) -> None:
    _run(name, self.request.id, None, hold)


SINGLETON_HOLD = {
    alias: singleton_task(
        key="celery-test:{name}",
        ttl=_LEASE_TTL,
        backend=alias,
        bind=True,
        name=f"tests.singleton_hold.{alias}",
    )(_singleton_hold)
    for alias in (*BACKENDS, *CONSENSUS_BACKENDS)
}
singleton_hold = SINGLETON_HOLD["default"]


@singleton_task(key="celery-test:{name}", ttl=_LEASE_TTL, on_duplicate="raise")
def singleton_strict(name: str) -> None:
    _run(name, "", None, 0)


@singleton_task(key="celery-test:{name}", ttl=_LEASE_TTL, on_duplicate="raise")
def singleton_strict_twin(name: str) -> None:
    """Another task with the very same key as :func:`singleton_strict`: guarded apart."""
    _run(name, "", None, 0)


@singleton_task(key="celery-test:{name}", ttl=_LEASE_TTL, bind=True, acks_late=True)
def singleton_late(self: Any, name: str, hold: float) -> None:
    """Acknowledged after the run: redelivered when its worker dies mid-body."""
    _run(name, self.request.id, None, hold)


@singleton_task(key="celery-test:{name}", ttl=_LEASE_TTL, bind=True)
def singleton_retrying(self: Any, name: str) -> int:
    """Retries itself once: the retry, sent without the guard, takes it in the worker."""
    _run(name, self.request.id, None, 0)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return int(self.request.retries)


class SingletonFailed(Exception):
    """The own error of :func:`singleton_failing`'s body."""


@singleton_task(key="celery-test:{name}", ttl=_LEASE_TTL)
def singleton_failing(name: str) -> None:
    raise SingletonFailed(name)


@leader_only(key="celery-test-beat", ttl=_LEASE_TTL, bind=True)
def leader_tick(self: Any, label: str) -> None:
    sender = getattr(self.request, _SENDER, None) or (self.request.headers or {}).get(_SENDER)
    _run(label, self.request.id, self.sent_by, 0, sender=sender or "")


if os.environ.get("LEASES_TEST_BEAT_QUEUE"):  # for `celery beat` processes started by a test
    _tick = {"task": leader_tick.name, "schedule": 0.5}
    _tick["args"] = (os.environ["LEASES_TEST_BEAT_LABEL"],)
    _tick["options"] = {"queue": os.environ["LEASES_TEST_BEAT_QUEUE"]}
    app.conf.beat_schedule = {"tick": _tick}


@partitioned(key="{account}", partitions=3, queue_prefix=f"leases-tests-part-{os.getpid()}")
def partitioned_touch(account: str) -> str:
    return account


# -- faults: a hard time limit, a pool child lost mid-body ---------------------------------------


def _die_on_first_delivery(task_id: str) -> None:
    """SIGKILL this pool child on the task's first delivery, as the OOM killer would."""
    if _first_delivery(task_id):
        os.kill(os.getpid(), 9)


def _locked_dying(self: Any, register: str, lease: Lease) -> bool:
    """A fenced run, then (first delivery only) the pool child dies before the task returns."""
    written = _fenced_run(register, lease, self.request.id, 0)
    _die_on_first_delivery(self.request.id)
    return written


#: ``task_reject_on_worker_lost`` both ways: redelivered after the child dies, or failed.
LOCKED_DYING = {
    reject: locked_task(key="celery-test:{register}", ttl=_LEASE_TTL, bind=True, acks_late=True,
                        reject_on_worker_lost=reject, timeout=30,
                        name=f"tests.locked_dying.{reject}")(_locked_dying)
    for reject in (True, False)
}  # fmt: skip


def _add_once_dying(self: Any, effect: str) -> int:
    """The effect in the key's transaction, then (first delivery only) the child dies."""
    from tests.testapp.models_celery import Effect

    Effect.objects.filter(name=effect).update(count=F("count") + 1)
    _run(effect, self.request.id, None, 0)
    _die_on_first_delivery(self.request.id)
    return Effect.objects.get(name=effect).count


ADD_ONCE_DYING = {
    reject: idempotent_task(lock=3, bind=True, acks_late=True, reject_on_worker_lost=reject,
                            in_flight_backoff=0.2,
                            name=f"tests.add_once_dying.{reject}")(_add_once_dying)
    for reject in (True, False)
}  # fmt: skip


@locked_task(key="celery-test:{register}", ttl=_LEASE_TTL, bind=True, acks_late=True,
             time_limit=1.5, timeout=30)  # fmt: skip
def locked_past_time_limit(self: Any, register: str, hold: float, lease: Lease) -> bool:
    """Holds past its hard ``time_limit`` on its first delivery: the pool child is killed."""
    return _fenced_run(
        register, lease, self.request.id, hold if _first_delivery(self.request.id) else 0
    )
