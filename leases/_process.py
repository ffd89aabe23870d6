"""This process's id, read once per process and again in a forked child.

Every acquire, renew and release asks "am I the process that took this?" (a forked child must
never renew or release its parent's grant, nor share its backend connections). ``os.getpid()``
is a system call each time; the answer only changes at ``fork``, which Python announces.
"""

from __future__ import annotations

import os

__all__ = ["pid"]

#: ``os.getpid()`` without the system call, rebound in a forked child. Read as
#: ``_process.pid`` (the module's attribute, never imported by name, which would keep the
#: parent's): a read rather than a call, as every acquire and release asks several times.
pid = os.getpid()


def _forked() -> None:
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_forked)
