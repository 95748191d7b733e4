-- Deletes a response (common/response_store.py): its document always, its record and events
-- only once finished (a running sequence's engine would write a headless record back).
-- Returns 1 when the record went too.
local document = KEYS[1]
local record = KEYS[2]
local events = KEYS[3]
local finished = ARGV[1]        -- the finished statuses, comma separated
redis.call('DEL', document)
local st = redis.call('HGET', record, 'status')
if st and string.find(',' .. finished .. ',', ',' .. st .. ',', 1, true) then
  redis.call('DEL', record, events)
  return 1
end
return 0
