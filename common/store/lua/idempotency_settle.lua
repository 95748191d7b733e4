-- The claim's holder answers (answer set: kept for ttl seconds) or lets go (answer empty)
-- (common/idempotency_store.py). A claim that lapsed and was taken again is not its any more.
local entry = KEYS[1]           -- the key's hash
local token = ARGV[1]           -- the holder's claim
local answer = ARGV[2]          -- JSON; '': let the claim go
local ttl = ARGV[3]
if redis.call('HGET', entry, 'token') ~= token then return 0 end
if answer == '' then return redis.call('DEL', entry) end
redis.call('HSET', entry, 'answer', answer)
redis.call('HDEL', entry, 'token')
redis.call('EXPIRE', entry, ttl)
return 1
