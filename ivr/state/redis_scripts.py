"""The Lua scripts that write a call record in Redis (``ivr.state.redis_store``): each one
reads and writes the call's key in a single atomic step, the compare-and-set on ``version``
included, and on one server (or Sentinel) moves the sid between the active and ended indexes in
that same step.
"""

from __future__ import annotations

import hashlib


class Lua:
    """A script run by EVALSHA, falling back to EVAL (which caches it) on NOSCRIPT: a restarted
    server or a just-promoted replica has an empty script cache."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


# ARGV: json, ttl ms, live ('1'/'0'), score (updated_at if live, else ended_at), sid, ended
# index cutoff (epoch s), resend ('1'/'0'). Returns 0 if another record has the sid. KEYS[2]
# and KEYS[3] (the active and ended sets) are left out in a cluster. On a resend (the first
# send may have landed, its reply lost) the very JSON already stored means it did land.
CREATE = Lua("""
local cur = redis.call('GET', KEYS[1])
if cur then
  if ARGV[7] == '1' and cur == ARGV[1] then return 1 end
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if #KEYS > 1 then
  if ARGV[3] == '1' then
    redis.call('ZADD', KEYS[2], ARGV[4], ARGV[5])
  else
    redis.call('ZADD', KEYS[3], ARGV[4], ARGV[5])
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[6])
  end
end
return 1
""")

# ARGV: expected version, new json, ttl ms, live ('1'/'0'), score (updated_at if live, else
# ended_at), sid, ended index cutoff (epoch s), resend ('1'/'0'), and the SHA-1 of the JSON
# the writer based its change on ('' when it read the record just now: the version decides).
# The SHA-1 spares the script decoding the record: 180 us a call in Redis for a talking
# call's record, against ~10 for the hash.
# Returns -1 missing, 0 version conflict, 1 written, 2 this exact write is already stored (a
# resend after a lost reply must not apply the mutation twice). Only a resend may take the
# same JSON as its own: two writers can produce identical records (same base, same mutation,
# same microsecond), and the second must then see a conflict, not count as written.
UPDATE = Lua("""
local cur = redis.call('GET', KEYS[1])
if not cur then return -1 end
if ARGV[8] == '1' and cur == ARGV[2] then return 2 end
if ARGV[9] ~= '' then
  if redis.sha1hex(cur) ~= ARGV[9] then return 0 end
elseif cjson.decode(cur)['version'] ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if #KEYS > 1 then
  if ARGV[4] == '1' then
    redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
  else
    redis.call('ZREM', KEYS[2], ARGV[6])
    redis.call('ZADD', KEYS[3], ARGV[5], ARGV[6])
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[7])
  end
end
return 1
""")

# ARGV: json, ttl ms. Stored only if absent (a version names its content); TTL renewed anyway.
SAVE_FLOW = Lua("""
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""")
