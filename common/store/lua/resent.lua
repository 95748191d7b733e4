-- A sequence taken back has its new message: it leaves the sender's running set, unless the
-- sender has started it since (its own consumer may take the new message first).
local record = KEYS[1]               -- llmq:seq:<id>
local sender_running_set = KEYS[2]   -- llmq:running:<the sender>
local sender = ARGV[1]
local seq_id = ARGV[2]

if redis.call('HGET', record, 'status') == 'running'
   and redis.call('HGET', record, 'worker') == sender then return 0 end
return redis.call('SREM', sender_running_set, seq_id)
