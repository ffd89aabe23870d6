"""Checks of backend options that every engine shares: numbers of seconds.

Each engine's ``check_options`` reports its own options; a timeout is the same question
everywhere, asked here once so that every engine refuses the same values with the same words.
"""

from __future__ import annotations

import math

__all__ = ["MAX_OPTION_SECONDS", "seconds_problems"]

#: The longest timeout any option may set: a day. Past it a bound is no bound at all, and
#: past the platform's ``time_t`` (``float("inf")`` written for "no timeout", ``1e11``) the
#: value passed the check and then failed every acquire with a bare ``OverflowError`` from
#: the socket, which no ``except LeaseError`` catches.
MAX_OPTION_SECONDS = 86_400.0


def seconds_problems(alias: str, option: str, value: object, *, zero: bool = False) -> list[str]:
    """Why ``value`` is not a finite number of seconds above 0 (or 0 itself, when ``zero``)
    and at most :data:`MAX_OPTION_SECONDS`, for the backend ``alias``'s ``option``."""
    if (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value > 0 or (zero and value == 0))
        and value <= MAX_OPTION_SECONDS
    ):
        return []
    lowest = "0 or more" if zero else "above 0"
    return [
        f'LEASES["BACKENDS"][{alias!r}]["{option}"] must be a number of seconds {lowest} and '
        f"at most {MAX_OPTION_SECONDS:g}, not {value!r}"
    ]
