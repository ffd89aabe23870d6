"""Partitioned tasks: one queue per partition, chosen by a stable hash of the task's key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..errors import InvalidLeaseOption
from ..keys import advisory_key, validate_name
from ._base import Key, format_key
from ._checks import Check, CheckedTask, valid_key

__all__ = ["PartitionedTask", "partition_for", "partition_queues"]

_UINT64 = 0xFFFFFFFFFFFFFFFF


def partition_for(key: str, partitions: int) -> int:
    """The partition of ``key`` among ``partitions``: stable forever, in every process.

    ``advisory_key(key)`` (the first 8 bytes of BLAKE2b of the UTF-8 key, see
    :mod:`leases.keys`) read as an unsigned 64-bit number, modulo ``partitions``. Python's
    ``hash()`` would not do: it is salted per process, so two producers would disagree.
    """
    _valid_partitions("partitions", partitions)
    digest = advisory_key(validate_name(key))
    assert isinstance(digest, int)
    return (digest & _UINT64) % partitions


def _valid_partitions(option: str, partitions: object) -> None:
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise InvalidLeaseOption(option, partitions, "must be a positive int")


def _valid_prefix(option: str, prefix: object) -> None:
    if prefix is not None and not isinstance(prefix, str):
        raise InvalidLeaseOption(option, prefix, "must be None (the task's name) or a str")


class PartitionedTask(CheckedTask):
    """A task routed to one of ``partitions`` queues by a stable hash of its key.

    Tasks of one key always land on the same queue, so a single consumer per queue
    (``celery worker -Q <queue> -c 1``) runs them one at a time, in order, without a lock.
    Queues are named ``<partition_queue_prefix>.<n>`` (default prefix: the task name); list
    them with :func:`partition_queues`. An explicit ``queue=`` given to ``apply_async`` wins.
    Changing ``partitions`` moves keys between queues: drain the queues first.
    """

    partition_key: ClassVar[Key | None] = None
    partitions: ClassVar[int] = 1
    partition_queue_prefix: ClassVar[str | None] = None

    _option_checks: ClassVar[Mapping[str, Check]] = {
        "partition_key": valid_key,
        "partitions": _valid_partitions,
        "partition_queue_prefix": _valid_prefix,
    }

    def partition_queue(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """Hook: the queue of one call."""
        key = format_key(self.partition_key or str(self.name), self, *args, **kwargs)
        return partition_queues(self)[partition_for(key, self.partitions)]

    def apply_async(  # type: ignore[override]  # options pass through to Celery unchanged
        self, args: Any = None, kwargs: Any = None, **options: Any
    ) -> Any:
        if not options.get("queue"):
            options["queue"] = self.partition_queue(tuple(args or ()), dict(kwargs or {}))
        return super().apply_async(args, kwargs, **options)


def partition_queues(task: PartitionedTask | type[PartitionedTask]) -> list[str]:
    """Every queue of a partitioned task, in partition order (start one consumer on each)."""
    prefix = task.partition_queue_prefix or str(task.name)
    return [f"{prefix}.{n}" for n in range(task.partitions)]
