"""The Redis backend's epochs: never below one installed before, though Redis forgets (an epoch
drawn before another client's, another project's epochs on the same Redis); on the async path
drawn on the event loop's own database connection (no worker thread), bounded by its reply
deadline, one increasing counter with the sync path; and a forked child's async counter,
whatever a parent thread held at the fork."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from devservers import RedisServer
from leases.backends._pgconn import connect
from leases.backends.base import Grant
from leases.backends.redis import COUNTER_BITS, Backend
from leases.errors import FencingUnavailable
from tests.test_redlock_token import NoWorkerThreads, locked_row, until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def backend() -> Iterator[Backend]:
    """A backend on the shared Redis with a prefix (so an epoch row) of its own."""
    prefix = f"epoch-{uuid.uuid4().hex[:8]}:"
    made = Backend("redis-epoch-test", {"URL": os.environ["REDIS_URL"], "PREFIX": prefix})
    try:
        yield made
    finally:
        made.close()


def unique() -> str:
    return f"e-{uuid.uuid4().hex[:10]}"


def epoch_row(backend: Backend) -> int:
    with connect("default") as conn:
        row = conn.execute(
            "SELECT token FROM leases_fence WHERE resource = %s", (backend.epoch_resource,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def locked_epoch_row(backend: Backend) -> contextlib.AbstractContextManager[Callable[[], bool]]:
    """The backend's epoch row locked by another session, so an epoch statement waits on it
    (an epoch database that does not answer); yields whether a statement waits on the lock."""
    return locked_row(
        "INSERT INTO leases_fence (resource, token) VALUES (%s, 1)"
        " ON CONFLICT (resource) DO UPDATE SET token = leases_fence.token",
        backend.epoch_resource,
    )


def test_an_epoch_drawn_before_another_clients_is_refused_after_redis_forgets(
    redis_server: RedisServer,
) -> None:
    """X draws E1 for a new name and stalls; Y draws E2 > E1, is granted E2's first token and
    releases; Redis forgets the counter (FLUSHDB, a restart without persistence). X's offer of
    E1 used to find no counter and be taken, granting a token below Y's: now it is refused (its
    reservation went with the counter) and X draws again."""
    prefix = f"stale-{uuid.uuid4().hex[:8]}:"
    x = Backend("redis-epoch-x", {"URL": redis_server.url, "PREFIX": prefix})
    y = Backend("redis-epoch-y", {"URL": redis_server.url, "PREFIX": prefix})
    drew, go_on = threading.Event(), threading.Event()
    real_next_epoch = x.next_epoch

    def stalling_next_epoch(stored: int) -> int:
        epoch = real_next_epoch(stored)
        drew.set()
        assert go_on.wait(10)
        return epoch

    x.next_epoch = stalling_next_epoch  # type: ignore[method-assign]
    got: dict[str, object] = {}
    worker = threading.Thread(target=lambda: got.update(x=x.try_acquire("job", "x", 30.0)))
    try:
        worker.start()
        assert drew.wait(10)
        first = y.try_acquire("job", "y", 30.0)
        assert first is not None
        y.release(first)
        redis.Redis.from_url(redis_server.url).flushdb()
        go_on.set()
        worker.join(10)
        second = got["x"]
        assert isinstance(second, Grant)
        assert second.token > first.token
    finally:
        go_on.set()
        worker.join(10)
        x.close()
        y.close()


def test_a_counter_of_another_projects_epochs_is_not_continued(redis_server: RedisServer) -> None:
    """Two projects on one Redis with the same ``PREFIX`` share each name's counter but draw
    epochs from their own databases. After Redis forgot the counters, B's grant stamped B's
    (lower) epoch and A's next grants continued it, below A's earlier tokens: now A takes a
    new epoch of its own over a counter another database's epoch stamped."""
    app_a = Backend("redis-epoch-a", {"URL": redis_server.url})
    app_b = Backend("redis-epoch-b", {"URL": redis_server.url})
    app_b.epoch_resource = "project-b-database:" + app_b.epoch_resource  # B's own database
    try:
        for _ in range(5):  # A has been running a while: its epochs are ahead of B's
            app_a.epochs.bump_fence(app_a.epoch_resource)
        a1 = app_a.try_acquire("nightly-report", "a", 30.0)
        assert a1 is not None
        app_a.release(a1)
        redis.Redis.from_url(redis_server.url).flushall()
        b1 = app_b.try_acquire("nightly-report", "b", 30.0)
        assert b1 is not None and b1.token >> COUNTER_BITS < a1.token >> COUNTER_BITS
        app_b.release(b1)
        a2 = app_a.try_acquire("nightly-report", "a", 30.0)
        assert a2 is not None and a2.token > a1.token
    finally:
        app_a.close()
        app_b.close()


def test_deploy_check_warns_of_another_projects_counters_under_the_prefix(
    redis_server: RedisServer,
) -> None:
    """Two projects sharing a Redis and a ``PREFIX`` share every name's lock, and each grant
    after the other's draws a new epoch; nothing said so before it happened in production.
    ``check --deploy`` now reads the counters under the prefix for another epoch source: as
    advice, not a deploy problem, which the health check would report as the store being
    unsafe (it is not; a restored database looks the same for a while, and the health check
    is polled: it must not scan keys)."""
    options = {"URL": redis_server.url, "PREFIX": f"shared-{uuid.uuid4().hex[:8]}:"}
    app_a = Backend("redis-epoch-a", options)
    app_b = Backend("redis-epoch-b", options)
    app_b.epoch_resource = "project-b-database:" + app_b.epoch_resource  # B's own database
    try:
        assert app_a.deploy_advice() == []  # nothing under the prefix yet
        for app, name in [(app_a, "a-report"), (app_a, "a-export")]:
            grant = app.try_acquire(name, "a", 30.0)
            assert grant is not None
            app.release(grant)
        assert app_a.deploy_advice() == []  # only A's own counters
        grant = app_b.try_acquire("b-report", "b", 30.0)
        assert grant is not None
        app_b.release(grant)
        (warning,) = app_a.deploy_advice()
        assert "1 of 3 name counters" in warning and "its own PREFIX" in warning
        assert app_a.deploy_checks() == []  # what the health check runs: healthy
    finally:
        app_a.close()
        app_b.close()


