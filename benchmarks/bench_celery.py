"""Celery: per-task overhead of our decorators vs a plain task, and celery-once / celery-singleton.

One real prefork worker (concurrency 1) on the demo's Redis broker; each operation sends one task
and waits for its result, so a row is the full round trip of one task and the differences to
the plain task are what each decorator adds: ``locked_task`` (acquire + release on the database
and on the Redis lease backend), ``idempotent_task`` (claim + record in the body's transaction;
with the default row claim and with ``claim_in_transaction=True``), ``singleton_task`` (a
guard taken on enqueue, adopted and released by the worker), and the
peers that also dedupe on enqueue: celery-once's ``QueueOnce`` and celery-singleton's
``Singleton`` (both on the same Redis), when installed.

The worker imports this module too (``celery -A benchmarks.bench_celery``), so tasks are
defined at import time; the peers' bare-DEL unlocks are their own business here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from typing import Any, cast

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")
django.setup()

from celery import Celery, Task  # noqa: E402
from django.conf import settings  # noqa: E402
from django.test.utils import override_settings  # noqa: E402
from kombu.connection import ConnectionPool  # noqa: E402

from benchmarks.common import Report, interleaved  # noqa: E402
from idempotency.celery import idempotent_task  # noqa: E402
from leases.celery import locked_task, singleton_task  # noqa: E402

TITLE = "celery: locked/idempotent/singleton tasks vs a plain task, celery-once, celery-singleton"

QUEUE = "bench-celery"
WORKER = f"bench-celery-{os.getpid()}"
OPS, ROUNDS = 20, 7

if os.environ.get("LEASES_BENCH_CELERY_WORKER"):  # in the worker only, not in the bench run
    # Persistent database connections, as a production worker runs with (with
    # CELERY_DB_REUSE_MAX below: CONN_MAX_AGE alone does not stop Celery closing them).
    settings.DATABASES["default"]["CONN_MAX_AGE"] = 600
    # A Redis lease backend next to the database one.
    leases_setting: dict[str, Any] = dict(settings.LEASES)
    backends = {**leases_setting["BACKENDS"], "bench-redis": {"ENGINE": "leases.backends.redis",
                                                              "CACHE": "default"}}  # fmt: skip
    override_settings(LEASES={**leases_setting, "BACKENDS": backends}).enable()

app = Celery("bench")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_acks_late = False
app.conf.ONCE = {"backend": "celery_once.backends.Redis",
                 "settings": {"url": settings.REDIS_URL, "default_timeout": 60}}  # fmt: skip
app.conf.singleton_backend_url = settings.REDIS_URL
if os.environ.get("LEASES_BENCH_CELERY_WORKER"):
    # Celery's Django fixup closes every database connection before and after each task unless
    # CELERY_DB_REUSE_MAX is set, whatever CONN_MAX_AGE says: without it, idempotent_task (the
    # one contender on Django's connection) paid a reconnect per task (~10-40 ms here).
    app.conf.CELERY_DB_REUSE_MAX = 1000

PEERS: dict[str, type[Task[Any, Any]]] = {}
with contextlib.suppress(ImportError):
    from celery_once import QueueOnce

    PEERS["celery-once QueueOnce"] = QueueOnce
with contextlib.suppress(ImportError):
    from celery_singleton import Singleton

    PEERS["celery-singleton Singleton"] = Singleton


@app.task(name="bench.plain")
def plain(n: int) -> int:
    return n


locked_db = locked_task(key="bench:{n}", app=app, name="bench.locked_db")(plain.run)
locked_redis = locked_task(key="bench:{n}", backend="bench-redis", app=app,
                           name="bench.locked_redis")(plain.run)  # fmt: skip
idempotent = idempotent_task(app=app, name="bench.idempotent")(plain.run)
# The same task claiming its key in the body's transaction (an advisory lock, the row written
# once with the result: one commit a task instead of two), beside the default row claim.
idempotent_gated = idempotent_task(
    app=app, name="bench.idempotent_gated", claim_in_transaction=True
)(plain.run)
singleton = singleton_task(key="bench:{n}", app=app, name="bench.singleton")(plain.run)
peer_tasks = {
    label: app.task(base=base, name=f"bench.{base.__name__}")(plain.run)
    for label, base in PEERS.items()
}


def _start_worker() -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "celery", "-A", "benchmarks.bench_celery", "worker",
               "-P", "prefork", "-c", "1", "--without-heartbeat", "--without-gossip",
               "--without-mingle", "--loglevel", "ERROR", "-Q", QUEUE,
               "-n", f"{WORKER}@%h"]  # fmt: skip
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "demo_project.settings",
           "LEASES_BENCH_CELERY_WORKER": "1"}  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, start_new_session=True)


def _wait_ready(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(
            name.startswith(WORKER)
            for reply in app.control.ping(timeout=0.5) or []
            for name in reply
        ):
            return
    raise RuntimeError("the benchmark's celery worker did not start")


def _round_trip(task: Any) -> Any:
    numbers = itertools.count()
    return lambda: task.apply_async((next(numbers),), queue=QUEUE).get(timeout=30)


def main(report: Report) -> None:
    app.set_current()
    proc = _start_worker()
    try:
        _wait_ready(proc)
        contenders = {
            "plain task": plain,
            "locked_task (database backend)": locked_db,
            "locked_task (redis backend)": locked_redis,
            "idempotent_task": idempotent,
            "idempotent_task (claim_in_transaction)": idempotent_gated,
            "singleton_task (database guard)": singleton,
            **peer_tasks,
        }
        rows = interleaved(
            {label: _round_trip(task) for label, task in contenders.items()},
            ops=OPS,
            rounds=ROUNDS,
            warmup=5,
        )
        report.table("one task sent and its result awaited, one prefork worker", rows, unit="ms")
        for label in ("celery-once QueueOnce", "celery-singleton Singleton"):
            if label not in PEERS:
                report.note(f"{label}: not installed (pip install '.[bench]'), not measured")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        _let_go_of_the_broker()


def _let_go_of_the_broker() -> None:
    """Close this process's broker connections before the next topic forks.

    kombu closes the connections a forked child inherits (an after-fork hook), and closing a
    Redis channel reads the reply to the ``BRPOP`` it left pending: the parent and every child
    then wait on one shared socket for one reply, and all children but one block for good.
    That is what hung the ``lease`` topic's contending processes (they never reached their own
    code) whenever it ran after this one: a harness bug, not starvation.
    """
    # celery-types says ProducerPool; Celery's app.pool is kombu's connection pool.
    cast(ConnectionPool, app.pool).force_close_all()
    app.close()
