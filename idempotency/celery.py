"""Idempotent Celery tasks: a redelivered or duplicate run returns the first run's result.

Celery delivers at least once, so a task's effects must be safe to apply twice, or be applied
once per key. :class:`IdempotentTask` does the latter with the same key state machine as the HTTP
views (:mod:`idempotency.store`): the first run claims ``(scope, key)`` (default key: the task
id, which a redelivery keeps), runs the body inside ``transaction.atomic()`` and stores its result
in the ``IdempotencyKey`` row *in that transaction*, so the effects and the record commit together
or not at all. A copy that arrives later returns the stored result without running the body; a
copy that arrives while the first is still in flight retries (or waits, ``wait=``) until the
first commits, or takes the key over once the first's claim lapses (its worker died, and its
uncommitted effects died with it).

Only database effects on the key's database are covered: an email sent from the body is sent by
every run that gets that far, unless the body is made of steps (:mod:`idempotency.steps`,
``atomic=False``): then each step commits with its record, a redelivery resumes after the last
recorded one, and outside calls get a derived key to deduplicate by. Results must be
JSON-serialisable: they are stored as JSON, and every run returns that JSON form, the first too
(:mod:`idempotency.operations`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from functools import partial
from typing import Any, ClassVar, Literal, overload

from django.core.serializers.json import DjangoJSONEncoder

from leases._extras import extra_required
from leases.keys import MAX_NAME_LENGTH, validate_name

with extra_required(__name__, "celery", "celery"):
    from leases.celery._base import (
        backoff,
        format_key,
        retries_spent,
        retry_on_own_budget,
        task_decorator,
        task_signature,
    )
    from leases.celery._checks import Check, CheckedTask, valid_key
    from leases.celery.locked import LockedTask

from . import conf
from .errors import IdempotencyImproperlyConfigured, IdempotencyKeyInProgress
from .operations import idempotency_key

__all__ = ["IN_FLIGHT_RETRIES_HEADER", "IdempotentTask", "idempotent_task"]

logger = logging.getLogger(__name__)

#: Message header counting a run's in-flight retries, apart from ``request.retries`` (the body's).
IN_FLIGHT_RETRIES_HEADER = "idempotency_in_flight_retries"


def _on_in_flight(option: str, value: object) -> None:
    """``"retry"`` or ``"raise"``: anything else behaved as ``"retry"``."""
    if value not in ("retry", "raise"):
        raise IdempotencyImproperlyConfigured(f"{option} must be 'retry' or 'raise', not {value!r}")


class IdempotentTask(CheckedTask):
    """A task whose database effects and result are recorded once per key; see the module doc.

    Class attributes (set by :func:`idempotent_task`): ``idempotency_key`` (template or
    callable, default: the task id), ``idempotency_ttl`` (seconds the result is replayed,
    default ``IDEMPOTENCY["TTL"]``), ``idempotency_lock`` (seconds a run's claim lasts before a
    copy may take over; longer than the task runs, default ``IDEMPOTENCY["LOCK_TIMEOUT"]``),
    ``idempotency_wait`` (seconds a copy waits in the worker for an in-flight one before
    ``on_in_flight``), ``on_in_flight`` (``"retry"`` or ``"raise"``) and
    ``in_flight_backoff`` / ``in_flight_max_retries`` (counted in the header
    :data:`IN_FLIGHT_RETRIES_HEADER`, never in the body's ``request.retries``).

    Each attribute is checked when a class is made from this one (a subclass, ``app.task(
    base=...)``, :func:`idempotent_task`), raising
    :class:`~idempotency.errors.IdempotencyImproperlyConfigured` (a key that is neither a
    template nor a callable: :class:`~leases.errors.InvalidLeaseOption`, as the other tasks'
    keys); see :class:`~leases.celery._checks.CheckedTask`.
    """

    idempotency_key: ClassVar[str | Callable[..., str] | None] = None
    idempotency_ttl: ClassVar[float | None] = None
    idempotency_lock: ClassVar[float | None] = None
    idempotency_wait: ClassVar[float] = 0
    on_in_flight: ClassVar[Literal["retry", "raise"]] = "retry"
    in_flight_backoff: ClassVar[float] = 0.5
    in_flight_max_retries: ClassVar[int] = 100
    #: False for a body made of steps (:mod:`idempotency.steps`) that a redelivery resumes.
    idempotency_atomic: ClassVar[bool] = True
    #: Claim the key in the body's transaction (``IDEMPOTENCY["CLAIM_IN_TRANSACTION"]`` when
    #: None): a worker killed mid-run leaves nothing, and its redelivery runs at once.
    idempotency_claim_in_transaction: ClassVar[bool | None] = None

    _option_checks: ClassVar[Mapping[str, Check]] = {
        "idempotency_key": valid_key,
        "idempotency_ttl": partial(conf.check_seconds, positive=True),
        "idempotency_lock": partial(conf.check_seconds, positive=True),
        "idempotency_wait": partial(conf.check_seconds, positive=False, optional=False),
        "on_in_flight": _on_in_flight,
        "in_flight_backoff": partial(conf.check_seconds, positive=False, optional=False),
        "in_flight_max_retries": conf.check_count,
        "idempotency_atomic": conf.check_flag,
        "idempotency_claim_in_transaction": partial(conf.check_flag, optional=True),
    }

    # -- hooks -------------------------------------------------------------------------------

    def idempotency_scope(self) -> str:
        """Hook: the key space (default ``celery:<task name>``; keys of two tasks never meet)."""
        return f"celery:{self.name}"

    def idempotency_key_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """Hook: the key of one call (the template formatted, or the task id)."""
        if self.idempotency_key is None:
            return str(self.request.id)
        return format_key(self.idempotency_key, self, *args, **kwargs)

    def fingerprint(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """Hook: a digest of the arguments; the same key with other arguments is an error.

        The arguments bound to the task's signature with defaults applied, as the key's are
        (:func:`~leases.celery._base.format_key`): ``charge(7, 100)``, ``charge(7,
        cents=100)`` and ``charge(order=7, cents=100)`` are one call. Listed as the
        positional form sends them (which thus kept the fingerprint it had before the
        binding), keyword-only ones by name."""
        try:
            bound = task_signature(self).bind_partial(*args, **kwargs)
        except TypeError:  # arguments the task does not take: the run fails on them anyway
            positional, named = list(args), dict(kwargs)
        else:
            bound.apply_defaults()
            positional, named = list(bound.args), dict(bound.kwargs)
        raw = json.dumps([self.name, positional, named], cls=DjangoJSONEncoder, sort_keys=True)
        return hashlib.sha256(raw.encode()).hexdigest()

    def in_flight(self, key: str, exc: IdempotencyKeyInProgress) -> Any:
        """Hook: another copy holds the key; retry (never later than its claim lapses) or raise."""
        if self.on_in_flight == "raise":
            raise exc
        spent = retries_spent(self, IN_FLIGHT_RETRIES_HEADER)
        delay = backoff(spent, self.in_flight_backoff, 30.0)
        countdown = min(exc.retry_after, delay) if exc.retry_after > 0 else delay
        logger.info(
            "task %s[%s]: key %r is in flight elsewhere; retry in %.2fs",
            self.name,
            self.request.id,
            key,
            countdown,
        )
        retry_on_own_budget(
            self,
            IN_FLIGHT_RETRIES_HEADER,
            spent,
            self.in_flight_max_retries,
            countdown=countdown,
            exc=exc,
        )

    # -- machinery ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.idempotency_key is None and not self.request.id:
            return super().__call__(*args, **kwargs)  # called directly: no delivery to dedupe
        key = self._key_of_run(args, kwargs)
        once = idempotency_key(
            key,
            scope=self.idempotency_scope(),
            fingerprint=self.fingerprint(args, kwargs),
            ttl=self.idempotency_ttl,
            lock_timeout=self.idempotency_lock,
            wait=self.idempotency_wait,
            atomic=self.idempotency_atomic,
            claim_in_transaction=self.idempotency_claim_in_transaction,
        )
        try:
            with once as operation:
                if operation.replayed:
                    logger.info(
                        "task %s[%s]: key %r is done; returning its recorded result",
                        self.name,
                        self.request.id,
                        key,
                    )
                else:
                    operation.result = super().__call__(*args, **kwargs)
        except IdempotencyKeyInProgress as exc:  # at the start, or taken over (Lost) at commit
            return self.in_flight(key, exc)
        return operation.result

    def _key_of_run(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The key this run claims (:meth:`idempotency_key_for`, called once a run)."""
        return self.idempotency_key_for(args, kwargs)


#: The key a run of ``idempotent_task(base=LockedTask)`` named its lease after, kept for the
#: claim of the same run: the task (a run of another task never takes it) and a box holding
#: the key until the claim takes it out.
_run_key: ContextVar[tuple[object, list[str]] | None] = ContextVar(
    "idempotency_run_key", default=None
)


class _LockedIdempotentTask(LockedTask, IdempotentTask):
    """``idempotent_task(base=LockedTask)``: a lease around each run, one per idempotency key.

    The lease is held outside the key's claim (the idempotency record is taken and committed
    under it), as with ``locked_task(base=IdempotentTask)``. Its name is the key's, in the
    key's scope (``<scope>:<key>``, the key's SHA-256 when that is too long for a lease name):
    named after the task, as a locked task's lease is by default, it put every key of the
    task behind one lease, one run at a time. A ``lease_key`` given, or a subclass's own
    :meth:`lease_name`, names it instead.

    The key is computed once a run, for the lease, and the claim takes the same: computed
    again, a key callable that reads the database paid twice, and one that is not pure (a
    clock, a counter) named the lease after one key and claimed another.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reset = _run_key.set((self, []))
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _run_key.reset(reset)

    def _key_of_run(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        run = _run_key.get()
        if run is not None and run[0] is self and run[1]:
            return run[1].pop()  # the lease's (taken out: a nested call computes its own)
        return super()._key_of_run(args, kwargs)

    def lease_name(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        if self.lease_key is not None or (self.idempotency_key is None and not self.request.id):
            return super().lease_name(args, kwargs)  # a lease_key, or no key (called directly)
        scope, key = self.idempotency_scope(), self.idempotency_key_for(args, kwargs)
        run = _run_key.get()
        if run is not None and run[0] is self:
            run[1][:] = [key]
        name = f"{scope}:{key}"
        if len(name) > MAX_NAME_LENGTH:
            name = f"{scope}:sha256:{hashlib.sha256(key.encode()).hexdigest()}"
        return validate_name(name)


def _locked_per_key(extra: type[LockedTask]) -> type[_LockedIdempotentTask]:
    """The task class of ``idempotent_task(base=extra)``, ``extra`` a locked task's base: its
    own hooks first, then the per-key lease (see :class:`_LockedIdempotentTask`)."""
    if extra is LockedTask:
        return _LockedIdempotentTask
    return type(f"{extra.__name__}{IdempotentTask.__name__}", (extra, _LockedIdempotentTask), {})


@overload
def idempotent_task(fun: Callable[..., Any], /) -> IdempotentTask: ...
@overload
def idempotent_task(
    fun: None = None,
    /,
    *,
    key: str | Callable[..., str] | None = None,
    ttl: float | None = None,
    lock: float | None = None,
    wait: float = 0,
    on_in_flight: Literal["retry", "raise"] = "retry",
    atomic: bool = True,
    claim_in_transaction: bool | None = None,
    **options: Any,
) -> Callable[[Callable[..., Any]], IdempotentTask]: ...
def idempotent_task(
    fun: Callable[..., Any] | None = None,
    /,
    *,
    key: str | Callable[..., str] | None = None,
    ttl: float | None = None,
    lock: float | None = None,
    wait: float = 0,
    on_in_flight: Literal["retry", "raise"] = "retry",
    atomic: bool = True,
    claim_in_transaction: bool | None = None,
    **options: Any,
) -> Any:
    """A task whose effects and result are recorded once per ``key``; see :class:`IdempotentTask`.

    ``options`` go to Celery's ``task()`` (``bind``, ``acks_late``, ``app``, ``base``, ...);
    ``base=LockedTask`` (or a subclass) holds a lease around each run, one per key (see
    :class:`_LockedIdempotentTask`; the lease's options are its attributes: ``lease_ttl=``,
    ``on_busy=``, ``lease_backend=``, ...). ``atomic=False`` for a body made of steps
    (:func:`idempotency.step`): each commits as it completes, and a redelivery after a crash
    resumes after the last one instead of running the body in one transaction again.
    ``claim_in_transaction=True`` claims the key in the body's transaction (see the guide's
    "Claiming the key in the view's transaction").
    """
    attrs = {
        "idempotency_key": ("key", key),
        "idempotency_ttl": ("ttl", ttl),
        "idempotency_lock": ("lock", lock),
        "idempotency_wait": ("wait", wait),
        "on_in_flight": ("on_in_flight", on_in_flight),
        "idempotency_atomic": ("atomic", atomic),
        "idempotency_claim_in_transaction": ("claim_in_transaction", claim_in_transaction),
    }
    extra = options.get("base")
    if isinstance(extra, type) and issubclass(extra, LockedTask):
        options["base"] = extra if issubclass(extra, IdempotentTask) else _locked_per_key(extra)
    return task_decorator(
        idempotent_task, IdempotentTask, fun, attrs, options, key="idempotency_key"
    )
