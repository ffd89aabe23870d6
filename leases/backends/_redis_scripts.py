"""Lua and key layout shared by the Redis and Redlock backends.

Both keep a grant under the same keys and prove ownership the same way, so the compare-and-
extend and compare-and-delete scripts, their return codes and the key names live here once;
neither backend imports the other.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Literal

from ..keys import validate_name

__all__ = [
    "RELEASE_LUA",
    "RENEW_LUA",
    "WAKE_TTL_MS",
    "KeyKind",
    "LeaseKeys",
    "Reply",
    "lua",
    "wake_lua",
]

#: How long, at least, a release's wake-up waits in the list for a waiter that is about to
#: ``BLPOP`` (up to twice as long: see :func:`wake_lua`).
WAKE_TTL_MS = 5000

#: Which of a name's keys (see :class:`LeaseKeys`).
KeyKind = Literal["lock", "fence", "wake", "readers", "writer"]


class Reply(enum.IntEnum):
    """Return codes of the Lua scripts (injected into them as Lua constants by :func:`lua`)."""

    LOST = 0
    OK = 1
    BUSY = 2
    NEED_EPOCH = 3
    #: Holder and token are the current grant's, the secret is not: a grant forged from public
    #: data (``inspect()``), refused without touching the key.
    NOT_OWNER = 4


def lua(body: str) -> str:
    """A script with :class:`Reply`'s names defined, so Python and Lua share one set of codes."""
    return "".join(f"local {r.name} = {r.value}\n" for r in Reply) + body


#: The owner's proof, shared by renew and release (and Redlock's nodes, whose values have no
#: token prefix). ARGV: the value's token prefix (``epoch:counter:``, or "" on Redlock), holder,
#: secret. ``owned`` is the value only the secret's owner can name; ``refused()`` tells a
#: forged grant (token prefix and holder match, hash does not: :attr:`Reply.NOT_OWNER`) from
#: a grant that expired or was taken over (:attr:`Reply.LOST`).
_OWNER_LUA = """
local owned = ARGV[1] .. redis.sha1hex(ARGV[3]) .. ':' .. ARGV[2]
local function refused()
  local current = redis.call('GET', KEYS[1]) or ''
  if string.sub(current, 1, #ARGV[1]) == ARGV[1]
      and string.sub(current, #ARGV[1] + 41) == ':' .. ARGV[2] then
    return NOT_OWNER
  end
  return LOST
end
"""

#: KEYS: lock. ARGV: token prefix, holder, secret, ttl ms. Compare-and-PEXPIRE.
RENEW_LUA = lua(
    _OWNER_LUA
    + """
if redis.call('GET', KEYS[1]) == owned then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return OK
end
return refused()
"""
)


def wake_lua(key: str, ttl: str) -> str:
    """Lua that leaves one wake-up in the list ``key`` lasting at least ``ttl`` ms (both Lua
    expressions): what every release does, so a waiter's ``BLPOP`` returns without polling.

    It pushes only when the list is missing. A client blocked in ``BLPOP`` on a list means the
    list is empty, and Redis deletes an empty list (a push is handed to a blocked client before
    the next command runs), so while the list exists nobody is blocked on it: the release has
    no one to wake now, only a waiter between its failed try and its ``BLPOP`` to keep the
    wake-up for. It then renews the wake-up's life (to twice ``ttl``) once less than ``ttl``
    is left, so every release still leaves one that lasts at least ``ttl``. An uncontended
    release costs a ``PTTL`` (and a ``PEXPIRE`` every ``ttl``), not ``RPUSH`` + ``LTRIM`` +
    ``PEXPIRE``; the list never holds more than one wake-up, so one release wakes one waiter.
    """
    return f"""
  local wake_left = redis.call('PTTL', {key})
  if wake_left < tonumber({ttl}) then
    if wake_left == -2 then
      redis.call('RPUSH', {key}, '1')
    end
    redis.call('PEXPIRE', {key}, 2 * {ttl})
  end
"""


#: KEYS: lock, wake. ARGV: token prefix, holder, secret, wake ttl ms.
#: Compare-and-delete, then wake one waiter; the counter in ``fence`` stays (it expires later:
#: :data:`~._redis_shared.FENCE_KEEP_MS`).
RELEASE_LUA = lua(
    _OWNER_LUA
    + """
if redis.call('GET', KEYS[1]) == owned then
  redis.call('DEL', KEYS[1])
"""
    + wake_lua("KEYS[2]", "ARGV[4]")
    + """
  return OK
end
return refused()
"""
)


@dataclass(frozen=True)
class LeaseKeys:
    """The keys of one name; ``{...}`` is the Redis Cluster hash tag, so they share a slot."""

    lock: str
    fence: str
    wake: str
    #: A group of readers' entries, and a waiting writer's stop sign (shared leases, Redis).
    readers: str = ""
    writer: str = ""

    @classmethod
    def of(cls, prefix: str, name: str) -> LeaseKeys:
        """The keys of ``name``, refused (:class:`~leases.errors.InvalidLeaseName`) unless it
        is one; a plain ``str`` is checked only the first time (see :func:`_lease_keys`)."""
        if type(name) is str:
            return _lease_keys(prefix, name)
        return _lease_keys(prefix, validate_name(name))

    @staticmethod
    def pattern(prefix: str, kind: KeyKind) -> str:
        """A ``SCAN MATCH`` pattern for every name's ``kind`` key under ``prefix``."""
        return f"{prefix}{{*}}:{kind}"

    @staticmethod
    def name_of(prefix: str, key: str, kind: KeyKind = "fence") -> str:
        """The lease name whose ``kind`` key is ``key`` (the inverse of :meth:`of`)."""
        escaped = key[len(prefix) + 1 : -len(f"}}:{kind}")]
        return escaped.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")

    @staticmethod
    def any_pattern(prefix: str) -> str:
        """A ``SCAN MATCH`` pattern for every key of every name under ``prefix``: one pass
        over the keyspace finds the keys of several kinds (see :meth:`name_if`)."""
        return f"{prefix}{{*}}:*"

    @staticmethod
    def name_if(prefix: str, key: str, kinds: tuple[KeyKind, ...]) -> str | None:
        """The lease name whose key ``key`` is, if it is a key of one of ``kinds`` (a name's
        braces are escaped, so ``}:<kind>`` can only end the key); else ``None``."""
        for kind in kinds:
            if key.endswith(f"}}:{kind}"):
                return LeaseKeys.name_of(prefix, key, kind)
        return None


@functools.lru_cache(maxsize=1024)
def _lease_keys(prefix: str, name: str) -> LeaseKeys:
    """Cached: every acquire, renew and release needs the keys, and escaping the name costs
    more than the rest of building the call. The name is checked here, so a name found in the
    cache was checked when it was put there (a refused one never is)."""
    validate_name(name)
    # Braces inside the name would move the hash tag; escaping keeps the mapping one-to-one.
    escaped = name.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    base = f"{prefix}{{{escaped}}}"
    return LeaseKeys(
        lock=f"{base}:lock",
        fence=f"{base}:fence",
        wake=f"{base}:wake",
        readers=f"{base}:readers",
        writer=f"{base}:writer",
    )
