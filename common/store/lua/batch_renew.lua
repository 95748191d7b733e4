-- The driver keeps its lease while its token is the batch's; expiry 0 hands it back at once
-- (common/batch_store.py). Returns 1 when kept, 0 when another driver has it.
local active = KEYS[1]          -- llmq:batches:active
local batch = KEYS[2]           -- the batch's hash
local id = ARGV[1]
local token = ARGV[2]
local expiry = ARGV[3]          -- the new expiry; 0: hand the lease back
if redis.call('HGET', batch, 'driver') ~= token then return 0 end
if not redis.call('ZSCORE', active, id) then return 0 end
redis.call('ZADD', active, expiry, id)
return 1
