-- A delivery may start (common/webhook_store.py): not while its host's breaker is open (then a
-- single attempt probes the host once the breaker's time is up, the others wait for its
-- outcome), nor past its host's or its owner's cap of deliveries in flight. Leases (not
-- counters) hold the slots, so a worker that dies mid-delivery frees its slots when they run
-- out. Returns {reason, seconds to wait} or {'ok', '0'}.
local host_deliveries = KEYS[1]
local owner_deliveries = KEYS[2]
local breaker = KEYS[3]
local event_id = ARGV[1]
local now = tonumber(ARGV[2])
local lease_end = ARGV[3]
local per_host = tonumber(ARGV[4])
local per_owner = tonumber(ARGV[5])   -- 0: no cap
local breaker_s = tonumber(ARGV[6])
local open_until = tonumber(redis.call('HGET', breaker, 'open_until') or '0')
if open_until > now then return {'breaker', tostring(open_until - now)} end
local slots = {host_deliveries, owner_deliveries}
local caps = {per_host, per_owner}
local names = {'host', 'key'}
for i = 1, 2 do
  redis.call('ZREMRANGEBYSCORE', slots[i], '-inf', now)
  if caps[i] > 0 and not redis.call('ZSCORE', slots[i], event_id)
     and redis.call('ZCARD', slots[i]) >= caps[i] then
    local first = redis.call('ZRANGE', slots[i], 0, 0, 'WITHSCORES')
    return {names[i], tostring(tonumber(first[2]) - now)}
  end
end
if open_until > 0 then
  redis.call('HSET', breaker, 'open_until', now + breaker_s)
end
for i = 1, 2 do
  redis.call('ZADD', slots[i], lease_end, event_id)
  redis.call('EXPIREAT', slots[i], math.ceil(tonumber(lease_end)))
end
return {'ok', '0'}
