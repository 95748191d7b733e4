-- An event was queued: mark it (common/webhook_store.py). The registration goes once nothing
-- more can be due: every event sent, or never due by the time `completed` was sent (a job
-- cancelled before it started). Returns 1 when the registration went.
local watch = KEYS[1]           -- llmq:webhooks:watch
local registration = KEYS[2]
local id = ARGV[1]
local event = ARGV[2]
redis.call('HSET', registration, event, 'sent')
local completed_sent = redis.call('HGET', registration, 'completed') == 'sent'
for ev in string.gmatch(redis.call('HGET', registration, 'events') or '', '[^,]+') do
  local st = redis.call('HGET', registration, ev) or ''
  if st ~= 'sent' and not (st == '' and completed_sent) then return 0 end
end
redis.call('SREM', watch, id)
redis.call('DEL', registration)
return 1
