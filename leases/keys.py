"""Names and the 64-bit keys Postgres advisory locks take.

The derivation is part of the public contract and must never change: two releases of this
package (or a service in another language) must map the same name to the same lock.

    key = int.from_bytes(blake2b(name.encode("utf-8"), digest_size=8).digest(), "big", signed=True)

A 64-bit space makes accidental collisions negligible (about 1 in 10^10 for 60,000 names);
truncating to 16 or 32 bits, as some peers do, makes them likely.
"""

from __future__ import annotations

import functools
import hashlib

from .errors import InvalidLeaseName

__all__ = [
    "MAX_NAME_LENGTH",
    "SEPARATOR",
    "LockKey",
    "advisory_key",
    "derived_name",
    "hashed_key",
    "split_key",
    "validate_lease_name",
    "validate_name",
]

MAX_NAME_LENGTH = 255

#: Joins a name to the part of a lease the package derives from it (slot 3 of semaphore
#: ``exports`` is the lease ``exports␟3``). U+241F is printable (admin pages and logs show it,
#: ZooKeeper paths and Redis keys take it) and no one types it by accident; user names may not
#: contain it, so a derived name can never be one somebody else chose.
SEPARATOR = "\u241f"

#: What the advisory helpers accept: a name, an explicit signed 64-bit key, or a pair of
#: signed 32-bit keys (Postgres's two-argument form).
LockKey = str | int | tuple[int, int]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def validate_name(name: object) -> str:
    """Return ``name`` if it can name a lock or lease, else raise :class:`InvalidLeaseName`.

    A name is 1 to 255 characters of text without NUL (Postgres text cannot hold NUL, and an
    unbounded name would let a caller bloat every table and key that records it).
    """
    if not isinstance(name, str):
        raise InvalidLeaseName(name, f"must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidLeaseName(name, "must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidLeaseName(
            name[:40] + "…", f"is {len(name)} characters long; at most {MAX_NAME_LENGTH} allowed"
        )
    if "\x00" in name:
        raise InvalidLeaseName(name, "must not contain NUL characters")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidLeaseName(name, "must be encodable as UTF-8") from exc
    return name


def validate_lease_name(name: object) -> str:
    """:func:`validate_name`, and not containing :data:`SEPARATOR`: the check at the doors where
    users name leases (``acquire``, ``semaphore``), so their names never collide with a name
    the package derives (a semaphore's slots). Operators' tools accept derived names.

    Every acquire asks, mostly about the same few names: a plain ``str`` found valid is
    remembered (the verdict depends on the text alone; a refusal is never remembered)."""
    if type(name) is str:
        return _valid_lease_str(name)
    return _valid_lease_name(name)


@functools.lru_cache(maxsize=1024)
def _valid_lease_str(name: str) -> str:
    return _valid_lease_name(name)


def _valid_lease_name(name: object) -> str:
    name = validate_name(name)
    if SEPARATOR in name:
        raise InvalidLeaseName(
            name, f"must not contain {SEPARATOR!r} (U+241F), reserved for semaphore slots"
        )
    return name


def derived_name(name: str, part: str) -> str:
    """``name`` + :data:`SEPARATOR` + ``part``, if that still fits in a name."""
    derived = f"{name}{SEPARATOR}{part}"
    if len(derived) > MAX_NAME_LENGTH:
        raise InvalidLeaseName(
            name[:40] + "…",
            f"is {len(name)} characters long; with the suffix {SEPARATOR}{part} it must fit in "
            f"{MAX_NAME_LENGTH}",
        )
    return derived


def advisory_key(key: LockKey) -> int | tuple[int, int]:
    """Map a name, int64 or (int32, int32) to what ``pg_advisory_*`` functions take.

    Names are hashed (see the module docstring); explicit keys are range-checked and passed
    through, so callers who share locks with other systems can use their numbers.
    """
    if isinstance(key, bool):
        raise InvalidLeaseName(key, "a bool is not a lock key")
    if isinstance(key, int):
        if not _INT64_MIN <= key <= _INT64_MAX:
            raise InvalidLeaseName(key, "an integer key must fit in a signed 64-bit integer")
        return key
    if isinstance(key, tuple):
        if len(key) != 2 or not all(
            isinstance(k, int) and not isinstance(k, bool) and _INT32_MIN <= k <= _INT32_MAX
            for k in key
        ):
            raise InvalidLeaseName(key, "a key pair must be two signed 32-bit integers")
        return (key[0], key[1])
    return hashed_key(validate_name(key))


def hashed_key(text: str) -> int:
    """The 64-bit key of a name: for :func:`advisory_key`, which validates it first, and for
    keys the package derives from a name already validated (a waiting room's
    ``leases:room:<name>``), which may run past the length a user's name is allowed."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def split_key(key: int) -> tuple[int, int]:
    """The ``(classid, objid)`` pair ``pg_locks`` shows for a 64-bit advisory key.

    ``pg_locks`` reports a one-argument advisory lock as ``classid`` = high 32 bits and
    ``objid`` = low 32 bits (both unsigned, as oid) with ``objsubid`` = 1.
    """
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF
