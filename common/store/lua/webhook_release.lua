-- A delivery ended (common/webhook_store.py): its slots are freed; an answer closes the host's
-- breaker, no answer counts a failure, and `threshold` failures in a row open it for
-- breaker_s seconds. Returns the failures in a row.
local host_deliveries = KEYS[1]
local owner_deliveries = KEYS[2]
local breaker = KEYS[3]
local event_id = ARGV[1]
local answered = ARGV[2]        -- '1' or '0'
local now = tonumber(ARGV[3])
local threshold = tonumber(ARGV[4])   -- 0: no breaker
local breaker_s = tonumber(ARGV[5])
redis.call('ZREM', host_deliveries, event_id)
redis.call('ZREM', owner_deliveries, event_id)
if answered == '1' then
  redis.call('DEL', breaker)
  return 0
end
if threshold <= 0 then return 0 end
local n = redis.call('HINCRBY', breaker, 'failures', 1)
if n >= threshold then
  redis.call('HSET', breaker, 'open_until', now + breaker_s)
end
redis.call('EXPIRE', breaker, math.ceil(10 * breaker_s) + 3600)
return n
