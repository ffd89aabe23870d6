"""What every Celery task base here shares: key templates, backoff, skip reports, decorators.

Per-run state (the lease a run holds) lives in a context variable, never on the task object:
a task instance is shared by every run in its process and by every thread of a threaded pool.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import Task, shared_task
from celery.exceptions import Ignore

from ..handle import Lease
from ..keys import validate_name
from ..retry import Backoff

__all__ = [
    "SKIPPED",
    "Key",
    "backoff",
    "current_call",
    "format_key",
    "skip",
    "task_decorator",
    "task_signature",
]

logger = logging.getLogger(__name__)

#: Result state of a run that did nothing on purpose (its lease was busy with
#: ``on_busy="skip"``, or it was sent by a former leader). Celery does not count it as ready:
#: poll ``AsyncResult.state`` rather than calling ``get()``.
SKIPPED = "SKIPPED"

#: A key: a :meth:`str.format` template naming the task's parameters, or a callable taking the
#: task's arguments (set on a task class body as a ``staticmethod``).
Key = str | Callable[..., str]


@dataclass
class Call:
    """The live state of one run of a locked task: its lease, and whether it was given back."""

    task: Task[..., Any]
    lease: Lease
    released: bool = False


current_call: contextvars.ContextVar[Call | None] = contextvars.ContextVar(
    "leases_celery_call", default=None
)


def task_signature(task: Task[..., Any]) -> inspect.Signature:
    """The signature callers use: no ``self`` for ``bind=True``, no injected ``lease``."""
    return inspect.signature(task.run)


def format_key(template: Key, task: Task[..., Any], *args: Any, **kwargs: Any) -> str:
    """The name one call of ``task`` maps to: ``template`` filled from the bound arguments.

    Arguments are bound to the task's signature with defaults applied, so a value passed
    positionally or by keyword gives the same name (``"sync:{account_id}"``). A callable
    template gets the task's arguments and returns the name.
    """
    if callable(template):
        return validate_name(template(*args, **kwargs))
    bound = task_signature(task).bind_partial(*args, **kwargs)
    bound.apply_defaults()
    try:
        return validate_name(template.format_map(bound.arguments))
    except KeyError as exc:
        raise TypeError(
            f"key template {template!r} of {task.name} names {exc}, which is not a parameter"
        ) from None


def backoff(retries: int, base: float, cap: float) -> float:
    """The countdown of retry number ``retries``: exponential, with full jitter.

    Uniform in ``[0, min(cap, base * 2**retries)]``: the package's one backoff
    (:class:`leases.retry.Backoff`) at attempt ``retries``, so tasks that found the same lease
    busy spread out instead of colliding again together.
    """
    delay = Backoff(base=base, cap=cap, attempt=retries).next_delay()
    assert delay is not None  # no deadline: a backoff without one always has a next delay
    return delay


def skip(task: Task[..., Any], reason: str, **meta: Any) -> None:
    """End a run that does nothing on purpose: log it and record state :data:`SKIPPED`."""
    logger.info("task %s[%s] skipped: %s", task.name, task.request.id, reason)
    if task.request.id and not task.request.called_directly:
        task.update_state(state=SKIPPED, meta={"reason": reason, **meta})
    raise Ignore(reason)


def _inject_lease(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` with its ``lease`` parameter filled from the current run's lease.

    The wrapper's signature drops ``lease``, so callers (and Celery's argument check) never
    pass it; arguments are re-bound by name, so ``lease`` may sit anywhere in the list.
    """
    signature = inspect.signature(fun)
    if "lease" not in signature.parameters:
        return fun
    public = signature.replace(
        parameters=[p for n, p in signature.parameters.items() if n != "lease"]
    )

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> Any:
        call = current_call.get()
        given = public.bind(*args, **kwargs).arguments
        given["lease"] = call.lease if call is not None else None
        ordered = {n: given[n] for n in signature.parameters if n in given}
        full = inspect.BoundArguments(signature, ordered)
        return fun(*full.args, **full.kwargs)

    run.__signature__ = public  # type: ignore[attr-defined]
    return run


def task_decorator(
    base: type[Task],  # type: ignore[type-arg]
    fun: Callable[..., Any] | None,
    attrs: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    """Sugar shared by every decorator: a Celery task with ``base`` and ``attrs`` set.

    Celery copies extra ``task()`` options onto the generated class, which is how ``attrs``
    configure the base's hooks. A ``base=`` in ``options`` is mixed in after ``base``
    (``locked_task(base=IdempotentTask)`` holds the lease around the idempotent run), and
    ``app=`` picks the app (default: ``shared_task``). Bare (``@deco``) and called forms work.
    When the base says ``inject_lease`` (a locked task does), a ``lease`` parameter of the
    function gets the run's lease.
    """
    app = options.pop("app", None)
    extra = options.pop("base", None)
    if extra is not None and issubclass(extra, base):
        base = extra
    elif extra is not None:
        base = type(f"{base.__name__}{extra.__name__}", (base, extra), {})

    # A function stored on a class would bind as a method: keep callables (keys, on_lost) plain.
    attrs = {k: staticmethod(v) if inspect.isfunction(v) else v for k, v in attrs.items()}

    def decorate(f: Callable[..., Any]) -> Any:
        make = app.task if app is not None else shared_task
        run = _inject_lease(f) if getattr(base, "inject_lease", False) else f
        return make(base=base, **attrs, **options)(run)

    return decorate(fun) if fun is not None else decorate
