-- Admits n sequences to the queue, or says which cap refuses them, in one step: the queue's
-- depth (the broker's priority lists, plus what other submissions admitted and have not sent
-- yet) against LLMQ_MAX_QUEUED, and with keys the key's unfinished sequences against its share.
-- Checked and then written in two round trips, concurrent submissions would all pass the check
-- before any wrote. Each admitted id also enters the unstarted index
-- (common/reconcile_store.py), here rather than in a round trip of its own.
-- And the owner's storage quota: what its ended sequences keep in Redis (their entries
-- pruned here as their records expire) must be under it.
-- Returns {'ok', the owner's count before} or {the cap that refused: 'queue', 'key' or
-- 'storage', its count (the owner's stored bytes for 'storage')}.
local admitting = KEYS[1]        -- llmq:admitting
local owner_seqs = KEYS[2]       -- the owner's unfinished sequences
local unstarted = KEYS[3]        -- llmq:unstarted
local stored = KEYS[4]           -- the owner's ended sequences' "<id> <bytes>" -> expiry
local stored_bytes = KEYS[5]     -- their sum
local FIRST_QUEUE_LIST = 6       -- KEYS[6..]: the queue's lists, one per priority step
local now = ARGV[1]
local admitting_stale = ARGV[2]  -- admissions at or before this no longer count
local owner_stale = ARGV[3]      -- an owner's sequences at or before this no longer count
local max_queued = tonumber(ARGV[4])
local cap = tonumber(ARGV[5])    -- the owner's share; 0: none
local pending_ttl = ARGV[6]
local floor = tonumber(ARGV[7])  -- what the owner may always have unfinished, a full queue or not
local quota = tonumber(ARGV[8])  -- the owner's stored bytes it must be under; 0: none
local FIRST_ID = 9               -- ARGV[9..]: the ids to admit
local PRUNE = 1000               -- expired entries pruned at most per call (the rest next time)

if quota > 0 then
  local gone = redis.call('ZRANGEBYSCORE', stored, '-inf', now, 'LIMIT', 0, PRUNE)
  if #gone > 0 then
    local freed = 0
    for _, m in ipairs(gone) do freed = freed + tonumber(string.match(m, ' (%d+)$')) end
    redis.call('ZREM', stored, unpack(gone))
    redis.call('DECRBY', stored_bytes, freed)
  end
  local used = tonumber(redis.call('GET', stored_bytes) or '0')
  if used >= quota then return {'storage', used} end
end

redis.call('ZREMRANGEBYSCORE', admitting, '-inf', admitting_stale)
local n = #ARGV - FIRST_ID + 1
local depth = redis.call('ZCARD', admitting)
for i = FIRST_QUEUE_LIST, #KEYS do depth = depth + redis.call('LLEN', KEYS[i]) end
local mine = 0
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', owner_seqs, '-inf', owner_stale)
  mine = redis.call('ZCARD', owner_seqs)
end
-- Within its floor a key gets in past a full queue: other keys' backlog cannot lock it out.
if depth + n > max_queued and (cap == 0 or mine + n > floor) then return {'queue', depth} end
if cap > 0 and mine + n > cap then return {'key', mine} end
for i = FIRST_ID, #ARGV do
  redis.call('ZADD', admitting, now, ARGV[i])
  redis.call('ZADD', unstarted, now, ARGV[i])
  if cap > 0 then redis.call('ZADD', owner_seqs, now, ARGV[i]) end
end
redis.call('EXPIRE', admitting, 600)
if cap > 0 then redis.call('EXPIRE', owner_seqs, pending_ttl) end
return {'ok', mine}
