"""What every Celery task base here shares: key templates, backoff, skip reports, decorators.

Per-run state (the lease a run holds) lives in a context variable, never on the task object:
a task instance is shared by every run in its process and by every thread of a threaded pool.
"""

from __future__ import annotations

import contextvars
import difflib
import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from celery import Task, shared_task
from celery.exceptions import Ignore, Reject, Retry
from celery.local import Proxy

from ..handle import Lease
from ..keys import validate_name
from ..retry import Backoff
from ._checks import check_attributes, check_key

__all__ = [
    "CELERY_TASK_OPTIONS",
    "SKIPPED",
    "Key",
    "Parameters",
    "backoff",
    "check_key",
    "check_options",
    "current_call",
    "format_key",
    "retries_spent",
    "retry_on_own_budget",
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


def retries_spent(task: Task[..., Any], counter: str) -> int:
    """How many retries counted in the message header ``counter`` the current run has behind it.

    Celery hands a message's own headers to the run in ``request.headers`` (a worker also sets
    each as an attribute of the request); anything but a count is no count (0).
    """
    request = task.request
    raw = (request.headers or {}).get(counter)
    if raw is None:
        raw = getattr(request, counter, None)
    if isinstance(raw, bool) or not isinstance(raw, int):
        return 0
    return max(raw, 0)


def retry_on_own_budget(
    task: Task[..., Any],
    counter: str,
    spent: int,
    max_retries: int,
    *,
    countdown: float,
    exc: Exception,
) -> NoReturn:
    """Retry the run in ``countdown`` seconds for a busy lease or key, on a budget of its own.

    :meth:`celery.Task.retry` counts every retry in ``request.retries``, the one count the
    body's own retries (``max_retries``, ``autoretry_for``) are measured against and that the
    body reads: a task with ``max_retries=3`` that found its lease busy twice started its body
    seeing ``retries == 2`` and got one retry of its own instead of three. These retries are
    counted in the message header ``counter`` instead, and the new message keeps
    ``request.retries`` as it was; after ``max_retries`` of them ``exc`` is raised, as Celery
    raises it past its budget. ``spent`` is the count the run has behind it
    (:func:`retries_spent`, which the caller has read for its backoff). Otherwise this is
    Celery's ``retry()``: the same message again (same task id, arguments and options),
    :class:`~celery.exceptions.Retry` raised for the worker, a message that cannot be sent
    rejected. Under ``apply()`` (eager), Celery itself counts the retry in
    ``request.retries`` of the next run, as it does every eager retry.
    """
    request = task.request
    if request.called_directly or spent >= max_retries:
        raise exc
    again = task.signature_from_request(request, countdown=countdown)
    again.options["headers"] = {**(again.options.get("headers") or {}), counter: spent + 1}
    if not request.is_eager:
        try:
            again.apply_async()
        except Exception as error:
            raise Reject(error, requeue=False) from error
    when: Any = countdown  # a float; the stubs ask for numbers.Real, which mypy cannot check
    raise Retry(exc=exc, when=when, is_eager=request.is_eager, sig=again)


def skip(task: Task[..., Any], reason: str, **meta: Any) -> NoReturn:
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


#: What Celery's ``task()`` takes besides attributes of the task class: the decorator's own
#: options (``app.task``'s and ``Celery._task_from_fun``'s), ``autoretry_for`` and its company
#: (read when the task is made), the execution and routing options ``apply_async`` reads off
#: the task (``celery.app.task.extract_exec_options``), and the attributes a task takes from
#: the settings when it is bound to an app (``Task.from_config``).
CELERY_TASK_OPTIONS = frozenset(
    {
        *("app", "base", "bind", "name", "shared", "lazy", "filter"),
        *("pydantic", "pydantic_strict", "pydantic_context", "pydantic_dump_kwargs"),
        *("autoretry_for", "dont_autoretry_for", "retry_kwargs"),
        *("retry_backoff", "retry_backoff_max", "retry_jitter"),
        *("queue", "routing_key", "exchange", "exchange_type", "priority", "expires"),
        *("serializer", "delivery_mode", "compression", "time_limit", "soft_time_limit"),
        *("immediate", "mandatory"),
        *(attribute for attribute, _ in Task.from_config),
    }
)


#: What a decorator sets on its task class: each attribute, with the decorator's parameter
#: that sets it and the value given (``{"lease_ttl": ("ttl", 60)}``).
Parameters = Mapping[str, tuple[str, Any]]


def check_options(
    decorator: Callable[..., Any],
    base: type[Task],  # type: ignore[type-arg]
    attrs: Parameters,
    options: Mapping[str, Any],
) -> None:
    """Refuse, when the task is defined, a ``task()`` option that nothing reads.

    Celery sets every option it does not know as an attribute of the task class, so a typo
    (``busy_max_retriess=3``, ``tll=60``) was accepted and silently ignored: the task ran on
    the defaults. An option must be one of Celery's own (:data:`CELERY_TASK_OPTIONS`) or an
    attribute of the task class ``base`` (Celery's ``Task``, the decorator's base and any
    ``base=`` mixed in: declare an attribute of your own on a base class to pass it). One
    that the decorator sets from its own parameters (``attrs``) is refused too, naming the
    parameter to use.
    """
    own = {
        name
        for name, parameter in inspect.signature(decorator).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    for option in options:
        if option in attrs:
            raise TypeError(
                f"{decorator.__name__}() sets the task attribute {option!r} from its own "
                f"parameter {attrs[option][0]}=: pass that instead"
            )
        if option in CELERY_TASK_OPTIONS or hasattr(base, option):
            continue
        known = own | CELERY_TASK_OPTIONS | {n for n in dir(base) if not n.startswith("_")}
        close = difflib.get_close_matches(option, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(
            f"{decorator.__name__}() got an unexpected keyword argument {option!r}: neither one "
            f"of its own nor a Celery task option, nor an attribute of {base.__name__}{hint}"
        )


def task_decorator(
    decorator: Callable[..., Any],
    base: type[Task],  # type: ignore[type-arg]
    fun: Callable[..., Any] | None,
    attrs: Parameters,
    options: dict[str, Any],
    key: str | None = None,
) -> Any:
    """Sugar shared by every decorator: a Celery task with ``base`` and ``attrs`` set.

    Celery copies extra ``task()`` options onto the generated class, which is how ``attrs``
    configure the base's hooks; the rest of ``options`` are checked (:func:`check_options`,
    ``decorator`` being the public decorator, for its name and parameters) and passed on.
    Both are checked now by the task class's own checks (:func:`check_attributes`), which
    Celery's making of the class runs again: without ``app=`` that waits for a worker. A
    ``base=`` in ``options`` is mixed in after ``base`` (``locked_task(base=IdempotentTask)``
    holds the lease around the idempotent run), and ``app=`` picks the app (default:
    ``shared_task``). Bare (``@deco``) and called forms work, on a function: a task already
    made by a decorator is refused (its own ``__call__`` would run outside any worker's
    request); combine with ``base=``. When the base says ``inject_lease`` (a locked task
    does), a ``lease`` parameter of the function gets the run's lease. ``key`` names the
    attribute holding the task's key template, checked against the task's parameters here
    (:func:`check_key`).
    """
    app = options.pop("app", None)
    extra = options.pop("base", None)
    if extra is not None and not (isinstance(extra, type) and issubclass(extra, Task)):
        raise TypeError(f"{decorator.__name__}(base=...) must be a celery.Task subclass: {extra!r}")
    if extra is not None and issubclass(extra, base):
        base = extra
    elif extra is not None:
        base = type(f"{base.__name__}{extra.__name__}", (base, extra), {})
    check_options(decorator, base, attrs, options)
    given = {**options, **{attribute: value for attribute, (_, value) in attrs.items()}}
    check_attributes(base, given, lambda attribute: attrs.get(attribute, (attribute,))[0])

    # A function stored on a class would bind as a method: keep callables (keys, on_lost) plain.
    values: dict[str, Any] = {
        a: staticmethod(v) if inspect.isfunction(v) else v for a, (_, v) in attrs.items()
    }

    def decorate(f: Callable[..., Any]) -> Any:
        if issubclass(type(f), Task | Proxy):  # type(): a proxy's __class__ would evaluate it
            raise TypeError(
                f"{decorator.__name__}() decorates a function, not a task ({f!r}); to combine "
                "two decorators' behaviour, pass the other's base class as base= (see the "
                "guide's Celery page, Combining)"
            )
        make = app.task if app is not None else shared_task
        run = _inject_lease(f) if getattr(base, "inject_lease", False) else f
        if key is not None:
            check_key(attrs[key][1], run, bind=bool(options.get("bind")))
        return make(base=base, **values, **options)(run)

    return decorate(fun) if fun is not None else decorate
