"""The arguments of ``lease()`` and ``acquire()``, checked before anything reaches a server.

A bad TTL, timeout or holder raises :class:`~leases.errors.InvalidLeaseOption` (a
``ValueError``) without costing a round trip or leaving state behind, like a bad name does.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

from . import conf
from .errors import InvalidLeaseOption
from .keys import validate_lease_name

__all__ = [
    "valid_decoration",
    "valid_flag",
    "valid_on_lost",
    "valid_timeout",
    "valid_ttl",
    "valid_ttl_shape",
    "warn_if_too_short",
]


def valid_ttl(ttl: object, settings: conf.LeasesSettings | None = None) -> float:
    """A TTL in seconds; one within the drift allowance would be invalid the moment granted,
    and one above ``LEASES["MAX_TTL"]`` is a unit mistake or an expiry nothing can read back.
    ``settings``: the ones the caller already read (default: the current ones)."""
    seconds = valid_ttl_shape(ttl)
    if settings is None:
        settings = conf.get()
    if seconds * (1 - settings.drift_factor) <= settings.drift_min:
        raise InvalidLeaseOption("ttl", ttl, "must exceed the clock drift allowance")
    if seconds > settings.max_ttl:
        raise InvalidLeaseOption(
            "ttl", ttl, f'must be at most LEASES["MAX_TTL"] = {settings.max_ttl:g} seconds'
        )
    return seconds


def valid_ttl_shape(ttl: object, option: str = "ttl") -> float:
    """The part of :func:`valid_ttl` that reads no setting: what a decorator can check when it
    is applied (often at import, before a test's ``override_settings``). ``option``: the name
    the caller gave it (a task class's ``lease_ttl``)."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < math.inf:
        raise InvalidLeaseOption(option, ttl, "must be a finite number of seconds greater than 0")
    return float(ttl)


def valid_timeout(timeout: object, option: str = "timeout") -> float | None:
    """``None`` (wait forever) or seconds; NaN would silently mean "do not wait"."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise InvalidLeaseOption(option, timeout, "must be None (wait forever) or >= 0")
    return float(timeout)


def valid_flag(option: str, value: object) -> bool:
    """``True`` or ``False`` only: a string such as ``"no"`` is truthy and would mean yes."""
    if value is not True and value is not False:
        raise InvalidLeaseOption(option, value, "must be True or False")
    return value


def valid_on_lost(on_lost: object, option: str = "on_lost") -> None:
    """``None`` or a callable: anything else would only fail in the keepalive thread, when the
    lease is lost and the caller most needs to hear of it."""
    if on_lost is not None and not callable(on_lost):
        raise InvalidLeaseOption(option, on_lost, "must be None or a callable (lease) -> None")


def warn_if_too_short(ttl: float, settings: conf.LeasesSettings) -> None:
    """Warn (at the caller's line) when a kept-alive TTL leaves no time to retry a renewal."""
    window = settings.retry_window(ttl)
    if window < conf.MIN_RETRY_WINDOW:
        warnings.warn(
            f"ttl={ttl:g}s leaves {window:.3f}s to retry a failed renewal (RENEW_FRACTION "
            f"{settings.renew_fraction:.2f}, drift {settings.drift_min}s + "
            f"{settings.drift_factor:.0%}); one slow round trip will lose the lease",
            RuntimeWarning,
            stacklevel=3,
        )


def valid_decoration(name: object, options: Mapping[str, object]) -> None:
    """The checks of an acquire that read no setting, made when a decorator is applied.

    A decorator runs at import, so ``@lease("x", ttl="60")`` fails at the line that wrote it
    rather than at the function's first call, perhaps in production at night. What depends
    on the settings (the backend's alias, the TTL against ``MAX_TTL`` and the drift) waits
    for the call: at import the settings may not be the ones the call will run under.
    """
    if name is not None:
        validate_lease_name(name)
    if options.get("ttl") is not None:
        valid_ttl_shape(options["ttl"])
    valid_timeout(options.get("timeout"))
    for flag in ("keepalive", "shared"):
        if flag in options:
            valid_flag(flag, options[flag])
    valid_on_lost(options.get("on_lost"))
