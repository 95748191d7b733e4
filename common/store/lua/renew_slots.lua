-- Renews some of a key's slots (see open_stream.lua) to a new lease end; a slot closed (or
-- expired) meanwhile stays closed. Returns how many were renewed.
local slots = KEYS[1]              -- llmq:owner:<owner>:streams or :waiting (token -> lease end)
local now = tonumber(ARGV[1])
local lease_end = tonumber(ARGV[2])
-- ARGV[3..]: the tokens

local renewed = 0
for i = 3, #ARGV do
  renewed = renewed + redis.call('ZADD', slots, 'XX', 'CH', lease_end, ARGV[i])
end
-- The set outlives the leases it holds (open_stream.lua's rule: only ever lengthened).
local ttl_ms = math.ceil((lease_end - now) * 1000) + 1000
if renewed > 0 and redis.call('PTTL', slots) < ttl_ms then
  redis.call('PEXPIRE', slots, ttl_ms)
end
return renewed
