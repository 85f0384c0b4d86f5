-- A request of a tenant ended: its concurrent-pair lease goes, and the tokens it reserved but
-- did not use return to the budget (never above it).
-- KEYS[1]: the leases, KEYS[2]: the token budget (as in claim.lua)
-- ARGV: lease id ('' for none), tokens to give back, tokens_per_minute
-- Returns {tokens_left, tokens_reset_ms} (-1 without a budget).
if ARGV[1] ~= '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
end
local back, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm <= 0 then
  return {-1, 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local s = redis.call('HMGET', KEYS[2], 'a', 't')
local avail = tonumber(s[1]) or tpm
local since = tonumber(s[2]) or now
avail = math.min(tpm, avail + math.max(0, now - since) * tpm / 60000 + back)
redis.call('HSET', KEYS[2], 'a', string.format('%.3f', avail), 't', string.format('%.3f', now))
redis.call('PEXPIRE', KEYS[2], 120000)
return {math.floor(avail), math.ceil((tpm - avail) * 60000 / tpm)}
