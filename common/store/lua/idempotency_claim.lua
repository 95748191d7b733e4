-- Claims an Idempotency-Key for a request (common/idempotency_store.py). Returns ('new',
-- token) after claiming, ('pending', '') while another holds the claim, ('mismatch', '') for
-- another request's fingerprint, ('done', answer) once answered.
local entry = KEYS[1]           -- the key's hash
local fp = ARGV[1]              -- the request's fingerprint
local token = ARGV[2]           -- the claim's, random
local claim_ttl = ARGV[3]
local cur = redis.call('HMGET', entry, 'fp', 'answer')
if not cur[1] then
  redis.call('HSET', entry, 'fp', fp, 'token', token)
  redis.call('EXPIRE', entry, claim_ttl)
  return {'new', token}
end
if cur[1] ~= fp then return {'mismatch', ''} end
if not cur[2] then return {'pending', ''} end
return {'done', cur[2]}
