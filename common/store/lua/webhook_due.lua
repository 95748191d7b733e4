-- Finds due job events and marks them dispatching (common/webhook_store.py). A registration
-- with nothing left that can become due goes: a job that ended (for good: an ended record
-- never runs again) without starting never makes `started` due, and a `started`-only
-- registration would otherwise stay in the watch set, scanned here every 0.5 s by every
-- worker, until it expired. Returns {id, event, id, event, ...}.
local watch = KEYS[1]           -- llmq:webhooks:watch
local registration_prefix = ARGV[1]
local record_prefix = ARGV[2]
local now = ARGV[3]
local redispatch_before = tonumber(ARGV[4])   -- a "d:" mark older than this is retried
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', watch)) do
  local hook = registration_prefix .. id
  local events = redis.call('HGET', hook, 'events')
  local rec = redis.call('HMGET', record_prefix .. id, 'status', 'started_at')
  local open = false
  if events and rec[1] then
    local ended = rec[1] == 'succeeded' or rec[1] == 'failed' or rec[1] == 'cancelled'
    local started = rec[2] and rec[2] ~= ''
    for ev in string.gmatch(events, '[^,]+') do
      local st = redis.call('HGET', hook, ev) or ''
      local due = (ev == 'started' and started) or (ev == 'completed' and ended)
      local stale = string.sub(st, 1, 2) == 'd:'
                    and tonumber(string.sub(st, 3)) < redispatch_before
      if due and (st == '' or stale) then
        redis.call('HSET', hook, ev, 'd:' .. now)
        table.insert(out, id)
        table.insert(out, ev)
      end
      -- Still to send: due (or being dispatched), or not yet due while the job can get there.
      if st ~= 'sent' and (due or not ended) then open = true end
    end
  end
  if not open then
    redis.call('SREM', watch, id)
    redis.call('DEL', hook)
  end
end
return out
