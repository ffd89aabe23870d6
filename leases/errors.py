"""Every error the ``leases`` app raises, under one base class.

Each error also inherits the builtin a caller would already catch (``TimeoutError`` for a lease
that could not be had in time, ``ValueError`` for bad input), and carries the data a handler needs
as attributes, so nobody has to parse a message.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from django.core.exceptions import ImproperlyConfigured, SynchronousOnlyOperation

__all__ = [
    "BackendNotSupported",
    "BackendUnavailable",
    "BlockingInEventLoop",
    "DatabaseNotSupported",
    "FenceRequired",
    "FencingTokenRevoked",
    "FencingUnavailable",
    "InvalidFencingToken",
    "InvalidLeaseName",
    "InvalidLeaseOption",
    "LeaseAlreadyHeld",
    "LeaseCheckFailed",
    "LeaseCheckUnavailable",
    "LeaseDeadlock",
    "LeaseError",
    "LeaseLost",
    "LeaseNotHeld",
    "LeaseUnavailable",
    "LeasesImproperlyConfigured",
    "NotInTransaction",
    "RevocationIncomplete",
    "StaleFencingToken",
]


class LeaseError(Exception):
    """Base class of every error raised by django-leases.

    ``args`` holds the constructor's arguments (not the formatted message), so an error
    survives pickling and Celery's JSON exception round trip (``cls(*args)``) with its data
    intact; ``str()`` is still the message.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        signature = inspect.signature(init)

        @functools.wraps(init)
        def keep_constructor_args(self: LeaseError, *args: Any, **kw: Any) -> None:
            init(self, *args, **kw)
            if "_message" not in self.__dict__:  # the innermost __init__ formatted it
                self.__dict__["_message"] = Exception.__str__(self)
            bound = signature.bind(self, *args, **kw)
            bound.apply_defaults()
            self.args = tuple(bound.arguments.values())[1:]

        cls.__init__ = keep_constructor_args  # type: ignore[method-assign,assignment]

    def __str__(self) -> str:
        return self.__dict__.get("_message") or Exception.__str__(self)


class InvalidLeaseName(LeaseError, ValueError):
    """A lock or lease name (or explicit key) that cannot be used.

    Raised before anything reaches a server, so a bad name never costs a round trip or leaves
    state behind.
    """

    def __init__(self, name: object, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"invalid lease name {name!r}: {reason}")


class InvalidFencingToken(LeaseError, ValueError):
    """A fencing token that is not an int from 1 to 2**63 - 1 (or a lease carrying one).

    Raised before anything reaches the database: a bool, a float or a negative number would
    otherwise compare "successfully" against a stored token and defeat the fence.
    """

    def __init__(self, token: object, reason: str) -> None:
        self.token = token
        self.reason = reason
        super().__init__(f"invalid fencing token {token!r}: {reason}")


class InvalidLeaseOption(LeaseError, ValueError):
    """An argument of ``lease()``/``acquire()`` that cannot work (a ttl <= 0, a negative timeout).

    Raised before anything reaches a server, like :class:`InvalidLeaseName`.
    """

    def __init__(self, option: str, value: object, reason: str) -> None:
        self.option = option
        self.value = value
        self.reason = reason
        super().__init__(f"invalid {option}={value!r}: {reason}")


class BlockingInEventLoop(LeaseError, SynchronousOnlyOperation):
    """A blocking acquisition (``acquire()``, ``with lease()``, ``semaphore()``) was called
    from a thread running an event loop.

    It would stall every task of that loop for its round trips and its whole wait (up to its
    ``timeout``), and a stalled loop cannot renew or even notice what its other tasks hold. A
    ``SynchronousOnlyOperation``, as Django's ORM raises for the same mistake, and lifted by the
    same switch: the ``DJANGO_ALLOW_ASYNC_UNSAFE`` environment variable.
    """

    def __init__(self, call: str, instead: str) -> None:
        self.call = call
        self.instead = instead
        super().__init__(
            f"{call} blocks, and this thread runs an event loop: use {instead} in async code, "
            "or call it through sync_to_async"
        )


