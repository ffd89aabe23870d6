"""This process's id, read once per process and again in a forked child.

Every acquire, renew and release asks "am I the process that took this?" (a forked child must
never renew or release its parent's grant, nor share its backend connections). ``os.getpid()``
is a system call each time; the answer only changes at ``fork``, which Python announces.
"""

from __future__ import annotations

import os

__all__ = ["pid"]

_pid = os.getpid()


def pid() -> int:
    """``os.getpid()``, without the system call."""
    return _pid


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)
