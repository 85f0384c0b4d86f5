-- One request of a tenant, taken from the limits every replica shares, all or nothing.
-- KEYS[1]: the request rate's theoretical arrival time (GCRA), ms
-- KEYS[2]: the concurrent-pair leases (sorted set: lease id -> expiry, ms)
-- KEYS[3]: the token budget (hash: a = tokens available, t = when, ms)
-- ARGV: requests_per_second, burst, max_pairs, lease id, lease ttl ms, tokens, tokens_per_minute
-- Returns {1, '', 0, requests_left, tokens_left, tokens_reset_ms} or
--         {0, what ('requests' | 'pairs' | 'tokens'), retry_after_ms, requests_left, tokens_left, tokens_reset_ms}.
-- Time is the store's (TIME), so replicas' clocks never matter.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local rps, burst, maxp = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lease, ttl = ARGV[4], tonumber(ARGV[5])
local n, tpm = tonumber(ARGV[6]), tonumber(ARGV[7])

local req_left, tat = -1, 0
if rps > 0 then
  if burst < 1 then burst = rps end
  local interval = 1000 / rps
  local span = burst * interval
  tat = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
  if tat < now then tat = now end
  local next_tat = tat + interval
  if next_tat - now > span then
    return {0, 'requests', math.ceil(next_tat - now - span), 0, -1, 0}
  end
  tat = next_tat
  req_left = math.floor((span - (tat - now)) / interval)
end

if maxp > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= maxp then
    return {0, 'pairs', 1000, math.max(req_left, 0), -1, 0}
  end
end

local avail = -1
if tpm > 0 then
  local s = redis.call('HMGET', KEYS[3], 'a', 't')
  avail = tonumber(s[1]) or tpm
  local since = tonumber(s[2]) or now
  avail = math.min(tpm, avail + math.max(0, now - since) * tpm / 60000)
  if avail < n then
    return {0, 'tokens', math.ceil((n - avail) * 60000 / tpm), math.max(req_left, 0),
            math.floor(avail), math.ceil((tpm - avail) * 60000 / tpm)}
  end
  avail = avail - n
end

-- Everything fits: take it.
if rps > 0 then
  redis.call('SET', KEYS[1], string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 1000)
end
if maxp > 0 then
  redis.call('ZADD', KEYS[2], string.format('%.0f', now + ttl), lease)
  redis.call('PEXPIRE', KEYS[2], ttl * 2)
end
local reset = 0
if tpm > 0 then
  redis.call('HSET', KEYS[3], 'a', string.format('%.3f', avail), 't', string.format('%.3f', now))
  redis.call('PEXPIRE', KEYS[3], 120000)
  reset = math.ceil((tpm - avail) * 60000 / tpm)
end
return {1, '', 0, req_left, math.floor(avail), reset}