class LeasesImproperlyConfigured(LeaseError, ImproperlyConfigured):
    """The ``LEASES`` setting is wrong; ``manage.py check`` reports the same problems."""


class DatabaseNotSupported(LeaseError, ImproperlyConfigured):
    """``manage.py migrate`` would create the ``leases`` or ``idempotency`` tables on a
    database that is not PostgreSQL.

    Raised before anything is migrated (by any app): their migrations use PostgreSQL-only
    operations (indexes built ``CONCURRENTLY``), so letting the run start would stop it half-way
    and leave a half-migrated database. ``leases.E002`` reports the same database under
    ``manage.py check``; this is what still refuses when that check is silenced.
    """

    def __init__(self, alias: str, vendor: str, app_label: str) -> None:
        self.alias = alias
        self.vendor = vendor
        self.app_label = app_label
        super().__init__(
            f"database {alias!r} is {vendor}, but the {app_label!r} app's migrations need "
            "PostgreSQL; nothing was migrated. Point it at PostgreSQL (psycopg 3), or have a "
            "database router's allow_migrate() keep the leases and idempotency apps off it "
            "(leases.E002)"
        )


class LeaseUnavailable(LeaseError, TimeoutError):
    """The lease (or lock) is held by someone else and could not be had before the deadline."""

    def __init__(self, name: str, timeout: float | None = None, detail: str = "") -> None:
        self.name = name
        self.timeout = timeout
        waited = "without waiting" if not timeout else f"within {timeout:g}s"
        msg = f"lease {name!r} is held by someone else and could not be acquired {waited}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class LeaseLost(LeaseError):
    """The lease expired, was taken over or revoked while this holder believed it held it.

    Whatever the holder did after the loss was unprotected: fenced writes carrying its token are
    rejected, and the work should be retried or compensated.
    """

    def __init__(self, name: str, token: int | None = None, detail: str = "") -> None:
        self.name = name
        self.token = token
        #: Why, in the store's words (without the "no longer held" this message begins with).
        self.detail = detail
        msg = f"lease {name!r} (token {token}) is no longer held"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class LeaseNotHeld(LeaseError):
    """An unlock or release of something this caller does not hold.

    For a Postgres session lock this means the unlock ran on another server session than the
    lock: the connection changed underneath (a transaction-pooling proxy, a reconnect), so the
    lock may still be held by a session nobody controls.
    """

    def __init__(self, name: str, detail: str = "", *, by: str = "this caller") -> None:
        self.name = name
        msg = f"{name!r} is not held by {by}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class LeaseAlreadyHeld(LeaseError, RuntimeError):
    """A second acquisition of a name this holder already holds.

    Leases are not reentrant on purpose: a silent nested "success" would let the inner block's
    release free the outer block's protection.
    """

    def __init__(self, name: str, holder: str = "") -> None:
        self.name = name
        self.holder = holder
        super().__init__(
            f"lease {name!r} is already held by this holder ({holder}); leases are not "
            "reentrant: pass the Lease you hold down instead of acquiring it again"
        )


