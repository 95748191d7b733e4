"""The reconciler's reads and writes: which accepted sequences (and webhook events) lost their
Celery message, and which of kombu's unacknowledged messages belong to sequences that have
ended.

The job record is the source of truth, not the broker. kombu's Redis transport takes a message
in two round trips (`BRPOP`, then `HSET unacked`); a consumer killed in between loses it, and
no running or held set ever names it (celery/celery#7950, celery/kombu#305). So every accepted
sequence sits in `llmq:unstarted` (written by the admission script, left by the start and
finish scripts) and live workers look there for what is still `queued` with no message
anywhere (see docs/reliability.md, "A message lost between the broker and the worker").

Webhook events have an index of their own, `llmq:webhooks:pending` (common/webhook_store.py),
read here the same way.

Keys (named in common/keys.py): llmq:unstarted, llmq:webhooks:pending, the records and events,
the workers' held and running sets, and kombu's own: the queue's priority lists, `unacked` and
`unacked_index`.
"""
from __future__ import annotations

import time

import redis

from .keys import Keys
from .protocol import SequenceStatus

# The task id in a kombu message (in its `headers`, JSON as kombu writes it; `root_id` and
# `parent_id` do not match): the generate task's id is its sequence's.
_ID_PATTERN = '"id":%s*"([^"]+)"'
_SEQ_ID_PATTERN = '"id":%s*"(seq%-%x+)"'   # a sequence's message (other tasks' ids differ)

# Finds the sequences (or webhook events) whose message is lost, and claims them for the
# caller, in one step (so that workers running it at once never claim one twice, and no
# message moves in between). A candidate was last sent or seen before the cutoff and is still
# waiting: a sequence `queued`, an event neither delivered nor settled. A sequence is accounted
# for, and seen again (its time set to now), when a registered worker holds it (held or
# running set: a live one has its message, a dead one is its reaper's); either kind is when
# its message waits in a queue list, or in kombu's `unacked` delivered after ARGV[5] (for a
# sequence the cutoff: a live consumer adds it to its held set a few milliseconds after, so an
# older delivery held by nobody was taken by a consumer that died first; for an event, any: a
# retry waits there for its countdown). What is left is claimed (time now) and returned with
# its priority, for the caller to send again. Candidates no longer waiting (started, ended,
# delivered, expired) leave the index.
# KEYS: the index, workers, unacked, unacked_index, the queue's lists. ARGV: cutoff, now, the
# most candidates, pattern, unacked-since, kind ('seq' or 'event'), then the record (or
# event), held and running keys as prefix and suffix pairs.
_RECONCILE = """
local cands = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
if #cands == 0 then return {} end
local function key(i, id) return ARGV[i] .. id .. ARGV[i + 1] end
local seqs = ARGV[6] == 'seq'
local function waiting(id)
  if seqs then return redis.call('HGET', key(7, id), 'status') == 'queued' end
  local ev = redis.call('HMGET', key(7, id), 'url', 'delivered_at', 'settled')
  return ev[1] and not ev[2] and not ev[3]
end
local workers = seqs and redis.call('ZRANGE', KEYS[2], 0, -1) or {}
local lost, left = {}, 0
for _, id in ipairs(cands) do
  if not waiting(id) then
    redis.call('ZREM', KEYS[1], id)
  else
    local held = false
    for _, w in ipairs(workers) do
      if redis.call('SISMEMBER', key(9, w), id) == 1
         or redis.call('SISMEMBER', key(11, w), id) == 1 then
        held = true
        break
      end
    end
    if held then
      redis.call('ZADD', KEYS[1], ARGV[2], id)
    else
      lost[id] = true
      left = left + 1
    end
  end
end
local function seen(message)
  local id = message and string.match(message, ARGV[4])
  if id and lost[id] then
    lost[id] = nil
    left = left - 1
    redis.call('ZADD', KEYS[1], ARGV[2], id)
  end
end
for i = 5, #KEYS do
  if left == 0 then break end
  for _, message in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do seen(message) end
end
if left > 0 then
  for _, tag in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], ARGV[5], '+inf')) do
    seen(redis.call('HGET', KEYS[3], tag))
  end
end
local out = {}
for _, id in ipairs(cands) do
  if lost[id] then
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    table.insert(out, id)
    table.insert(out, seqs and redis.call('HGET', key(7, id), 'priority') or '')
  end
end
return out
"""

