-- Takes back the sequences a dead worker had (once: the ZREM decides who reclaims): each it was
-- running goes back to "queued" with a reset event; each whose message it had received but not
-- started is still "queued" (its message sits unacknowledged until kombu's visibility timeout),
-- and so is each it had itself taken back from another and not yet sent again (in its running
-- set). The caller queues them all again, once each; with a sender, they move to the sender's
-- running set and each leaves it only once its message is sent (resent.lua): a send that fails
-- part-way leaves the rest there, for the sender's next reap or whoever reaps the sender.
-- Returns the ids to queue again.
local running_set = KEYS[1]          -- llmq:running:<the worker>
local workers = KEYS[2]              -- llmq:workers
local held_set = KEYS[3]             -- llmq:held:<the worker>
local sender_running_set = KEYS[4]   -- llmq:running:<the sender>
local unstarted = KEYS[5]            -- llmq:unstarted
local worker = ARGV[1]
local cutoff = ARGV[2]               -- its heartbeat must be at or before this; 'force': its own
local reason = ARGV[3]               -- the reset reason, JSON-encoded
local maxlen = ARGV[4]               -- events stream MAXLEN
local held_too = ARGV[5]             -- '1': the held messages are taken back too
local events_ttl = ARGV[6]
local with_sender = ARGV[7]          -- '1': the taken ids wait in the sender's running set
-- A sequence's keys are named around its id by common/keys.py: prefix .. id .. suffix.
local record_pre, record_post = ARGV[8], ARGV[9]
local events_pre, events_post = ARGV[10], ARGV[11]
local channel_pre, channel_post = ARGV[12], ARGV[13]
local text_pre, text_post = ARGV[14], ARGV[15]
local now = ARGV[16]

if cutoff ~= 'force' then
  local beat = redis.call('ZSCORE', workers, worker)
  if not beat or tonumber(beat) > tonumber(cutoff) then return {} end
  if redis.call('ZREM', workers, worker) == 0 then return {} end
end
local out, seen = {}, {}
for _, id in ipairs(redis.call('SMEMBERS', running_set)) do
  local rec = record_pre .. id .. record_post
  local events = events_pre .. id .. events_post
  local st = redis.call('HGET', rec, 'status')
  if st == 'running' and redis.call('HGET', rec, 'worker') == worker then
    redis.call('HSET', rec, 'status', 'queued', 'text', '', 'completion_tokens', 0, 'worker', '')
    redis.call('DEL', text_pre .. id .. text_post)
    -- The same payload as the reset a start writes (common/store/events.reset_data): the run
    -- to come.
    local data = string.format('"attempt": %d, "reason": %s',
                               tonumber(redis.call('HGET', rec, 'attempts') or '0') + 1, reason)
    redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', 'event', 'reset',
               'data', '{' .. data .. '}')
    -- (the stream may start here: no token was published yet)
    redis.call('EXPIRE', events, events_ttl)
    redis.call('PUBLISH', channel_pre .. id .. channel_post, '{"reset": true, ' .. data .. '}')
    table.insert(out, id)
    seen[id] = true
  elseif st == 'queued' then
    table.insert(out, id)
    seen[id] = true
  end
end
if held_too == '1' then
  for _, id in ipairs(redis.call('SMEMBERS', held_set)) do
    if not seen[id] and redis.call('HGET', record_pre .. id .. record_post, 'status') == 'queued' then
      table.insert(out, id)
    end
  end
  redis.call('DEL', held_set)
end
redis.call('DEL', running_set)
if with_sender == '1' then
  for _, id in ipairs(out) do redis.call('SADD', sender_running_set, id) end
end
-- queued again, unstarted: their new messages are watched as the first ones were
for _, id in ipairs(out) do redis.call('ZADD', unstarted, now, id) end
return out