class LeaseDeadlock(LeaseError):
    """The server detected a deadlock between lock waiters and chose this caller as victim.

    The caller's transaction is aborted; retry the whole transaction.
    """

    def __init__(self, name: str, detail: str = "") -> None:
        self.name = name
        msg = f"deadlock detected while waiting for {name!r}; retry the transaction"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class NotInTransaction(LeaseError, RuntimeError):
    """A transaction-scoped lock was requested in autocommit mode.

    In autocommit the lock would be released when the statement ends, protecting nothing.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"xact_lock({name!r}) needs an open transaction: wrap the code in "
            "transaction.atomic(), or use session_lock() for a lock that spans transactions"
        )


class StaleFencingToken(LeaseError):
    """A write carried a fencing token lower than one the resource has already accepted.

    The writer's lease was lost (paused, partitioned or evicted) and someone newer has written
    since; the write was refused and nothing was changed.
    """

    def __init__(self, resource: str, offered: int, stored: int | None) -> None:
        self.resource = resource
        self.offered = offered
        self.stored = stored
        accepted = "a greater one" if stored is None else str(stored)
        super().__init__(
            f"stale fencing token for {resource}: offered {offered}, but {accepted} was "
            "already accepted; the lease behind this write was lost, so the write was rejected"
        )


class FencingTokenRevoked(StaleFencingToken):
    """A write was fenced by a lease an operator force-released (revoked).

    The resource refuses it although nobody newer has written yet: the revocation is recorded
    in the application database and the fenced statement consults it.
    """

    def __init__(self, resource: str, offered: int, lease: str, revoked_through: int) -> None:
        self.resource = resource
        self.offered = offered
        self.stored = None
        self.lease = lease
        self.revoked_through = revoked_through
        LeaseError.__init__(
            self,
            f"fencing token {offered} for {resource} was revoked: lease {lease} was "
            f"force-released through token {revoked_through}, so the write was rejected",
        )


class FenceRequired(LeaseError, TypeError):
    """An unfenced write (``save()``, ``update()``, ``delete()``) of a model that requires a fence.

    Raised before anything reaches the database, for models that set ``require_fence = True``.
    """

    def __init__(self, model: str, operation: str) -> None:
        self.model = model
        self.operation = operation
        super().__init__(
            f"{model} requires a fence: pass fence=lease to {operation}, or use "
            f"{model.rsplit('.', 1)[-1]}.objects.fenced(lease)"
        )


class BackendUnavailable(LeaseError, ConnectionError):
    """The lease store could not be reached or answered with an error.

    A holder that cannot reach its store cannot renew: treat its lease as about to be lost.
    """

    def __init__(self, backend: str, detail: str = "") -> None:
        self.backend = backend
        msg = f"lease backend {backend!r} is unavailable"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class RevocationIncomplete(BackendUnavailable):
    """A force release advanced the name's token but could not take the grant away in enough
    of the store: the evicted holder may still renew, and the name stays held, until its TTL
    runs out or a revocation succeeds. Only the token moved (``token``, the name's new one).

    Raised instead of reporting a revocation that did not happen; force-release the name again
    with ``token``, which :meth:`~leases.backends.base.LeaseBackend.inspect` now shows.
    """

    def __init__(self, backend: str, name: str, token: int, detail: str) -> None:
        self.name = name
        self.token = token
        super().__init__(
            backend,
            f"the revocation of {name!r} is incomplete ({detail}); its token is now {token}, "
            "force-release that token again",
        )


class FencingUnavailable(LeaseError):
    """The backend cannot currently issue a fencing token that is guaranteed to increase.

    Raised instead of granting a lease whose token could be lower than one already handed out
    (for example a Redis server restarted without persistence and no epoch source).
    """

    def __init__(self, backend: str, detail: str) -> None:
        self.backend = backend
        super().__init__(f"lease backend {backend!r} refuses to grant: {detail}")


class BackendNotSupported(LeaseError, NotImplementedError):
    """The configured backend cannot do what was asked (declared by its capabilities)."""

    def __init__(self, backend: str, capability: str) -> None:
        self.backend = backend
        self.capability = capability
        super().__init__(f"lease backend {backend!r} does not support {capability}")


class LeaseCheckFailed(LeaseLost):
    """A lease-checked write (``save(lease=...)``, ``under_lease(...)``) was refused by the
    database: in the statement that would have written, the lease row was no longer this grant
    (released, taken over, revoked) or had expired by the database's clock. Nothing was written.

    A :class:`LeaseLost`, because that is what it means: the holder must stop.
    """

    def __init__(self, name: str, token: int | None, resource: str) -> None:
        self.resource = resource
        super().__init__(
            name,
            token,
            f"the database refused a write to {resource} checked against it: the grant is "
            "no longer current or expired by the database clock; nothing was written",
        )


class LeaseCheckUnavailable(BackendNotSupported):
    """A lease-checked write where the database cannot see the lease: the backend keeps no
    lease rows, or keeps them in another database than the one written (a fence still works
    across stores; a lease check is one statement, so it works only within one database)."""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(backend, "lease-checked writes")
        self.reason = reason
        self.__dict__["_message"] = f"{Exception.__str__(self)}: {reason}"
