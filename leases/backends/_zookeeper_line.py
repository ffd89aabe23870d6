"""The line of contenders for one name in ZooKeeper: who is first, and when the first has lapsed.

ZooKeeper's lock recipe, with a TTL on the head. Each contender is an ephemeral sequential
child ``c-<guid>-<sequence>`` of the name node; the lowest sequence is the *head*. A head whose
data says ``"held": true`` holds the name; an unpromoted head (a queued waiter whose turn came)
has a short *claim window* to promote itself. Everything here is pure: no I/O, so the rules a
contender applies before deleting someone else's znode can be read in one place.

The GUID in a child's name is derived from the grant's secret (:func:`guid_of`): after a
connection loss during ``create`` the creator finds its own node by it (the create may have been
applied with its reply lost), and a renewal or release addresses the node by a path only the
secret's owner can compute, so the path itself proves the secret without reading the node.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHILD_PREFIX",
    "Queued",
    "child_prefix",
    "deadline_ms",
    "guid_of",
    "line_of",
    "node_data",
    "read_data",
]

#: Contender znodes start with this; anything else under a name node is not in the line.
CHILD_PREFIX = "c-"
#: ZooKeeper appends a 10-digit, zero-padded sequence number to a sequential node's name.
_SEQUENCE_DIGITS = 10


def guid_of(secret: str) -> str:
    """The GUID in a contender's name: 128 bits of a hash of the grant's secret (not the secret,
    which never leaves the process; ZooKeeper clients can list names)."""
    return hashlib.sha256(f"zookeeper-contender:{secret}".encode()).hexdigest()[:32]


def child_prefix(secret: str) -> str:
    """``c-<guid>-``: the name a sequential create is given; ZooKeeper appends the sequence."""
    return f"{CHILD_PREFIX}{guid_of(secret)}-"


def line_of(children: list[str]) -> list[str]:
    """The contenders among ``children``, first (lowest sequence) first."""
    line = [c for c in children if c.startswith(CHILD_PREFIX) and c[-_SEQUENCE_DIGITS:].isdigit()]
    return sorted(line, key=lambda child: int(child[-_SEQUENCE_DIGITS:]))


def node_data(*, held: bool, ttl_ms: int, holder: str = "") -> bytes:
    """A contender's data: whether it holds the name, for whom, and for how long after its
    last write (its ``mtime``), on the leader's clock."""
    return json.dumps({"holder": holder, "ttl_ms": ttl_ms, "held": held}).encode()


def read_data(raw: bytes) -> dict[str, Any]:
    """A contender's data; an unreadable one counts as an unpromoted node with no window."""
    try:
        data = json.loads(raw)
    except ValueError:
        return {"holder": "", "ttl_ms": 0, "held": False}
    return data if isinstance(data, dict) else {"holder": "", "ttl_ms": 0, "held": False}


def deadline_ms(head: Any, data: dict[str, Any], name: Any) -> int:
    """When the head lapses, in ms on the leader's clock (the ``mtime`` of znode stats).

    A holder lapses ``ttl_ms`` after its last write (acquire, promotion or renewal). An
    unpromoted head's window runs from whichever is later, its own creation or the name node's
    last write, which every release, takeover and revocation makes in the same multi as its
    delete: so a waiter whose turn just came gets a whole window to claim it. (A predecessor
    dropped by session expiry writes nothing; its successor may then be dislodged early and
    simply queues again: liveness, never safety.)
    """
    window = int(data.get("ttl_ms", 0))
    if data.get("held"):
        return int(head.mtime) + window
    return max(int(head.mtime), int(name.mtime)) + window


@dataclass
class Queued:
    """A thread's place in one name's line while it waits (see the backend's ``waiting_room``).

    ``woken`` is set by the watch on the predecessor (deleted or changed); until it fires, and
    until ``check_at_ms`` when the predecessor is a head that may lapse, the place cannot have
    changed, so a retry costs no round trip.
    """

    name: str
    child: str
    secret: str = field(repr=False)  # the grant's, once promoted: never in a log line
    czxid: int
    session: int
    woken: threading.Event = field(default_factory=threading.Event)
    #: Local wall-clock ms after which a head predecessor may have lapsed (``None``: it cannot).
    check_at_ms: float | None = None
    #: Whether the place was looked at since the last wake-up (else the next try reads).
    checked: bool = False
    #: Promoted to the grant: leaving the waiting room must not delete it.
    granted: bool = False
    #: Also called on a wake-up, while an async waiter awaits one (it wakes that task's loop).
    on_wake: Callable[[], object] | None = None

    def wake(self, _event: object = None) -> None:
        """The predecessor's watch (kazoo calls it with the event, on its own thread)."""
        self.woken.set()
        hook = self.on_wake
        if hook is not None:
            hook()
