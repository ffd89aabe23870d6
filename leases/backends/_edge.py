"""Where a backend's driver errors become :class:`~leases.errors.BackendUnavailable`."""

from __future__ import annotations

from types import TracebackType
from typing import ClassVar

from ..errors import BackendUnavailable

__all__ = ["DriverEdge"]


class DriverEdge:
    """Around one round trip: a driver error (one of :attr:`errors`) raised in it leaves as
    :class:`BackendUnavailable` naming the backend and what it was doing, the driver's error
    chained. Each driver's module subclasses it with its own errors; anything else passes.

    A class, not ``@contextmanager``: it wraps every round trip, and a generator-based context
    manager costs about a microsecond more each time.
    """

    __slots__ = ("alias", "what")

    #: The driver's errors that mean the store could not be used.
    errors: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(self, alias: str, what: str) -> None:
        self.alias, self.what = alias, what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, self.errors):
            detail = f"{self.what}: {type(exc).__name__}: {exc}"
            raise BackendUnavailable(self.alias, detail) from exc
