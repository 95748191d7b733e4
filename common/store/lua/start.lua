-- Moves a record to "running" unless it already finished, or another live worker runs it (a
-- late redelivery). Returns the status it had and the attempt number (0 = do not run). A
-- sequence found "running" under this worker's own name is a second message for the attempt its
-- engine runs now (a stuck peer's hand-back and the reaper's re-send of one message can both
-- reach this worker): skipped, not restarted. Any other was lost by its previous life, and its
-- running text goes with it.
local record = KEYS[1]         -- llmq:seq:<id>
local workers = KEYS[2]        -- llmq:workers (name -> last heartbeat)
local running_set = KEYS[3]    -- llmq:running:<this worker>
local unstarted = KEYS[4]      -- llmq:unstarted
local running_text = KEYS[5]   -- llmq:text:<id>
local now = ARGV[1]
local worker = ARGV[2]         -- this worker's name
local stale_before = ARGV[3]   -- a heartbeat at or before this is a dead worker's
local seq_id = ARGV[4]
local running_here = ARGV[5]   -- the attempt this worker's engine runs now, '' when none

local st = redis.call('HGET', record, 'status')
if not st then return {'missing', 0} end
if st ~= 'queued' and st ~= 'running' then return {st, 0} end
if st == 'running' then
  local w = redis.call('HGET', record, 'worker')
  if w == worker and running_here ~= ''
     and redis.call('HGET', record, 'attempts') == running_here then
    return {'running-here', 0}
  end
  if w and w ~= '' and w ~= worker then
    local beat = redis.call('ZSCORE', workers, w)
    if beat and tonumber(beat) > tonumber(stale_before) then return {'running-elsewhere', 0} end
  end
end
local n = redis.call('HINCRBY', record, 'attempts', 1)
redis.call('HSET', record, 'status', 'running', 'started_at', now, 'worker', worker,
           'text', '', 'completion_tokens', 0)
redis.call('DEL', running_text)
redis.call('SADD', running_set, seq_id)
redis.call('ZREM', unstarted, seq_id)
return {st, n}
