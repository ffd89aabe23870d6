"""The database backend's async I/O: psycopg's ``AsyncConnection``, one set per event loop.

The twins of :class:`~leases.backends._pgconn.PrivateConnection` and
:class:`~leases.backends._pgconn.Listener`: the same parameters, autocommit and
``synchronous_commit`` (:func:`~leases.backends._pgconn.connect_params`), but awaited, so a
statement or a wait never blocks the event loop. :class:`AsyncState` gathers what one loop
uses, made on its first use there (see :mod:`~leases.backends._aio`).

A statement interrupted by cancellation may leave its connection mid-protocol, so the
connection is dropped then and the next statement reconnects (lease state lives in the table,
not the session). ``aacquire()`` never cancels an acquire or a release halfway anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import psycopg

from .._pgdeadline import REQUEST_TIMEOUT, Deadline, aarmed
from .._pgpooler import BACKEND_PID_SQL
from ..errors import BackendUnavailable
from ._pgconn import LISTEN_SQL, cannot_connect, connect_params, remember, stale
from ._pgpooled import keeps_sessions, warn_unheard
from ._pgprepared import Prepared, arun_prepared

__all__ = ["AsyncListener", "AsyncPrivateConnection", "AsyncState", "aconnect"]

logger = logging.getLogger("leases")

#: How long :meth:`AsyncListener.close` waits for its cancelled task to end, twice at most.
_CLOSE_WAIT = 1.0


async def aconnect(db_alias: str, alias: str | None = None) -> psycopg.AsyncConnection[Any]:
    """:func:`~leases.backends._pgconn.connect`, async."""
    connecting = connect_params(db_alias)
    conn = None
    try:
        conn = await psycopg.AsyncConnection.connect(autocommit=True, **connecting.params)
        setup = connecting.setup(conn.info)
        if setup is not None:
            await conn.execute(setup)
    except psycopg.Error as exc:
        if conn is not None:
            await _aclose_quietly(conn)
        raise BackendUnavailable(alias or db_alias, cannot_connect(db_alias, exc)) from exc
    return conn


async def _aclose_quietly(conn: psycopg.AsyncConnection[Any] | None) -> None:
    if conn is not None:
        with contextlib.suppress(Exception):
            await conn.close()


class AsyncPrivateConnection:
    """One private async connection for one loop; its tasks take turns on it."""

    def __init__(
        self,
        db_alias: str,
        timeout: float = REQUEST_TIMEOUT,
        *,
        prepared: bool = True,
        alias: str | None = None,
    ) -> None:
        self.db_alias = db_alias
        #: The lease backend errors are raised for (default: the database alias).
        self.alias = alias or db_alias
        self.timeout = timeout
        self.prepared = prepared
        self._lock = asyncio.Lock()
        self.conn: psycopg.AsyncConnection[Any] | None = None
        #: The prepared statements the open connection's session is known to have.
        self._names: set[str] = set()

    async def run(
        self, statement: str | Prepared, params: Mapping[str, Any], timeout: float | None = None
    ) -> list[tuple[Any, ...]]:
        """Run one statement and fetch its rows: one round trip on an open connection.

        Waits for the reply and raises as the sync one does (:meth:`PrivateConnection.run`);
        a :class:`~._pgprepared.Prepared` statement is sent prepared unless ``prepared`` is
        false (see :func:`~._pgprepared.arun_prepared`).
        """
        async with self._lock:
            conn = self.conn
            if conn is None or stale(conn):
                await _aclose_quietly(conn)
                conn = self.conn = None
                self._names = set()
                conn = self.conn = await aconnect(self.db_alias, self.alias)
            due = Deadline(conn.fileno(), self.timeout if timeout is None else timeout)
            try:
                with aarmed(due):
                    if isinstance(statement, Prepared):
                        if self.prepared:
                            return await arun_prepared(conn, statement, params, self._names)
                        statement = statement.sql
                    cursor = await conn.execute(statement, params)
                    return await cursor.fetchall() if cursor.description else []
            except psycopg.Error as exc:
                if conn.broken or conn.closed or due.fired:
                    await self.close()
                if due.fired:
                    raise BackendUnavailable(self.alias, due.why()) from exc
                raise
            except asyncio.CancelledError:
                await self.close()  # maybe mid-protocol: never reuse it
                raise

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        self._names = set()
        await _aclose_quietly(conn)


class AsyncListener:
    """One ``LISTEN`` connection and task per loop; remembers when each name was released.

    Behind a pooler not declared a session pooler it does not listen, as the sync
    :class:`~._pgconn.Listener`: it becomes :attr:`deaf` and :meth:`wait` waits out its
    timeout."""

    def __init__(
        self, db_alias: str, alias: str | None = None, *, session_pooling: bool = False
    ) -> None:
        self._db_alias = db_alias
        self._alias = alias or db_alias
        self._session_pooling = session_pooling
        self._released: OrderedDict[str, float] = OrderedDict()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        #: The task's connection, for :meth:`close` to close under a wait that outlives its
        #: cancellation.
        self._conn: psycopg.AsyncConnection[Any] | None = None
        #: Whether it found a pooler in the way and will never listen.
        self.deaf = False

    async def _run(self) -> None:
        me = asyncio.current_task()
        while self._task is me:  # closed: no longer (a cancellation the driver swallowed)
            conn = None
            try:
                conn = self._conn = await aconnect(self._db_alias)
                row = await (await conn.execute(BACKEND_PID_SQL)).fetchone()
                if row is None or not keeps_sessions(conn, row[0], self._session_pooling):
                    self.deaf = True
                    warn_unheard(self._alias)
                    return
                await conn.execute(LISTEN_SQL)
                async for note in conn.notifies():
                    await self._record(note.payload)
            except (psycopg.Error, BackendUnavailable, OSError) as exc:
                if self._task is not me:
                    return  # closed under its wait by close()
                logger.debug("leases: async LISTEN connection failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
            finally:
                await _aclose_quietly(conn)
                if self._conn is conn:  # no closed connection kept for close() to close again
                    self._conn = None

    async def _record(self, name: str) -> None:
        async with self._changed:
            remember(self._released, name, time.monotonic())
            self._changed.notify_all()

    async def wait(self, name: str, since: float, timeout: float) -> bool:
        """Whether ``name`` was released after ``since``, waiting up to ``timeout`` for it."""
        if not self.deaf and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name=f"leases-alisten-{self._db_alias}")
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(
                    lambda: self._released.get(name, float("-inf")) >= since
                )
                return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        """Cancel the task and wait for it to end, a bounded time.

        A driver's wait may outlive its cancellation: psycopg up to 3.3.0 waits for a
        cancelled wait's query to end with no bound (its issue 1371), and ``aclose()``, which
        awaited the task, hung with it (and ``asyncio.run`` too, which awaits every task left
        as the loop ends). So after :data:`_CLOSE_WAIT` its connection is closed under it,
        which ends any wait on it; a task still running after that is left, logged.
        """
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=_CLOSE_WAIT)
        if not done:
            await _aclose_quietly(self._conn)
            done, _ = await asyncio.wait({task}, timeout=_CLOSE_WAIT)
        if not done:
            logger.warning("leases: the LISTEN task of %r did not end when closed", self._alias)
            return
        if not task.cancelled():
            task.result()  # its own failure, as awaiting it raised it


class AsyncState:
    """What the database backend uses on one event loop: a connection for statements, a
    listener for waits, and when each task's last try of each name failed (a release after
    that moment must wake the wait that follows)."""

    def __init__(
        self,
        db_alias: str,
        timeout: float = REQUEST_TIMEOUT,
        *,
        prepared: bool = True,
        alias: str | None = None,
        session_pooling: bool = False,
    ) -> None:
        self.conn = AsyncPrivateConnection(db_alias, timeout, prepared=prepared, alias=alias)
        self.listener = AsyncListener(db_alias, alias, session_pooling=session_pooling)
        self.failed_at: OrderedDict[tuple[int, str], float] = OrderedDict()

    @staticmethod
    def task_id() -> int:
        return id(asyncio.current_task())

    def failed(self, name: str, sent_at: float) -> None:
        """Remember when this task's try of ``name`` was sent, for the wait that may follow.

        Only the latest are kept (:func:`~._pgconn.remember`): a failed try that no wait
        follows (``timeout=0``, the other slots of a full semaphore) would otherwise stay for
        the loop's whole life, one entry per task and name."""
        remember(self.failed_at, (self.task_id(), name), sent_at)

    def failed_since(self, name: str) -> float:
        """When this task's last failed try of ``name`` was sent (now, if not remembered)."""
        return self.failed_at.pop((self.task_id(), name), time.monotonic())

    async def close(self) -> None:
        await self.listener.close()
        await self.conn.close()
