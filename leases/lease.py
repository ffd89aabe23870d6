"""``lease()``: the context manager and decorator around :func:`~leases.acquiring.acquire`.

Leaving the block releases the lease, never hiding the body's own exception; a body that
outlived its lease raises :class:`~leases.errors.LeaseLost`, because its work ran unprotected.
Leases are not reentrant: acquiring a name the same thread already holds raises
:class:`~leases.errors.LeaseAlreadyHeld` instead of waiting for itself or nesting silently.

The handle lives in :mod:`leases.handle` and the acquire loop in :mod:`leases.acquiring`; both
are re-exported here, where they have always been importable from.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn, TypeVar, overload

from ._arguments import valid_decoration
from .acquiring import acquire
from .errors import BackendUnavailable, InvalidLeaseName, InvalidLeaseOption, LeaseLost
from .handle import Lease, OnLost

__all__ = ["Lease", "acquire", "lease"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


#: The leases entered by ``with lease(...)`` blocks in this context, innermost last.
_entered: contextvars.ContextVar[tuple[Lease, ...]] = contextvars.ContextVar(
    "leases_entered", default=()
)


class _LeaseBlock(contextlib.ContextDecorator):
    """What ``lease()`` returns: a context manager that is also a decorator.

    Holds only its arguments; the live :class:`Lease` of each ``with`` is kept on a context
    variable, so one decorated function can run in many threads at once.
    """

    #: How ``__enter__`` comes to hold the name (``semaphore()`` takes a slot instead).
    _acquire: Callable[..., Lease] = staticmethod(acquire)

    def __init__(self, name: str | None, options: dict[str, Any]) -> None:
        self.name = name
        self.options = options

    def __call__(self, func: F) -> F:
        if inspect.iscoroutinefunction(func) or inspect.isgeneratorfunction(func):
            raise InvalidLeaseOption(
                "func",
                func,
                "lease() cannot decorate a coroutine or generator function: the lease would be "
                "released when the call returns, before the body runs; decorate a coroutine "
                "function with alease(), or use a with block inside a generator",
            )
        if self.name is None:
            return type(self)(_default_name(func), self.options)(func)
        valid_decoration(self.name, self.options)
        return super().__call__(func)

    async def __aenter__(self) -> NoReturn:
        """``async with lease(...)`` would otherwise fail with Python's bare "does not support
        the asynchronous context manager protocol", naming neither the fix nor the async twin
        (and a sync acquire in a coroutine would block its event loop)."""
        raise InvalidLeaseOption(
            "async with", self.name, "lease() is entered with `with`; in async code use alease()"
        )

    async def __aexit__(self, *exc: object) -> None:
        """Never reached (``__aenter__`` raises); Python needs both to call ``__aenter__``."""

    def __enter__(self) -> Lease:
        if self.name is None:
            raise InvalidLeaseOption("name", None, "lease() needs a name in a with statement")
        entered = self._acquire(self.name, **self.options)
        _entered.set((*_entered.get(), entered))
        return entered

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack = _entered.get()
        _entered.set(stack[:-1])
        _finish(stack[-1], exc)


def _finish(held: Lease, body_error: BaseException | None) -> None:
    """Release after a ``with`` body, never hiding the body's own exception (see
    :func:`_settle`)."""
    protected = held.remaining() > 0
    try:
        held.release()
    except BaseException as error:
        _settle(held, body_error, protected, error)


def _settle(
    held: Lease, body_error: BaseException | None, protected: bool, error: BaseException
) -> None:
    """What a release that raised ``error`` after a block means (``lease()`` and ``alease()``).

    A body that finished while the lease was lost ran unprotected: that raises
    :class:`LeaseLost`. A release that merely could not reach the store after the body finished
    in time (``protected``) is logged: the work was protected and the grant expires by itself.
    The body's own exception always wins; the release's failure becomes a note on it.
    """
    if not isinstance(error, LeaseLost | BackendUnavailable):
        raise error
    if isinstance(error, BackendUnavailable) and protected:
        held._abandon()  # the block is over: the grant runs out by its TTL, unrenewed
    if body_error is not None:
        body_error.add_note(f"and then the lease {held.name!r} could not be released: {error}")
        return
    if isinstance(error, LeaseLost) or not protected:
        raise error
    logger.warning("leases: could not release %r, it will expire: %s", held.name, error)


def _default_name(func: Callable[..., Any]) -> str:
    """The name a bare ``@lease`` (``@alease``, ``@semaphore``...) gives ``func``:
    ``module.qualname``, the same in every process that imports the function.

    A module run with ``python -m pkg.mod`` is ``__main__`` to Python, but its spec keeps its
    real name, which is used: the function is named as when imported (by a worker, by the
    next script), so both exclude each other. A script run by path (``python job.py``),
    ``python -c`` or a REPL has no such name: ``__main__`` would make every script's ``main``
    one lease, and the same function imported elsewhere another, so the lock would silently
    not exclude what it should. That is refused with :class:`InvalidLeaseName`, at decoration.
    """
    module = func.__module__
    if module == "__main__":
        spec = getattr(sys.modules.get(module), "__spec__", None)
        if spec is None or spec.name in ("", "__main__"):
            raise InvalidLeaseName(
                f"{module}.{func.__qualname__}",
                "a function of a script run as __main__ has no name other processes share: "
                "imported elsewhere it would hold another lease, and another script's function "
                'of that name this one; name the lease (@lease("...")) or run the script as a '
                "module (python -m package.module)",
            )
        module = spec.name
    return f"{module}.{func.__qualname__}"


@overload
def lease(name: F, /) -> F: ...
@overload
def lease(
    name: str | None = None,
    /,
    *,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
    shared: bool = False,
) -> _LeaseBlock: ...
def lease(
    name: str | Callable[..., Any] | None = None,
    /,
    *,
    ttl: float | None = None,
    backend: str = "default",
    timeout: float | None = None,
    keepalive: bool = True,
    on_lost: OnLost | None = None,
    holder: str | None = None,
    shared: bool = False,
) -> Any:
    """Hold ``name`` for the duration of a ``with`` block or a decorated function.

    ``@lease`` bare names the lease after the function (``module.qualname``, see
    :func:`_default_name` for a script run as ``__main__``). Arguments are
    those of :func:`acquire` (``shared=True``: as one of many readers). Leaving the block
    releases; see :func:`_finish` for errors.
    """
    options: dict[str, Any] = {
        "ttl": ttl,
        "backend": backend,
        "timeout": timeout,
        "keepalive": keepalive,
        "on_lost": on_lost,
        "holder": holder,
        "shared": shared,
    }
    if callable(name):
        return _LeaseBlock(_default_name(name), options)(name)
    return _LeaseBlock(name, options)
