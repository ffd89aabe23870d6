"""Checks on command-line input shared by the commands of both apps.

Each turns bad input into a :class:`CommandError`, which ``manage.py`` prints as one line and
exits 1 with, before anything runs: an operator who mistyped a database alias or a negative
interval should read what to fix, not a traceback from deep inside a connection handler. The
checks live in ``handle()``, not in argparse ``type=`` callables, because argparse errors from
the command line exit 2 with a usage dump instead.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
from collections.abc import Iterable

from django.core.management.base import CommandError
from django.db import connections
from django.utils.dateparse import parse_duration

from leases.errors import InvalidLeaseName
from leases.keys import validate_name

__all__ = ["at_least", "database", "duration", "lease_name", "pause", "share_base_options"]

#: The longest pause a command takes between two steps (a day). ``time.sleep`` and
#: ``Event.wait`` overflow past ``threading.TIMEOUT_MAX`` (about 292 years), after the command
#: has done its first step; a pause of more than a day between polls or batches is a unit
#: mistake (milliseconds typed as seconds), better refused up front than waited for.
MAX_PAUSE = 86400.0

#: The options Django's ``BaseCommand`` adds to every command's parser.
_BASE_DESTS = frozenset(
    {"verbosity", "settings", "pythonpath", "traceback", "no_color", "force_color", "skip_checks"}
)


def share_base_options(
    parser: argparse.ArgumentParser, subparsers: Iterable[argparse.ArgumentParser]
) -> None:
    """Accept ``--settings``, ``-v`` and the other base options after a subcommand too.

    argparse hands everything after ``leases list`` to the subcommand's parser, which does not
    know them, so ``manage.py leases list --settings x`` failed with "unrecognized arguments"
    although ``manage.py`` itself had already honoured ``--settings``. The copies default to
    ``SUPPRESS``, so a value given before the subcommand is not overwritten.
    """
    shared = [action for action in parser._actions if action.dest in _BASE_DESTS]
    for subparser in subparsers:
        for action in shared:
            copied = copy.copy(action)
            copied.default = argparse.SUPPRESS
            subparser._add_action(copied)


def database(alias: str) -> str:
    """``alias`` if it names a database in ``settings.DATABASES``."""
    if alias not in connections.settings:
        known = ", ".join(sorted(connections.settings)) or "none"
        raise CommandError(f"unknown database {alias!r} (settings.DATABASES has: {known})")
    return alias


def at_least(option: str, value: float, minimum: float, *, inclusive: bool = True) -> float:
    """``value`` of ``option`` if it is at least (or, not ``inclusive``, above) ``minimum``;
    NaN, which compares false with everything, is refused too, and so is infinity (``--sleep
    inf`` passed, deleted a batch, then crashed in ``time.sleep`` with a traceback)."""
    relation = "at least" if inclusive else "greater than"
    if not (value >= minimum if inclusive else value > minimum):
        raise CommandError(f"{option} must be {relation} {minimum:g}, not {value:g}")
    if math.isinf(value):
        raise CommandError(f"{option} must be {relation} {minimum:g} and finite, not {value:g}")
    return value


def pause(option: str, value: float, *, inclusive: bool = True) -> float:
    """``value`` of ``option``, seconds to wait between steps: :func:`at_least` 0 (or, not
    ``inclusive``, above 0) and at most :data:`MAX_PAUSE`. ``--interval 1e10`` passed
    :func:`at_least`, printed the leases, then crashed in ``time.sleep`` with a traceback."""
    at_least(option, value, 0, inclusive=inclusive)
    if value > MAX_PAUSE:
        raise CommandError(f"{option} must be at most {MAX_PAUSE:g} seconds (a day), not {value:g}")
    return value


def lease_name(name: str) -> str:
    """``name`` if it can name a lease (see :func:`leases.keys.validate_name`)."""
    try:
        return validate_name(name)
    except InvalidLeaseName as exc:
        raise CommandError(str(exc)) from None


#: Seconds per unit of a short duration (``90d``, ``12h``, ``30m``, ``45s``).
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(option: str, text: str) -> float:
    """Seconds in ``text``: ``90d``, ``12h``, ``30m``, ``45s``, a bare number of seconds, or
    what Django's ``parse_duration`` reads (``P90D``, ``3 12:00:00``); never negative."""
    short = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if short:
        seconds = float(short[1]) * _UNITS[short[2] or "s"]
    else:
        parsed = parse_duration(text)
        if parsed is None:
            raise CommandError(
                f"{option} must be a duration such as 90d, 12h, 30m or 45s, not {text!r}"
            )
        seconds = parsed.total_seconds()
    if not math.isfinite(seconds):
        raise CommandError(f"{option} must be finite, not {text!r}")
    return at_least(option, seconds, 0)


def spoken_duration(seconds: float) -> str:
    """``seconds`` in the largest whole unit of :func:`duration`'s (``90d``, ``36h``, ``45s``),
    so an operator reads back what they typed, not ``7.776e+06s``."""
    for unit, size in sorted(_UNITS.items(), key=lambda item: -item[1]):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:g}s"
