"""Advisory locks between real processes and sessions: exclusion, deadlock, a killed holder."""

from __future__ import annotations

import select
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Any

import psycopg
import pytest
from django.db import connection, connections, transaction

from leases import advisory
from leases.errors import LeaseDeadlock, LeaseLost
from leases.keys import advisory_key
from tests.advisory_support import holders, other_session
from tests.factories import AdvisoryCounterFactory
from tests.testapp.models_advisory import AdvisoryCounter

WORKERS, TIMES, PAUSE = 4, 6, 0.02
ARGS = [str(TIMES), str(PAUSE)]


@pytest.fixture
def other(transactional_db: None) -> Iterator[psycopg.Connection[Any]]:
    with other_session() as conn:
        yield conn


def _wait_line(proc: subprocess.Popen[str], expected: str, deadline: float) -> None:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = proc.stdout.readline().strip() if ready else "<timeout>"
    assert line == expected, f"worker said {line!r}, expected {expected!r}"


def race(python: str, env: dict[str, str], mode: str) -> int:
    """Run WORKERS processes incrementing one counter TIMES each; return the final value."""
    counter = AdvisoryCounterFactory()
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(WORKERS):
            procs.append(
                subprocess.Popen(
                    [python, "-m", "tests.advisory_worker", counter.name, mode, *ARGS],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + 60
        for proc in procs:
            _wait_line(proc, "ready", deadline)
        for proc in procs:  # every worker is connected: start them together
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.close()
        for proc in procs:
            _wait_line(proc, "done", deadline)
            assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    return AdvisoryCounter.objects.get(pk=counter.pk).value


def test_counter_loses_updates_without_a_lock(python: str, child_env: dict[str, str]) -> None:
    """The race is real: without this the lock tests below would prove nothing."""
    assert race(python, child_env, "none") < WORKERS * TIMES


@pytest.mark.parametrize("mode", ["xact", "session"])
def test_counter_loses_no_update_under_the_lock(
    python: str, child_env: dict[str, str], mode: str
) -> None:
    assert race(python, child_env, mode) == WORKERS * TIMES


def in_thread(fn: Callable[[], Any]) -> Future[Any]:
    """Run ``fn`` in a thread with its own database connection, closed when it ends."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)
        finally:
            connections.close_all()

    threading.Thread(target=run, daemon=True).start()
    return future


@pytest.mark.parametrize("scope", ["xact", "session"])
def test_deadlock_between_two_sessions_raises_lease_deadlock(
    transactional_db: None, scope: str
) -> None:
    both_hold_one = threading.Barrier(2, timeout=10)

    def lock(name: str) -> Any:
        if scope == "xact":
            return advisory.xact_lock(name)
        return advisory.session_lock(name)

    def take(first: str, second: str) -> str:
        with transaction.atomic() if scope == "xact" else nullcontext(), lock(first):
            both_hold_one.wait()
            with lock(second):
                return "got both"

    futures = [in_thread(lambda: take("left", "right")), in_thread(lambda: take("right", "left"))]
    outcomes = []
    for future in futures:
        try:
            outcomes.append(future.result(timeout=30))
        except LeaseDeadlock as exc:
            outcomes.append(type(exc).__name__)
    assert sorted(outcomes) == ["LeaseDeadlock", "got both"]


def test_terminated_session_frees_the_lock_and_the_holder_learns_loudly(
    transactional_db: None, other: psycopg.Connection[Any]
) -> None:
    started, resume = threading.Event(), threading.Event()
    pid: list[int] = []

    def hold() -> list[str]:
        seen: list[str] = []
        try:
            with advisory.session_lock("killed") as lock:
                pid.append(connection.connection.info.backend_pid)
                started.set()
                resume.wait(timeout=20)
                try:
                    lock.ensure_held()
                except LeaseLost:
                    seen.append("ensure_held")
        except LeaseLost:
            seen.append("exit")
        return seen

    future = in_thread(hold)
    try:
        assert started.wait(timeout=20)
        other.execute("SELECT pg_terminate_backend(%s)", [pid[0]])
        deadline = time.monotonic() + 10
        while holders(other, "killed") and time.monotonic() < deadline:
            time.sleep(0.02)
        got = other.execute("SELECT pg_try_advisory_lock(%s)", [advisory_key("killed")])
        assert got.fetchone() == (True,)  # the lock was freed with the session
    finally:
        resume.set()
    # The holder's next call in the block and the block's exit both report the loss.
    assert future.result(timeout=20) == ["ensure_held", "exit"]


def test_one_decorator_instance_excludes_across_threads(transactional_db: None) -> None:
    inside: list[int] = []
    overlaps: list[int] = []

    @advisory.session_lock("shared-decorator")
    def critical() -> None:
        inside.append(1)
        overlaps.append(len(inside))
        time.sleep(0.02)
        inside.pop()

    futures = [in_thread(lambda: [critical() for _ in range(5)]) for _ in range(3)]
    for future in futures:
        future.result(timeout=30)
    assert len(overlaps) == 15 and max(overlaps) == 1
