"""Celery tasks that run under a lease, once per key, on the leader, or on one partition.

Celery delivers at least once: a task is redelivered after its worker dies (``acks_late``), and
on the Redis broker it is delivered again while the first copy still runs past
``visibility_timeout``. A lock alone cannot make that safe, because the first copy may still be
running when its lease expires; so the body can take the :class:`~leases.lease.Lease` (a
``lease`` parameter) and pass it to fenced writes (``obj.save(fence=lease)``): a copy that lost
its lease cannot overwrite what a newer holder wrote.

Each feature is a :class:`celery.Task` base class with documented hooks (override them in a
subclass, use it with ``app.task(base=...)``); the decorators are thin sugar over them:

    @locked_task(key="sync:{account_id}", ttl=60, acks_late=True)
    def sync(account_id, lease): ...

=======================  ==================================  ==================================
decorator                base class                          what it guarantees
=======================  ==================================  ==================================
:func:`locked_task`      :class:`LockedTask`                 bodies of one key never overlap
:func:`singleton_task`   :class:`SingletonTask`              one copy per key queued or running
:func:`leader_only`      :class:`LeaderOnlyTask`             only the elected beat sends ticks
:func:`partitioned`      :class:`PartitionedTask`            one key, one queue, one consumer
=======================  ==================================  ==================================

Every decorator takes Celery's ``task()`` options too (``bind``, ``acks_late``, ``app``,
``name``, and ``base`` to mix in another base such as
:class:`idempotency.celery.IdempotentTask`); one that neither Celery nor the task class
knows (a typo) is refused with :class:`TypeError` when the task is defined. So is an option
value that cannot work (``lease_ttl = -5``, ``on_busy = "retyr"``), in a decorator or in the
body of a subclass: :class:`~leases.errors.InvalidLeaseOption` is raised when the class is
made (for an ``idempotency`` option, ``IdempotencyImproperlyConfigured``), naming the
attribute and the class. This package is the only part of ``leases`` that imports Celery.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, overload

from .._extras import extra_required
from ..handle import Lease

with extra_required(__name__, "celery", "celery"):
    from ._base import SKIPPED, Key, format_key, task_decorator
    from .leader import LeaderOnlyTask, resign_leaderships
    from .locked import LockedTask, OnBusy
    from .partition import PartitionedTask, partition_for, partition_queues
    from .singleton import SingletonTask

__all__ = [
    "SKIPPED",
    "LeaderOnlyTask",
    "LockedTask",
    "PartitionedTask",
    "SingletonTask",
    "format_key",
    "leader_only",
    "locked_task",
    "partition_for",
    "partition_queues",
    "partitioned",
    "resign_leaderships",
    "singleton_task",
]


@overload
def locked_task(fun: Callable[..., Any], /) -> LockedTask: ...
@overload
def locked_task(
    fun: None = None,
    /,
    *,
    key: Key | None = None,
    ttl: float | None = None,
    on_busy: OnBusy = "retry",
    backend: str = "default",
    timeout: float | None = 0,
    on_lost: Callable[[Lease], object] | None = None,
    limit: int | None = None,
    **options: Any,
) -> Callable[[Callable[..., Any]], LockedTask]: ...
def locked_task(
    fun: Callable[..., Any] | None = None,
    /,
    *,
    key: Key | None = None,
    ttl: float | None = None,
    on_busy: OnBusy = "retry",
    backend: str = "default",
    timeout: float | None = 0,
    on_lost: Callable[[Lease], object] | None = None,
    limit: int | None = None,
    **options: Any,
) -> Any:
    """A task whose body runs under the lease ``key`` (a template); see :class:`LockedTask`.

    With ``limit=N``, up to N bodies of one key run at once, each under a slot of the semaphore
    ``key`` (checked here: a positive int up to :data:`~leases.semaphore.MAX_LIMIT`).
    """
    attrs = {
        "lease_key": ("key", key),
        "lease_ttl": ("ttl", ttl),
        "on_busy": ("on_busy", on_busy),
        "lease_backend": ("backend", backend),
        "lease_timeout": ("timeout", timeout),
        "on_lease_lost": ("on_lost", on_lost),
        "lease_limit": ("limit", limit),
    }
    return task_decorator(locked_task, LockedTask, fun, attrs, options, key="lease_key")


@overload
def singleton_task(fun: Callable[..., Any], /) -> SingletonTask: ...
@overload
def singleton_task(
    fun: None = None,
    /,
    *,
    key: Key | None = None,
    ttl: float | None = None,
    on_duplicate: Literal["return", "raise"] = "return",
    backend: str = "default",
    **options: Any,
) -> Callable[[Callable[..., Any]], SingletonTask]: ...
def singleton_task(
    fun: Callable[..., Any] | None = None,
    /,
    *,
    key: Key | None = None,
    ttl: float | None = None,
    on_duplicate: Literal["return", "raise"] = "return",
    backend: str = "default",
    **options: Any,
) -> Any:
    """A task deduplicated on enqueue by ``key``; see :class:`SingletonTask`."""
    attrs = {
        "singleton_key": ("key", key),
        "singleton_ttl": ("ttl", ttl),
        "on_duplicate": ("on_duplicate", on_duplicate),
        "singleton_backend": ("backend", backend),
    }
    return task_decorator(singleton_task, SingletonTask, fun, attrs, options, key="singleton_key")


@overload
def leader_only(fun: Callable[..., Any], /) -> LeaderOnlyTask: ...
@overload
def leader_only(
    fun: None = None,
    /,
    *,
    key: str | None = None,
    ttl: float | None = None,
    backend: str = "default",
    **options: Any,
) -> Callable[[Callable[..., Any]], LeaderOnlyTask]: ...
def leader_only(
    fun: Callable[..., Any] | None = None,
    /,
    *,
    key: str | None = None,
    ttl: float | None = None,
    backend: str = "default",
    **options: Any,
) -> Any:
    """A periodic task sent and run only by the leader of the election ``key`` (default: the
    task's name); see :class:`LeaderOnlyTask`.

    ``key`` names the election, as the other decorators' ``key`` names their lease, and
    ``name`` is Celery's task name, as everywhere else. The election was named ``name=``
    before: alone, it is refused (:class:`TypeError`) rather than silently taken for the other
    one, which would move the task to a new name that beat's schedule does not list. ``key``
    is checked here (:func:`~leases.keys.validate_name`; a bad one would make every send fail
    in beat and every run fail in the worker), and it is one name, not a template: the
    election is the task's, whatever its arguments.
    """
    if "name" in options and key is None:
        raise TypeError(
            "leader_only(name=...) is ambiguous: the election is now named by key= (name= "
            "named it in earlier versions), and name= is Celery's task name, as in every other "
            "decorator. Write key=<election> (the name you passed), and add name= only to "
            "register the task under a name of its own"
        )
    attrs = {
        "leader_name": ("key", key),
        "leader_ttl": ("ttl", ttl),
        "leader_backend": ("backend", backend),
    }
    return task_decorator(leader_only, LeaderOnlyTask, fun, attrs, options)


def partitioned(
    *,
    key: Key | None = None,
    partitions: int,
    queue_prefix: str | None = None,
    **options: Any,
) -> Callable[[Callable[..., Any]], PartitionedTask]:
    """A task routed by a stable hash of ``key`` to one of ``partitions`` queues."""
    attrs = {
        "partition_key": ("key", key),
        "partitions": ("partitions", partitions),
        "partition_queue_prefix": ("queue_prefix", queue_prefix),
    }
    decorate: Callable[[Callable[..., Any]], PartitionedTask]
    decorate = task_decorator(
        partitioned, PartitionedTask, None, attrs, options, key="partition_key"
    )
    return decorate
