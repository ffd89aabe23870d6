"""Multi-step operations: recovery points and derived keys (Stripe's pattern).

Some work cannot be one transaction: a charge at a payment provider, then an order row, then an
email. A crash between them must neither redo what was done (a second charge) nor leave the
key stuck. So the work is cut into named steps, and each step

- runs in a transaction of its own (a savepoint inside an atomic attempt) together with the
  record of its completion: its local effects and its recovery point commit together, or
  neither does;
- receives a **derived key**, stable for the operation's key and the step's name, to pass to
  the outside service (``Idempotency-Key`` at a payment provider): when a crash comes after the
  call but before the record, the retry calls again with the same key and the provider, not
  us, answers it once;
- is skipped by a retry that finds it recorded, which gets the recorded result instead.

A retry after a crash takes the key over once its lock lapses (each step a non-atomic attempt
records renews the lock, so ``LOCK_TIMEOUT`` bounds one step, not the whole operation) and
resumes after the last recorded step. A step that raises gives the key up but keeps the steps
before it, so the retry resumes there too; only a key with no recorded step is deleted.

Recovery needs the steps to commit as they go: the attempt must not be atomic
(``@idempotent(atomic=False)``, ``idempotency_key(..., atomic=False)``,
``idempotent_task(atomic=False)``). In an atomic attempt steps are savepoints: a crash rolls them
all back and the retry runs every step again, outside calls deduplicated by their derived keys.
So they are kept in the attempt's memory, not written to the key row (see
:attr:`~idempotency.store.Attempt.steps_in_memory`): ``LOCK_TIMEOUT`` bounds the whole attempt.
A step with an outside effect that takes no key (an SMTP server) happens again if the crash
falls between it and its record: at least once, as everywhere outside the database.

A step whose result cannot be recorded (not JSON) has run all the same. In an atomic attempt
it rolls back like any failure. Outside one its effects may not be undone, and leaving it
unrecorded made every retry resume at it and run it again: so it is recorded as run without a
result (its database effects commit with that record), the caller gets
:class:`~idempotency.errors.IdempotencyResultNotRecorded`, and so does every retry under the
key, instead of running it again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any, NoReturn, TypeVar

from asgiref.sync import sync_to_async
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connections, transaction

from . import store
from .errors import IdempotencyImproperlyConfigured, IdempotencyResultNotRecorded

__all__ = ["astep", "astep_in", "derived_key", "step", "step_in"]

T = TypeVar("T")


def derived_key(claim: store.Claim, name: str) -> str:
    """The key a step passes on: the same for every attempt of one request under one key (scope,
    key, fingerprint and step name), 64 hex characters, so it fits any provider's key header
    and names nothing the client sent."""
    parts = (claim.scope, claim.key, claim.fingerprint, name)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise IdempotencyImproperlyConfigured(f"a step needs a non-empty name, not {name!r}")


def _attempt(name: str) -> store.Attempt:
    _check_name(name)
    attempt = store.current()
    if attempt is None:
        raise IdempotencyImproperlyConfigured(
            f"step {name!r} runs outside an idempotent operation: call it from a view under "
            "@idempotent, IdempotentMixin or the idempotency middleware, inside "
            "idempotency_key(...), or from an idempotent_task (and not on a replay)"
        )
    return attempt


def _encode(result: Any) -> str:
    """The result as JSON that PostgreSQL's ``jsonb`` takes, or a ``TypeError`` (saying why)
    before any write: besides what ``json.dumps`` refuses, NaN and infinities (not JSON,
    though Python writes them), a NUL character and an unpaired surrogate (which ``jsonb``
    refuses: the write failed, was reported as the key lost, and the step's call ran again on
    every retry)."""
    try:
        text = json.dumps(result, cls=DjangoJSONEncoder, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        raise TypeError(str(exc)) from exc
    if _NUL.search(text):
        raise TypeError("it holds a NUL character, which jsonb refuses")
    return text


#: ``json.dumps``' escape of a NUL character: ``\u0000`` after an even number of backslashes
#: (an odd number would make it the text of an escaped backslash followed by ``u0000``).
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _jsonb_number(token: str) -> int | float:
    """A JSON number with a fraction or an exponent as ``jsonb`` gives it back: stored as
    ``numeric``, printed without an exponent, so one that has no fraction then (Python writes
    floats from 1e16 up as ``1e+16``) is read back as an int; and ``numeric`` has no -0."""
    plain = format(Decimal(token), "f")
    return float(plain) + 0.0 if "." in plain else int(plain)


def _jsonb_key_order(item: tuple[str, Any]) -> tuple[int, bytes]:
    """``jsonb``'s order of an object's keys: shorter (in UTF-8 bytes) first, then bytewise."""
    key = item[0].encode()
    return len(key), key


def _jsonb_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object as ``jsonb`` gives it back: the last of repeated keys, in its key order."""
    return dict(sorted(dict(pairs).items(), key=_jsonb_key_order))


