"""Blocking acquisitions refused on a thread that runs an event loop.

``acquire()`` waits (up to its timeout) and makes blocking round trips; called from a coroutine
it stalls every task of the loop for that long, which is how an async view's ``with lease()``
turns one busy name into a frozen server. Django refuses its blocking ORM calls there
(``SynchronousOnlyOperation``, lifted by ``DJANGO_ALLOW_ASYNC_UNSAFE``); the blocking
acquisitions here follow the same rule, so the mistake shows at the first call, not under load.
"""

from __future__ import annotations

import os
from asyncio import events

from .errors import BlockingInEventLoop

__all__ = ["refuse_blocking"]


def refuse_blocking(call: str, instead: str) -> None:
    """Raise :class:`BlockingInEventLoop` when this thread runs an event loop.

    The check on every sync acquire is one C call returning ``None`` (no loop): the
    environment is read only when a loop runs, as Django reads it.
    """
    if events._get_running_loop() is None:
        return
    if os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE"):
        return
    raise BlockingInEventLoop(call, instead)
