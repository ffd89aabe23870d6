"""Singleton tasks: at most one copy per key queued or running, deduplicated on enqueue."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from celery.exceptions import Ignore
from celery.result import AsyncResult

from .. import conf
from ..acquiring import acquire
from ..backends import Grant, LeaseBackend, get_backend
from ..errors import BackendUnavailable, LeaseError, LeaseUnavailable
from ..handle import Lease
from ..keys import validate_name
from ._base import Key, format_key, skip
from ._checks import Check, CheckedTask, one_of, valid_alias, valid_key, valid_ttl_or_default

__all__ = ["GUARD_HEADER", "SingletonTask"]

logger = logging.getLogger(__name__)

#: Message header carrying the guard (name, holder, token, and the grant's secret, which the
#: worker needs to renew and release it) from the sender to the worker.
GUARD_HEADER = "leases_singleton"
_HOLDER_PREFIX = "celery-task:"
_LOOKS = 5
#: Before the guard's name, the run lease's (see :meth:`SingletonTask._enter_run`); no guard
#: name starts so (theirs is ``singleton:``), so no key's guard is another key's run lease.
_RUN_PREFIX = "singleton-run:"
#: ``apply_async`` options through which a canvas waits on, or chains work after, this very
#: call: another task's result cannot stand in for it.
_CANVAS_OPTIONS = ("group_id", "chord", "chain", "link", "link_error")


class SingletonTask(CheckedTask):
    """A task of which at most one copy per key is queued or running: dedupe on enqueue.

    :meth:`apply_async` takes a guard lease ``singleton:<key>`` (one try, held in the name of
    the new task's id) before it sends. A second call with the same key while the guard is held
    gets the existing task's :class:`~celery.result.AsyncResult` (``on_duplicate="return"``) or
    :class:`~leases.errors.LeaseUnavailable` (``"raise"``). The worker adopts the guard when the
    run starts (renewing it, and keeping it alive while the body runs) and releases it when the
    run ends (a retry waiting for its countdown is not guarded). The guard is a lease, so a
    crashed worker's guard frees after ``singleton_ttl`` at most, which must cover the time a
    task may wait in the queue.

    A message with no guard to adopt (sent with ``send_task`` or by name, a retry, or a
    redelivered copy whose guard expired while it waited) takes the guard in the worker before
    its body runs; if another copy holds it the run is a duplicate and ends in state
    :data:`~leases.celery.SKIPPED`, never beside that copy. When the store cannot be reached
    the run fails with :class:`~leases.errors.BackendUnavailable` rather than run unguarded.
    """

    singleton_key: ClassVar[Key | None] = None
    singleton_ttl: ClassVar[float | None] = None
    singleton_backend: ClassVar[str] = "default"
    on_duplicate: ClassVar[Literal["return", "raise"]] = "return"

    _option_checks: ClassVar[Mapping[str, Check]] = {
        "singleton_key": valid_key,
        "singleton_ttl": valid_ttl_or_default,
        "singleton_backend": valid_alias,
        "on_duplicate": one_of("return", "raise"),
    }

    def singleton_name(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """Hook: the guard's lease name for a call: ``singleton:<task name>[:<key>]``.

        The task's name is always part of it, so two tasks with the same key (say
        ``"{customer}"``) guard separately instead of one silently swallowing the other.
        """
        if self.singleton_key is None:
            return validate_name(f"singleton:{self.name}")
        key = format_key(self.singleton_key, self, *args, **kwargs)
        return validate_name(f"singleton:{self.name}:{key}")

    def duplicate(
        self, name: str, task_id: str, options: Mapping[str, Any] | None = None
    ) -> AsyncResult[Any]:
        """Hook: what a call gets when task ``task_id`` already holds the guard ``name``.

        Inside a group or chord the canvas has already frozen this call's own task id into its
        result set, so returning another task's result would leave ``GroupResult.get()``
        waiting forever and a chord body never firing; at the head of a chain, or with
        ``link``/``link_error`` callbacks, the rest of the work rides in this call's message,
        which is never sent, so the chain's result would never complete. A duplicate in any of
        these is refused.
        """
        if self.on_duplicate == "raise":
            raise LeaseUnavailable(name, 0, f"task {task_id} is already queued or running")
        canvas = [key for key in _CANVAS_OPTIONS if (options or {}).get(key)]
        if canvas:
            raise LeaseUnavailable(
                name,
                0,
                f"task {task_id} is already queued or running, and a singleton inside a group, "
                "chord or chain, or with callbacks, cannot stand in for it (the canvas waits "
                f"for its own task id, or its {', '.join(canvas)} would be dropped)",
            )
        return self.AsyncResult(task_id)

    def _guard_ttl(self) -> float:
        return self.singleton_ttl if self.singleton_ttl is not None else conf.get().default_ttl

    def apply_async(  # type: ignore[override]  # options pass through to Celery unchanged
        self, args: Any = None, kwargs: Any = None, **options: Any
    ) -> Any:
        task_id = options.pop("task_id", None) or str(uuid.uuid4())
        if task_id == self.request.id:  # retry() of the running task: not a second copy
            headers = dict(options.pop("headers", None) or {})
            headers.pop(GUARD_HEADER, None)
            return super().apply_async(args, kwargs, task_id=task_id, headers=headers, **options)
        name = self.singleton_name(tuple(args or ()), dict(kwargs or {}))
        _run_name(name)  # the run lease's name must fit too: refused here, not in a worker
        store = get_backend(self.singleton_backend)
        for _ in range(_LOOKS):  # the holder may release between our try and our look
            # The sender never renews nor releases the guard (the worker does), so it is a bare
            # grant here, not a Lease watched and kept alive by this process.
            guard = store.try_acquire(name, _HOLDER_PREFIX + task_id, self._guard_ttl())
            if guard is None:
                info = store.inspect(name)
                if info is not None and info.held:
                    holder = info.holder.removeprefix(_HOLDER_PREFIX)
                    return self.duplicate(name, holder, options)
                continue
            headers = dict(options.pop("headers", None) or {})
            headers[GUARD_HEADER] = _guard_header(guard)
            try:
                return super().apply_async(
                    args, kwargs, task_id=task_id, headers=headers, **options
                )
            except BaseException:
                _release_sent_quietly(store, guard)
                raise
        raise LeaseUnavailable(name, 0, "the guard changed hands on every look")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body only under the guard: the sender's, adopted, or else taken here.

        A message without a live guard is not proof that no other copy runs: ``send_task`` and
        a beat sending by name send none, and an ``acks_late`` copy redelivered after its
        worker died finds its guard expired, maybe retaken by a newer copy. Running those
        unguarded put two copies of one key side by side. Calling the task object directly
        (plain Python in this process, not a message) runs unguarded, as Celery's own
        ``task(...)`` does.
        """
        if self.request.called_directly:
            return super().__call__(*args, **kwargs)
        guard = self._adopt_guard() or self._take_guard(args, kwargs)
        try:
            run = self._enter_run(guard)
        except BaseException:
            _release_quietly(guard)
            raise
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _release_quietly(guard)  # first: a copy waiting for the run lease then sees it gone
            _release_quietly(run)

    def _enter_run(self, guard: Lease) -> Lease:
        """The run lease ``singleton-run:<guard>``: one delivery of a key runs at a time.

        The guard alone does not ensure that: a copy the broker delivers again while the first
        still runs (``acks_late`` and a visibility timeout shorter than the body, a worker whose
        broker connection dropped) carries the same guard, and adopts it with the sender's
        secret as well as the first copy did; both ran. The run lease is taken in the worker,
        by this process, and kept alive while the body runs, so its TTL (``DEFAULT_TTL`` at
        most, not the guard's queue-covering one) bounds how long a dead worker's lease holds
        the next delivery back. A copy that finds it held waits that long: if it then gets it,
        the one before died (or ended), and the guard says which: still held, this copy is the
        redelivery of a crashed run and goes ahead; gone, the run ended and released it, and
        this copy is dropped. Not getting it, the other copy still runs: dropped too (``Ignore``,
        leaving the running copy's state alone). The guard is abandoned then, not released:
        it is the running copy's as well.
        """
        alias = self.singleton_backend
        name = _run_name(guard.name)
        ttl = min(self._guard_ttl(), conf.get().default_ttl)
        try:
            return acquire(name, ttl=ttl, timeout=0, backend=alias)
        except LeaseUnavailable:
            pass
        try:
            run = acquire(name, ttl=ttl, timeout=1.25 * ttl + 1, backend=alias)
        except LeaseUnavailable:
            guard._abandon()
            logger.info("task %s[%s] dropped: another copy runs", self.name, self.request.id)
            raise Ignore(f"task {self.request.id}: another copy of {guard.name!r} runs") from None
        try:
            guard.renew()
        except BackendUnavailable:
            _release_quietly(run)
            raise  # which it is cannot be told: the run fails, as when the guard is unreachable
        except LeaseError:
            _release_quietly(run)
            guard._abandon()
            logger.info("task %s[%s] dropped: another copy ran", self.name, self.request.id)
            raise Ignore(f"task {self.request.id}: another copy of {guard.name!r} ran") from None
        return run

    def _adopt_guard(self) -> Lease | None:
        """The sender's guard, adopted by this run (``None`` if there is none or it expired).

        A store that cannot be reached raises :class:`~leases.errors.BackendUnavailable`: the
        guard can then be checked neither way, and the run must not go ahead unguarded.
        """
        request = self.request
        data = (request.headers or {}).get(GUARD_HEADER) or getattr(request, GUARD_HEADER, None)
        if not data:
            return None
        try:
            return _adopt(data, self._guard_ttl(), self.singleton_backend)
        except BackendUnavailable:
            raise
        except LeaseError as exc:  # expired while queued: a duplicate may have been sent
            logger.warning(
                "task %s[%s]: singleton guard %r expired before the run, taking it again: %s",
                self.name,
                request.id,
                data.get("name"),
                exc,
            )
            return None

    def _take_guard(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Lease:
        """Take the guard in the worker, for a run that brought none it could adopt.

        Held in this task's id, as :meth:`apply_async` holds it, so a ``delay()`` meanwhile
        returns this run's result. If another copy holds it this run is the duplicate: it is
        skipped (state :data:`~leases.celery.SKIPPED`), as a second ``delay()`` would have
        been refused on enqueue. Retries (sent without the guard) come through here too.
        """
        name = self.singleton_name(args, kwargs)
        store = get_backend(self.singleton_backend)
        holder = _HOLDER_PREFIX + str(self.request.id)
        grant = store.try_acquire(name, holder, self._guard_ttl())
        if grant is None:
            info = store.inspect(name)
            if info is not None and info.held and info.holder == holder:
                # This very task is running elsewhere (a broker's redelivery of a running
                # task): that copy records the task's state, which a SKIPPED must not replace.
                logger.info("task %s[%s] skipped: already running", self.name, self.request.id)
                raise Ignore(f"task {self.request.id} is already running")
            skip(self, f"another copy holds the singleton guard {name!r}", guard=name)
        return Lease.start(store, grant, renew_fraction=conf.get().renew_fraction)


def _run_name(guard: str) -> str:
    return validate_name(_RUN_PREFIX + guard)


def _guard_header(guard: Grant) -> dict[str, Any]:
    """The sender's grant, as the worker needs it to renew and release the guard.

    The grant's secret travels with it (through the broker): the worker can only prove it owns
    the guard with it. Anyone who can read the broker's messages could release the guard early;
    they could also run the task, so this adds no exposure the broker did not already have.
    """
    return {
        "name": guard.name,
        "holder": guard.holder,
        "token": guard.token,
        "extra": dict(guard.extra),
        "secret": guard.secret,
    }


def _adopt(data: Mapping[str, Any], ttl: float, alias: str) -> Lease:
    """Take over the sender's grant in this process: renew it, then hold it like any lease.

    The renewal is conditional on name, holder, token and secret like any other, so a guard
    that expired while the task was queued (and may be someone else's now) is never adopted.
    """
    store = get_backend(alias)
    sent = Grant(
        name=str(data["name"]),
        holder=str(data["holder"]),
        token=int(data["token"]),
        ttl=ttl,
        sent_at=time.monotonic(),
        extra=dict(data.get("extra") or {}),
        secret=str(data.get("secret") or ""),
    )
    return Lease.start(store, store.renew(sent, ttl), renew_fraction=conf.get().renew_fraction)


def _release_sent_quietly(store: LeaseBackend, guard: Grant) -> None:
    """Free the sender's guard after a send that failed, keeping the send's own error.

    The send's error is what the caller must see: a broker that refused the message, or (in
    eager mode) the body's own exception, whose run already released the guard. A guard that
    cannot be released here expires by its TTL.
    """
    try:
        store.release(guard)
    except LeaseError as exc:
        logger.debug("singleton guard %r not released after the failed send: %s", guard.name, exc)


def _release_quietly(held: Lease) -> None:
    """Release the run's guard or run lease; a failure is logged, the task being over."""
    try:
        held.release()
    except BackendUnavailable as exc:
        held._abandon()  # its task is over: the lease runs out by its TTL, unrenewed
        logger.warning(
            "singleton lease %r could not be released, it will expire: %s", held.name, exc
        )
    except LeaseError as exc:
        logger.warning("singleton lease %r was lost before its release: %s", held.name, exc)
