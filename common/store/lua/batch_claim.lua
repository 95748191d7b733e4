-- Dispatch (common/batch_store.py): takes a batch whose lease has run out (or that nobody
-- drove yet) for a new driver. Returns 1 when taken, 0 when not (a batch whose record is gone
-- leaves the active set).
local active = KEYS[1]          -- llmq:batches:active
local batch = KEYS[2]           -- the batch's hash
local id = ARGV[1]
local now = tonumber(ARGV[2])
local expiry = ARGV[3]          -- the new lease's expiry
local token = ARGV[4]           -- the new driver's
local score = redis.call('ZSCORE', active, id)
if not score or tonumber(score) > now then return 0 end
if redis.call('EXISTS', batch) == 0 then redis.call('ZREM', active, id) return 0 end
redis.call('ZADD', active, expiry, id)
redis.call('HSET', batch, 'driver', token)
return 1
