"""The database backend's acquire, renew and release run as prepared statements of its own
names, and every way a session can disagree with what the connection believes (lost them, has
them already) still runs the statement exactly once; ``PREPARED_STATEMENTS`` off sends plain
text."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from leases import aacquire, acquire
from leases.backends import get_backend
from leases.backends._pgconn import PrivateConnection, connect
from leases.backends._pgprepared import Prepared, run_prepared
from leases.backends._tenure import PREPARED_QUEUE, PREPARED_QUEUED_ACQUIRE
from leases.backends.database import (
    ACQUIRE_SQL,
    PREPARED_ACQUIRE,
    PREPARED_OWN_ACQUIRE,
    PREPARED_PINNED_RELEASE,
    PREPARED_RELEASE,
    PREPARED_RENEW,
    PREPARED_ROOM_ACQUIRE,
    RELEASE_SQL,
    RENEW_SQL,
    Backend,
)
from tests.lease_backends import lease_name
from tests.test_lease_database import room_locks, round_trips, waiting_behind_a_holder

__all__ = ["lease_name"]

pytestmark = pytest.mark.django_db

#: What a sync grant on the own connection runs: it takes its tenure lock, and its release
#: unlocks it (see ``_tenure.Tenures``).
OURS = {PREPARED_OWN_ACQUIRE.name, PREPARED_RENEW.name, PREPARED_PINNED_RELEASE.name}
#: An async grant takes none.
ASYNC_OURS = {PREPARED_ACQUIRE.name, PREPARED_RENEW.name, PREPARED_RELEASE.name}


def session_statements(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """The backend's statements prepared in ``conn``'s session -> times run with a plan."""
    rows = conn.execute(
        "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements"
        " WHERE name LIKE 'leases\\_%%'"
    ).fetchall()
    return dict(rows)


def own_connection(backend: Backend) -> psycopg.Connection[Any]:
    backend.inspect("warm-up")  # opens the connection
    conn = backend.connection()
    assert conn is not None
    return conn


@pytest.fixture
def fresh() -> Iterator[Backend]:
    """A database backend with a connection of its own, new to every statement."""
    backend = Backend("prepared-test", {})
    backend._probe_pooler()  # as a process's first grant does: then its grants take tenures
    try:
        yield backend
    finally:
        backend.close()


def test_acquire_renew_release_run_prepared(lease_name: str) -> None:
    backend = get_backend("default")
    assert isinstance(backend, Backend)
    backend._probe_pooler()
    held = acquire(lease_name, ttl=5, keepalive=False)
    held.renew()
    held.release()
    backend = get_backend("default")
    assert isinstance(backend, Backend)
    ran = session_statements(own_connection(backend))
    assert set(ran) >= OURS
    assert all(ran[name] >= 1 for name in OURS)


def test_names_are_the_text_so_no_session_runs_another_text() -> None:
    """Behind a pooler one server session serves many clients: a name it already has must
    stand for the very same text, so the name is derived from the text."""
    assert Prepared("acquire", ACQUIRE_SQL).name == PREPARED_ACQUIRE.name
    assert Prepared("acquire", ACQUIRE_SQL + " ").name != PREPARED_ACQUIRE.name
    assert len({PREPARED_ACQUIRE.name, PREPARED_RENEW.name, PREPARED_RELEASE.name}) == 3
    assert (PREPARED_RENEW.sql, PREPARED_RELEASE.sql) == (RENEW_SQL, RELEASE_SQL)


def test_a_session_that_lost_the_statements_prepares_them_again(
    lease_name: str, fresh: Backend
) -> None:
    """``DISCARD ALL`` (or a pooler's other session): the refused ``EXECUTE`` ran nothing, so
    the token moves on by exactly one per grant, at one more round trip."""
    first = fresh.try_acquire(lease_name, "discarded", 5.0)
    assert first is not None
    fresh.release(first)
    conn = own_connection(fresh)
    conn.execute("DEALLOCATE ALL")
    grants = []
    # The refused EXECUTE, then PREPARE and EXECUTE in one query.
    assert round_trips(lambda: grants.append(fresh.try_acquire(lease_name, "d", 5.0)), fresh) == 2
    (second,) = grants
    assert second is not None and second.token == first.token + 1
    conn.execute("DEALLOCATE ALL")
    fresh.release(second)
    info = fresh.inspect(lease_name)
    assert info is not None and not info.held and info.token == second.token
    assert set(session_statements(conn)) == {PREPARED_PINNED_RELEASE.name}  # the one run since


def test_a_session_that_already_has_the_statement_runs_it_once(
    lease_name: str, fresh: Backend
) -> None:
    """Another client of a pooler prepared it in this session: the ``PREPARE`` is refused
    before the ``EXECUTE`` in its query runs, then the ``EXECUTE`` alone runs it once."""
    conn = own_connection(fresh)
    conn.execute(PREPARED_OWN_ACQUIRE.prepare_sql)
    conn.execute(PREPARED_PINNED_RELEASE.prepare_sql)
    tokens = []
    for _ in range(2):
        grant = fresh.try_acquire(lease_name, "pooled", 5.0)
        assert grant is not None
        tokens.append(grant.token)
        fresh.release(grant)
    assert tokens[1] == tokens[0] + 1
    ran = session_statements(conn)
    assert ran[PREPARED_OWN_ACQUIRE.name] == 2 and ran[PREPARED_PINNED_RELEASE.name] == 2


def test_prepared_statements_off_sends_plain_text(lease_name: str) -> None:
    backend = Backend("plain-test", {"PREPARED_STATEMENTS": False})
    try:
        grant = backend.try_acquire(lease_name, "plain", 5.0)
        assert grant is not None
        backend.release(backend.renew(grant, 5.0))
        assert session_statements(own_connection(backend)) == {}
    finally:
        backend.close()


def test_prepared_statements_option_must_be_a_bool() -> None:
    problems = Backend.check_options("x", {"PREPARED_STATEMENTS": "yes"})
    assert problems == ['LEASES["BACKENDS"][\'x\']["PREPARED_STATEMENTS"] must be True or False']
    assert Backend.check_options("x", {"PREPARED_STATEMENTS": False}) == []


def test_a_plan_a_migration_made_stale_is_prepared_anew() -> None:
    """A column's type changed under a prepared statement: the session refuses its plan
    ("cached plan must not change result type") until it is made again, so it is."""
    probe = Prepared("probe", "SELECT value FROM leases_prepared_probe WHERE id = %(id)s::int")
    conn = PrivateConnection("default")
    with own_autocommit() as ddl:
        ddl.execute("DROP TABLE IF EXISTS leases_prepared_probe")
        ddl.execute("CREATE TABLE leases_prepared_probe (id int PRIMARY KEY, value int)")
        ddl.execute("INSERT INTO leases_prepared_probe VALUES (1, 7)")
        try:
            assert conn.run(probe, {"id": 1}) == [(7,)]
            assert conn.run(probe, {"id": 1}) == [(7,)]  # by name now
            ddl.execute("ALTER TABLE leases_prepared_probe ALTER value TYPE text")
            assert conn.run(probe, {"id": 1}) == [("7",)]
        finally:
            conn.close()
            ddl.execute("DROP TABLE leases_prepared_probe")


@contextmanager
def own_autocommit() -> Iterator[psycopg.Connection[Any]]:
    ddl = connect("default")
    try:
        yield ddl
    finally:
        ddl.close()


async def async_session_statements(backend: Backend) -> dict[str, int]:
    """:func:`session_statements` of the running loop's async connection of ``backend``."""
    rows = await backend._async.get().conn.run(
        "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements"
        " WHERE name LIKE 'leases\\_%%'",
        {},
    )
    return dict(rows)


def test_async_acquire_renew_release_run_prepared_and_survive_a_lost_session(
    lease_name: str, fresh: Backend
) -> None:
    """The async path prepares the same statements (the server's parse and plan of each is
    most of what a plain statement costs it); a session that lost them (``DISCARD ALL``, a
    pooler's other session) runs each grant exactly once all the same."""

    async def main() -> tuple[dict[str, int], list[int], dict[str, int]]:
        try:
            grant = await fresh.atry_acquire(lease_name, "async", 5.0)
            assert grant is not None
            await fresh.arelease(await fresh.arenew(grant, 5.0))
            before = await async_session_statements(fresh)
            await fresh._async.get().conn.run("DEALLOCATE ALL", {})
            tokens = [grant.token]
            for _ in range(2):
                again = await fresh.atry_acquire(lease_name, "async", 5.0)
                assert again is not None
                tokens.append(again.token)
                await fresh.arelease(again)
            return before, tokens, await async_session_statements(fresh)
        finally:
            await fresh.aclose()

    before, tokens, after = asyncio.run(main())
    assert set(before) == ASYNC_OURS and all(before[name] == 1 for name in ASYNC_OURS)
    assert tokens == [tokens[0], tokens[0] + 1, tokens[0] + 2]
    assert after == {PREPARED_ACQUIRE.name: 2, PREPARED_RELEASE.name: 2}


def test_async_prepared_statements_off_sends_plain_text(lease_name: str) -> None:
    backend = Backend("plain-async-test", {"PREPARED_STATEMENTS": False})

    async def main() -> dict[str, int]:
        try:
            grant = await backend.atry_acquire(lease_name, "plain", 5.0)
            assert grant is not None
            await backend.arelease(await backend.arenew(grant, 5.0))
            return await async_session_statements(backend)
        finally:
            await backend.aclose()

    try:
        assert asyncio.run(main()) == {}
    finally:
        backend.close()


@pytest.fixture
def empty_room() -> Iterator[None]:
    """The default backend's room with no idle connection left by earlier tests (whose
    sessions have run the room's try already), before and after."""
    backend = get_backend("default")
    assert isinstance(backend, Backend)
    backend._room.close()
    yield
    backend._room.close()


def handed_over_in_the_room(name: str) -> psycopg.Connection[Any]:
    """Hold ``name``, let one thread wait for it inside its room, release: the waiter's try
    runs on its room connection. Returns that connection, taken from the room's idle ones
    (its last reply read) for the caller to inspect and close."""
    holder, waiter, tokens = waiting_behind_a_holder(name)
    holder.release()
    waiter.join(15)
    assert len(tokens) == 1 and tokens[0] == holder.token + 1
    backend = get_backend("default")
    assert isinstance(backend, Backend)
    return backend._room._connection()


def test_the_waiters_try_in_the_room_runs_prepared(lease_name: str, empty_room: None) -> None:
    """The try inside the room is on the hand-off's path (the holder's release, then this
    try's grant, then the new holder returns): sent as text, its parse and plan cost the
    server more than running it. A thread's try is the queued one (see
    ``leases.backends._tenure``, two statements): the first on a room connection prepares
    them, the next run them by name, and the kept connection's release is prepared likewise;
    a session that lost them (``DEALLOCATE ALL``) prepares them again, granting once."""
    tried = {PREPARED_QUEUE.name, PREPARED_QUEUED_ACQUIRE.name, PREPARED_PINNED_RELEASE.name}
    conn = handed_over_in_the_room(lease_name)
    try:
        # Refused once (the holder won outside the room and keeps no tenure lock), then
        # granted; the grant kept the connection, and its release ran there.
        assert session_statements(conn) == {
            PREPARED_QUEUE.name: 2,
            PREPARED_QUEUED_ACQUIRE.name: 2,
            PREPARED_PINNED_RELEASE.name: 1,
        }
        get_backend("default")._room._idle.append(conn)  # type: ignore[attr-defined]
        conn = handed_over_in_the_room(lease_name)
        # The holder may have waited in the room too, on a connection of its own: which
        # connection the waiter's visit took, and how often each ran there, may vary.
        assert set(session_statements(conn)) == tried
        conn.execute("DEALLOCATE ALL")
        get_backend("default")._room._idle.append(conn)  # type: ignore[attr-defined]
        conn = handed_over_in_the_room(lease_name)  # the token moved on by one: asserted there
        assert set(session_statements(conn)) == tried
    finally:
        conn.close()


def test_the_waiters_try_in_the_room_is_plain_text_with_prepared_statements_off(
    lease_name: str, monkeypatch: pytest.MonkeyPatch, empty_room: None
) -> None:
    backend = get_backend("default")
    assert isinstance(backend, Backend)
    monkeypatch.setattr(backend._room, "prepared", False)
    conn = handed_over_in_the_room(lease_name)
    try:
        assert session_statements(conn) == {}
    finally:
        conn.close()


def test_the_async_waiters_try_in_the_room_runs_prepared(lease_name: str, empty_room: None) -> None:
    """:func:`test_the_waiters_try_in_the_room_runs_prepared` for ``aacquire``."""
    holder = acquire(lease_name, ttl=30, keepalive=False, holder="holder")
    backend = get_backend("default")
    assert isinstance(backend, Backend)

    async def main() -> tuple[int, dict[str, int]]:
        room = backend._aroom.get()

        async def wait() -> int:
            held = await aacquire(lease_name, ttl=5, timeout=30, keepalive=False)
            await held.arelease()
            return held.token

        waiter = asyncio.create_task(wait())
        for _ in range(750):  # bounded: 15 s
            if await asyncio.to_thread(room_locks, lease_name) == {True: 1}:
                break
            await asyncio.sleep(0.02)
        await asyncio.to_thread(holder.release)
        async with asyncio.timeout(30):
            token = await waiter
        (conn,) = room._idle
        cursor = await conn.execute(
            "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements"
            " WHERE name LIKE 'leases\\_%%'"
        )
        ran = dict(await cursor.fetchall())
        await backend.aclose()
        return token, ran

    token, ran = asyncio.run(main())
    assert token == holder.token + 1
    assert ran == {PREPARED_ROOM_ACQUIRE.name: 1}


def test_a_notification_read_with_a_prepared_statements_reply_is_kept(
    fresh: Backend,
) -> None:
    """A listening connection (a waiting room's) that runs a prepared statement gets the
    notifications that arrived with its reply from ``notifies()``: libpq reads them while it
    waits for the reply, and left in its queue they were never yielded (``notifies()`` waits
    for the socket), so the waiter inside the room slept through the release it had missed."""
    notify = Prepared("test_notify", "SELECT pg_notify('leases_test', %(payload)s::text)")
    conn = connect("default")
    try:
        conn.execute("LISTEN leases_test")
        names: set[str] = set()
        for payload in ("first", "second"):  # PREPARE and EXECUTE, then run by name
            run_prepared(conn, notify, {"payload": payload}, names)
        assert names == {notify.name}
        heard = [note.payload for note in conn.notifies(timeout=0.5, stop_after=2)]
        assert heard == ["first", "second"]
    finally:
        conn.close()


def _query_texts() -> list[str]:
    """What ``pg_stat_activity`` shows of every session (a monitoring role sees as much)."""
    with connect("default") as observer:
        return [row[0] for row in observer.execute("SELECT query FROM pg_stat_activity")]


def test_a_grants_secret_never_appears_in_pg_stat_activity(lease_name: str) -> None:
    """A statement the session did not have was sent as ``PREPARE ...; EXECUTE name('<the
    secret>')``: PostgreSQL keeps that whole text as the statement's source and shows it in
    ``pg_stat_activity`` each time the statement runs again, so the first grant's secret
    stayed readable to monitoring roles (and usable: it releases the lease) for the
    session's life."""
    backend = Backend("secret-in-text-test", {})
    try:
        first = backend.try_acquire(lease_name, "first", 30.0)
        second = backend.try_acquire(f"{lease_name}-2", "second", 30.0)
        assert first is not None and second is not None
        seen = []
        for grant in (first, first, second):  # the session's first renewal, then by name
            backend.renew(grant, 30.0)
            seen += [t for t in _query_texts() if first.secret in t or second.secret in t]
        assert seen == []
        backend.release(first)
        backend.release(second)
    finally:
        backend.close()


def test_an_async_grants_secret_never_appears_in_pg_stat_activity(lease_name: str) -> None:
    async def grants() -> list[str]:
        backend = Backend("secret-in-text-async-test", {})
        try:
            first = await backend.atry_acquire(lease_name, "first", 30.0)
            second = await backend.atry_acquire(f"{lease_name}-2", "second", 30.0)
            assert first is not None and second is not None
            seen = []
            for grant in (first, first, second):
                await backend.arenew(grant, 30.0)
                texts = await asyncio.to_thread(_query_texts)
                seen += [t for t in texts if first.secret in t or second.secret in t]
            await backend.arelease(first)
            await backend.arelease(second)
            return seen
        finally:
            await backend.aclose()
            backend.close()

    assert asyncio.run(grants()) == []
