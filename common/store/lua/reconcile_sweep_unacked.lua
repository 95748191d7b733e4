-- Drops from kombu's `unacked` the sequences' messages delivered before delivered_before whose
-- sequence has ended (or whose record is gone) (common/reconcile_store.py): a live worker
-- acknowledges its message as the sequence ends, so these are a dead consumer's, which kombu
-- would redeliver after its visibility timeout only for the start guard to skip. Other tasks'
-- messages are left to kombu. Returns how many it dropped.
local unacked = KEYS[1]         -- kombu's unacked hash
local unacked_index = KEYS[2]   -- kombu's unacked_index zset
local delivered_before = ARGV[1]
local limit = ARGV[2]           -- the most messages to look at
local pattern = ARGV[3]         -- a sequence's id in its message
local record_prefix, record_suffix = ARGV[4], ARGV[5]
local finished = ARGV[6]        -- the finished statuses, comma separated
local n = 0
local tags = redis.call('ZRANGEBYSCORE', unacked_index, '-inf', delivered_before,
                        'LIMIT', 0, limit)
for _, tag in ipairs(tags) do
  local message = redis.call('HGET', unacked, tag)
  local id = message and string.match(message, pattern)
  if id then
    local st = redis.call('HGET', record_prefix .. id .. record_suffix, 'status')
    if not st or string.find(',' .. finished .. ',', ',' .. st .. ',', 1, true) then
      redis.call('HDEL', unacked, tag)
      redis.call('ZREM', unacked_index, tag)
      n = n + 1
    end
  end
end
return n
