-- A line's answer, once (common/batch_store.py): the first of output or error wins, and only
-- it adds its tokens to the batch's usage. Returns 1 when this answer was taken, 0 when the
-- line had one.
local out = KEYS[1]             -- the batch's output lines
local err = KEYS[2]             -- the batch's error lines
local inflight = KEYS[3]        -- the line indexes in flight
local target = KEYS[4]          -- out or err: where this answer goes
local batch = KEYS[5]           -- the batch's hash (its usage fields)
local index = ARGV[1]
local line = ARGV[2]
local FIRST_USAGE = 3           -- ARGV[3..]: per usage field (USAGE_FIELDS), its name and tokens
redis.call('SREM', inflight, index)
if redis.call('HEXISTS', out, index) == 1 or redis.call('HEXISTS', err, index) == 1 then
  return 0
end
redis.call('HSET', target, index, line)
for i = FIRST_USAGE, #ARGV, 2 do
  if tonumber(ARGV[i + 1]) ~= 0 then redis.call('HINCRBY', batch, ARGV[i], ARGV[i + 1]) end
end
return 1
