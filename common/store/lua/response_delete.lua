-- Deletes a response (common/response_store.py): its document always, its record and events
-- only once finished (a running sequence's engine would write a headless record back).
-- Returns false when the record stays, else the bytes its end counted toward its owner's
-- storage quota ('' for none: see finish.lua), for Admission.unstore to give back.
local document = KEYS[1]
local record = KEYS[2]
local events = KEYS[3]
local finished = ARGV[1]        -- the finished statuses, comma separated
redis.call('DEL', document)
local st = redis.call('HGET', record, 'status')
if st and string.find(',' .. finished .. ',', ',' .. st .. ',', 1, true) then
  local size = redis.call('HGET', record, 'stored_bytes') or ''
  redis.call('DEL', record, events)
  return size
end
return false
