-- Charges a key's minute window with n sequences and t tokens, unless that would pass its
-- limit: nothing is charged for a refused request. Returns the limit hit, or 'ok'.
local window = KEYS[1]          -- llmq:rate:<owner>:<minute>
local seqs_n = ARGV[1]          -- sequences to charge
local tokens_n = ARGV[2]        -- tokens to charge
local rpm = tonumber(ARGV[3])   -- 0: no limit
local tpm = tonumber(ARGV[4])   -- 0: no limit

local cur = redis.call('HMGET', window, 'seqs', 'tokens')
local seqs, tokens = tonumber(cur[1] or '0'), tonumber(cur[2] or '0')
if rpm > 0 and seqs + tonumber(seqs_n) > rpm then return 'rpm' end
if tpm > 0 and tokens + tonumber(tokens_n) > tpm then return 'tpm' end
redis.call('HINCRBY', window, 'seqs', seqs_n)
redis.call('HINCRBY', window, 'tokens', tokens_n)
redis.call('EXPIRE', window, 120)
return 'ok'
