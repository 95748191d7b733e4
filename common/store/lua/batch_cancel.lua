-- Cancel (common/batch_store.py): only a batch that has not ended.
local batch = KEYS[1]           -- the batch's hash
local now = ARGV[1]
local st = redis.call('HGET', batch, 'status')
if st == 'validating' or st == 'in_progress' then
  redis.call('HSET', batch, 'status', 'cancelling', 'cancelling_at', now)
end
return 1
