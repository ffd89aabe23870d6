"""PostgreSQL advisory locks, scoped to a transaction or to a database session.

``xact_lock`` is the one to reach for: the server releases it when the outermost
``transaction.atomic()`` ends (commit or rollback), so no code path can forget to unlock, and
the protected writes commit before anyone else can take the lock. ``session_lock`` spans
transactions (a long management command) and must be unlocked by the same session; its exit
checks that the unlock really happened.

Behaviour pinned by the tests (``tests/test_advisory.py``):

* An xact lock taken inside a savepoint (a nested ``atomic()``) that rolls back is released
  with the savepoint; one taken in a savepoint that is released lives until the outermost
  ``atomic()`` ends.
* A ``timeout`` is sent in the same message as the lock, inside a savepoint, so a timeout
  (``55P03``) raises :class:`LeaseUnavailable` and leaves the caller's transaction usable, and the
  caller's own ``lock_timeout`` is restored afterwards. Without a timeout no savepoint is taken:
  one statement, one round trip.
* An exception raised by a signal handler while a lock call waits (Ctrl-C, Celery's soft time
  limit) leaves no lock held that the caller cannot know of, and the connection usable: the
  wait is cancelled and a session lock granted meanwhile is unlocked before the exception goes
  on (:func:`_settle_interrupted`).
* A session whose connection is killed (``pg_terminate_backend``, a server restart) loses its
  session locks at once; the holder learns it at its next :meth:`AdvisoryLock.ensure_held` or at
  the block's exit, both of which raise :class:`LeaseLost`.
* A connection that goes silent (a half-open peer, or a middlebox that keeps TCP alive while
  replies are lost) cannot hang that check: each waits at most :data:`CHECK_TIMEOUT` seconds
  for its answer, then shuts the connection down (which ends the session and its locks, once
  the server hears of it) and raises :class:`LeaseLost`. A holder that cannot prove it holds
  must not go on as if it did.

Names map to keys with :func:`leases.keys.advisory_key` (stable forever). Names are not recorded
in ``leases_advisory_name`` here (``leases.operations.remember_advisory_names`` does that, once,
outside any transaction): an insert in the caller's transaction could wait on, or abort
with, another transaction taking the same name, breaking shared locks.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
import weakref
from collections.abc import Callable
from contextlib import ContextDecorator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, TypeVar

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db import Error as DjangoDatabaseError
from django.db import InterfaceError as DjangoInterfaceError
from django.db import OperationalError as DjangoOperationalError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import TransactionManagementError
from psycopg.pq import TransactionStatus

from . import _advisory_names, _session_leaks, conf
from ._arguments import valid_flag, valid_timeout
from ._pgcancel import cancel_running
from ._pgdeadline import Deadline, armed
from ._pgpooler import BACKEND_PID_SQL, behind_pooler
from .errors import (
    BackendNotSupported,
    BackendUnavailable,
    InvalidLeaseOption,
    LeaseDeadlock,
    LeaseError,
    LeaseLost,
    LeaseNotHeld,
    LeaseUnavailable,
    NotInTransaction,
)
from .keys import LockKey, advisory_key, split_key

__all__ = ["AdvisoryLock", "session_lock", "try_xact_lock", "xact_lock"]

# Server functions, by ``shared``. Keys are always rendered from Python ints (never from user
# text), so statements can be sent without parameters: that keeps the simple query protocol,
# which accepts several statements in one message whatever cursor class Django uses.
XACT_LOCK = {False: "pg_advisory_xact_lock", True: "pg_advisory_xact_lock_shared"}
XACT_TRY_LOCK = {False: "pg_try_advisory_xact_lock", True: "pg_try_advisory_xact_lock_shared"}
SESSION_LOCK = {False: "pg_advisory_lock", True: "pg_advisory_lock_shared"}
SESSION_TRY_LOCK = {False: "pg_try_advisory_lock", True: "pg_try_advisory_lock_shared"}
SESSION_UNLOCK = {False: "pg_advisory_unlock", True: "pg_advisory_unlock_shared"}

CALL_SQL = "SELECT {function}({key})"

# Inside a transaction: one message. The savepoint makes a timeout recoverable; lock_timeout is
# saved and restored around the lock so the caller's transaction keeps its own value (SET LOCAL
# made inside a savepoint that is released would otherwise last until the transaction ends).
TIMED_CALL_IN_TRANSACTION_SQL = """SAVEPOINT leases_advisory;
SELECT set_config('leases.saved_lock_timeout', current_setting('lock_timeout'), true);
SELECT set_config('lock_timeout', '{timeout_ms}', true);
SELECT {function}({key});
SELECT set_config('lock_timeout', current_setting('leases.saved_lock_timeout'), true);
RELEASE SAVEPOINT leases_advisory"""

# Sent only after a timed call failed, to make the caller's transaction usable again.
UNDO_TIMED_CALL_SQL = "ROLLBACK TO SAVEPOINT leases_advisory; RELEASE SAVEPOINT leases_advisory"

# In autocommit the message runs as one implicit transaction, which ends the local setting.
TIMED_CALL_AUTOCOMMIT_SQL = (
    "SELECT set_config('lock_timeout', '{timeout_ms}', true); SELECT {function}({key})"
)

# This session holds the lock, as ``pg_locks`` shows it (:meth:`AdvisoryLock.in_pg_locks`).
_HELD_BY_THIS_SESSION = (
    "EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND pid = pg_backend_pid() AND classid = {classid} AND objid = {objid}"
    " AND objsubid = {objsubid} AND mode = '{mode}')"
)
HELD_SQL = f"SELECT {_HELD_BY_THIS_SESSION}"

# After a lock call was interrupted: unlock once if this session holds the lock, else do
# nothing (a bare unlock of a lock not held puts a WARNING in the server's log).
UNLOCK_IF_HELD_SQL = f"SELECT {{function}}({{key}}) WHERE {_HELD_BY_THIS_SESSION}"

#: Seconds :meth:`AdvisoryLock.ensure_held` and a session lock's unlock wait for the server's
#: answer before they give the session up (see the module's docstring): the bound the
#: package's own connections get from ``tcp_user_timeout``.
CHECK_TIMEOUT = 10.0

LOCK_NOT_AVAILABLE = "55P03"
DEADLOCK_DETECTED = "40P01"
QUERY_CANCELED = "57014"
_MAX_TIMEOUT_MS = 2**31 - 1  # lock_timeout is an int of milliseconds

_DRIVER_ERRORS = (DjangoDatabaseError, psycopg.Error)
_CONNECTION_ERRORS = (
    DjangoOperationalError,
    DjangoInterfaceError,
    psycopg.OperationalError,
    psycopg.InterfaceError,
)

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class AdvisoryLock:
    """Which advisory lock a block holds, on which database. Immutable: safe to share."""

    name: LockKey
    key: int | tuple[int, int]
    shared: bool
    using: str

    @property
    def label(self) -> str:
        return self.name if isinstance(self.name, str) else f"advisory key {self.key}"

    def held(self, timeout: float | None = None) -> bool:
        """Whether this session holds the lock now, asked of the server (one round trip).

        A dead connection counts as not held: its session, and every lock of it, is gone; so
        does one that gives no answer within ``timeout`` seconds (default
        :data:`CHECK_TIMEOUT`), which is shut down so that the session ends.
        """
        sql = HELD_SQL.format(**self.in_pg_locks())
        try:
            bound = CHECK_TIMEOUT if timeout is None else timeout
            return bool(_execute(_database(self.using), sql, bound=bound))
        except _CONNECTION_ERRORS:
            return False
        except _DRIVER_ERRORS as exc:
            raise _translate(exc, self, None) from exc

    def in_pg_locks(self) -> dict[str, int | str]:
        """How ``pg_locks`` shows this lock: its ``classid``, ``objid``, ``objsubid`` and
        ``mode``."""
        if isinstance(self.key, tuple):
            classid, objid, objsubid = self.key[0] & 0xFFFFFFFF, self.key[1] & 0xFFFFFFFF, 2
        else:
            (classid, objid), objsubid = split_key(self.key), 1
        mode = "ShareLock" if self.shared else "ExclusiveLock"
        return {"classid": classid, "objid": objid, "objsubid": objsubid, "mode": mode}

    def ensure_held(self, timeout: float | None = None) -> None:
        """Raise :class:`LeaseLost` unless this session still holds the lock.

        Call it before an effect that must not happen unprotected: a session lock dies with its
        connection, and nothing else tells the holder. It returns or raises within ``timeout``
        seconds (default :data:`CHECK_TIMEOUT`) whatever the network does.
        """
        if not self.held(timeout):
            raise LeaseLost(self.label, detail="the database session no longer holds the lock")


def _render_key(key: int | tuple[int, int]) -> str:
    return f"{int(key[0])}, {int(key[1])}" if isinstance(key, tuple) else str(int(key))


def _timeout_ms(timeout: float | None) -> int | None:
    """Validate ``timeout`` (seconds); milliseconds for ``lock_timeout``, ``None`` = forever.

    A positive timeout never rounds to 0 ms, because ``lock_timeout = 0`` means wait forever.
    Checked like ``lease()``'s timeout (:func:`~leases._arguments.valid_timeout`), plus the
    bound PostgreSQL's ``lock_timeout`` can hold.
    """
    seconds = valid_timeout(timeout)
    if seconds is None:
        return None
    if not math.isfinite(seconds) or math.ceil(seconds * 1000) > _MAX_TIMEOUT_MS:
        raise InvalidLeaseOption(
            "timeout", timeout, f"must be at most {_MAX_TIMEOUT_MS / 1000:g} seconds, or None"
        )
    return math.ceil(seconds * 1000)


def _execute(
    connection: BaseDatabaseWrapper, sql: str, *, raw: bool = False, bound: float | None = None
) -> Any:
    """Run ``sql`` through Django's cursor (so debug logging and execute wrappers see it).

    ``raw`` uses the driver's cursor instead, for the one statement Django would refuse: an
    unlock in a transaction already marked for rollback. Returns the first column of the last
    result set, or ``None`` when it has no rows. With a ``bound`` (seconds; lock calls have
    none: they wait as long as their ``timeout`` says), the connection is shut down when no
    answer came in time, and the driver's connection error is raised.
    """
    with connection.connection.cursor() if raw else connection.cursor() as cursor:
        if bound is None:
            cursor.execute(sql)
        else:
            with armed(Deadline(connection.connection.fileno(), bound)):
                cursor.execute(sql)
        while cursor.nextset():
            pass
        row = cursor.fetchone() if cursor.description else None
    return row[0] if row else None


def _database(using: str) -> BaseDatabaseWrapper:
    connection = connections[using]
    if connection.vendor != "postgresql":
        raise BackendNotSupported(f"database {using!r} ({connection.vendor})", "advisory locks")
    return connection


def _translate(exc: BaseException, lock: AdvisoryLock, timeout: float | None) -> LeaseError:
    """The package's error for a driver error raised while taking ``lock``."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    sqlstate = getattr(cause, "sqlstate", None)
    if sqlstate == LOCK_NOT_AVAILABLE:
        return LeaseUnavailable(lock.label, timeout)
    if sqlstate == QUERY_CANCELED:
        return LeaseUnavailable(lock.label, timeout, "the wait was canceled by the server")
    if sqlstate == DEADLOCK_DETECTED:
        return LeaseDeadlock(lock.label, str(cause).strip())
    return BackendUnavailable(f"postgresql:{lock.using}", str(cause).strip())


