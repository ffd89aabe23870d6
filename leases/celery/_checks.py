"""The options of a task base class, checked when a task class is made from it.

The base classes are the documented API (override an attribute in a subclass, use it with
``app.task(base=...)``), and a decorator is a subclass made for you; so every way of defining a
task comes through :meth:`CheckedTask.__init_subclass__`, and a value that cannot work
(``lease_ttl = -5``, ``on_busy = "retyr"``, ``busy_max_retries = "3"``) is refused where it
was written, at import, instead of failing every run in a worker long after the deploy.
"""

from __future__ import annotations

import functools
import inspect
import math
import string
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from celery import Task

from .._arguments import valid_ttl_shape
from ..errors import InvalidLeaseOption

__all__ = [
    "Check",
    "CheckedTask",
    "check_attributes",
    "check_key",
    "one_of",
    "valid_alias",
    "valid_count",
    "valid_delay",
    "valid_key",
    "valid_ttl_or_default",
]

#: Checks one option: raises its app's typed error (:class:`~leases.errors.InvalidLeaseOption`,
#: or ``IdempotencyImproperlyConfigured`` for :mod:`idempotency`'s), naming the option as
#: given (its first argument), when the value (its second) cannot work. It checks the shape
#: only and reads no setting: a task module may be imported before a test overrides them.
Check = Callable[[str, Any], object]


