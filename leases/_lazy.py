"""Lazy re-exports for a package ``__init__`` (PEP 562).

``import leases`` and ``import idempotency`` run while ``INSTALLED_APPS`` load, before the app
registry is ready, so names whose modules define models or views are imported on first use.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    package: str, table: Mapping[str, str], public: Sequence[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module ``__getattr__`` and ``__dir__`` for ``package``.

    ``table`` maps an exported name to the submodule defining it; the value is cached in the
    package's namespace after the first lookup, so later accesses cost nothing.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
