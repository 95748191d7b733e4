-- Finds the sequences (or webhook events) whose message is lost, and claims them for the
-- caller, in one step (common/reconcile_store.py), so that workers running it at once never
-- claim one twice, and no message moves in between. A candidate was last sent or seen before
-- the cutoff and is still waiting: a sequence `queued`, an event neither delivered nor
-- settled. A sequence is accounted for, and seen again (its time set to now), when a
-- registered worker holds it (held or running set: a live one has its message, a dead one is
-- its reaper's); either kind is when its message waits in a queue list, or in kombu's
-- `unacked` delivered after unacked_since (for a sequence the cutoff: a live consumer adds it
-- to its held set a few milliseconds after, so an older delivery held by nobody was taken by
-- a consumer that died first; for an event, any: a retry waits there for its countdown).
-- What is left is claimed (time now) and returned with its priority, for the caller to send
-- again. Candidates no longer waiting (started, ended, delivered, expired) leave the index.
-- Returns {id, priority, id, priority, ...} (priority '' for an event).
local index = KEYS[1]           -- llmq:unstarted or llmq:webhooks:pending
local workers_key = KEYS[2]     -- llmq:workers
local unacked = KEYS[3]         -- kombu's unacked hash
local unacked_index = KEYS[4]   -- kombu's unacked_index zset
local FIRST_QUEUE_LIST = 5      -- KEYS[5..]: the queue's lists
local cutoff, now = ARGV[1], ARGV[2]
local limit = ARGV[3]           -- the most candidates
local pattern = ARGV[4]         -- the task id in a kombu message
local unacked_since = ARGV[5]
local kind = ARGV[6]            -- 'seq' or 'event'
local subject_prefix, subject_suffix = ARGV[7], ARGV[8]   -- the record (or event) key
local held_prefix, held_suffix = ARGV[9], ARGV[10]
local running_prefix, running_suffix = ARGV[11], ARGV[12]
local cands = redis.call('ZRANGEBYSCORE', index, '-inf', cutoff, 'LIMIT', 0, limit)
if #cands == 0 then return {} end
local function subject(id) return subject_prefix .. id .. subject_suffix end
local seqs = kind == 'seq'
local function waiting(id)
  if seqs then return redis.call('HGET', subject(id), 'status') == 'queued' end
  local ev = redis.call('HMGET', subject(id), 'url', 'delivered_at', 'settled')
  return ev[1] and not ev[2] and not ev[3]
end
local workers = seqs and redis.call('ZRANGE', workers_key, 0, -1) or {}
local lost, left = {}, 0
for _, id in ipairs(cands) do
  if not waiting(id) then
    redis.call('ZREM', index, id)
  else
    local held = false
    for _, w in ipairs(workers) do
      if redis.call('SISMEMBER', held_prefix .. w .. held_suffix, id) == 1
         or redis.call('SISMEMBER', running_prefix .. w .. running_suffix, id) == 1 then
        held = true
        break
      end
    end
    if held then
      redis.call('ZADD', index, now, id)
    else
      lost[id] = true
      left = left + 1
    end
  end
end
local function seen(message)
  local id = message and string.match(message, pattern)
  if id and lost[id] then
    lost[id] = nil
    left = left - 1
    redis.call('ZADD', index, now, id)
  end
end
for i = FIRST_QUEUE_LIST, #KEYS do
  if left == 0 then break end
  for _, message in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do seen(message) end
end
if left > 0 then
  for _, tag in ipairs(redis.call('ZRANGEBYSCORE', unacked_index, unacked_since, '+inf')) do
    seen(redis.call('HGET', unacked, tag))
  end
end
local out = {}
for _, id in ipairs(cands) do
  if lost[id] then
    redis.call('ZADD', index, now, id)
    table.insert(out, id)
    table.insert(out, seqs and redis.call('HGET', subject(id), 'priority') or '')
  end
end
return out
