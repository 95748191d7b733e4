-- One engine step's deltas, fenced: each is written only while its record is still running the
-- attempt that produced it. A worker that was taken for dead (its engine hung past
-- LLMQ_WORKER_STALE) and moves again must not write into a record that was handed back or
-- restarted meanwhile. And idempotent: a delta whose token count the record already has was
-- written before (a retry after the reply was lost with the connection) and is skipped.
-- Only the new text goes out, APPENDed to the running text (the record gets the whole at the
-- end): what a step writes to Redis and its append-only file does not grow with the length.
-- The running text's TTL is set when an APPEND creates it (its length is then the piece's).
-- KEYS: 4 per delta (see below). ARGV: maxlen, ttl, then 5 per delta (see below).
-- Returns the 1-based positions of the deltas that were refused.
local maxlen = ARGV[1]
local ttl = ARGV[2]
local KEYS_PER_DELTA, ARGS_PER_DELTA, FIRST_ARG = 4, 5, 3

local refused = {}
local n = (#ARGV - FIRST_ARG + 1) / ARGS_PER_DELTA
for pos = 1, n do
  local k = KEYS_PER_DELTA * (pos - 1)
  local record = KEYS[k + 1]         -- llmq:seq:<id>
  local events = KEYS[k + 2]         -- its events stream
  local chan = KEYS[k + 3]           -- its pub/sub channel
  local running_text = KEYS[k + 4]   -- llmq:text:<id>
  local a = FIRST_ARG + ARGS_PER_DELTA * (pos - 1)
  local attempt = ARGV[a]            -- '' (not fenced) or the attempt that produced it
  local token_data = ARGV[a + 1]     -- the token event's data, '' for none
  local pubsub_msg = ARGV[a + 2]
  local piece = ARGV[a + 3]          -- the new text
  local completion_tokens = ARGV[a + 4]

  local cur = redis.call('HMGET', record, 'status', 'attempts', 'completion_tokens')
  if attempt ~= '' and (cur[1] ~= 'running' or cur[2] ~= attempt) then
    table.insert(refused, pos)
  elseif attempt ~= '' and tonumber(cur[3] or '0') >= tonumber(completion_tokens) then
    -- already written
  else
    if token_data ~= '' then
      redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', 'event', 'token',
                 'data', token_data)
      redis.call('EXPIRE', events, ttl)
      redis.call('PUBLISH', chan, pubsub_msg)
    end
    if piece ~= '' and redis.call('APPEND', running_text, piece) == #piece then
      redis.call('EXPIRE', running_text, ttl)
    end
    redis.call('HSET', record, 'completion_tokens', completion_tokens)
  end
end
return refused
