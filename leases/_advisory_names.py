"""Advisory lock names, recorded the first time this process locks them, off the caller's path.

``pg_locks`` only knows 64-bit keys; the admin and ``manage.py leases`` show a name when
``leases_advisory_name`` maps the key back. Asking users to call ``remember_advisory_names()``
for every name meant most locks showed as numbers. Recording inside ``xact_lock`` would add a
statement to the caller's transaction (and roll back with it), so instead the first use of a
name in a process queues it, and one daemon thread writes queued names in batches on a
connection of its own (Django's connections are per thread), in autocommit, then closes it.
Best effort by design: a name that cannot be recorded is only shown as its key.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading

from django.db import connections, router

__all__ = ["note"]

logger = logging.getLogger(__name__)

#: Names written per statement; the queue is drained in batches up to this size.
BATCH = 500
#: Names waiting to be written, at most; beyond it new names are dropped (shown as keys).
MAX_PENDING = 10_000

_pending: queue.Queue[tuple[str, str]] = queue.Queue(MAX_PENDING)
_started = threading.Lock()
_writer: threading.Thread | None = None


def note(name: str, using: str) -> None:
    """Queue ``name`` to be recorded in database ``using``; never blocks, never raises."""
    global _writer
    try:
        _pending.put_nowait((using, name))
    except queue.Full:
        return
    if _writer is None:
        with _started:
            if _writer is None:
                _writer = threading.Thread(
                    target=_write_forever, name="leases-advisory-names", daemon=True
                )
                _writer.start()


def _write_forever() -> None:
    while True:
        batch = [_pending.get()]
        while len(batch) < BATCH:
            try:
                batch.append(_pending.get_nowait())
            except queue.Empty:
                break
        by_database: dict[str, list[str]] = {}
        for using, name in batch:
            by_database.setdefault(using, []).append(name)
        for using, names in by_database.items():
            _write(using, names)


def _write(using: str, names: list[str]) -> None:
    from .models import AdvisoryLockName
    from .operations import remember_advisory_names

    try:
        if router.allow_migrate_model(using, AdvisoryLockName):
            remember_advisory_names(*names, using=using)
    except Exception as exc:  # best effort: the lock itself is unaffected
        logger.debug("could not record advisory lock names %s: %s", names[:5], exc)
    finally:
        # Not just tidiness: this runs on the one writer thread, and an alias gone from
        # DATABASES raises here; uncaught, it ended the thread and every later name with it.
        with contextlib.suppress(Exception):
            connections[using].close()


def _forget_after_fork() -> None:
    """A forked child has no writer thread (and must not share the parent's queue)."""
    global _pending, _started, _writer
    _pending = queue.Queue(MAX_PENDING)
    _started = threading.Lock()
    _writer = None


os.register_at_fork(after_in_child=_forget_after_fork)
