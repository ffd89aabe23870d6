"""``idempotency_key``: run a non-HTTP operation once per key and record its result.

For a management command, a webhook consumer or a script that may be re-run: the first run claims
the key, runs the block (in atomic mode inside one transaction with the recorded result) and
stores the result; a later run with the same key gets the recorded result instead. A ``with``
block cannot skip itself, so the block checks ``op.replayed``; the decorator form skips the call::

    with idempotency_key(f"invoice-{invoice.pk}", scope="billing") as op:
        if not op.replayed:
            op.result = send_invoice(invoice)
    print(op.result)

    @idempotency_key(lambda invoice_id: f"invoice-{invoice_id}", scope="billing")
    def send_invoice(invoice_id: int) -> dict: ...

Results are stored as JSON (``DjangoJSONEncoder``) and every run returns that JSON form: after
a first run too, ``op.result`` (and the decorator's return value) is the recorded value read
back, as a replay returns it: tuples become lists, ``Decimal`` and ``datetime`` strings, dict
keys strings. (It used to be the value as the block left it on a first run, so code that worked
on the first run broke on a retry.) A result that is not JSON raises
:class:`~idempotency.errors.IdempotencyResultNotRecorded` (a ``TypeError``): in atomic mode the
block's effects roll back and the key is freed; outside it they have happened, so the key is
recorded as run without a result, and every retry gets the same error instead of running the
block again (freed, the key let each retry repeat the effects and fail the same way).

The key and the scope are 1 to 255 characters of text without NUL (the ``Idempotency-Key``
header's bound, and the key table's), checked with the other options before any round trip.

Async code uses ``async with idempotency_key(...) as op`` and decorates coroutine functions the
same way. The key's statements run through ``sync_to_async`` (thread-sensitive, as Django's
async ORM methods do), so in atomic mode the block's own ``await Model.objects.acreate(...)``
joins the key's transaction. That thread is shared by a context: inside an ASGI request it is
the request's own; outside one, wrap concurrent tasks in ``asgiref.sync.ThreadSensitiveContext``
so their transactions do not interleave on one connection.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NoReturn, TypeVar, cast

from asgiref.sync import sync_to_async
from django.core.serializers.json import DjangoJSONEncoder

from . import conf, http, steps, store
from ._claiming import open_cancellably
from .errors import IdempotencyImproperlyConfigured, IdempotencyResultNotRecorded

__all__ = ["Operation", "idempotency_key"]

F = TypeVar("F", bound=Callable[..., Any])
KeySource = str | Callable[..., str]

#: Stored in an outcome's headers (which an operation's outcome has no other use for) in place
#: of a result that could not be recorded: the block ran outside atomic mode, so its key is
#: done, and a retry is refused rather than replayed or run (see the module).
_NOT_RECORDED = ("idempotency-result", "not-recorded")

#: The blocks open in this context, each with its operation, innermost last: how ``__exit__``
#: finds its block's operation when the instance (which holds only options) is shared.
_OPEN: contextvars.ContextVar[tuple[tuple[idempotency_key, Operation], ...]] = (
    contextvars.ContextVar("idempotency_operations", default=())
)


@dataclass
class Operation:
    """One run under a key: ``replayed`` tells whether ``result`` was recorded by an earlier run."""

    scope: str
    key: str
    replayed: bool
    result: Any = None
    _attempt: store.Attempt | None = field(default=None, repr=False)

    def _running(self, name: str) -> store.Attempt:
        if self._attempt is None:
            raise IdempotencyImproperlyConfigured(
                f"step {name!r} of operation {self.key!r}: the operation replayed its recorded "
                "result, so its steps do not run again (check op.replayed)"
            )
        return self._attempt

    def step(self, name: str, fn: Callable[[str], Any]) -> Any:
        """Run one step of this operation (:func:`idempotency.steps.step`)."""
        return steps.step_in(self._running(name), name, fn)

    async def astep(self, name: str, fn: Callable[[str], Any]) -> Any:
        """Run one step of this operation from async code (:func:`idempotency.steps.astep`)."""
        return await steps.astep_in(self._running(name), name, fn)


class idempotency_key:
    """Context manager and decorator; holds only its options, so one instance may be shared."""

    def __init__(
        self,
        key: KeySource,
        *,
        scope: str = "operations",
        fingerprint: str = "",
        ttl: float | None = None,
        lock_timeout: float | None = None,
        wait: float = 0.0,
        atomic: bool | None = None,
        claim_in_transaction: bool | None = None,
    ) -> None:
        if not callable(key):
            _check_text("key", key)  # a computed key is checked once computed (_with_key)
        _check_text("scope", scope)
        if not isinstance(fingerprint, str):
            raise IdempotencyImproperlyConfigured(
                f"fingerprint must be a str, not {type(fingerprint).__name__}"
            )
        conf.check_seconds("ttl", ttl, positive=True)
        conf.check_seconds("lock_timeout", lock_timeout, positive=True)
        conf.check_seconds("wait", wait, positive=False, optional=False)
        conf.check_flag("atomic", atomic, optional=True)
        conf.check_flag("claim_in_transaction", claim_in_transaction, optional=True)
        self.key = key
        self.scope = scope
        self.fingerprint = fingerprint
        self.ttl = ttl
        self.lock_timeout = lock_timeout
        self.wait = wait
        self.atomic = atomic
        self.claim_in_transaction = claim_in_transaction

    def _open(self, key: str) -> Operation:
        settings = conf.get()
        ttl = settings.ttl if self.ttl is None else self.ttl
        lock = settings.lock_timeout if self.lock_timeout is None else self.lock_timeout
        atomic = settings.atomic if self.atomic is None else self.atomic
        in_transaction = store.claims_in_transaction(
            atomic, self.claim_in_transaction, settings.claim_in_transaction, settings.database
        )
        begun = store.begin(
            self.scope,
            key,
            http.digest([self.fingerprint.encode()]),
            ttl=ttl,
            lock_timeout=lock,
            wait=self.wait,
            using=settings.database,
            in_transaction=in_transaction,
        )
        begun.raise_for_conflict(self.scope, key)
        if begun.outcome is not None:
            if _NOT_RECORDED in begun.outcome.headers:
                raise IdempotencyResultNotRecorded(
                    self.scope,
                    key,
                    None,
                    "was not JSON when the block ran once, so it could not be recorded: the "
                    "block is not run again under this key",
                )
            return Operation(self.scope, key, replayed=True, result=json.loads(begun.outcome.body))
        assert begun.claim is not None
        attempt = store.Attempt(begun.claim, atomic=atomic, ttl=ttl)
        attempt.start()
        return Operation(self.scope, key, replayed=False, _attempt=attempt)

    def __enter__(self) -> Operation:
        operation = self._open(self._fixed_key())
        _OPEN.set((*_OPEN.get(), (self, operation)))
        return operation

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _finish(self._take(), exc_type is not None)

    async def __aenter__(self) -> Operation:
        # Cancelled while claiming (asyncio.timeout, a client gone away), the block never runs
        # and __aexit__ never comes: the claim the thread goes on to make is given up in that
        # thread. Left, the key stayed started until its lock lapsed, and in atomic mode the
        # attempt's block stayed open on the connection, swallowing the thread's later writes.
        operation = await open_cancellably(
            functools.partial(self._open, self._fixed_key()), lambda opened: opened._attempt
        )
        _OPEN.set((*_OPEN.get(), (self, operation)))
        return operation

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await sync_to_async(_finish)(self._take(), exc_type is not None)

    def _fixed_key(self) -> str:
        if callable(self.key):
            raise TypeError("a key computed from arguments needs the decorator form")
        return self.key

    def _take(self) -> Operation:
        """This block's operation, taken off the open ones: the last one this instance opened.
        Not simply the innermost: blocks need not nest (a generator's block ends while its
        caller's is still open), and the innermost one then belonged to the other block, whose
        key this one finished with its own result. (The open blocks of one shared instance
        have one key, so at most one of them holds it; order tells them apart.)"""
        entries = _OPEN.get()
        index = max(i for i, (block, _) in enumerate(entries) if block is self)
        _OPEN.set(entries[:index] + entries[index + 1 :])
        return entries[index][1]

    def __call__(self, func: F) -> F:
        if inspect.iscoroutinefunction(func):
            return cast(F, self._decorate_async(func))

        @functools.wraps(func)
        def run_once(*args: Any, **kwargs: Any) -> Any:
            key = self.key(*args, **kwargs) if callable(self.key) else self.key
            with self._with_key(key, self._call_fingerprint(func, args, kwargs)) as op:
                if not op.replayed:
                    op.result = func(*args, **kwargs)
            return op.result

        return cast(F, run_once)

    def _decorate_async(self, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        async def run_once(*args: Any, **kwargs: Any) -> Any:
            key = self.key(*args, **kwargs) if callable(self.key) else self.key
            async with self._with_key(key, self._call_fingerprint(func, args, kwargs)) as op:
                if not op.replayed:
                    op.result = await func(*args, **kwargs)
            return op.result

        return run_once

    def _call_fingerprint(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str:
        """The decorator form's fingerprint, unless one was given: the function and its
        arguments, bound to its signature with defaults applied (``f(7, 1)`` and
        ``f(7, amount=1)`` are one call). A key string another decorated function also makes,
        or the same key with other arguments, is then a mismatch
        (:class:`~idempotency.errors.IdempotencyKeyMismatch`), as a request's other payload is;
        with an empty fingerprint the second function silently returned the first's result
        and never ran. Arguments that are not JSON (a model instance) leave the function
        alone to fingerprint."""
        if self.fingerprint:
            return self.fingerprint
        name = f"{func.__module__}.{func.__qualname__}"
        try:
            bound = inspect.signature(func).bind_partial(*args, **kwargs)
            bound.apply_defaults()
            raw = json.dumps(
                [name, list(bound.args), dict(bound.kwargs)], cls=DjangoJSONEncoder, sort_keys=True
            )
        except (TypeError, ValueError):
            raw = json.dumps([name])
        return hashlib.sha256(raw.encode()).hexdigest()

    def _with_key(self, key: str, fingerprint: str) -> idempotency_key:
        return idempotency_key(
            key,
            scope=self.scope,
            fingerprint=fingerprint,
            ttl=self.ttl,
            lock_timeout=self.lock_timeout,
            wait=self.wait,
            atomic=self.atomic,
            claim_in_transaction=self.claim_in_transaction,
        )


def _finish(operation: Operation, failed: bool) -> None:
    """Record the result of a first run (or give the key up when it raised); nothing to do
    for a replay."""
    attempt = operation._attempt
    if attempt is None:
        return
    if failed:
        attempt.abort()
        return
    try:
        body = json.dumps(operation.result, cls=DjangoJSONEncoder).encode()
    except (TypeError, ValueError) as exc:
        _refuse_result(operation, attempt, exc)
    attempt.commit(store.Outcome(status=None, headers=[], body=body))
    # What a replay will return, so the first run returns it too (see the module docstring).
    operation.result = json.loads(body)


def _refuse_result(operation: Operation, attempt: store.Attempt, exc: Exception) -> NoReturn:
    """End a first run whose result is not JSON, and say so. Atomic, it ends as a failed one
    (effects rolled back, key freed); its transaction must be closed either way, or it would
    stay open on the connection under every later write of the thread. Outside atomic mode
    the effects have happened and cannot be rolled back: the key is stored as run without a
    result, so a retry is refused instead of running the block again."""
    scope, key = operation.scope, operation.key
    if attempt.atomic:
        attempt.abort()
        outcome = "its effects were rolled back and the key freed"
    else:
        attempt.commit(store.Outcome(status=None, headers=[_NOT_RECORDED], body=b"null"))
        outcome = (
            "the block ran (its effects are kept) and is recorded as run without a result: "
            "it is not run again under this key"
        )
    raise IdempotencyResultNotRecorded(
        scope, key, None, f"is not JSON, so it could not be recorded ({exc}); {outcome}"
    ) from exc


def _check_text(name: str, value: object) -> None:
    """Refuse a key or scope the key table cannot hold before any round trip: found by the
    database, an over-long one failed (under ``claim_in_transaction`` only after the block
    ran), None broke a constraint, a number was stored as its text and met that string's key."""
    if not isinstance(value, str):
        problem = f"must be a str, not {type(value).__name__}"
    elif not 0 < len(value) <= http.MAX_KEY_LENGTH:
        problem = f"must be 1 to {http.MAX_KEY_LENGTH} characters, not {len(value)}"
    elif "\x00" in value:
        problem = "must not contain a NUL character (Postgres text cannot hold one)"
    else:
        return
    raise IdempotencyImproperlyConfigured(f"{name} {value!r:.80} {problem}")
