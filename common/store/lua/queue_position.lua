-- Where a sequence stands in the broker's queue (common/queue_store.py): {ahead, found}.
-- Its own list is read from both ends at once, a chunk at a time: a sequence just queued is
-- near the left (the back of the line), one about to start near the right, so a poll finds
-- either in its first chunks, and one in the middle of a long list after half of it.
-- KEYS[1..10]: the queue's lists, priority 0 first.
local id = ARGV[1]
local p = tonumber(ARGV[2])     -- its priority: the lists before its own are all ahead
local scan = tonumber(ARGV[3])  -- the most messages of its list to read
local ahead = 0
for i = 1, p do ahead = ahead + redis.call('LLEN', KEYS[i]) end
local list = KEYS[p + 1]
local len = redis.call('LLEN', list)
local half = math.ceil(math.min(len, scan) / 2)
local chunk = 32
for start = 0, half - 1, chunk do
  local size = math.min(chunk, half - start)
  local right = redis.call('LRANGE', list, -(start + size), -(start + 1))
  for j = #right, 1, -1 do
    if string.find(right[j], id, 1, true) then return {ahead + start + #right - j, 1} end
  end
  local left = redis.call('LRANGE', list, start, start + size - 1)
  for j = 1, #left do
    if string.find(left[j], id, 1, true) then return {ahead + len - start - j, 1} end
  end
end
return {ahead, 0}
