"""Redlock's durable token statement: prepared, run by name in one round trip, and a session
that disagrees with what the connection believes (lost the statement, has it already) still
bumps the token exactly once per grant. On the async path the same statement is awaited on the
event loop's own connection, bounded by its reply deadline and given up on cancellation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest
import redis
from django.contrib.auth.models import Permission
from django.test import Client, override_settings
from django.urls import reverse

from devservers import RedisServer
from leases import acquire, operations
from leases.backends import Capability, get_backend
from leases.backends._counter import PREPARED_BUMP_LEASE
from leases.backends._pgconn import connect
from leases.backends.base import FORGED, Grant
from leases.backends.redis import LeaseKeys
from leases.backends.redlock import Backend
from leases.errors import BackendNotSupported, FencingUnavailable, LeaseNotHeld
from leases.models import Revocation
from tests.factories import StaffUserFactory

pytestmark = pytest.mark.django_db(transaction=True)

Servers = Callable[[int], list[RedisServer]]


@pytest.fixture
def backend(redis_servers: Servers) -> Iterator[Backend]:
    made = Backend("redlock-token-test", {"NODES": [s.url for s in redis_servers(3)]})
    try:
        yield made
    finally:
        made.close()


def counter_connection(backend: Backend) -> psycopg.Connection[Any]:
    backend.counter.current_lease("warm-up")  # opens the connection
    conn = backend.counter._connection.conn
    assert conn is not None
    return conn


def granted(backend: Backend, name: str) -> Grant:
    grant = backend.try_acquire(name, "token-test", 5.0)
    assert grant is not None
    backend.release(grant)
    return grant


def sent(conn: psycopg.Connection[Any], action: Callable[[], object]) -> list[list[str]]:
    """The protocol messages the client sent on ``conn`` during ``action`` (libpq's trace)."""
    with tempfile.TemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            action()
        finally:
            conn.pgconn.untrace()
        trace.seek(0)
        lines = [line.split("\t") for line in trace.read().splitlines()]
    return [parts[2:] for parts in lines if parts[0] == "F"]


def test_a_grants_token_is_the_prepared_statement_run_by_name(backend: Backend) -> None:
    """One round trip, no text to parse on the server: ``Bind`` of the statement's name (a
    plain-text statement would send ``Parse`` with its text every time)."""
    name = f"rl-token-{uuid.uuid4().hex[:8]}"
    first = granted(backend, name)  # prepares it in the counter's session
    grants: list[Grant] = []
    messages = sent(counter_connection(backend), lambda: grants.append(granted(backend, name)))
    kinds = [message[0] for message in messages]
    assert kinds.count("Sync") + kinds.count("Query") == 1
    assert "Parse" not in kinds and "Query" not in kinds
    (bind,) = [message for message in messages if message[0] == "Bind"]
    assert f'"{PREPARED_BUMP_LEASE.name}"' in " ".join(bind)
    assert grants[0].token == first.token + 1


def test_a_counter_session_that_lost_the_statement_bumps_once(backend: Backend) -> None:
    """``DISCARD ALL``, ``DEALLOCATE``, a pooler's other session: the refused run changed
    nothing, so the token still moves on by exactly one per grant."""
    name = f"rl-token-{uuid.uuid4().hex[:8]}"
    first = granted(backend, name)
    counter_connection(backend).execute("DEALLOCATE ALL")
    second = granted(backend, name)
    third = granted(backend, name)
    assert (second.token, third.token) == (first.token + 1, first.token + 2)
    assert backend.counter.current_lease(name) == third.token


def test_a_counter_session_that_already_has_the_statement_bumps_once(backend: Backend) -> None:
    """Another client of a pooler prepared it in this session: the ``PREPARE`` is refused
    before its ``EXECUTE`` runs, then the ``EXECUTE`` alone runs once."""
    name = f"rl-token-{uuid.uuid4().hex[:8]}"
    counter_connection(backend).execute(PREPARED_BUMP_LEASE.prepare_sql)
    first = granted(backend, name)
    second = granted(backend, name)
    assert second.token == first.token + 1
    assert backend.counter.current_lease(name) == second.token


# -- the async path: the token awaited on the event loop's own connection --------------------


class NoWorkerThreads(concurrent.futures.ThreadPoolExecutor):
    """A loop's default executor that refuses work: ``asyncio.to_thread`` and
    ``run_in_executor(None, ...)`` fail the call that used them."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{fn!r} was sent to a worker thread")


def async_counter_connection(backend: Backend) -> psycopg.AsyncConnection[Any]:
    """The running loop's token connection (open once a grant took a token)."""
    conn = backend.counter._aconnections.get().conn
    assert conn is not None
    return conn


def locked_token_row(name: str) -> contextlib.AbstractContextManager[Callable[[], bool]]:
    """``name``'s token row locked by another session, so the token statement waits on it
    (a token database that does not answer); yields whether a statement waits on the lock."""
    return locked_row(
        "INSERT INTO leases_lease (name, holder, token, meta) VALUES (%s, '', 1, '{}')"
        " ON CONFLICT (name) DO UPDATE SET holder = leases_lease.holder",
        name,
    )


@contextlib.contextmanager
def locked_row(upsert: str, key: str) -> Iterator[Callable[[], bool]]:
    """The row ``upsert`` writes for ``key`` locked by another session's open transaction
    until the block ends; yields whether some statement waits on that lock."""
    with connect("default") as locker:
        locker.execute("BEGIN")
        locker.execute(upsert, (key,))
        pid = locker.info.backend_pid

        def waiting() -> bool:
            with connect("default") as probe:
                row = probe.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                    (pid,),
                ).fetchone()
            return row is not None and row[0] > 0

        try:
            yield waiting
        finally:
            locker.execute("ROLLBACK")


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` off the loop until it holds, the loop free meanwhile."""
    deadline = time.monotonic() + 30
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def nodes_hold(servers: list[RedisServer], name: str) -> list[Any]:
    key = LeaseKeys.of("leases:", name).lock
    return [redis.Redis.from_url(server.url).get(key) for server in servers]


def test_an_async_grants_token_is_run_by_name_on_the_loops_own_connection(
    backend: Backend,
) -> None:
    """No worker thread on the async path (the loop's executor refuses work): the token is the
    prepared statement run by name (``Bind``, no ``Parse``, no query text) on an async
    connection of the loop, one round trip, as on the sync path."""
    name = f"rl-token-{uuid.uuid4().hex[:8]}"

    async def main() -> tuple[list[list[str]], list[int]]:
        asyncio.get_running_loop().set_default_executor(NoWorkerThreads())
        tokens = []
        try:
            for _ in range(2):  # the first prepares it in the session
                grant = await backend.atry_acquire(name, "async", 5.0)
                assert grant is not None
                await backend.arelease(grant)
                tokens.append(grant.token)
            conn = async_counter_connection(backend)

            async def third() -> None:
                grant = await backend.atry_acquire(name, "async", 5.0)
                assert grant is not None
                tokens.append(grant.token)
                await backend.arelease(grant)

            with tempfile.TemporaryFile("w+") as trace:
                conn.pgconn.trace(trace.fileno())
                conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
                try:
                    await third()
                finally:
                    conn.pgconn.untrace()
                trace.seek(0)
                lines = [line.split("\t") for line in trace.read().splitlines()]
            return [parts[2:] for parts in lines if parts[0] == "F"], tokens
        finally:
            await backend.aclose()

    messages, tokens = asyncio.run(main())
    kinds = [message[0] for message in messages]
    assert kinds.count("Sync") + kinds.count("Query") == 1, kinds
    assert "Parse" not in kinds and "Query" not in kinds, kinds
    (bind,) = [message for message in messages if message[0] == "Bind"]
    assert f'"{PREPARED_BUMP_LEASE.name}"' in " ".join(bind)
    assert tokens == [tokens[0], tokens[0] + 1, tokens[0] + 2]


def test_sync_and_async_grants_of_one_name_share_one_increasing_token(backend: Backend) -> None:
    """The sync connection and the loop's async one bump the same row: each grant's token is
    the one before it plus one, whichever path took it, and ``inspect`` reports the last."""
    name = f"rl-token-{uuid.uuid4().hex[:8]}"
    tokens: list[int] = []

    async def agranted() -> None:
        grant = await backend.atry_acquire(name, "async", 5.0)
        assert grant is not None
        tokens.append(grant.token)
        await backend.arelease(grant)

    async def main() -> None:
        try:
            for _ in range(3):
                await agranted()
                tokens.append(await asyncio.to_thread(lambda: granted(backend, name).token))
        finally:
            await backend.aclose()

    asyncio.run(main())
    tokens.append(granted(backend, name).token)
    assert tokens == list(range(tokens[0], tokens[0] + 7)), tokens
    info = backend.inspect(name)
    assert info is not None and info.token == tokens[-1]


def test_an_async_try_whose_token_database_stalls_fails_within_its_reply_deadline(
    redis_servers: Servers,
) -> None:
    """The token statement gets no reply (its row is locked by another session): the try fails
    with ``FencingUnavailable`` at the connection's reply deadline, not when the database
    answers (the lock is let go only after the try ended), the loop turning meanwhile; the
    quorum it won is given back, and the next try, once the database answers, is granted a
    higher token."""
    servers = redis_servers(3)
    backend = Backend("redlock-token-stall", {"NODES": [s.url for s in servers]})
    name = f"rl-token-{uuid.uuid4().hex[:8]}"
    first = granted(backend, name)

    async def stalled_try(waiting: Callable[[], bool]) -> None:
        backend.counter._aconnections.get().timeout = 1.0
        attempt = asyncio.ensure_future(backend.atry_acquire(name, "stalled", 30.0))
        await until(waiting, "the token statement to wait on the locked row")
        assert not attempt.done()
        async with asyncio.timeout(30):  # a hang fails the test, never blocks it
            with pytest.raises(FencingUnavailable):
                await attempt

    async def main() -> int:
        try:
            with locked_token_row(name) as waiting:
                await stalled_try(waiting)
            await until(lambda: nodes_hold(servers, name) == [None] * 3, "the give-back")
            grant = await backend.atry_acquire(name, "next", 30.0)
            assert grant is not None
            await backend.arelease(grant)
            return grant.token
        finally:
            await backend.aclose()

    try:
        assert asyncio.run(main()) > first.token
    finally:
        backend.close()


def test_cancelling_an_async_try_while_its_token_is_awaited_leaves_nothing_held(
    redis_servers: Servers,
) -> None:
    """Cancelled while the token statement waits (the quorum is won): the cancellation ends the
    try at once (the row lock is let go only after it), gives the quorum back and drops the
    connection, whose statement's outcome is unknown; the next try is granted."""
    servers = redis_servers(3)
    backend = Backend("redlock-token-cancel", {"NODES": [s.url for s in servers]})
    name = f"rl-token-{uuid.uuid4().hex[:8]}"
    first = granted(backend, name)

    async def main() -> int:
        try:
            with locked_token_row(name) as waiting:
                attempt = asyncio.ensure_future(backend.atry_acquire(name, "cancelled", 30.0))
                await until(waiting, "the token statement to wait on the locked row")
                attempt.cancel()
                async with asyncio.timeout(30):
                    with pytest.raises(asyncio.CancelledError):
                        await attempt
                assert backend.counter._aconnections.get().conn is None  # dropped
            await until(lambda: nodes_hold(servers, name) == [None] * 3, "the give-back")
            grant = await backend.atry_acquire(name, "next", 30.0)
            assert grant is not None
            await backend.arelease(grant)
            return grant.token
        finally:
            await backend.aclose()

    try:
        assert asyncio.run(main()) > first.token
    finally:
        backend.close()


def test_async_refusals_check_the_current_token_on_the_loop_too(backend: Backend) -> None:
    """A refusal whose cause only the token can tell (a quorum knows the holder, not this
    secret) reads the current token on the loop's connection, no worker thread: a forged
    grant of the current token is told apart from a lost lease, for renewal and release."""
    name = f"rl-token-{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(NoWorkerThreads())
        try:
            grant = await backend.atry_acquire(name, "async", 30.0)
            assert grant is not None
            forged = replace(grant, secret="forged")
            with pytest.raises(LeaseNotHeld) as renewing:
                await backend.arenew(forged, 30.0)
            with pytest.raises(LeaseNotHeld) as releasing:
                await backend.arelease(forged)
            assert FORGED in str(renewing.value) and FORGED in str(releasing.value)
            await backend.arelease(grant)  # the real grant was untouched
        finally:
            await backend.aclose()

    asyncio.run(main())


def test_a_forked_child_never_ends_the_parents_async_token_session(backend: Backend) -> None:
    """Forked from inside a coroutine after an async grant, the child takes tokens on an event
    loop and an async connection of its own and closes them; the parent's loop keeps its token
    connection and server session (a child closing the parent's would end it)."""
    name = f"rl-token-{uuid.uuid4().hex[:8]}"

    async def child() -> None:
        try:
            grant = await backend.atry_acquire(name, "child", 5.0)
            assert grant is not None
            await backend.arelease(grant)
        finally:
            await backend.aclose()

    async def main() -> tuple[int, int, int]:
        try:
            grant = await backend.atry_acquire(name, "parent", 5.0)
            assert grant is not None
            await backend.arelease(grant)
            conn = async_counter_connection(backend)
            session = conn.info.backend_pid
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    asyncio.run(child())
                    code = 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            again = await backend.atry_acquire(name, "parent", 5.0)
            assert again is not None
            await backend.arelease(again)
            assert async_counter_connection(backend) is conn and not conn.closed
            return os.waitstatus_to_exitcode(status), session, conn.info.backend_pid
        finally:
            await backend.aclose()

    code, before, after = asyncio.run(main())
    assert code == 0
    assert before == after


_custom_tokens = itertools.count(1000)


def custom_token(name: str) -> int:
    """A custom ``TOKEN_SOURCE``: strictly increasing, kept to itself."""
    return next(_custom_tokens)


def test_a_custom_token_source_cannot_force_release_and_shows_no_token(
    redis_servers: Servers,
) -> None:
    """``inspect`` and ``force_release`` read the database row a custom source never writes:
    a held lease showed token 0 (or a stale one) and every revocation was refused as "never
    granted". Now the token shows as unknown (0) and force release is refused up front."""
    options = {
        "NODES": [s.url for s in redis_servers(3)],
        "TOKEN_SOURCE": f"{__name__}.custom_token",
    }
    backend = Backend("redlock-token-custom", options)
    try:
        grant = backend.try_acquire(f"custom-{uuid.uuid4().hex[:8]}", "worker", 30.0)
        assert grant is not None and grant.token >= 1000
        backend.counter.bump_lease(grant.name)  # a stale row, as after switching sources
        info = backend.inspect(grant.name)
        assert info is not None and info.held and info.token == 0
        with pytest.raises(BackendNotSupported, match="custom TOKEN_SOURCE"):
            backend.force_release(grant.name, grant.token)
        backend.renew(grant, 30.0)  # nothing was taken away
    finally:
        backend.close()


def test_a_custom_token_source_offers_no_force_release(
    redis_servers: Servers, client: Client
) -> None:
    """The backend refuses force release with a custom ``TOKEN_SOURCE`` (above), yet declared
    the capability (a class attribute, the same for every configuration): the every-backend
    admin page offered "Force release…" on its held leases, and the operator path answered
    the click with "its token is now 0" instead of saying the backend cannot do it."""
    config = {
        "ENGINE": "leases.backends.redlock",
        "NODES": [s.url for s in redis_servers(3)],
        "TOKEN_SOURCE": f"{__name__}.custom_token",
    }
    backends = {"default": {"ENGINE": "leases.backends.database"}, "custom": config}
    with override_settings(LEASES={"BACKENDS": backends}):
        store = get_backend("custom")
        assert Capability.FORCE_RELEASE not in store.capabilities
        assert Capability.FORCE_RELEASE in get_backend("default").capabilities
        operator: Any = StaffUserFactory()
        codenames = ["view_lease", "force_release_lease"]
        operator.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
        client.force_login(operator)
        custom = store.try_acquire(f"custom-{uuid.uuid4().hex[:8]}", "worker", 30.0)
        assert custom is not None
        database = acquire(f"custom-db-{uuid.uuid4().hex[:8]}", ttl=30, timeout=0)
        try:
            page = client.get(reverse("admin:leases_backendlease_changelist")).content.decode()
            rows = dict(
                re.findall(r'<tr class="lease-row" data-name="([^"]+)">(.*?)</tr>', page, re.S)
            )
            assert "force-release" not in rows[custom.name]
            assert "force-release" in rows[database.name]
            with pytest.raises(BackendNotSupported, match="force release"):
                operations.force_release(
                    custom.name, backend="custom", token=1, user=operator, via="command"
                )
            assert not Revocation.objects.filter(name=custom.name).exists()
        finally:
            store.release(custom)
            database.release()