def _in_transaction(connection: BaseDatabaseWrapper) -> bool:
    return not connection.get_autocommit()


def _call(
    lock: AdvisoryLock,
    functions: dict[bool, str],
    timeout: float | None = None,
    *,
    needs_transaction: bool = False,
) -> Any:
    """Run one lock function for ``lock``, with ``timeout`` in the same message.

    A failure without a savepoint aborts the caller's transaction on the server, so Django is
    told (``set_rollback``) and refuses further queries until the ``atomic()`` block ends, just
    as it does after an ``IntegrityError``.
    """
    connection = _database(lock.using)
    in_transaction = _in_transaction(connection)
    if needs_transaction and not in_transaction:
        raise NotInTransaction(lock.label)
    call = {"function": functions[lock.shared], "key": _render_key(lock.key)}
    milliseconds = _timeout_ms(timeout)
    if milliseconds is None:
        sql = CALL_SQL.format(**call)
    elif in_transaction:
        sql = TIMED_CALL_IN_TRANSACTION_SQL.format(timeout_ms=milliseconds, **call)
    else:
        sql = TIMED_CALL_AUTOCOMMIT_SQL.format(timeout_ms=milliseconds, **call)
    try:
        return _execute(connection, sql)
    except TransactionManagementError:
        raise  # Django refused to send it (a broken atomic block): the caller's bug, in its words
    except _DRIVER_ERRORS as exc:
        error = _translate(exc, lock, timeout)
        if in_transaction:
            _recover(connection, savepoint=milliseconds is not None)
        raise error from exc
    except BaseException:  # a signal handler's, raised while the call waited: Ctrl-C and more
        _settle_interrupted(
            connection, lock, session=not needs_transaction, savepoint=milliseconds is not None
        )
        raise


