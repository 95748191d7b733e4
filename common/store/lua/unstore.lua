-- Takes an ended sequence off its owner's storage count (see finish.lua) when its record is
-- deleted before it expires: once, only while its entry is still there.
local stored = KEYS[1]          -- the owner's stored sequences, "<id> <bytes>" -> expiry
local stored_bytes = KEYS[2]    -- their sum
local seq_id = ARGV[1]
local size = ARGV[2]            -- its bytes, as finish.lua counted them

if redis.call('ZREM', stored, seq_id .. ' ' .. size) == 1 then
  redis.call('DECRBY', stored_bytes, size)
  return 1
end
return 0
