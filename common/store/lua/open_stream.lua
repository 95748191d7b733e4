-- Opens one of a key's SSE streams if it has fewer than `cap` open (expired leases, left by an
-- API process that died, do not count). Returns 1 when opened.
local streams = KEYS[1]            -- llmq:owner:<owner>:streams (token -> lease end)
local now = ARGV[1]
local lease_end = ARGV[2]
local cap = tonumber(ARGV[3])      -- 0: no cap
local token = ARGV[4]

redis.call('ZREMRANGEBYSCORE', streams, '-inf', now)
if cap > 0 and redis.call('ZCARD', streams) >= cap then return 0 end
redis.call('ZADD', streams, lease_end, token)
redis.call('EXPIRE', streams, math.ceil(tonumber(lease_end) - tonumber(now)) + 1)
return 1