# Drops from kombu's `unacked` the sequences' messages delivered before ARGV[1] whose sequence
# has ended (or whose record is gone): a live worker acknowledges its message as the sequence
# ends, so these are a dead consumer's, which kombu would redeliver after its visibility
# timeout only for the start guard to skip. Other tasks' messages are left to kombu.
# KEYS: unacked, unacked_index. ARGV: delivered-before, the most to look at, pattern, record
# key prefix and suffix, the finished statuses (comma separated).
_SWEEP_UNACKED = """
local n = 0
local tags = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, tag in ipairs(tags) do
  local message = redis.call('HGET', KEYS[1], tag)
  local id = message and string.match(message, ARGV[3])
  if id then
    local st = redis.call('HGET', ARGV[4] .. id .. ARGV[5], 'status')
    if not st or string.find(',' .. ARGV[6] .. ',', ',' .. st .. ',', 1, true) then
      redis.call('HDEL', KEYS[1], tag)
      redis.call('ZREM', KEYS[2], tag)
      n = n + 1
    end
  end
end
return n
"""

_FINISHED = ",".join(s.value for s in SequenceStatus if s.is_finished)


class ReconcileStore:
    """The unstarted index, the broker's lists and kombu's unacked hash, read together."""

    def __init__(self, client: redis.Redis, queue_lists: list[str]):
        self.r = client
        self.queue_lists = queue_lists
        self._reconcile = client.register_script(_RECONCILE)
        self._sweep = client.register_script(_SWEEP_UNACKED)

    def claim_lost(self, lost_after_s: float, limit: int = 256) -> list[tuple[str, int | None]]:
        """Sequences `queued` for lost_after_s or more since their message was last sent or
        seen, held by no registered worker, whose message is in no queue list and was not
        delivered since: (id, priority) each, claimed (another worker's call does not return
        them again for lost_after_s). The caller sends each again."""
        flat = self._claim(Keys.unstarted, "seq", Keys.record, lost_after_s, None, limit)
        return [(seq_id, int(p) if p not in (None, "") else None)
                for seq_id, p in zip(flat[::2], flat[1::2])]

    def claim_lost_events(self, lost_after_s: float, limit: int = 256) -> list[str]:
        """Webhook events queued for delivery lost_after_s or more ago (or last seen then),
        neither delivered nor settled, whose message is in no queue list and not in
        `unacked`: claimed, as claim_lost's. The caller sends each delivery again."""
        return self._claim(Keys.webhooks_pending, "event", Keys.webhook_event, lost_after_s,
                           "-inf", limit)[::2]

    def _claim(self, index: str, kind: str, subject, lost_after_s: float,
               unacked_since: str | None, limit: int) -> list[str]:
        now = time.time()
        cutoff = now - lost_after_s
        return self._reconcile(
            keys=[index, Keys.workers, Keys.kombu_unacked, Keys.kombu_unacked_index,
                  *self.queue_lists],
            args=[cutoff, now, limit, _ID_PATTERN, unacked_since or cutoff, kind,
                  *Keys.around(subject), *Keys.around(Keys.held), *Keys.around(Keys.running)])

    def sweep_unacked(self, delivered_before_s: float, limit: int = 1000) -> int:
        """Drops the unacknowledged messages delivered delivered_before_s ago or more whose
        sequence has ended; returns how many."""
        return int(self._sweep(
            keys=[Keys.kombu_unacked, Keys.kombu_unacked_index],
            args=[time.time() - delivered_before_s, limit, _SEQ_ID_PATTERN,
                  *Keys.around(Keys.record), _FINISHED]))

    def unstarted(self) -> dict[str, float]:
        """The index as it is (id -> when last sent or seen), for checks and tests."""
        return dict(self.r.zrange(Keys.unstarted, 0, -1, withscores=True))
