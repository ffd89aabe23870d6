"""Argument types for the benchmark tools' command lines, checked before anything starts.

A benchmark run starts throwaway servers and takes minutes; a typo in a count or a list must
end it at once with argparse's usage error (exit 2) naming what was wrong, not a traceback
after the servers started, nor a run that quietly measured nothing (``--seconds -1`` printed
a table of zeros; ``--kinds foo`` ran the prototype and called it ``foo``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from typing import TypeVar

__all__ = ["at_least", "listed", "positive_seconds"]

_Item = TypeVar("_Item")


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer of ``minimum`` or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """A finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above zero")
    return value


def listed(
    item: Callable[[str], _Item], allowed: Collection[str] = ()
) -> Callable[[str], list[_Item]]:
    """A comma-separated list, each part read by ``item`` (and one of ``allowed``, if given),
    none repeated: a list naming one thing twice would measure it twice as another row."""

    def parse(text: str) -> list[_Item]:
        parts = text.split(",")
        if allowed:
            unknown = [part for part in parts if part not in allowed]
            if unknown:
                raise argparse.ArgumentTypeError(
                    f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(allowed)}"
                )
        values = [item(part) for part in parts]
        if len(set(parts)) != len(parts):
            raise argparse.ArgumentTypeError(f"{text!r} names something twice")
        return values

    return parse
