"""Locked tasks: the body runs while holding a lease named from the task's arguments."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

from .. import conf
from .._arguments import valid_flag, valid_on_lost, valid_timeout
from ..acquiring import acquire
from ..errors import BackendUnavailable, LeaseLost, LeaseUnavailable
from ..handle import Lease
from ..keys import validate_name
from ..semaphore import acquire_slot, valid_limit
from ._base import (
    Call,
    Key,
    backoff,
    current_call,
    format_key,
    retries_spent,
    retry_on_own_budget,
    skip,
)
from ._checks import (
    Check,
    CheckedTask,
    one_of,
    valid_alias,
    valid_count,
    valid_delay,
    valid_key,
    valid_ttl_or_default,
)

__all__ = ["BUSY_RETRIES_HEADER", "LockedTask", "OnBusy"]

logger = logging.getLogger(__name__)

OnBusy = Literal["retry", "skip", "raise"]

#: Message header counting a run's busy retries, apart from ``request.retries`` (the body's).
BUSY_RETRIES_HEADER = "leases_busy_retries"


class LockedTask(CheckedTask):
    """A task whose body runs while holding a lease named from its arguments.

    The lease is acquired before the body, kept alive while it runs and released after, also
    when the body calls :meth:`retry`: the release happens *before* the retry message is sent,
    so the retry is never blocked by its own earlier attempt. A lease lost mid-run is reported
    (``lease_lost`` signal, a warning log, :meth:`lease_lost`, ``on_lease_lost``), fenced writes
    made with it are rejected from then on, and the run fails with
    :class:`~leases.errors.LeaseLost` when the body returns, so nobody mistakes it for done.

    The body gets the :class:`~leases.lease.Lease` through a ``lease`` parameter (with
    :func:`~leases.celery.locked_task`) or :attr:`lease`, and passes it to fenced writes.

    Class attributes (set by :func:`~leases.celery.locked_task`): ``lease_key`` (default: the
    task name), ``lease_ttl`` (default ``LEASES["DEFAULT_TTL"]``), ``lease_backend``,
    ``lease_timeout`` (seconds to wait for the lease in the worker before ``on_busy``; 0 tries
    once, ``None`` waits as long as it takes, holding the worker's slot), ``on_busy``
    (``"retry"`` with backoff, ``"skip"`` to end in state ``SKIPPED``, ``"raise"`` to fail
    with :class:`~leases.errors.LeaseUnavailable`), ``busy_backoff`` /
    ``busy_backoff_max`` / ``busy_max_retries`` (for ``"retry"``; default 0.5 s doubling up to 30 s,
    100 times, then :class:`~leases.errors.LeaseUnavailable`; counted in the header
    :data:`BUSY_RETRIES_HEADER`, never in the body's ``request.retries``) and ``on_lease_lost``.

    With ``lease_limit = N`` the key names a semaphore instead
    (:func:`~leases.semaphore.semaphore`): up to N bodies of one key run at once, each holding
    a slot (a :class:`~leases.semaphore.Slot`, whose token fences writes per slot);
    ``on_busy`` applies when all N are taken.

    Each attribute is checked when a class is made from this one (a subclass, ``app.task(
    base=...)``, :func:`~leases.celery.locked_task`), raising
    :class:`~leases.errors.InvalidLeaseOption`; see :class:`~leases.celery._checks.CheckedTask`.
    """

    lease_key: ClassVar[Key | None] = None
    lease_ttl: ClassVar[float | None] = None
    lease_backend: ClassVar[str] = "default"
    lease_timeout: ClassVar[float | None] = 0
    lease_limit: ClassVar[int | None] = None
    on_busy: ClassVar[OnBusy] = "retry"
    busy_backoff: ClassVar[float] = 0.5
    busy_backoff_max: ClassVar[float] = 30.0
    busy_max_retries: ClassVar[int] = 100
    on_lease_lost: ClassVar[Callable[[Lease], object] | None] = None
    #: The decorators fill a ``lease`` parameter of the task function with the run's lease.
    inject_lease: ClassVar[bool] = True

    _option_checks: ClassVar[Mapping[str, Check]] = {
        "lease_key": valid_key,
        "lease_ttl": valid_ttl_or_default,
        "lease_backend": valid_alias,
        "lease_timeout": lambda option, timeout: valid_timeout(timeout, option),
        "lease_limit": lambda option, limit: limit is None or valid_limit(limit, option),
        "on_busy": one_of("retry", "skip", "raise"),
        "busy_backoff": valid_delay,
        "busy_backoff_max": valid_delay,
        "busy_max_retries": valid_count,
        # Called only when a lease is lost, on the keepalive thread: found there, the loss
        # report itself would fail, at the worst moment and long after the deploy.
        "on_lease_lost": lambda option, on_lost: valid_on_lost(on_lost, option),
        "inject_lease": valid_flag,
    }

    # -- hooks -------------------------------------------------------------------------------

    def lease_name(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """Hook: the lease a call needs (``lease_key`` formatted, or the task name)."""
        if self.lease_key is None:
            return validate_name(str(self.name))
        return format_key(self.lease_key, self, *args, **kwargs)

    def lease_holder(self) -> str:
        """Hook: the holder identity; names worker and task id for operators, plus a nonce.

        The nonce keeps a redelivered copy of the same task id on the same host from passing
        for the holder of the earlier copy's lease.
        """
        holder = f"celery:{self.request.hostname}:{self.request.id}:{uuid.uuid4().hex[:8]}"
        return holder[-255:]

    def lease_busy(self, name: str, exc: LeaseUnavailable) -> Any:
        """Hook: the lease is held elsewhere; retry with backoff, skip or raise (``on_busy``)."""
        if self.on_busy == "raise":
            raise exc
        if self.on_busy == "skip":
            skip(self, f"lease {name!r} is busy", lease=name)
        spent = retries_spent(self, BUSY_RETRIES_HEADER)
        countdown = backoff(spent, self.busy_backoff, self.busy_backoff_max)
        logger.debug("task %s[%s]: %s; retry in %.2fs", self.name, self.request.id, exc, countdown)
        retry_on_own_budget(
            self, BUSY_RETRIES_HEADER, spent, self.busy_max_retries, countdown=countdown, exc=exc
        )

    def lease_lost(self, lease: Lease) -> None:
        """Hook, run on the keepalive thread when the run's lease is lost mid-run."""
        logger.warning(
            "task %s lost lease %r (token %s) while running: %s; its fenced writes are "
            "rejected from now on",
            self.name,
            lease.name,
            lease.token,
            lease.lost_reason,
        )
        callback = type(self).on_lease_lost
        if callback is not None:
            callback(lease)

    @property
    def lease(self) -> Lease | None:
        """The lease held by the current run of this task (``None`` outside a run)."""
        call = current_call.get()
        return call.lease if call is not None and call.task is self else None

    # -- machinery ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = self.lease_name(args, kwargs)
        ttl = self.lease_ttl if self.lease_ttl is not None else conf.get().default_ttl
        options: dict[str, Any] = {
            "ttl": ttl,
            "backend": self.lease_backend,
            "timeout": self.lease_timeout,
            "holder": self.lease_holder(),
            "on_lost": self.lease_lost,
        }
        try:
            if self.lease_limit is None:
                held = acquire(name, **options)
            else:
                held = acquire_slot(name, limit=self.lease_limit, **options)
        except LeaseUnavailable as exc:
            return self.lease_busy(name, exc)
        call = Call(self, held)
        reset = current_call.set(call)
        try:
            result = super().__call__(*args, **kwargs)
        except BaseException:
            self._give_back(call, quiet=True)
            raise
        finally:
            current_call.reset(reset)
        self._give_back(call, quiet=False)
        return result

    def _give_back(self, call: Call, *, quiet: bool) -> None:
        """Release the run's lease once, as ``lease()`` does on leaving its block.

        A lease lost before the body returned fails the run (it ran unprotected), unless the body
        already failed or is retrying; a store that cannot be reached after a protected run is
        only logged: the grant expires by itself.
        """
        if call.released:
            return
        call.released = True
        protected = call.lease.remaining() > 0
        try:
            call.lease.release()
        except (LeaseLost, BackendUnavailable) as exc:
            if isinstance(exc, BackendUnavailable) and protected:
                call.lease._abandon()  # the run is over: the grant runs out by its TTL
            if not quiet and (isinstance(exc, LeaseLost) or not protected):
                raise
            logger.warning(
                "task %s[%s]: lease %r not released: %s",
                self.name,
                self.request.id,
                call.lease.name,
                exc,
            )

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Release this run's lease, then retry: a retry must not wait for its own attempt."""
        call = current_call.get()
        if call is not None and call.task is self:
            self._give_back(call, quiet=True)
        return super().retry(*args, **kwargs)
