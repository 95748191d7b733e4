-- A response's document, with its TTL cut to its record's; nil (and the document gone) once
-- the record is (common/response_store.py).
local document = KEYS[1]
local record = KEYS[2]
local doc = redis.call('GET', document)
if not doc then return false end
local left = redis.call('PTTL', record)
if left == -2 then
  redis.call('DEL', document)
  return false
end
if left > 0 and redis.call('PTTL', document) > left then redis.call('PEXPIRE', document, left) end
return doc
