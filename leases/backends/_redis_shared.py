"""Shared (reader) grants on the Redis backend, and the token step both acquires share.

Readers of a name hold its ``:lock`` key together, as a *group*: the value is
``epoch:counter::␟shared`` (the latest reader's token, no secret hash, a holder no exclusive
grant can have), expiring with the latest reader. ``:readers`` (a hash, same hash tag, same
expiry) maps each reader's ``epoch:counter`` to ``expiry ms:sha1(secret):holder``, expiry on
Redis's clock. To the exclusive scripts a group is a held key, so they need no change: an
exclusive acquire is busy until the last reader leaves or expires. Every reader's grant takes
the name's next token (:data:`NEXT_GRANT_LUA`, the exclusive acquire's own step), so a writer's
token is above every reader's before it.

A waiting writer stops new readers with ``:writer``, a key set for a moment on each of its
retries (:data:`STOP_READERS_LUA`); readers may not join, nor start a group, while it exists.
Behind an exclusive holder the writer's refused tries set it themselves, in the acquire script
they run anyway (no round trip of their own: ``acquire_call`` in the protocol module), on the
names readers use: the first reader to start a group marks ``:fence`` (field ``shared``).
"""

from __future__ import annotations

from ..holders import SHARED_HOLDER
from ._redis_scripts import lua, wake_lua

__all__ = [
    "FENCE_KEEP_MS",
    "FENCE_KEEP_TTLS",
    "GROUP",
    "NEXT_GRANT_LUA",
    "READER_CHECK_LUA",
    "SHARED_ACQUIRE_LUA",
    "SHARED_RELEASE_LUA",
    "SHARED_RENEW_LUA",
    "STOP_READERS_LUA",
    "WRITER_INTENT_MS",
]

#: The holder part of a group's lock value (the value ends ``::`` + this).
GROUP = SHARED_HOLDER
#: How long a waiting writer's ``:writer`` key stops new readers; it retries well within this.
WRITER_INTENT_MS = 1000

#: How long a name's ``:fence`` hash lives after its latest grant, at least: a day, or ten of the
#: grant's TTLs if longer. A counter Redis forgets costs only a new epoch from the database, so
#: nothing needs it forever, and a name never used again leaves no key behind.
FENCE_KEEP_MS = 24 * 3600 * 1000
FENCE_KEEP_TTLS = 10

#: The next token of a name, in ``epoch`` and ``counter``: ``KEYS[2]`` is the ``:fence`` hash,
#: ARGV[2] the grant's TTL in ms, ARGV[3] the offer (``0``: none yet, else ``epoch:nonce``, a
#: new epoch and the reservation it was drawn under), ARGV[4] the counter limit, ARGV[5] the
#: grant's secret; the script sets the locals ``source`` (which epoch database the caller draws
#: from) and ``known_run`` before (the server's replication id as the caller's connection knows
#: it, '' if it does not). The id is read (``INFO``) only when it is not known or the counter
#: carries another (see the Redis backend's docstring); ``run`` is the id used, for the reply.
#:
#: A counter is continued only if it is there, from this server run, from the caller's epoch
#: source and not exhausted. Otherwise a new epoch is installed only under a *reservation*:
#: the first refusal writes ``reserved`` (``run:nonce``, the nonce derived from the secret and
#: the offer, so new for every call) and returns ``{NEED_EPOCH, stored, run, nonce}``; the
#: caller draws an epoch from the database and offers it with the nonce. An install consumes
#: the reservation, and a wipe or another server run loses it, so an offer is taken only if no
#: epoch was installed since its reservation: every epoch installed was drawn after every
#: earlier install of the name, and the database makes it higher. (Without it, an epoch drawn
#: before another client's, offered after Redis forgot the counter, took the token back.)
#: Concurrent callers share one reservation, so the first offer wins and the others continue
#: its counter. A counter stamped by another source (another project on the same Redis and
#: ``PREFIX``, or our database restored into a new cluster) is not continued, but its epoch
#: still floors the new one: that costs our counter nothing but a jump, and keeps a restored
#: database that is behind from handing out an epoch below the ones Redis saw.
NEXT_GRANT_LUA = f"""
local state = redis.call('HMGET', KEYS[2], 'epoch', 'counter', 'run', 'source')
local run = known_run
if run == '' or state[3] ~= run then
  if redis.replicate_commands then
    redis.replicate_commands()  -- Redis < 5: allow writes after INFO (no-op since 5)
  end
  run = string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)') or ''
end
local epoch, counter = tonumber(state[1]), tonumber(state[2])
local fence_keep = math.max({FENCE_KEEP_MS}, {FENCE_KEEP_TTLS} * tonumber(ARGV[2]))
if counter == nil or state[3] ~= run or state[4] ~= source or counter >= tonumber(ARGV[4]) then
  local stored = epoch or 0
  local offered, echoed = string.match(ARGV[3], '^(%d+):(%x+)$')
  local reserved = redis.call('HGET', KEYS[2], 'reserved')
  if offered == nil or reserved ~= run .. ':' .. echoed or tonumber(offered) <= stored then
    if not reserved or string.sub(reserved, 1, #run + 1) ~= run .. ':' then
      reserved = run .. ':' .. redis.sha1hex(ARGV[5] .. ':' .. ARGV[3])
      redis.call('HSET', KEYS[2], 'reserved', reserved)
      redis.call('PEXPIRE', KEYS[2], fence_keep)
    end
    return {{NEED_EPOCH, tostring(stored), run, string.sub(reserved, #run + 2)}}
  end
  epoch, counter = tonumber(offered), 1
  redis.call('HDEL', KEYS[2], 'reserved')
  redis.call('HSET', KEYS[2], 'epoch', epoch, 'counter', counter, 'run', run, 'source', source)
else
  counter = counter + 1
  redis.call('HSET', KEYS[2], 'counter', counter)
end
redis.call('PEXPIRE', KEYS[2], fence_keep)
"""