def _recover(connection: BaseDatabaseWrapper, *, savepoint: bool) -> None:
    """Make the caller's transaction usable after a failed call, or mark it for rollback."""
    if savepoint:
        try:
            _execute(connection, UNDO_TIMED_CALL_SQL)
        except _DRIVER_ERRORS:
            pass
        else:
            return
    if connection.in_atomic_block:
        transaction.set_rollback(True, using=connection.alias)


def _settle_interrupted(
    connection: BaseDatabaseWrapper, lock: AdvisoryLock, *, session: bool, savepoint: bool
) -> None:
    """After an exception interrupted a lock call, leave no lock behind that the caller cannot
    know of, and a connection it can use.

    The block never runs, so nobody will unlock what the call may have taken: a session lock
    granted just before the interruption (its reply dropped), or after it (the driver cancels
    the statement on ``KeyboardInterrupt`` only; see :mod:`leases._pgcancel`) stayed
    held until the session ended, for the next request or task on the connection and against
    every other process. So the statement is cancelled, the caller's transaction made usable
    as after a failed call (:func:`_recover`), and a session lock this session holds
    unlocked. If the session's state cannot be known, the session is ended: the release
    that cannot fail. So when the cancellation got no answer; when the statement failed
    inside the caller's transaction (which cannot be asked until it ends, though the lock may
    have been granted before the cancellation reached the statement); and when the lock was
    already held by an outer block (``pg_locks`` cannot tell whether this call added a hold).
    An xact lock needs no more: it ends with the transaction the exception is unwinding (with
    the savepoint, for a timed call).
    """
    raw = connection.connection
    if raw is None or raw.closed:
        return  # the driver ended the session (interrupted twice): the lock went with it
    try:
        cancel_running(raw, CHECK_TIMEOUT)
        if raw.info.transaction_status == TransactionStatus.INERROR:
            if not savepoint:
                _recover(connection, savepoint=False)
                if session:
                    # The cancellation may have reached the statement after its lock was
                    # granted (it failed while finishing): a session lock outlives the failed
                    # statement, and the aborted transaction cannot be asked.
                    raise LeaseNotHeld(lock.label, "failed inside an aborted transaction")
                return  # an xact lock went with the failed statement's transaction
            _execute(connection, UNDO_TIMED_CALL_SQL)
        if not session:
            return
        if _session_leaks.holds(connection, _session_unlock_sql(lock)):
            raise LeaseNotHeld(lock.label, "a re-entrant hold cannot be told from the outer one")
        sql = UNLOCK_IF_HELD_SQL.format(
            function=SESSION_UNLOCK[lock.shared], key=_render_key(lock.key), **lock.in_pg_locks()
        )
        _execute(connection, sql, bound=CHECK_TIMEOUT)
    except Exception as exc:  # whatever failed, the session's state is unknown: end it
        logger.warning(
            "advisory lock %r: the call was interrupted and the session's state could not be "
            "settled (%s); its connection was closed to release whatever it held",
            lock.label,
            exc,
        )
        _session_leaks.end_session(connection)