def _as_stored(text: str) -> Any:
    """The step result ``text`` as a resumed run reads it from its ``jsonb`` record, which is
    what the first run gets too: read as Python wrote it, a float of 1e16 or more was a float
    on the first run and an int on every resumed one."""
    return json.loads(text, parse_float=_jsonb_number, object_pairs_hook=_jsonb_object)


#: The name (no step may have it) under which the steps that ran without a recordable result
#: are listed, name -> why: a retry is refused at them (see the module).
_UNRECORDED = ""
_UNRECORDABLE = "its result was not JSON"


#: What :func:`_recorded_result` returns for a step that is to run (a recorded result may be
#: ``None``, so ``None`` cannot say it).
_TO_RUN: Any = object()


def _recorded_result(attempt: store.Attempt, name: str) -> Any:
    """Check ``name``, then return the result recorded for it (the step is skipped), or
    :data:`_TO_RUN`, refusing to run again a step an earlier attempt ran without recording
    its result. How ``step_in`` and ``astep_in`` both begin, so the sync and the async step
    can never skip or refuse differently; pure Python, no round trip (nothing for
    ``astep_in`` to hand to a thread)."""
    _check_name(name)
    recorded = attempt.recorded.get(name, _TO_RUN)
    if recorded is _TO_RUN:
        why = attempt.recorded.get(_UNRECORDED, {}).get(name)
        if why is not None:
            claim = attempt.claim
            raise IdempotencyResultNotRecorded(
                claim.scope,
                claim.key,
                name,
                f"ran once, in an earlier attempt, but {why}, so it could not be recorded: it "
                "is not run again under this key",
            )
    return recorded


def _kept(
    attempt: store.Attempt, name: str, recorded: Any, error: IdempotencyResultNotRecorded | None
) -> Any:
    """Once the step's transaction has committed (never before: a record that did not commit
    must not be kept), raise the error of a result that could not be recorded
    (:func:`_settle`), or keep the recorded result for a second step of the name, and return
    it. How ``step_in`` and ``astep_in`` both end, for the same reason as
    :func:`_recorded_result`."""
    if error is not None:
        raise error
    attempt.recorded[name] = recorded
    return recorded


def _settle(
    attempt: store.Attempt, name: str, result: Any, outermost: bool
) -> tuple[Any, IdempotencyResultNotRecorded | None]:
    """Record the step in its open transaction: the result as recorded, or, for one that
    cannot be recorded outside atomic mode, the error to raise once the transaction has
    committed the record that the step ran (in atomic mode the error is raised here, and the
    step rolls back)."""
    claim = attempt.claim
    try:
        text = _encode(result)
    except TypeError as exc:
        detail = f"returned a result that is not JSON ({exc})"
        if attempt.steps_in_memory:
            raise IdempotencyResultNotRecorded(
                claim.scope, claim.key, name, f"{detail}: it rolls back with this error"
            ) from exc
        unrecorded = {**attempt.recorded.get(_UNRECORDED, {}), name: _UNRECORDABLE}
        _record(attempt, _UNRECORDED, json.dumps(unrecorded), outermost)
        attempt.recorded[_UNRECORDED] = unrecorded
        error = IdempotencyResultNotRecorded(
            claim.scope,
            claim.key,
            name,
            f"{detail}: it ran, and is recorded as run without a result, so it is not run "
            "again under this key (a retry is refused here)",
        )
        error.__cause__ = exc
        return None, error
    return _record(attempt, name, text, outermost), None