#: Redis's clock in ms (writes after TIME need effects replication: Redis < 5 asks for it),
#: and whether a lock value names a group.
_CLOCK_LUA = """
if redis.replicate_commands then
  redis.replicate_commands()
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local function is_group(value, mark)
  return value ~= false and value ~= nil and string.sub(value, -#mark) == mark
end
"""

#: KEYS: lock, fence, readers, writer. ARGV: holder, ttl ms, offer, counter limit, secret,
#: epoch source, group mark (``::␟shared``), the replication id the connection knows ('' if
#: none). Returns {OK, value, run} | {BUSY, value, run} | {NEED_EPOCH, epoch, run, nonce}.
SHARED_ACQUIRE_LUA = lua(
    _CLOCK_LUA
    + """
local source, known_run = ARGV[6], ARGV[8] or ''
local current = redis.call('GET', KEYS[1])
local group = is_group(current, ARGV[7])
if (current and not group) or redis.call('EXISTS', KEYS[4]) == 1 then
  return {BUSY, current or '', known_run}
end
"""
    + NEXT_GRANT_LUA
    + """
if not group then
  redis.call('DEL', KEYS[3])
  redis.call('HSET', KEYS[2], 'shared', '1')
end
local key = epoch .. ':' .. counter
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[3], key, (now + ttl) .. ':' .. redis.sha1hex(ARGV[5]) .. ':' .. ARGV[1])
local keep = ttl
if group then
  keep = math.max(redis.call('PTTL', KEYS[1]), ttl)
end
local value = key .. ARGV[7]
redis.call('SET', KEYS[1], value, 'PX', keep)
redis.call('PEXPIRE', KEYS[3], keep)
return {OK, value, run}
"""
)

#: This reader's entry, checked: ``LOST`` unless the key is a group and the entry is live and
#: names the holder; ``NOT_OWNER`` if only the secret is wrong. KEYS: lock, readers. ARGV:
#: reader key, holder, secret, then the script's own.
READER_CHECK_LUA = """
local function refused(mark)
  if not is_group(redis.call('GET', KEYS[1]), mark) then
    return LOST
  end
  local entry = redis.call('HGET', KEYS[2], ARGV[1])
  if not entry then
    return LOST
  end
  local expiry, hash, holder = string.match(entry, '^(%d+):(%x+):(.*)$')
  if holder ~= ARGV[2] or tonumber(expiry) <= now then
    return LOST
  end
  if hash ~= redis.sha1hex(ARGV[3]) then
    return NOT_OWNER
  end
  return nil
end
"""

#: KEYS: lock, readers. ARGV: reader key, holder, secret, ttl ms, group mark.
SHARED_RENEW_LUA = lua(
    _CLOCK_LUA
    + READER_CHECK_LUA
    + """
local no = refused(ARGV[5])
if no then
  return no
end
local ttl = tonumber(ARGV[4])
redis.call('HSET', KEYS[2], ARGV[1], (now + ttl) .. ':' .. redis.sha1hex(ARGV[3]) .. ':' .. ARGV[2])
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return OK
"""
)

#: KEYS: lock, readers, wake. ARGV: reader key, holder, secret, group mark, wake ttl ms.
#: Leave the group; the group then lasts as long as its latest live reader, and the last one
#: out deletes the lock (the counter in ``:fence`` stays) and wakes one waiter.
SHARED_RELEASE_LUA = lua(
    _CLOCK_LUA
    + READER_CHECK_LUA
    + """
local no = refused(ARGV[4])
if no then
  return no
end
redis.call('HDEL', KEYS[2], ARGV[1])
local latest = 0
local entries = redis.call('HGETALL', KEYS[2])
for i = 1, #entries, 2 do
  local expiry = tonumber(string.match(entries[i + 1], '^(%d+):'))
  if expiry > now then
    latest = math.max(latest, expiry)
  else
    redis.call('HDEL', KEYS[2], entries[i])
  end
end
if latest == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
"""
    + wake_lua("KEYS[3]", "ARGV[5]")
    + """
else
  redis.call('PEXPIRE', KEYS[1], latest - now)
  redis.call('PEXPIRE', KEYS[2], latest - now)
end
return OK
"""
)

#: KEYS: lock, writer. ARGV: group mark, ms. A waiting writer stops new readers of a group.
STOP_READERS_LUA = lua(
    """
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, -#ARGV[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
end
return OK
"""
)
