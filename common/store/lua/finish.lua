-- Finishes a record if its status is one of the given ones: writes the fields, appends the done
-- event, publishes it and sets the TTLs, all at once so no reader sees half of it. The running
-- text ends here: the fields carry the whole text (the record gets it once, not at each step),
-- or, given none, the running text moves into the record. Returns 1 when it finished it.
local record = KEYS[1]          -- llmq:seq:<id>
local events = KEYS[2]          -- its events stream
local chan = KEYS[3]            -- its pub/sub channel
local cancelled = KEYS[4]       -- llmq:cancelled
local metrics = KEYS[5]         -- the metrics hash
local owner_seqs = KEYS[6]      -- its owner's unfinished sequences
local unstarted = KEYS[7]       -- llmq:unstarted
local running_text = KEYS[8]    -- llmq:text:<id>
local stored = KEYS[9]          -- its owner's stored sequences, "<id> <bytes>" -> expiry
local stored_bytes = KEYS[10]   -- their sum (the owner's storage quota)
local statuses = ARGV[1]        -- the statuses it may end from, comma separated
local fields_json = ARGV[2]     -- the fields to write, a JSON object
local done_data = ARGV[3]       -- the done event's data
local pubsub_msg = ARGV[4]      -- the done pub/sub message
local maxlen = ARGV[5]
local ttl = ARGV[6]             -- the result TTL
local seq_id = ARGV[7]
-- The running set of the worker the record names (only the script reads which): prefix ..
-- worker .. suffix, named by common/keys.py.
local running_pre = ARGV[8]
local attempt = ARGV[9]         -- '' or the attempt it must still be running
local running_post = ARGV[10]
local counter = ARGV[11]        -- the metrics counter to count it in, '' when none
-- The logprobs fields its token events carry whole, comma separated: while the stream holds
-- every event (never trimmed to maxlen), the record keeps only a mark (ARGV[13]) for them.
local in_events = ARGV[12]
local in_events_mark = ARGV[13]
local size = tonumber(ARGV[14]) -- what its record and events keep, about, in bytes
local expires_at = ARGV[15]     -- when they expire (now + the result TTL)

local st = redis.call('HGET', record, 'status')
if not st then return 0 end
if not string.find(',' .. statuses .. ',', ',' .. st .. ',', 1, true) then return 0 end
if attempt ~= '' and redis.call('HGET', record, 'attempts') ~= attempt then return 0 end
local fields = cjson.decode(fields_json)
if in_events ~= '' and redis.call('XLEN', events) + 1 < tonumber(maxlen) then
  for name in string.gmatch(in_events, '[^,]+') do fields[name] = in_events_mark end
end
for k, v in pairs(fields) do redis.call('HSET', record, k, v) end
if fields['text'] == nil then
  local running = redis.call('GET', running_text)
  if running then redis.call('HSET', record, 'text', running) end
end
redis.call('DEL', running_text)
redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', 'event', 'done', 'data', done_data)
redis.call('PUBLISH', chan, pubsub_msg)
redis.call('EXPIRE', record, ttl)
redis.call('EXPIRE', events, ttl)
redis.call('SREM', cancelled, seq_id)
redis.call('ZREM', unstarted, seq_id)
local w = redis.call('HGET', record, 'worker')
if w and w ~= '' then redis.call('SREM', running_pre .. w .. running_post, seq_id) end
local owner = redis.call('HGET', record, 'owner')
if owner and owner ~= '' then redis.call('ZREM', owner_seqs, seq_id) end
if counter ~= '' then redis.call('HINCRBY', metrics, counter, 1) end
if size > 0 then
  redis.call('HSET', record, 'stored_bytes', size)
  redis.call('ZADD', stored, expires_at, seq_id .. ' ' .. size)
  redis.call('INCRBY', stored_bytes, size)
  redis.call('EXPIRE', stored, ttl)
  redis.call('EXPIRE', stored_bytes, ttl)
end
-- Settle the tokens-per-minute charge: the reservation made at submit becomes the real prompt
-- plus completion count, in the window it was charged to (if that window is still open).
local rk = redis.call('HGET', record, 'rate_key')
if rk and rk ~= '' and redis.call('EXISTS', rk) == 1 then
  local used = tonumber(redis.call('HGET', record, 'prompt_tokens') or '0')
             + tonumber(redis.call('HGET', record, 'completion_tokens') or '0')
  local reserved = tonumber(redis.call('HGET', record, 'reserved_tokens') or '0')
  redis.call('HINCRBY', rk, 'tokens', used - reserved)
end
return 1
