"""Demo scenarios, one module each, run in ``ORDER`` by ``manage.py demo``.

A scenario module defines ``ORDER: int``, ``TITLE: str`` and ``run(say) -> None``, where
``say(text)`` prints a line of narration. A scenario proves its point or raises.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def discover() -> list[ModuleType]:
    modules = [
        importlib.import_module(f"{__name__}.{info.name}")
        for info in pkgutil.iter_modules(__path__)
        if not info.name.startswith("_")
    ]
    return sorted(modules, key=lambda m: (getattr(m, "ORDER", 1000), m.__name__))
