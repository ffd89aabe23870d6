"""This process's id, read once per process and again in a forked child; its threads' numbers.

Every acquire, renew and release asks "am I the process that took this?" (a forked child must
never renew or release its parent's grant, nor share its backend connections). ``os.getpid()``
is a system call each time; the answer only changes at ``fork``, which Python announces.
"""

from __future__ import annotations

import itertools
import os
import threading

__all__ = ["pid", "thread"]

#: ``os.getpid()`` without the system call, rebound in a forked child. Read as
#: ``_process.pid`` (the module's attribute, never imported by name, which would keep the
#: parent's): a read rather than a call, as every acquire and release asks several times.
pid = os.getpid()


def _forked() -> None:
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


class _Thread(threading.local):
    """A number per thread, never given twice: ``threading.get_ident()`` is reused by a later
    thread once one ends, and what is kept for a thread that ended (a lease it took and
    handed to another to release, a failed try it noted) would then be taken for an
    unrelated thread's. ``key`` is the number as a lease registry's holder key."""

    def __init__(self) -> None:
        self.number = next(_thread_numbers)
        self.key = f"thread:{self.number}"


_thread_numbers = itertools.count(1)
#: The calling thread's (``_process.thread.number``, ``.key``).
thread = _Thread()
