"""Backend lookup: one instance per configured alias and process."""

from __future__ import annotations

import importlib
import threading

from .. import _process, conf
from ..errors import LeasesImproperlyConfigured
from .base import Capability, Grant, LeaseBackend, LeaseInfo, first_try_until, tries_until

__all__ = [
    "Capability",
    "Grant",
    "LeaseBackend",
    "LeaseInfo",
    "backend_class",
    "capabilities",
    "first_try_until",
    "get_backend",
    "reset",
    "tries_until",
]

_lock = threading.Lock()
_instances: dict[str, LeaseBackend] = {}
_pid = _process.pid


def backend_class(alias: str) -> type[LeaseBackend]:
    """The class of the backend configured as ``alias``, imported but not instantiated.

    What system checks and the admin ask about a backend (its options, databases and
    capabilities) is answered by the class, so asking connects nowhere.
    """
    engine = conf.get().backend(alias).engine
    try:
        module = importlib.import_module(engine)
    except (ImportError, ValueError, TypeError) as exc:  # also "" and "..x" (relative names)
        raise LeasesImproperlyConfigured(
            f'LEASES["BACKENDS"][{alias!r}]["ENGINE"] = {engine!r} cannot be imported ({exc}); '
            "is the matching extra installed?"
        ) from exc
    cls = getattr(module, "Backend", None)
    if not (isinstance(cls, type) and issubclass(cls, LeaseBackend)):
        raise LeasesImproperlyConfigured(
            f'LEASES["BACKENDS"][{alias!r}]["ENGINE"] = {engine!r} has no Backend class '
            "implementing LeaseBackend"
        )
    return cls


def capabilities(alias: str) -> frozenset[Capability]:
    """What the backend configured as ``alias`` can do with its options, asked of its class
    (:meth:`~.base.LeaseBackend.capabilities_of`): connects nowhere, as :func:`backend_class`."""
    return backend_class(alias).capabilities_of(conf.get().backend(alias).options)


def _instance(alias: str) -> LeaseBackend | None:
    """This process's backend ``alias``, if made; an unhashable ``alias`` (a list) is refused
    as an unknown one is, not with a bare ``TypeError``."""
    try:
        return _instances.get(alias)
    except TypeError:
        conf.get().backend(alias)  # raises LeasesImproperlyConfigured
        raise


def get_backend(alias: str = "default") -> LeaseBackend:
    """The backend configured as ``LEASES["BACKENDS"][alias]``.

    Instances are per process: a forked child builds its own, because a connection or socket
    shared with the parent would interleave both processes' requests. An existing instance
    of this process is read without the lock (a dict read is atomic; one replaced meanwhile
    is as stale as one returned a moment before the replacement).
    """
    global _pid
    if _pid == _process.pid:  # every acquire asks: the common case takes no lock
        backend = _instance(alias)
        if backend is not None:
            return backend
    with _lock:
        if _process.pid != _pid:
            _instances.clear()
            _pid = _process.pid
        backend = _instance(alias)
        if backend is None:
            cls = backend_class(alias)
            backend = _instances[alias] = cls(alias, conf.get().backend(alias).options)
        return backend


@conf.on_reset
def reset() -> None:
    """Close and forget every backend instance (settings changed, or tests)."""
    with _lock:
        instances = list(_instances.values())
        _instances.clear()
    for backend in instances:
        backend.close()
