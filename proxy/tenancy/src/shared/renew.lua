-- A replica's heartbeat: its presence, then the leases it still holds, renewed for ttl.
-- KEYS[1]: the replicas (sorted set: replica id -> expiry, ms); KEYS[2..]: lease sets
-- ARGV: replica id, ttl ms, then for each lease set in KEYS[2..]: its lease count, the ids.
-- A lease the store already expired (the replica was cut off longer than ttl) is added again:
-- the request it stands for is still running.
-- Returns the replicas alive.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local ttl = tonumber(ARGV[2])
local until_ms = string.format('%.0f', now + ttl)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], until_ms, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl * 2)
local at = 3
for k = 2, #KEYS do
  local count = tonumber(ARGV[at])
  at = at + 1
  for _ = 1, count do
    redis.call('ZADD', KEYS[k], until_ms, ARGV[at])
    at = at + 1
  end
  redis.call('PEXPIRE', KEYS[k], ttl * 2)
end
return redis.call('ZCARD', KEYS[1])