def _lock(name: LockKey, shared: bool, using: str) -> AdvisoryLock:
    """Validate everything before any SQL: a bad name fails where it is written.

    String names are cached, because ``with xact_lock("name"):`` in a hot function builds the
    same lock on every call. Only exact ``str`` names: ``1``, ``True`` and ``1.0`` compare equal,
    so caching them would let an invalid key ride on a valid one's cache entry.
    """
    if shared is not False and shared is not True:  # "false" is truthy: it would share
        valid_flag("shared", shared)
    _valid_database(using)
    if type(name) is str:
        return _cached_lock(name, shared, using)
    return AdvisoryLock(name=name, key=advisory_key(name), shared=shared, using=using)


def _valid_database(using: object) -> None:
    """Refuse an alias ``settings.DATABASES`` does not have, where the lock is written.

    Unchecked, a misspelt ``using=`` surfaced only when the lock was entered (a decorator's
    at its first call), as Django's ``ConnectionDoesNotExist`` from inside a query. Checked on
    every call, not cached with the lock: an alias's absence is a fact about the settings.
    """
    if type(using) is not str or using not in connections.settings:
        known = ", ".join(sorted(connections.settings)) or "none"
        raise InvalidLeaseOption(
            "using", using, f"must be a database alias in settings.DATABASES (it has: {known})"
        )


