"""Optional dependencies: a module that needs an extra says which one when it is missing.

``leases.celery``, ``leases.metrics`` and ``leases.health`` import a library the package does not
install by default (its extras in ``pyproject.toml``). Without it, the import failed with
Python's bare ``No module named 'celery'``, which names the library, not the ``pip install``
that brings the version this package was tested with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["extra_required"]


@contextlib.contextmanager
def extra_required(feature: str, extra: str, *modules: str) -> Iterator[None]:
    """Around ``feature``'s imports of ``modules`` (top-level names), which ``extra`` installs.

    A missing one raises :class:`ModuleNotFoundError` (so ``except ImportError`` and
    ``except ModuleNotFoundError`` still catch it, with the same ``name``) whose message says
    what to install. Any other import error is the library's own (a broken install, a missing
    dependency of its own) and passes unchanged.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in modules:
            raise
        raise ModuleNotFoundError(
            f'{feature} needs the "{extra}" extra: pip install "django-leases[{extra}]" ({exc})',
            name=exc.name,
        ) from exc
