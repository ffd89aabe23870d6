"""Holder identities: who holds a grant, made in one place and read back in one place.

``acquire()`` makes ``[label@]host:pid:thread:random``; the admin, ``manage.py leases`` and
``leader_of`` split it back into the parts an operator looks for. Keeping both directions here
means the format can change without the readers drifting from the writer.
"""

from __future__ import annotations

import os
import random
import re
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import conf
from .errors import InvalidLeaseOption
from .keys import MAX_NAME_LENGTH, SEPARATOR

__all__ = [
    "SHARED_HOLDER",
    "Holder",
    "holder_identity",
    "live_readers",
    "parse_holder",
    "public_meta",
    "shown_holder",
]

#: The holder a backend stores for a group of readers (``lease(name, shared=True)``) in place
#: of one: no holder anyone passes can equal it (:func:`holder_identity` refuses the separator).
#: Each reader's own identity is kept beside it (the database backend: ``meta["readers"]``).
SHARED_HOLDER = f"{SEPARATOR}shared"


_this_process = ""
#: What every identity this process makes starts with, for the settings it was made from:
#: ``(settings, "[label@]host:pid:", whether that prefix passes the checks)``.
_own_prefix: tuple[conf.LeasesSettings, str, bool] | None = None
#: What a made identity adds to its prefix at most: ``thread:random`` (a thread id has at
#: most 20 digits).
_MADE_SUFFIX_LENGTH = 20 + 1 + 8


def _read_process_identity() -> None:
    """``host:pid``, read once per process (and again in a forked child, which has a new pid):
    ``gethostname`` is a system call that every acquire would otherwise pay for."""
    global _this_process, _own_prefix
    _this_process = f"{socket.gethostname()[:100]}:{os.getpid()}"
    _own_prefix = None


def _prefix() -> tuple[conf.LeasesSettings, str, bool]:
    """This process's ``[label@]host:pid:`` for the current settings, made once per process
    and settings change (the label is a setting) and checked once: every identity made from
    it is then valid without checking it again (the rest is digits and hex)."""
    global _own_prefix
    settings = conf.get()
    own = _own_prefix
    if own is None or own[0] is not settings:
        label = settings.holder_label[: conf.MAX_LABEL_LENGTH]
        prefix = f"{label}@{_this_process}:" if label else f"{_this_process}:"
        fits = len(prefix) + _MADE_SUFFIX_LENGTH <= MAX_NAME_LENGTH and prefix.isprintable()
        own = _own_prefix = (settings, prefix, fits)
    return own


_read_process_identity()
os.register_at_fork(after_in_child=_read_process_identity)


def holder_identity(holder: str | None) -> str:
    """Who holds a grant: label, host, pid, thread and a random part unique to this grant.

    The random part only tells grants apart (the grant's secret is what proves ownership), so
    it comes from ``random``, not from a system call per acquire.

    Printable only: Redis's Lua truncates at a NUL (the stored holder would never match again,
    leaving a lease nobody can release), PostgreSQL rejects one, and control characters would
    corrupt the admin, the logs and ``manage.py leases``.
    """
    if holder is None:
        _, prefix, fits = _prefix()
        holder = f"{prefix}{threading.get_ident()}:{random.getrandbits(32):08x}"
        if fits:
            return holder
    if not isinstance(holder, str) or not 0 < len(holder) <= MAX_NAME_LENGTH:
        raise InvalidLeaseOption("holder", holder, f"must be 1 to {MAX_NAME_LENGTH} characters")
    if not holder.isprintable():
        raise InvalidLeaseOption("holder", holder, "must be printable (no NUL, no control chars)")
    if SEPARATOR in holder:
        # The package's own mark (SHARED_HOLDER): a Redis writer whose holder ended in
        # "::\u241fshared" was taken for a group of readers, and a reader was granted beside it.
        raise InvalidLeaseOption("holder", holder, f"must not contain {SEPARATOR!r}")
    return holder


@dataclass(frozen=True)
class Holder:
    """A holder identity split into the parts an operator looks for."""

    raw: str
    host: str = ""
    pid: int | None = None
    thread: str = ""
    label: str = ""


_HOLDER_RE = re.compile(
    r"^(?:(?P<label>[^@]*)@)?(?P<host>[^:@]+):(?P<pid>\d+):(?P<thread>[^:/]+)(?:[:/].*)?$"
)


def parse_holder(holder: str) -> Holder:
    """Split ``[label@]host:pid:thread[:unique]`` (what ``acquire()`` makes) into its parts.

    Holders given explicitly that have another shape are shown raw.
    """
    match = _HOLDER_RE.match(holder or "")
    if match is None:
        return Holder(raw=holder or "")
    return Holder(
        raw=holder,
        host=match["host"],
        pid=int(match["pid"]),
        thread=match["thread"],
        label=match["label"] or "",
    )


def shown_holder(holder: str, meta: Mapping[str, Any] | None = None, *, named: bool = False) -> str:
    """``holder`` as an operator should read it: a group of readers (:data:`SHARED_HOLDER`, an
    internal mark nobody's identity) as ``shared (2 readers)``, or ``shared (readers)`` where
    the store keeps no list of them; with ``named``, their identities too (the audit record).
    Any other holder as it is.

    Readers are counted from ``meta["readers"]`` (token -> ``{"h": holder, "e": expiry}``),
    those whose own expiry has not passed on this machine's clock (a hint, as the admin's
    states are): a reader that stopped renewing stays listed until the next one joins or
    leaves."""
    if holder != SHARED_HOLDER:
        return holder
    readers = live_readers(holder, meta)
    if not readers:
        return "shared (readers)"
    count = f"{len(readers)} reader{'s' if len(readers) != 1 else ''}"
    if not named:
        return f"shared ({count})"
    return f"shared ({count}: {', '.join(readers.values())})"


def live_readers(holder: str, meta: Mapping[str, Any] | None) -> dict[int, str]:
    """The readers of a group (``holder`` is :data:`SHARED_HOLDER`) still within their own
    expiry: token -> holder, by token. Empty for any other holder, or where the store keeps
    no list of them."""
    listed = (meta or {}).get("readers") if holder == SHARED_HOLDER else None
    if not isinstance(listed, Mapping):
        return {}
    now = time.time()
    live = {}
    for token, entry in listed.items():
        if not isinstance(entry, Mapping) or not str(token).isdigit():
            continue
        expiry = entry.get("e")
        if isinstance(expiry, int | float) and expiry > now:
            live[int(token)] = str(entry.get("h", ""))
    return dict(sorted(live.items()))


def public_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``meta`` without the readers' secret hashes (never shown, like ``secret_hash``): every
    listing and the admin's change page show it so. Beside :func:`live_readers`, so the
    readers' entries (``{"h": holder, "e": expiry, "s": secret hash}``) are read in one
    place."""
    readers = meta.get("readers")
    if not isinstance(readers, Mapping):
        return dict(meta)
    shown = {
        token: {k: v for k, v in entry.items() if k != "s"} if isinstance(entry, Mapping) else {}
        for token, entry in readers.items()
    }
    return {**meta, "readers": shown}
