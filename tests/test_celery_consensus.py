"""``locked_task`` and ``singleton_task`` on the etcd and ZooKeeper backends: the core cases.

The same real prefork workers and Redis broker as ``tests/test_celery.py``, with the tasks of
:mod:`tests.celery_app` bound to the ``etcd`` and ``zookeeper`` aliases. Each test first makes
sure the alias's cluster is up (it starts on first use), so the workers it starts inherit its
address. Kept to a few cases per backend: the broker-by-broker and fault cases run on the
other backends in ``tests/test_celery.py``, and the backend contract itself is the
conformance suite's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from leases.backends import get_backend
from tests.celery_app import CONSENSUS_BACKENDS, LOCKED_UNTIL_REVOKED, LOCKED_WRITE
from tests.celery_workers import Worker, celery_workers_fixture, new_queue
from tests.checker import check_history, history, new_register
from tests.lease_backends import SETUP
from tests.test_celery import assert_runs_never_overlap, ready, tokens, wait_states
from tests.test_celery import (
    test_singleton_50_concurrent_delays_queue_one_task as singleton_case,  # not collected here
)
from tests.testapp.models_celery import TaskRun
from tests.waiting import wait_until

__all__ = ["celery_workers_fixture"]  # fixture, re-exported for pytest

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture(params=CONSENSUS_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """A consensus backend's alias, its cluster started (before any worker of the test)."""
    alias: str = request.param
    SETUP[alias](request)
    return alias


def test_locked_bodies_never_overlap_and_all_complete(
    backend: str, celery_workers: Callable[..., Worker]
) -> None:
    task, queue = LOCKED_WRITE[backend], new_queue()
    ready(celery_workers, *({"queues": [queue], "name": n} for n in "ab"))
    register = new_register("celery-consensus")

    results = [task.apply_async((register, 0.05), queue=queue) for _ in range(12)]

    assert [r.get(timeout=90) for r in results] == [True] * 12  # every closing write accepted
    runs = list(TaskRun.objects.filter(label=register))
    assert len(runs) == 12
    assert_runs_never_overlap(runs)
    summary = check_history(register, tokens(sorted(runs, key=lambda r: r.started_at)))
    assert summary.accepted == 24


def test_revoked_lease_mid_task_fails_the_task_and_its_later_fenced_write(
    backend: str, celery_workers: Callable[..., Worker]
) -> None:
    queue = new_queue()
    ready(celery_workers, {"queues": [queue]})
    register = new_register("celery-consensus-lost")

    result = LOCKED_UNTIL_REVOKED[backend].apply_async((register,), queue=queue)

    assert wait_states([result]) == ["FAILURE"]
    assert type(result.result).__name__ == "LeaseLost"
    outcomes = [a.outcome for a in history(register)]
    assert outcomes[0] == "accepted" and outcomes[-1] in ("lost", "stale", "revoked"), outcomes
    check_history(register)
    # on_lost runs on the keepalive thread after ``lost`` is set: wait for its row (as in
    # tests/test_celery.py), the task may have failed first.
    wait_until(
        lambda: TaskRun.objects.filter(label=f"lost:celery-test:{register}").exists(),
        15,
        "the on_lost callback's row",
    )
    info = get_backend(backend).inspect(f"celery-test:{register}")
    assert info is not None and not info.held


def test_singleton_50_concurrent_delays_queue_one_task(backend: str) -> None:
    singleton_case(backend)