def test_a_new_epoch_source_starts_above_the_epochs_redis_saw(redis_server: RedisServer) -> None:
    """A counter of another epoch source is not continued, but its epoch still floors ours:
    our database restored into a new cluster (a new source, its epoch row behind) must not
    hand out epochs below those Redis saw."""
    before = Backend("redis-epoch-old", {"URL": redis_server.url})
    restored = Backend("redis-epoch-new", {"URL": redis_server.url})
    restored.epoch_resource = f"restored-{uuid.uuid4().hex[:8]}:" + restored.epoch_resource
    try:
        for _ in range(5):
            before.epochs.bump_fence(before.epoch_resource)
        old = before.try_acquire("report", "a", 30.0)
        assert old is not None
        before.release(old)
        new = restored.try_acquire("report", "a", 30.0)
        assert new is not None and new.token >> COUNTER_BITS > old.token >> COUNTER_BITS
    finally:
        before.close()
        restored.close()


def test_an_async_grant_draws_its_epoch_on_the_loops_own_connection(backend: Backend) -> None:
    """A new name's first grant needs a new epoch: with no worker thread to be had (the loop's
    executor refuses work) it is drawn on the loop's async connection to the epoch database,
    the same row the sync path bumps, and ``aclose`` closes that connection."""

    async def main() -> tuple[list[int], bool]:
        asyncio.get_running_loop().set_default_executor(NoWorkerThreads())
        epochs = []
        try:
            for _ in range(2):
                grant = await backend.atry_acquire(unique(), "async", 5.0)
                assert grant is not None
                await backend.arelease(grant)
                epochs.append(grant.token >> COUNTER_BITS)
            conn = backend.epochs._aconnections.get().conn
            assert conn is not None and not conn.closed
        finally:
            await backend.aclose()
        return epochs, conn.closed

    epochs, closed = asyncio.run(main())
    assert epochs[0] < epochs[1] == epoch_row(backend)
    assert closed


def test_sync_and_async_epochs_of_one_server_never_regress(backend: Backend) -> None:
    """Sync and async grants of new names, interleaved: each draws the next epoch of the one
    row, whichever path took it."""
    epochs: list[int] = []

    def granted() -> None:
        grant = backend.try_acquire(unique(), "sync", 5.0)
        assert grant is not None
        backend.release(grant)
        epochs.append(grant.token >> COUNTER_BITS)

    async def main() -> None:
        try:
            for _ in range(3):
                grant = await backend.atry_acquire(unique(), "async", 5.0)
                assert grant is not None
                await backend.arelease(grant)
                epochs.append(grant.token >> COUNTER_BITS)
                await asyncio.to_thread(granted)
        finally:
            await backend.aclose()

    asyncio.run(main())
    granted()
    assert epochs == list(range(epochs[0], epochs[0] + 7)), epochs
    assert epoch_row(backend) == epochs[-1]


def test_an_async_grant_whose_epoch_database_stalls_fails_within_its_reply_deadline(
    backend: Backend,
) -> None:
    """The epoch statement gets no reply (its row is locked by another session): the try fails
    with ``FencingUnavailable`` at the connection's reply deadline, while the lock is still
    held, the loop turning meanwhile; nothing is held in Redis, and the next try, once the
    database answers, is granted with a higher epoch."""
    name = unique()
    before = backend.try_acquire(unique(), "sync", 5.0)
    assert before is not None
    backend.release(before)

    async def main() -> int:
        try:
            backend.epochs._aconnections.get().timeout = 1.0
            with locked_epoch_row(backend) as waiting:
                attempt = asyncio.ensure_future(backend.atry_acquire(name, "stalled", 30.0))
                await until(waiting, "the epoch statement to wait on the locked row")
                assert not attempt.done()
                async with asyncio.timeout(30):  # a hang fails the test, never blocks it
                    with pytest.raises(FencingUnavailable):
                        await attempt
            assert backend.inspect(name) is None
            grant = await backend.atry_acquire(name, "next", 30.0)
            assert grant is not None
            await backend.arelease(grant)
            return grant.token
        finally:
            await backend.aclose()

    assert asyncio.run(main()) >> COUNTER_BITS > before.token >> COUNTER_BITS


def test_a_child_forked_while_a_thread_holds_the_per_loop_lock_uses_its_async_counter(
    backend: Backend,
) -> None:
    """Another thread of the parent is inside the async counter's per-loop lock at the fork
    (it holds it here until the fork is done): the child, on a loop of its own, still draws
    an epoch, since its lock is its own. An alarm ends a child that hangs on the parent's."""
    resource = backend.epoch_resource
    backend.epochs.bump_fence(resource)  # the parent's sync connection is open too
    held, forked = threading.Event(), threading.Event()
    lock = backend.epochs._aconnections._lock

    def holder() -> None:
        with lock:
            held.set()
            forked.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's
                signal.alarm(60)  # its default action ends a hung child

                async def child() -> int:
                    try:
                        return await backend.epochs.abump_fence(resource)
                    finally:
                        await backend.epochs.aclose()

                code = 0 if asyncio.run(child()) > 0 else 3
            finally:
                os._exit(code)
    finally:
        forked.set()
        thread.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert backend.epochs.bump_fence(resource) > 0  # the parent's session still works
