-- Opens one of a key's slots (its SSE streams, or its requests waiting for a result) if it has
-- fewer than `cap` open (expired leases, left by an API process that died, do not count).
-- Returns 1 when opened.
local slots = KEYS[1]              -- llmq:owner:<owner>:streams or :waiting (token -> lease end)
local now = ARGV[1]
local lease_end = ARGV[2]
local cap = tonumber(ARGV[3])      -- 0: no cap
local token = ARGV[4]

redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
if cap > 0 and redis.call('ZCARD', slots) >= cap then return 0 end
redis.call('ZADD', slots, lease_end, token)
-- The set lives as long as its longest lease: only ever lengthened, or a short lease taken
-- now would end the set, and with it the other slots' longer ones.
local ttl_ms = math.ceil((tonumber(lease_end) - tonumber(now)) * 1000) + 1000
if redis.call('PTTL', slots) < ttl_ms then redis.call('PEXPIRE', slots, ttl_ms) end
return 1