def _refuse_awaitable(name: str, result: object) -> NoReturn:
    """``step`` cannot await: a coroutine is closed unrun (no "never awaited" warning) and
    refused before anything is recorded."""
    if inspect.iscoroutine(result):
        result.close()
    raise TypeError(
        f"step {name!r} returned a {type(result).__name__}, which step() cannot await: "
        "from async code use await astep(...)"
    )


def _record(attempt: store.Attempt, name: str, text: str, outermost: bool) -> Any:
    """Record the step in its open transaction (committing it in the same round trip when the
    step's block is the outermost one); the result as a resumed run would see it."""
    if not attempt.steps_in_memory:
        commit = outermost and not connections[attempt.claim.using].needs_rollback
        store.record_step(attempt.claim, name, text, commit=commit)
    return _as_stored(text)


def step(name: str, fn: Callable[[str], T]) -> Any:
    """Run ``fn(derived_key)`` once for this operation, as the step ``name``; see the module.

    Returns ``fn``'s result as recorded (JSON: a retry that skips the step gets the same value
    the first run got). Names are unique within an operation: a second step of one name
    returns the first's result.
    """
    return step_in(_attempt(name), name, fn)


def step_in(attempt: store.Attempt, name: str, fn: Callable[[str], T]) -> Any:
    """:func:`step` under a given attempt (an :class:`~idempotency.operations.Operation`'s own,
    whatever attempt is innermost)."""
    recorded = _recorded_result(attempt, name)
    if recorded is not _TO_RUN:
        return recorded
    using = attempt.claim.using
    outermost = not connections[using].in_atomic_block
    with transaction.atomic(using=using):
        result = fn(derived_key(attempt.claim, name))
        if inspect.isawaitable(result):
            _refuse_awaitable(name, result)
        recorded, error = _settle(attempt, name, result, outermost)
    return _kept(attempt, name, recorded, error)


async def astep(name: str, fn: Callable[[str], Any]) -> Any:
    """:func:`step` for async code: ``fn`` may be a coroutine function (an ``httpx`` call); a
    plain function runs in the thread where the step's transaction is open, so its ORM writes
    join it, and what it returns is awaited if it is awaitable (``lambda key:
    client.post(...)`` on an ``httpx.AsyncClient``), still inside the step."""
    return await astep_in(_attempt(name), name, fn)


async def astep_in(attempt: store.Attempt, name: str, fn: Callable[[str], Any]) -> Any:
    """:func:`astep` under a given attempt."""
    recorded = _recorded_result(attempt, name)
    if recorded is not _TO_RUN:
        return recorded
    using = attempt.claim.using
    block = transaction.atomic(using=using)

    def enter() -> bool:
        outermost = not connections[using].in_atomic_block
        block.__enter__()
        return outermost

    outermost = await sync_to_async(enter)()
    try:
        key = derived_key(attempt.claim, name)
        if inspect.iscoroutinefunction(fn):
            result = await fn(key)
        else:
            result = await sync_to_async(fn)(key)
            if inspect.isawaitable(result):
                result = await result
        recorded, error = await sync_to_async(_settle)(attempt, name, result, outermost)
    except BaseException as exc:
        await sync_to_async(block.__exit__)(type(exc), exc, exc.__traceback__)
        raise
    await sync_to_async(block.__exit__)(None, None, None)
    return _kept(attempt, name, recorded, error)