@functools.lru_cache(maxsize=1024)
def _cached_lock(name: str, shared: bool, using: str) -> AdvisoryLock:
    """Built once per name (per process, while cached): also where a name gets recorded."""
    lock = AdvisoryLock(name=name, key=advisory_key(name), shared=shared, using=using)
    try:
        record = conf.get().record_advisory_names
    except LeaseError:  # a broken LEASES setting is manage.py check's to report, not a lock's
        record = False
    if record:
        _advisory_names.note(name, using)
    return lock


class _LockBlock(ContextDecorator):
    """A lock as a context manager and decorator: one instance serves every call and thread.

    Nothing is stored per call: what ``__exit__`` needs (key, alias) is fixed at construction,
    and whether this session holds the lock is the server's to say.

    Calling ``xact_lock(name)`` alone reads naturally ("lock until the transaction ends") but
    takes no lock: only entering does. The call cannot take the lock itself (the same call
    builds a decorator at import time, outside any transaction), so an object dropped without
    ever being entered or decorating anything is reported instead, as Python reports a
    coroutine never awaited: a ``RuntimeWarning`` and an error log line, the moment it is
    dropped (at once in CPython, for a bare call).
    """

    WAIT: ClassVar[dict[bool, str]]
    TRY: ClassVar[dict[bool, str]]
    NEEDS_TRANSACTION: ClassVar[bool]
    FACTORY: ClassVar[str]

    def __init__(self, lock: AdvisoryLock, timeout: float | None) -> None:
        _timeout_ms(timeout)
        self.lock = lock
        self.timeout = timeout
        #: Entered or used as a decorator at least once (only ever set to True).
        self.used = False

    def __call__(self, func: F) -> F:
        self.used = True
        return super().__call__(func)

    def __del__(self) -> None:
        if getattr(self, "used", True):
            return
        message = (
            f"advisory.{self.FACTORY}({self.lock.label!r}) was never entered, so it locked "
            f"nothing: write `with advisory.{self.FACTORY}(...):` or use it as a decorator"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=1, source=self)
        logger.error(message)

    def __enter__(self) -> AdvisoryLock:
        self.used = True
        if self.timeout == 0:
            if not _call(self.lock, self.TRY, needs_transaction=self.NEEDS_TRANSACTION):
                raise LeaseUnavailable(self.lock.label, 0)
        else:
            _call(self.lock, self.WAIT, self.timeout, needs_transaction=self.NEEDS_TRANSACTION)
        return self.lock


