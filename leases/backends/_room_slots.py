"""The waiting rooms' connections of one process (or event loop), handed out in arrival order.

A waiter inside a name's room holds a connection of its own (its session sleeps in the server's
lock queue), so a process caps them (``ROOM_CONNECTIONS``); a waiter that finds none free waits
without a room. A caller outside a room does not overtake the waiters in it (see
:mod:`~._waiting_room`), so such a waiter could only wait for the room to empty: with more
threads than connections on one busy name, those that came last were never served (sixteen
threads on one name: eight took about 800 grants each in 5 s, eight none). A freed connection
went to whoever asked next, and that was the thread that had just been granted the name, back
for its next turn.

Here a waiter that finds none free gets a :class:`Ticket` in the process's line, and keeps
waiting without a room meanwhile (its name may have no room waiters at all: a line of names
must not hold it up). A connection given back goes to the oldest ticket, which then enters
the room at its next try; only with nobody in line does it become free for whoever asks.
While waiters of the same process fill its name's room, a waiter in line waits for its
ticket (:attr:`Ticket.wake`) rather than for the name's release: a try outside the room would
be refused then, and every release would wake each such waiter for one.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

__all__ = ["RoomSlots", "Ticket"]


class Ticket:
    """One waiter's claim on a room connection: held (``granted``), or in line for one."""

    __slots__ = ("granted", "used", "wake")

    def __init__(self, granted: bool) -> None:
        #: A room connection is this waiter's (at once, or handed on by another).
        self.granted = granted
        #: The waiter went into the room with it (or tried: once is enough).
        self.used = False
        #: Called when a connection is handed to this ticket (a waiting waiter's wake-up).
        self.wake: Callable[[], None] | None = None


class RoomSlots:
    """``count`` room connections, each held by one waiter at a time; the rest wait in line.

    Thread-safe; an event loop's room uses it from one thread, where the lock is never
    contended (nothing awaits while holding it).
    """

    __slots__ = ("_free", "_line", "_lock")

    def __init__(self, count: int) -> None:
        self._lock = threading.Lock()
        self._free = count
        self._line: collections.deque[Ticket] = collections.deque()

    def ask(self) -> Ticket:
        """A ticket: granted if a connection is free and nobody is in line before it."""
        with self._lock:
            if self._free and not self._line:
                self._free -= 1
                return Ticket(granted=True)
            ticket = Ticket(granted=False)
            self._line.append(ticket)
            return ticket

    def done(self, ticket: Ticket) -> None:
        """The waiter is done with ``ticket`` (granted the name, or gave up): its connection,
        if it was handed one, goes to the oldest ticket in line, else becomes free; a ticket
        still in line leaves it."""
        handed = None
        with self._lock:
            if not ticket.granted:
                self._line.remove(ticket)
                return
            ticket.granted = False
            if self._line:
                handed = self._line.popleft()
                handed.granted = True
            else:
                self._free += 1
        wake = None if handed is None else handed.wake
        if wake is not None:
            wake()