class CheckedTask(Task):  # type: ignore[type-arg]
    """A task base whose option attributes are checked whenever a class is made from it.

    Each base class lists the checks of its own attributes in ``_option_checks``, in its own
    body; a class is checked against those of every class it inherits from, so one mixing two
    bases (``locked_task(base=IdempotentTask)``, ``idempotent_task(base=LockedTask)``) is
    checked for both. ``None``, where a base takes it, stays "the setting", read when a task
    runs. An attribute computed by a ``property`` is left to the run: it has no value yet.
    """

    _option_checks: ClassVar[Mapping[str, Check]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        checks = option_checks(cls)
        _keep_key_functions_plain(cls, checks)
        values = {
            attribute: getattr(cls, attribute)
            for attribute in checks
            if not isinstance(
                inspect.getattr_static(cls, attribute), property | functools.cached_property
            )
        }
        _check_values(checks, values, lambda attribute: f"{cls.__qualname__}.{attribute}")
        _check_keys_against_run(cls, checks, values)


def _keep_key_functions_plain(cls: type[Task], checks: Mapping[str, Check]) -> None:  # type: ignore[type-arg]
    """Store a key function set on ``cls`` itself as a ``staticmethod``: a plain function on a
    class binds as a method, so it would get the task as its first argument instead of the
    task's arguments alone (``app.task(base=LockedTask, lease_key=fn)`` sets it so, as a class
    body would). A key is a value, never a method: :meth:`lease_name` and its like are the
    hooks that get the task."""
    for attribute, value in list(vars(cls).items()):
        if checks.get(attribute) is valid_key and inspect.isfunction(value):
            setattr(cls, attribute, staticmethod(value))


def option_checks(task: type[Task]) -> dict[str, Check]:  # type: ignore[type-arg]
    """The checks of every attribute ``task`` takes from the bases it inherits from."""
    checks: dict[str, Check] = {}
    for klass in reversed(task.__mro__):
        checks.update(vars(klass).get("_option_checks", {}))
    return checks


def check_attributes(
    task: type[Task],  # type: ignore[type-arg]
    values: Mapping[str, Any],
    name: Callable[[str], str],
) -> None:
    """Check each of ``values`` that is an option attribute of ``task``, naming it ``name(it)``.

    Called for a class when it is made, and by the decorators on what they will set, before
    Celery makes the class: without ``app=`` that waits for an app to be finalized (a
    worker's start), and the decorator's own parameters are named as the caller wrote them.
    """
    _check_values(option_checks(task), values, name)


def _check_values(
    checks: Mapping[str, Check], values: Mapping[str, Any], name: Callable[[str], str]
) -> None:
    """:func:`check_attributes` with the checks already gathered."""
    for attribute, value in values.items():
        check = checks.get(attribute)
        if check is not None:
            check(name(attribute), value)


def one_of(*choices: str) -> Check:
    """A check that the value is one of ``choices``: any other would behave as none of them."""
    listed = ", ".join(f'"{choice}"' for choice in choices[:-1]) + f' or "{choices[-1]}"'

    def check(option: str, value: object) -> None:
        if value not in choices:
            raise InvalidLeaseOption(option, value, f"must be {listed}")

    return check


def valid_key(option: str, template: object) -> None:
    """``None`` (the task's name or id), a ``str.format`` template or a callable: anything
    else would fail every call formatting it."""
    if template is None or callable(template) or isinstance(template, str):
        return
    reason = f"must be a str.format template or a callable, not {type(template).__name__}"
    raise InvalidLeaseOption(option, template, reason)


def check_key(
    template: object, run: Callable[..., Any], *, bind: bool = False, option: str = "key"
) -> None:
    """Refuse a key template that names no parameter of the task's function ``run`` (its first,
    ``self``, left out when ``bind``) when the task is defined.

    Found at run time instead, a misspelt field (``"sync:{acount_id}"``) would fail every call
    of the task, in a worker, long after the deploy; a positional field (``"{0}"``) or broken
    braces would too. A callable key is the caller's code and is left to run. The function is
    read, not the task: a ``shared_task`` is a proxy that would bind to an app if touched now.
    Anything else (``key=123``) is refused too: every call would fail formatting it.
    """
    valid_key(option, template)
    if not isinstance(template, str):
        return
    parameters = list(inspect.signature(run).parameters)[1 if bind else 0 :]
    name = getattr(run, "__qualname__", repr(run))
    try:
        fields = [
            field for _, field, _, _ in string.Formatter().parse(template) if field is not None
        ]
    except ValueError as exc:
        raise InvalidLeaseOption(option, template, f"not a str.format template: {exc}") from None
    for field in fields:
        root = field.replace("[", ".").partition(".")[0]
        if not root or root.isdigit():
            reason = f"{{{field}}} is positional: name one of {name}'s parameters"
            raise InvalidLeaseOption(option, template, reason)
        if root not in parameters:
            known = ", ".join(parameters) or "none"
            reason = f"{{{root}}} is not a parameter of {name} (its parameters: {known})"
            raise InvalidLeaseOption(option, template, reason)


def _check_keys_against_run(
    cls: type[Task],  # type: ignore[type-arg]
    checks: Mapping[str, Check],
    values: Mapping[str, Any],
) -> None:
    """The key templates of a class that has its own ``run`` (``app.task(base=...)`` makes
    one; a class body may define it), checked against its parameters as the decorators check
    theirs (:func:`check_key`). Celery stores an unbound task's function as a
    ``staticmethod``; a plain function in the class binds, its first parameter the task."""
    run = vars(cls).get("run")
    if run is None:
        return
    bind = not isinstance(run, staticmethod)
    function = run.__func__ if isinstance(run, staticmethod) else run
    if not callable(function):
        return
    for attribute, template in values.items():
        if checks.get(attribute) is valid_key and isinstance(template, str):
            check_key(template, function, bind=bind, option=f"{cls.__qualname__}.{attribute}")


def valid_ttl_or_default(option: str, ttl: object) -> None:
    """``None`` (``LEASES["DEFAULT_TTL"]``) or a TTL's shape; its bounds read the settings,
    so they are checked when the task runs."""
    if ttl is not None:
        valid_ttl_shape(ttl, option)


def valid_alias(option: str, alias: object) -> None:
    """A backend's alias is a str; whether ``LEASES["BACKENDS"]`` has it is read at run time."""
    if not isinstance(alias, str) or not alias:
        raise InvalidLeaseOption(option, alias, "must be the alias of a LEASES backend (a str)")


def valid_delay(option: str, seconds: object) -> None:
    """Seconds of a backoff: finite and >= 0 (NaN passes every comparison)."""
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 0 <= seconds < math.inf
    ):
        raise InvalidLeaseOption(option, seconds, "must be a finite number of seconds >= 0")


def valid_count(option: str, count: object) -> None:
    """A number of retries: an int >= 0 (``"3"`` would fail the first comparison with it)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise InvalidLeaseOption(option, count, "must be an int >= 0")