class _XactLock(_LockBlock):
    """``xact_lock(...)``."""

    WAIT, TRY, NEEDS_TRANSACTION = XACT_LOCK, XACT_TRY_LOCK, True
    FACTORY = "xact_lock"

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Nothing to do: the server releases the lock when the outermost transaction ends."""


def xact_lock(
    name: LockKey,
    *,
    shared: bool = False,
    timeout: float | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> _XactLock:
    """Take ``pg_advisory_xact_lock`` in the caller's transaction; use as ``with`` or decorator.

    The lock is released by the server when the outermost ``atomic()`` commits or rolls back
    (or earlier, if the nested ``atomic()`` it was taken in rolls back). ``timeout=None`` waits
    forever, ``0`` tries once; a failed wait raises :class:`LeaseUnavailable` and leaves the
    transaction usable. Raises :class:`NotInTransaction` in autocommit, where the lock would be
    gone before the next statement.
    """
    return _XactLock(_lock(name, shared, using), timeout)


def try_xact_lock(name: LockKey, *, shared: bool = False, using: str = DEFAULT_DB_ALIAS) -> bool:
    """``pg_try_advisory_xact_lock``: take the lock if it is free right now, else ``False``."""
    lock = _lock(name, shared, using)
    return bool(_call(lock, XACT_TRY_LOCK, needs_transaction=True))


#: Per driver connection (one server session, or one pooler client): whether session state
#: stays with it, asked before its first session lock (:func:`_keeps_sessions`).
_session_keeping: weakref.WeakKeyDictionary[psycopg.Connection[Any], bool] = (
    weakref.WeakKeyDictionary()
)


def _keeps_sessions(lock: AdvisoryLock) -> bool:
    """Whether ``lock``'s connection keeps its server session from one statement to the next.

    Behind a transaction pooler (PgBouncer's default mode) it does not: the lock is taken on
    one server session, the pooler lends that session to another client, whose
    ``session_lock`` of the same name is let straight in (advisory locks are re-entrant per
    session), and both unlocks succeed, so neither exit notices the two holders. The pooler
    probe tells (:mod:`leases._pgpooler`: a pooler answers the startup with a process id of
    its own), once per connection; the alias may be declared a session pooler in
    ``LEASES["SESSION_POOLING"]`` (the client cannot read the pooler's mode).
    """
    connection = _database(lock.using)
    if lock.using in conf.get().session_pooling:
        return True
    connection.ensure_connection()
    raw = connection.connection
    known = _session_keeping.get(raw)
    if known is None:
        try:
            pid = _execute(connection, BACKEND_PID_SQL, bound=CHECK_TIMEOUT)
        except _DRIVER_ERRORS as exc:
            raise _translate(exc, lock, None) from exc
        known = _session_keeping[raw] = not behind_pooler(raw, int(pid))
    return known


class _SessionLock(_LockBlock):
    """``session_lock(...)``: tracked while held, so a lock still held when the request ends
    is released and reported rather than inherited by the next request on the connection
    (:mod:`leases._session_leaks`). Refused behind a transaction pooler
    (:func:`_keeps_sessions`)."""

    WAIT, TRY, NEEDS_TRANSACTION = SESSION_LOCK, SESSION_TRY_LOCK, False
    FACTORY = "session_lock"

    def __enter__(self) -> AdvisoryLock:
        self.used = True  # entered, even if refused below: not a lock dropped unused
        if not _keeps_sessions(self.lock):
            raise BackendNotSupported(
                f"database {self.lock.using!r} (behind a connection pooler that may hand each "
                'transaction another server session; list it in LEASES["SESSION_POOLING"] if '
                "the pooler keeps each client's session)",
                "session_lock",
            )
        lock = super().__enter__()
        _session_leaks.track(connections[lock.using], lock.label, _session_unlock_sql(lock))
        return lock

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Unlock, and say so loudly when the lock was not ours any more.

        The body's own exception always wins; a failed unlock is then logged, not raised.
        """
        _session_leaks.untrack(connections[self.lock.using], _session_unlock_sql(self.lock))
        try:
            _unlock(self.lock)
        except LeaseError as error:
            if exc is None:
                raise
            logger.warning("session_lock(%r) exit after an error: %s", self.lock.label, error)


def _session_unlock_sql(lock: AdvisoryLock) -> str:
    """The statement that unlocks ``lock`` once on its session (it answers whether it did)."""
    return CALL_SQL.format(function=SESSION_UNLOCK[lock.shared], key=_render_key(lock.key))


def _unlock(lock: AdvisoryLock) -> None:
    connection = connections[lock.using]
    raw = connection.connection
    if raw is not None and raw.info.transaction_status == TransactionStatus.INERROR:
        _release_by_closing(connection, lock)
    sql = _session_unlock_sql(lock)
    try:
        unlocked = _execute(
            connection, sql, raw=raw is not None and connection.needs_rollback, bound=CHECK_TIMEOUT
        )
    except _CONNECTION_ERRORS as exc:
        raise LeaseLost(
            lock.label,
            detail="the database session ended while the lock was held (terminated, server "
            "restart or network loss), which released it: the block ran partly unprotected",
        ) from exc
    except _DRIVER_ERRORS as exc:
        raise _translate(exc, lock, None) from exc
    if not unlocked:
        raise LeaseNotHeld(
            lock.label,
            "the unlock ran on a session that did not hold the lock: the connection changed "
            "under the block (a transaction-pooling proxy, a reconnect)",
        )


def _release_by_closing(connection: BaseDatabaseWrapper, lock: AdvisoryLock) -> None:
    """An aborted transaction refuses the unlock; ending the session is the only release left
    (really ending it: Django's ``close()`` alone hands a pooled session back to its pool,
    lock and all, see :func:`leases._session_leaks.end_session`).

    Django then rolls the transaction back (it already could not commit) and reconnects on the
    next query.
    """
    _session_leaks.end_session(connection)
    raise BackendUnavailable(
        f"postgresql:{lock.using}",
        f"the transaction around session_lock({lock.label!r}) was aborted by an earlier error, "
        "so the lock could not be unlocked; the connection was closed to release it",
    )


def session_lock(
    name: LockKey,
    *,
    shared: bool = False,
    timeout: float | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> _SessionLock:
    """Hold ``pg_advisory_lock`` for the block; use as ``with`` or decorator.

    Works in and out of transactions (a rollback does not release it). Exit raises
    :class:`LeaseNotHeld` if the unlock found no lock (the session changed underneath) and
    :class:`LeaseLost` if the session died, which released the lock while the block ran.
    """
    return _SessionLock(_lock(name, shared, using), timeout)
