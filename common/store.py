"""The Redis key schema and every read and write of a sequence's record, stream and channel.

Keys (all names are built in common/keys.py, and read and written only by the stores):
  llmq:seq:<id>            hash    the sequence record (status, prompt, params, text, usage, times)
  llmq:seq:<id>:events     stream  token / reset / done events; entry ids are the SSE ids
  llmq:tokens:<id>         pub/sub the same events, at-most-once, for direct subscribers
  llmq:text:<id>           string  a running attempt's text so far, appended to at each step
  llmq:cancelled           set     ids whose cancellation was asked for; the engine polls it
  llmq:workers             zset    worker name -> last engine heartbeat (unix seconds)
  llmq:worker:<name>       hash    what that worker reports (model, device, counters)
  llmq:running:<name>      set     ids a worker started and has not finished, and ids it took
                                   back (from a dead worker) and has not yet sent again
  llmq:rate:<owner>:<min>  hash    a key's sequences and tokens in one minute (rate limits)
  llmq:owner:<owner>:seqs  zset    a key's unfinished sequences -> created (its queue share)
  llmq:owner:<owner>:streams zset  a key's open SSE streams -> lease end (its stream cap)
  llmq:owner-secret        string the HMAC secret naming owners, when no setting gives one
  llmq:held:<name>         set     ids whose message that worker received, task not yet ended
  llmq:admitting           zset    ids admitted to the queue, message not sent yet -> when
  llmq:unstarted           zset    ids accepted and not yet started or ended -> when their
                                   message was last sent or seen (common/reconcile_store.py)
"""
from __future__ import annotations

import functools
import json
import math
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Iterable

import redis

from .keys import Keys
from .metrics import METRICS_KEY, SUCCESS_COUNTER, read_snapshot, record_finished
from .protocol import (
    EVENT_DONE,
    EVENT_RESET,
    EVENT_TOKEN,
    FinishReason,
    SamplingParams,
    SequenceRequest,
    SequenceStatus,
    decode_event,
    encode_event,
    encode_pubsub,
)
from .tool_calls import parse_calls

# The names, all built in common/keys.py (under the same names as before, for the importers).
CANCELLED_KEY = Keys.cancelled
WORKERS_KEY = Keys.workers
OWNER_SECRET_KEY = Keys.owner_secret
ADMITTING_KEY = Keys.admitting
UNSTARTED_KEY = Keys.unstarted
record_key, events_key, channel = Keys.record, Keys.events, Keys.channel
text_key = Keys.running_text
worker_key, running_key, held_key = Keys.worker, Keys.running, Keys.held
owner_seqs_key, owner_streams_key, rate_key = Keys.owner_seqs, Keys.owner_streams, Keys.rate


def _slots_key(owner: str, waiting: bool) -> str:
    return Keys.owner_waiting(owner) if waiting else owner_streams_key(owner)


PRIORITY_SEP = "\x06\x16"   # kombu's Redis priority-queue separator

# Ids are checked by shape before they become part of a key name: "seq-<id>:events" names a
# stream, not a record, and a newline or a 23-digit stream id makes Redis itself fail.
_SEQ_ID = re.compile(r"seq-[0-9a-f]{32}")
_STREAM_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")   # ASCII digits only
_U64 = 2**64 - 1


def queue_lists(queue: str) -> list[str]:
    """The broker's lists of one queue: Celery's Redis transport keeps one per priority step
    (name, name + sep + step)."""
    return [queue] + [f"{queue}{PRIORITY_SEP}{p}" for p in range(1, 10)]


def is_seq_id(seq_id: str) -> bool:
    return bool(_SEQ_ID.fullmatch(seq_id))


def valid_stream_id(entry_id: str) -> bool:
    """A Redis stream entry id (<ms>-<seq>, both 64-bit unsigned), the SSE resume position."""
    m = _STREAM_ID.fullmatch(entry_id)
    return bool(m) and int(m[1]) <= _U64 and int(m[2]) <= _U64


def reserved_tokens(req: SequenceRequest) -> int:
    """What a sequence is charged against its key's tokens per minute when it is accepted:
    max_tokens plus its prompt as OpenAI estimates it (a token per 4 bytes; the API does not
    tokenize). The end settles the charge with the real prompt and completion counts."""
    text = req.prompt or "".join(m.get("content", "") for m in req.messages or [])
    return req.params.max_tokens + math.ceil(len(text.encode("utf-8")) / 4)


# Moves a record to "running" unless it already finished, or another live worker runs it (a
# late redelivery). Returns the status it had and the attempt number (0 = do not run). A
# sequence found "running" under this worker's own name is a second message for the attempt its
# engine runs now (ARGV[5]; a stuck peer's hand-back and the reaper's re-send of one message can
# both reach this worker): skipped, not restarted. Any other was lost by its previous life,
# and its running text (KEYS[5]) goes with it.
_START = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {'missing', 0} end
if st ~= 'queued' and st ~= 'running' then return {st, 0} end
if st == 'running' then
  local w = redis.call('HGET', KEYS[1], 'worker')
  if w == ARGV[2] and ARGV[5] ~= '' and redis.call('HGET', KEYS[1], 'attempts') == ARGV[5] then
    return {'running-here', 0}
  end
  if w and w ~= '' and w ~= ARGV[2] then
    local beat = redis.call('ZSCORE', KEYS[2], w)
    if beat and tonumber(beat) > tonumber(ARGV[3]) then return {'running-elsewhere', 0} end
  end
end
local n = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2],
           'text', '', 'completion_tokens', 0)
redis.call('DEL', KEYS[5])
redis.call('SADD', KEYS[3], ARGV[4])
redis.call('ZREM', KEYS[4], ARGV[4])
return {st, n}
"""

# Takes back the sequences a dead worker had (once: the ZREM decides who reclaims): each it was
# running goes back to "queued" with a reset event; each whose message it had received but not
# started is still "queued" (its message sits unacknowledged until kombu's visibility timeout),
# and so is each it had itself taken back from another and not yet sent again (in its running
# set). The caller queues them all again, once each; with a sender (ARGV[7]), they move to the
# sender's running set and each leaves it only once its message is sent (_RESENT): a send that
# fails part-way leaves the rest there, for the sender's next reap or whoever reaps the sender.
# KEYS: the worker's running set, workers, its held set, the sender's running set, unstarted.
# ARGV: worker, stale cutoff (or 'force'), reset reason, maxlen, held too ('1'), events ttl,
# sender ('1'), then record, events, channel and running text keys as prefix and suffix pairs
# (the ids are read here), now.
_RECLAIM = """
if ARGV[2] ~= 'force' then
  local beat = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if not beat or tonumber(beat) > tonumber(ARGV[2]) then return {} end
  if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return {} end
end
-- A sequence's keys, named around its id by common/keys.py (ARGV[i] .. id .. ARGV[i + 1]).
local function key(i, id) return ARGV[i] .. id .. ARGV[i + 1] end
local out, seen = {}, {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local rec = key(8, id)
  local st = redis.call('HGET', rec, 'status')
  if st == 'running' and redis.call('HGET', rec, 'worker') == ARGV[1] then
    redis.call('HSET', rec, 'status', 'queued', 'text', '', 'completion_tokens', 0, 'worker', '')
    redis.call('DEL', key(14, id))
    -- The same payload as the reset a start writes (SequenceStore.reset_data): the run to come.
    local data = string.format('"attempt": %d, "reason": %s',
                               tonumber(redis.call('HGET', rec, 'attempts') or '0') + 1, ARGV[3])
    redis.call('XADD', key(10, id), 'MAXLEN', '~', ARGV[4], '*', 'event', 'reset',
               'data', '{' .. data .. '}')
    -- (the stream may start here: no token was published yet)
    redis.call('EXPIRE', key(10, id), ARGV[6])
    redis.call('PUBLISH', key(12, id), '{"reset": true, ' .. data .. '}')
    table.insert(out, id)
    seen[id] = true
  elseif st == 'queued' then
    table.insert(out, id)
    seen[id] = true
  end
end
if ARGV[5] == '1' then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
    if not seen[id] and redis.call('HGET', key(8, id), 'status') == 'queued' then
      table.insert(out, id)
    end
  end
  redis.call('DEL', KEYS[3])
end
redis.call('DEL', KEYS[1])
if ARGV[7] == '1' then
  for _, id in ipairs(out) do redis.call('SADD', KEYS[4], id) end
end
-- queued again, unstarted: their new messages are watched as the first ones were
for _, id in ipairs(out) do redis.call('ZADD', KEYS[5], ARGV[16], id) end
return out
"""

# A sequence taken back has its new message: it leaves the sender's running set, unless the
# sender has started it since (its own consumer may take the new message first).
# KEYS: record, the sender's running set. ARGV: sender, id.
_RESENT = """
if redis.call('HGET', KEYS[1], 'status') == 'running'
   and redis.call('HGET', KEYS[1], 'worker') == ARGV[1] then return 0 end
return redis.call('SREM', KEYS[2], ARGV[2])
"""

# Finishes a record if its status is one of ARGV[1] (comma separated): writes the fields, appends
# the done event, publishes it and sets the TTLs, all at once so no reader sees half of it.
# The running text ends here: the fields carry the whole text (the record gets it once, not
# at each step), or, given none, the running text moves into the record.
# KEYS: record, events, channel, cancelled, metrics, its owner's sequences, unstarted, its
# running text. ARGV: statuses, fields, done event, pub/sub message, maxlen, ttl, id, the
# running set around the worker the record names (ARGV[8] .. worker .. ARGV[10]: only the
# script reads which),
# attempt, counter.
_FINISH = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 0 end
if not string.find(',' .. ARGV[1] .. ',', ',' .. st .. ',', 1, true) then return 0 end
if ARGV[9] ~= '' and redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[9] then return 0 end
local fields = cjson.decode(ARGV[2])
for k, v in pairs(fields) do redis.call('HSET', KEYS[1], k, v) end
if fields['text'] == nil then
  local running = redis.call('GET', KEYS[8])
  if running then redis.call('HSET', KEYS[1], 'text', running) end
end
redis.call('DEL', KEYS[8])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'event', 'done', 'data', ARGV[3])
redis.call('PUBLISH', KEYS[3], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('SREM', KEYS[4], ARGV[7])
redis.call('ZREM', KEYS[7], ARGV[7])
local w = redis.call('HGET', KEYS[1], 'worker')
if w and w ~= '' then redis.call('SREM', ARGV[8] .. w .. ARGV[10], ARGV[7]) end
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= '' then redis.call('ZREM', KEYS[6], ARGV[7]) end
if ARGV[11] ~= '' then redis.call('HINCRBY', KEYS[5], ARGV[11], 1) end
-- Settle the tokens-per-minute charge: the reservation made at submit becomes the real prompt
-- plus completion count, in the window it was charged to (if that window is still open).
local rk = redis.call('HGET', KEYS[1], 'rate_key')
if rk and rk ~= '' and redis.call('EXISTS', rk) == 1 then
  local used = tonumber(redis.call('HGET', KEYS[1], 'prompt_tokens') or '0')
             + tonumber(redis.call('HGET', KEYS[1], 'completion_tokens') or '0')
  local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved_tokens') or '0')
  redis.call('HINCRBY', rk, 'tokens', used - reserved)
end
return 1
"""

# Admits n sequences to the queue, or says which cap refuses them, in one step: the queue's
# depth (the broker's priority lists, plus what other submissions admitted and have not sent
# yet) against LLMQ_MAX_QUEUED, and with keys the key's unfinished sequences against its share.
# Checked and then written in two round trips, concurrent submissions all passed the check
# before any wrote (16 at once took a key to 13 of its 5).
# Each admitted id also enters the unstarted index (common/reconcile_store.py), here rather than
# in a round trip of its own.
# KEYS: admitting, the owner's sequences, unstarted, the queue's lists. ARGV: now,
# admitting-stale-before, owner-stale-before, max queued, owner cap (0: none), pending TTL,
# owner floor (what the owner may always have unfinished, a full queue or not), ids...
_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
local n = #ARGV - 7
local depth = redis.call('ZCARD', KEYS[1])
for i = 4, #KEYS do depth = depth + redis.call('LLEN', KEYS[i]) end
local mine = 0
local cap = tonumber(ARGV[5])
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[3])
  mine = redis.call('ZCARD', KEYS[2])
end
if depth + n > tonumber(ARGV[4]) and (cap == 0 or mine + n > tonumber(ARGV[7])) then
  return {'queue', depth}
end
if cap > 0 and mine + n > cap then return {'key', mine} end
for i = 8, #ARGV do
  redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i])
  redis.call('ZADD', KEYS[3], ARGV[1], ARGV[i])
  if cap > 0 then redis.call('ZADD', KEYS[2], ARGV[1], ARGV[i]) end
end
redis.call('EXPIRE', KEYS[1], 600)
if cap > 0 then redis.call('EXPIRE', KEYS[2], ARGV[6]) end
return {'ok', mine}
"""
ADMITTING_S = 60.0   # an admission whose messages were never sent (a dead API) counts this long

# Charges a key's minute window with n sequences and t tokens, unless that would pass its
# limit: nothing is charged for a refused request. Returns the limit hit, or 'ok'.
_RESERVE = """
local cur = redis.call('HMGET', KEYS[1], 'seqs', 'tokens')
local seqs, tokens = tonumber(cur[1] or '0'), tonumber(cur[2] or '0')
if tonumber(ARGV[3]) > 0 and seqs + tonumber(ARGV[1]) > tonumber(ARGV[3]) then return 'rpm' end
if tonumber(ARGV[4]) > 0 and tokens + tonumber(ARGV[2]) > tonumber(ARGV[4]) then return 'tpm' end
redis.call('HINCRBY', KEYS[1], 'seqs', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[2])
redis.call('EXPIRE', KEYS[1], 120)
return 'ok'
"""

# Opens one of a key's SSE streams if it has fewer than ARGV[3] open (expired leases, left by
# an API process that died, do not count). ARGV: now, lease end, cap, stream token.
_OPEN_STREAM = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if tonumber(ARGV[3]) > 0 and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) - tonumber(ARGV[1])) + 1)
return 1
"""


# One engine step's deltas, fenced: each is written only while its record is still running the
# attempt that produced it. A worker that was taken for dead (its engine hung past
# LLMQ_WORKER_STALE) and moves again must not write into a record that was handed back or
# restarted meanwhile. And idempotent: a delta whose token count the record already has was
# written before (a retry after the reply was lost with the connection) and is skipped.
# Only the new text goes out, APPENDed to the running text (the record gets the whole at the
# end): what a step writes to Redis and its append-only file does not grow with the length.
# The running text's TTL is set when an APPEND creates it (its length is then the piece's).
# KEYS: per delta (record, events, channel, running text). ARGV: maxlen, ttl, then per delta
# (attempt, token event data or '', pub/sub message, new text, completion tokens).
# Returns the 1-based positions of the deltas that were refused.
_PUBLISH = """
local refused = {}
local pos = 0
for i = 3, #ARGV, 5 do
  pos = pos + 1
  local rec, events = KEYS[4 * pos - 3], KEYS[4 * pos - 2]
  local cur = redis.call('HMGET', rec, 'status', 'attempts', 'completion_tokens')
  if ARGV[i] ~= '' and (cur[1] ~= 'running' or cur[2] ~= ARGV[i]) then
    table.insert(refused, pos)
  elseif ARGV[i] ~= '' and tonumber(cur[3] or '0') >= tonumber(ARGV[i + 4]) then
    -- already written
  else
    if ARGV[i + 1] ~= '' then
      redis.call('XADD', events, 'MAXLEN', '~', ARGV[1], '*', 'event', 'token',
                 'data', ARGV[i + 1])
      redis.call('EXPIRE', events, ARGV[2])
      redis.call('PUBLISH', KEYS[4 * pos - 1], ARGV[i + 2])
    end
    local piece = ARGV[i + 3]
    if piece ~= '' and redis.call('APPEND', KEYS[4 * pos], piece) == #piece then
      redis.call('EXPIRE', KEYS[4 * pos], ARGV[2])
    end
    redis.call('HSET', rec, 'completion_tokens', ARGV[i + 4])
  end
end
return refused
"""


@functools.lru_cache(maxsize=4096)
def _delta_keys(seq_id: str) -> tuple[str, str, str, str]:
    """A running sequence's record, events, channel and running text keys, named once, not
    once per token."""
    return record_key(seq_id), events_key(seq_id), channel(seq_id), text_key(seq_id)


def _now() -> float:
    return round(time.time(), 6)


def _num(v: Any, cast=float):
    return cast(v) if v not in (None, "") else None


def job_from_record(rec: dict[str, str]) -> dict[str, Any]:
    """The public job object, built from a record hash."""
    prompt_tokens = _num(rec.get("prompt_tokens"), int) or 0
    completion_tokens = _num(rec.get("completion_tokens"), int) or 0
    error = rec.get("error") or None
    error_code = rec.get("error_code") or None
    job = {
        "id": rec["id"],
        "object": "job",
        "status": rec.get("status"),
        "prompt": rec.get("prompt") or None,
        "messages": json.loads(rec["messages"]) if rec.get("messages") else None,
        "text": rec.get("text", ""),
        "finish_reason": rec.get("finish_reason") or None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": _num(rec.get("cached_tokens"), int) or 0},
        },
        "error": ({"message": error, **({"code": error_code} if error_code else {})}
                  if error else None),
        "model": rec.get("model") or None,
        "created_at": _num(rec.get("created_at")),
        "started_at": _num(rec.get("started_at")),
        "finished_at": _num(rec.get("finished_at")),
    }
    for name in ("prompt_token_ids", "logprobs", "prompt_logprobs"):   # only when there are some
        if rec.get(name):
            job[name] = json.loads(rec[name])
    if rec.get("call_format") and job["status"] == SequenceStatus.SUCCEEDED.value:
        _, calls = parse_calls(job["text"], json.loads(rec["call_format"]), job["id"])
        job["tool_calls"] = calls
    return job


@dataclass(slots=True)
class TokenDelta:
    """One sequence's progress in one engine step, as the worker publishes it."""

    seq_id: str
    text: str            # the new piece of text (may be empty), appended to the running text
    completion_tokens: int
    attempt: int | None = None   # the start that produced it; set, the write is fenced on it
    logprobs: list | None = None   # the token's logprobs entry, for sequences that asked
    prompt_logprobs: list | None = None   # with the first token: the prompt's (echo)


def reset_data(attempt: int, reason: str) -> dict[str, Any]:
    """A reset event's data, on the stream and pub/sub alike: the number of the run that comes
    next (2 for the first re-run) and why the text so far is dropped ("worker lost", "handed
    back"). _RECLAIM writes the same two fields in Lua."""
    return {"attempt": attempt, "reason": reason}


def _token_data(d: "TokenDelta") -> dict[str, Any]:
    """A token event's data: its text, and its logprobs entry when the sequence asked."""
    data: dict[str, Any] = {"text": d.text}
    if d.logprobs is not None:
        data["logprobs"] = d.logprobs
    if d.prompt_logprobs is not None:
        data["prompt_logprobs"] = d.prompt_logprobs
    return data


@dataclass(frozen=True)
class Finish:
    """One sequence's end, as SequenceStore.finish_many writes it."""
    seq_id: str
    reason: FinishReason
    text: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    error_code: str | None = None      # a bad input's kind ("context_length_exceeded", ...)
    cached_tokens: int | None = None   # prompt tokens the prefix cache gave
    logprobs: list | None = None          # per output token, for sequences that asked
    prompt_logprobs: list | None = None   # per prompt token (echo)
    only_if: tuple[SequenceStatus, ...] = (SequenceStatus.QUEUED, SequenceStatus.RUNNING)
    attempt: int | None = None   # set: only if the record still runs that start
    # The engine records a run sequence's full figures itself (EngineCore._record_metrics);
    # any other end (cancelled while queued, rejected at admission, not queued) is counted in
    # request_success_total by the finish script, in the same call that ends it: once.
    metrics_recorded: bool = False


class SequenceStore:
    """Reads and writes sequences in Redis; both the API and the worker go through it."""

    def __init__(self, client: redis.Redis, *, result_ttl_s: int = 86400,
                 pending_ttl_s: int = 7 * 86400, stream_maxlen: int = 20_000):
        self.r = client
        self.result_ttl_s = result_ttl_s
        self.pending_ttl_s = pending_ttl_s
        self.stream_maxlen = stream_maxlen
        self._start = client.register_script(_START)
        self._reclaim = client.register_script(_RECLAIM)
        self._resent = client.register_script(_RESENT)
        self._finish = client.register_script(_FINISH)
        self._publish = client.register_script(_PUBLISH)
        self._reserve = client.register_script(_RESERVE)
        self._admit = client.register_script(_ADMIT)
        self._open_stream = client.register_script(_OPEN_STREAM)
        self._conn_id: int | None = None   # a dedicated store's connection id, kept current

    def beside(self, store_cls: type, *args: Any):
        """Another store (files, batches, webhooks, an owner's index) on this one's connection:
        the stores are the only modules that touch Redis (tests/unit/test_keys.py)."""
        return store_cls(self.r, *args)

    @classmethod
    def from_settings(cls, settings, client: redis.Redis | None = None) -> "SequenceStore":
        # redis-py's default 5 s socket timeout would cut every XREAD BLOCK that waits longer
        # (an SSE stream whose next token is slow): allow the longest block plus a margin, and
        # still notice a dead server.
        client = client or redis.Redis.from_url(
            settings.redis_url, decode_responses=True, health_check_interval=30,
            socket_timeout=max(settings.sse_keepalive_s, settings.wait_timeout_s / 60) + 15,
            socket_connect_timeout=5, retry_on_timeout=False,
            # redis-py 8 caps a pool at 100 connections; every open SSE stream holds one while
            # it blocks in XREAD, and an API process serves 256 threads.
            max_connections=1024)
        return cls(client, result_ttl_s=settings.result_ttl_s,
                   pending_ttl_s=settings.pending_ttl_s, stream_maxlen=settings.stream_maxlen)

    # --- API side ----------------------------------------------------------------------------
    def create(self, requests: Iterable[SequenceRequest], model: str = "",
               charged_to: str = "") -> list[dict[str, Any]]:
        """Stores new queued records (one round trip for a whole batch) and returns their jobs.
        `charged_to`: the rate window their tokens were reserved in (settled at the end)."""
        now = str(_now())
        jobs, pipe = [], self.r.pipeline(transaction=True)
        for req in requests:
            if req.owner:
                pipe.zadd(owner_seqs_key(req.owner), {req.seq_id: float(now)})
                pipe.expire(owner_seqs_key(req.owner), self.pending_ttl_s)
            rec = {
                "id": req.seq_id,
                "status": SequenceStatus.QUEUED.value,
                "prompt": req.prompt if req.prompt is not None else "",
                "messages": json.dumps(req.messages) if req.messages is not None else "",
                "template_args": json.dumps(req.template_args) if req.template_args else "",
                "call_format": json.dumps(req.call_format) if req.call_format else "",
                "prompt_token_ids": (json.dumps(req.prompt_token_ids)
                                     if req.prompt_token_ids is not None else ""),
                "params": json.dumps(req.params.to_dict()),
                "owner": req.owner,
                "model": model,
                "text": "",
                "created_at": now,
                "deadline": "" if req.deadline is None else str(req.deadline),
                "attempts": 0,
                # the Celery priority it was queued at: a hand-back queues it at the same one
                "priority": "" if req.priority is None else int(req.priority),
                "rate_key": charged_to,
                "reserved_tokens": reserved_tokens(req) if charged_to else 0,
            }
            pipe.hset(record_key(req.seq_id), mapping=rec)
            pipe.expire(record_key(req.seq_id), self.pending_ttl_s)
            jobs.append(job_from_record({k: str(v) for k, v in rec.items()}))
        pipe.execute()
        return jobs

    def get_record(self, seq_id: str, text: bool = True) -> dict[str, str] | None:
        """A record (see get_records); None when it does not exist."""
        return self.get_records([seq_id], text)[0] or None

    def get_records(self, seq_ids: list[str], text: bool = True) -> list[dict[str, str]]:
        """Many records in one round trip, in order ({} for one that does not exist). A
        running one's text is its running text (the record holds it only once it ended),
        read with the record in one transaction; `text` False leaves it out, for readers of
        the status alone (its reading grows with the length)."""
        if not seq_ids:
            return []
        pipe = self.r.pipeline(transaction=text)
        for seq_id in seq_ids:
            pipe.hgetall(record_key(seq_id))
            if text:
                pipe.get(text_key(seq_id))
        replies = pipe.execute()
        if not text:
            return replies
        recs = replies[::2]
        for rec, running in zip(recs, replies[1::2]):
            if running is not None and rec.get("status") == SequenceStatus.RUNNING.value:
                rec["text"] = running
        return recs

    def get_job(self, seq_id: str) -> dict[str, Any] | None:
        rec = self.get_record(seq_id)
        return job_from_record(rec) if rec else None

    def request_cancel(self, seq_id: str) -> None:
        """Flags a sequence; a queued one is finished here, a running one by its engine."""
        self.r.sadd(CANCELLED_KEY, seq_id)
        if not self.finish(seq_id, FinishReason.CANCELLED, only_if=(SequenceStatus.QUEUED,)):
            # Already finished (or gone): nobody would ever remove the flag, so drop it here.
            st = self.r.hget(record_key(seq_id), "status")
            if st is None or SequenceStatus(st).is_finished:
                self.r.srem(CANCELLED_KEY, seq_id)

    def read_events(self, seq_id: str, after: str = "0-0", block_ms: int | None = None,
                    count: int = 512) -> list[tuple[str, str, dict[str, Any]]]:
        """Stream entries after `after`: [(entry_id, kind, data)]."""
        res = self.r.xread({events_key(seq_id): after}, count=count, block=block_ms)
        out = []
        for _key, entries in res or []:
            for entry_id, fields in entries:
                kind, data = decode_event(fields)
                out.append((entry_id, kind, data))
        return out

    def read_events_many(self, positions: dict[str, str], block_ms: int | None = None,
                         count: int = 512) -> list[tuple[str, str, str, dict[str, Any]]]:
        """read_events over several sequences at once (one XREAD): [(seq_id, entry_id, kind,
        data)], each sequence's entries in order."""
        res = self.r.xread({events_key(s): after for s, after in positions.items()},
                           count=count, block=block_ms)
        out = []
        for key, entries in res or []:
            seq_id = key.removeprefix(Keys.record("")).removesuffix(":events")
            for entry_id, fields in entries:
                kind, data = decode_event(fields)
                out.append((seq_id, entry_id, kind, data))
        return out

    def dedicated(self) -> "SequenceStore":
        """This store over a connection of its own, held (not returned to the pool between
        commands): a blocking reader that others must be able to name (CLIENT UNBLOCK). Its
        id is kept current: redis-py reconnects a dropped connection inside a command, and
        retries the command (a blocking XREAD too) under the new id."""
        client = type(self.r)(connection_pool=self.r.connection_pool,
                              single_connection_client=True)
        store = SequenceStore(client, result_ttl_s=self.result_ttl_s,
                              pending_ttl_s=self.pending_ttl_s, stream_maxlen=self.stream_maxlen)
        store._conn_id = int(client.client_id())
        conn = getattr(client, "connection", None)
        if hasattr(conn, "register_connect_callback"):
            conn.register_connect_callback(store._reconnected)
        return store

    def _reconnected(self, conn) -> None:
        """redis-py's callback after it (re)connected a dedicated store's connection: its
        new id, asked on that connection before the command it retries goes out."""
        conn.send_command("CLIENT", "ID")
        self._conn_id = int(conn.read_response())

    def close(self) -> None:
        """Lets go of this store's connections (a dedicated one's included)."""
        conn = getattr(self.r, "connection", None)
        if self._conn_id is not None and hasattr(conn, "deregister_connect_callback"):
            conn.deregister_connect_callback(self._reconnected)   # it goes back to the pool
        self.r.close()

    def client_id(self) -> int:
        """The connection's id (a dedicated store's as of its last connect, no round trip)."""
        return self._conn_id if self._conn_id is not None else int(self.r.client_id())

    def unblock_client(self, client_id: int) -> bool:
        """Ends another connection's blocking command (as if it timed out); False when it was
        not blocked."""
        return bool(self.r.client_unblock(client_id))

    # --- worker side -------------------------------------------------------------------------
    def load_request(self, seq_id: str) -> SequenceRequest | None:
        rec = self.get_record(seq_id)
        if not rec:
            return None
        return SequenceRequest(
            seq_id=seq_id,
            prompt=rec.get("prompt") if not rec.get("messages") else None,
            prompt_token_ids=(json.loads(rec["prompt_token_ids"])
                              if rec.get("prompt_token_ids") else None),
            messages=json.loads(rec["messages"]) if rec.get("messages") else None,
            template_args=(json.loads(rec["template_args"]) if rec.get("template_args")
                           else None),
            params=SamplingParams.from_dict(json.loads(rec.get("params") or "{}")),
            owner=rec.get("owner", ""),
            created_at=_num(rec.get("created_at")),
            deadline=_num(rec.get("deadline")),
        )

    def owner_of(self, seq_id: str) -> str:
        return self.r.hget(record_key(seq_id), "owner") or ""

    def priority_of(self, seq_id: str) -> int | None:
        """The Celery priority a sequence was queued at (None: the default)."""
        return _num(self.r.hget(record_key(seq_id), "priority"), int)

    def start(self, seq_id: str, worker: str, stale_s: float = 15.0,
              running: int | None = None) -> tuple[str, int]:
        """Marks a sequence running. Returns (previous status, attempt); attempt 0 = do not run.
        `running`: the attempt of it this worker's engine runs now, if any (a second message
        for it is skipped)."""
        prev, attempt = self._start(
            keys=[record_key(seq_id), WORKERS_KEY, running_key(worker), UNSTARTED_KEY,
                  text_key(seq_id)],
            args=[_now(), worker, time.time() - stale_s, seq_id,
                  "" if running is None else int(running)])
        if prev == SequenceStatus.RUNNING.value and attempt:
            # A redelivered sequence restarts from scratch: readers drop what they have.
            self._append(self.r, seq_id, EVENT_RESET, reset_data(int(attempt), "worker lost"))
        return prev, int(attempt)

    def hold(self, worker: str, seq_id: str) -> None:
        """A worker received the sequence's message (before its task starts it)."""
        self.r.sadd(held_key(worker), seq_id)

    def release(self, worker: str, seq_id: str) -> None:
        """The worker's task for the sequence returned: the message is acknowledged next."""
        self.r.srem(held_key(worker), seq_id)

    def reclaim(self, worker: str, stale_s: float | None = None, held: bool = True,
                reason: str = "worker lost", sender: str | None = None) -> list[str]:
        """Sequences of a dead worker (or, with stale_s None, this worker's own): those it ran
        are put back to queued with a reset event and, with `held`, those whose message it held
        unstarted (still queued) are added. The caller queues them all again. A live worker
        handing back at shutdown leaves `held` out: its tasks still hold those messages, and
        should it die before it has queued them again, a peer finds them there. With `sender`
        (the worker that queues them again), each waits in its running set until `resent`."""
        cutoff = "force" if stale_s is None else str(time.time() - stale_s)
        return list(self._reclaim(
            keys=[running_key(worker), WORKERS_KEY, held_key(worker),
                  running_key(sender or worker), UNSTARTED_KEY],
            args=[worker, cutoff, json.dumps(reason), self.stream_maxlen, "1" if held else "0",
                  self.pending_ttl_s, "1" if sender else "0",
                  *Keys.around(record_key), *Keys.around(events_key), *Keys.around(channel),
                  *Keys.around(text_key), time.time()]))

    def resent(self, sender: str, seq_id: str) -> None:
        """A sequence `sender` took back has its new message (see reclaim)."""
        self._resent(keys=[record_key(seq_id), running_key(sender)], args=[sender, seq_id])

    def stale_workers(self, stale_s: float) -> list[str]:
        return self.r.zrangebyscore(WORKERS_KEY, "-inf", time.time() - stale_s)

    def set_prompt_tokens(self, seq_id: str, n: int) -> None:
        self.r.hset(record_key(seq_id), "prompt_tokens", n)

    def publish_deltas(self, deltas: Iterable[TokenDelta]) -> list[int]:
        """One engine step's tokens for all its sequences, in one round trip: a token event per
        new token, as vLLM streams a chunk per token, even when its text is empty (a special
        token, or a character completed by the next one). Deltas that carry
        their attempt are fenced on it (see _PUBLISH); returns the positions (0-based) of those
        refused because their record is no longer running that attempt."""
        return self.publish_step(deltas)[0]

    def publish_step(self, deltas: Iterable[TokenDelta], watched: list[str] | None = None
                     ) -> tuple[list[int], set[str]]:
        """publish_deltas and cancelled_among(watched) in one round trip: what the engine
        writes each step, and its look for cancels. (Two round trips a step were a sixth of
        the engine's CPU per token at one sequence, on cores llama.cpp's threads share.)
        Returns (refused positions, cancelled ids)."""
        deltas, watched = list(deltas), list(watched or [])
        if not deltas and not watched:
            return [], set()
        pipe = self.r.pipeline(transaction=False)
        fenced = any(d.attempt is not None for d in deltas)
        if fenced:
            keys: list[str] = []
            args: list[Any] = [self.stream_maxlen, self.pending_ttl_s]
            for d in deltas:
                data = _token_data(d)
                keys += _delta_keys(d.seq_id)
                args += ["" if d.attempt is None else int(d.attempt),
                         encode_event(EVENT_TOKEN, data)["data"],
                         encode_pubsub(EVENT_TOKEN, data), d.text, d.completion_tokens]
            # EVALSHA itself, not the Script object: in a pipeline that would first ask
            # SCRIPT EXISTS, a round trip of its own, every time.
            pipe.evalsha(self._publish.sha, len(keys), *keys, *args)
        else:
            for d in deltas:
                self._append(pipe, d.seq_id, EVENT_TOKEN, _token_data(d))
                if d.text:
                    pipe.append(text_key(d.seq_id), d.text)
                    pipe.expire(text_key(d.seq_id), self.pending_ttl_s)
                pipe.hset(record_key(d.seq_id), "completion_tokens", d.completion_tokens)
        if watched:
            pipe.smismember(CANCELLED_KEY, watched)
        replies = pipe.execute(raise_on_error=False)
        if fenced and isinstance(replies[0], redis.exceptions.NoScriptError):
            # Redis restarted (or never saw the script): the Script object loads it and runs
            # it; the cancel look in the pipeline ran all the same.
            replies[0] = self._publish(keys=keys, args=args)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        refused = [int(p) - 1 for p in replies[0]] if fenced else []
        flags = replies[-1] if watched else []
        return refused, {s for s, f in zip(watched, flags) if f}

    def cancelled_among(self, seq_ids: list[str]) -> set[str]:
        if not seq_ids:
            return set()
        flags = self.r.smismember(CANCELLED_KEY, seq_ids)
        return {s for s, f in zip(seq_ids, flags) if f}

    def finish(self, seq_id: str, reason: FinishReason, *, text: str | None = None,
               completion_tokens: int | None = None, error: str | None = None,
               error_code: str | None = None,
               only_if: tuple[SequenceStatus, ...] = (SequenceStatus.QUEUED,
                                                      SequenceStatus.RUNNING),
               attempt: int | None = None, metrics_recorded: bool = False) -> bool:
        """Ends a sequence once: fields, done event, publish and TTLs in one atomic script.
        With `attempt`, only if the record is still running that start (a worker's late
        result for a sequence taken over elsewhere is refused)."""
        return self.finish_many([Finish(seq_id, reason, text=text,
                                        completion_tokens=completion_tokens, error=error,
                                        error_code=error_code, only_if=only_if,
                                        attempt=attempt,
                                        metrics_recorded=metrics_recorded)])[0]

    def finish_many(self, items: list["Finish"]) -> list[bool]:
        """finish() for many sequences in two round trips: the records, then every script.
        An engine step can end its whole batch at once (64 sequences given the same length),
        and one round trip each made the last done event wait for all the others."""
        if not items:
            return []
        # (the running texts only for ends that bring no text: the engine's bring the whole)
        recs = self.get_records([it.seq_id for it in items],
                                text=any(it.text is None for it in items))
        pipe = self.r.pipeline(transaction=False)
        queued = []
        running_pre, running_post = Keys.around(running_key)
        for i, (it, rec) in enumerate(zip(items, recs)):
            if not rec:
                continue
            fields = {"status": it.reason.status.value, "finish_reason": it.reason.value,
                      "finished_at": str(_now())}
            if it.text is not None:
                fields["text"] = it.text
            if it.completion_tokens is not None:
                fields["completion_tokens"] = str(it.completion_tokens)
            if it.error:
                fields["error"] = it.error
            if it.error_code:
                fields["error_code"] = it.error_code
            if it.cached_tokens is not None:
                fields["cached_tokens"] = str(it.cached_tokens)
            for name in ("logprobs", "prompt_logprobs"):
                if getattr(it, name) is not None:
                    fields[name] = json.dumps(getattr(it, name), separators=(",", ":"))
            job = job_from_record({**rec, **fields})
            self._finish(
                keys=[record_key(it.seq_id), events_key(it.seq_id), channel(it.seq_id),
                      CANCELLED_KEY, METRICS_KEY, owner_seqs_key(rec.get("owner", "")),
                      UNSTARTED_KEY, text_key(it.seq_id)],
                args=[",".join(s.value for s in it.only_if), json.dumps(fields),
                      encode_event(EVENT_DONE, job)["data"], encode_pubsub(EVENT_DONE, job),
                      self.stream_maxlen, self.result_ttl_s, it.seq_id, running_pre,
                      "" if it.attempt is None else str(int(it.attempt)), running_post,
                      "" if it.metrics_recorded else f"c:{SUCCESS_COUNTER}:{it.reason.value}"],
                client=pipe)
            queued.append(i)
        written = [False] * len(items)
        for i, ok in zip(queued, pipe.execute() if queued else []):
            written[i] = bool(ok)
        return written

    def metrics_snapshot(self) -> dict[str, Any]:
        """Every worker's figures as GET /metrics shows them (common/metrics.read_snapshot)."""
        return read_snapshot(self.r)

    def record_metrics(self, observations: list[dict[str, Any]]) -> None:
        """Run sequences' figures (common/metrics.record_finished's arguments), one round trip."""
        if not observations:
            return
        pipe = self.r.pipeline(transaction=False)
        for obs in observations:
            record_finished(pipe, **obs)
        pipe.execute()

    def _append(self, pipe, seq_id: str, kind: str, data: dict[str, Any]) -> None:
        pipe.xadd(events_key(seq_id), encode_event(kind, data),
                  maxlen=self.stream_maxlen, approximate=True)
        pipe.expire(events_key(seq_id), self.pending_ttl_s)
        pipe.publish(channel(seq_id), encode_pubsub(kind, data))

    # --- admission ---------------------------------------------------------------------------
    def queue_depth(self, queue: str) -> int:
        """Messages in the broker queue. Celery's Redis transport keeps one list per queue and
        priority step (name, name + sep + step)."""
        pipe = self.r.pipeline(transaction=False)
        for name in queue_lists(queue):
            pipe.llen(name)
        return sum(pipe.execute())

    def reserve_usage(self, owner: str, seqs: int, tokens: int, rpm: int, tpm: int
                      ) -> tuple[str, int, str]:
        """Charges the caller's fixed one-minute window (shared by every API replica) with
        `seqs` sequences and `tokens` tokens unless that passes `rpm` or `tpm` (0 = no limit).
        Returns (the limit hit: "rpm", "tpm" or "" when charged, seconds until the window
        ends, the window's key)."""
        now = time.time()
        window = int(now // 60)
        key = rate_key(owner, window)
        hit = self._reserve(keys=[key], args=[seqs, tokens, rpm, tpm])
        return ("" if hit == "ok" else hit), max(1, int((window + 1) * 60 - now) + 1), key

    def admit(self, queue: str, seq_ids: list[str], owner: str, max_queued: int,
              owner_cap: int, owner_floor: int = 0) -> tuple[str, int]:
        """Admits the sequences in one atomic step unless the queue (LLMQ_MAX_QUEUED) or the
        owner's share (owner_cap; 0: none) is full; an owner with a cap whose unfinished
        sequences, these included, stay within owner_floor gets in even past a full queue
        (other keys' backlog cannot lock it out). Returns ("ok", the owner's unfinished
        sequences before them) or the cap that refused them ("queue" or "key") and its count.
        Admitted ids count towards the queue until `sent` (or unadmit) takes them out."""
        now = time.time()
        kind, count = self._admit(
            keys=[ADMITTING_KEY, owner_seqs_key(owner), UNSTARTED_KEY, *queue_lists(queue)],
            args=[now, now - ADMITTING_S, now - self.pending_ttl_s, max_queued, owner_cap,
                  int(self.pending_ttl_s), owner_floor, *seq_ids])
        return (kind.decode() if isinstance(kind, bytes) else kind), int(count)

    def sent(self, seq_ids: list[str]) -> None:
        """Their messages are in the broker's lists (or never will be): the queue counts them
        there, not as admitted."""
        if seq_ids:
            self.r.zrem(ADMITTING_KEY, *seq_ids)

    def unadmit(self, seq_ids: list[str], owner: str) -> None:
        """Takes back an admission that a later check refused (nothing was created)."""
        if seq_ids:
            pipe = self.r.pipeline(transaction=True)
            pipe.zrem(ADMITTING_KEY, *seq_ids)
            pipe.zrem(UNSTARTED_KEY, *seq_ids)
            if owner:
                pipe.zrem(owner_seqs_key(owner), *seq_ids)
            pipe.execute()

    def unfinished_of(self, owner: str) -> int:
        """How many sequences of a key are queued or running (records that expired without
        finishing drop out after the pending TTL)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zremrangebyscore(owner_seqs_key(owner), "-inf", time.time() - self.pending_ttl_s)
        pipe.zcard(owner_seqs_key(owner))
        return pipe.execute()[1]

    def open_stream(self, owner: str, cap: int, lease_s: float,
                    waiting: bool = False) -> str | None:
        """Takes one of a key's `cap` stream slots (with `waiting`: slots of requests waiting
        for their result) for `lease_s` seconds (renew it with renew_stream while the stream
        lives); returns its token, or None when all are taken."""
        token, now = secrets.token_hex(8), time.time()
        ok = self._open_stream(keys=[_slots_key(owner, waiting)],
                               args=[now, now + lease_s, cap, token])
        return token if ok else None

    def renew_stream(self, owner: str, token: str, lease_s: float) -> None:
        self.r.zadd(owner_streams_key(owner), {token: time.time() + lease_s}, xx=True)

    def close_stream(self, owner: str, token: str, waiting: bool = False) -> None:
        self.r.zrem(_slots_key(owner, waiting), token)

    def owner_secret(self, known: str | None = None) -> str:
        """The HMAC secret that names owners, made once and shared by every API replica (for
        deployments that set no LLMQ_OWNER_SECRET); `known`, the one last read, is put back
        if Redis lost it."""
        pipe = self.r.pipeline(transaction=True)
        pipe.set(OWNER_SECRET_KEY, known or secrets.token_hex(32), nx=True)
        pipe.get(OWNER_SECRET_KEY)
        return pipe.execute()[1]

    # --- workers -----------------------------------------------------------------------------
    def heartbeat(self, name: str, info: dict[str, Any], ttl_s: float) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(WORKERS_KEY, {name: time.time()})
        pipe.hset(worker_key(name), mapping={k: str(v) for k, v in info.items()})
        pipe.expire(worker_key(name), max(1, int(ttl_s)))
        pipe.execute()

    def running_ids(self, name: str) -> set[str]:
        """What a worker has taken and not finished (its reclaimable sequences): started,
        received and not yet started, or taken back and not yet sent again."""
        return self.r.sunion(running_key(name), held_key(name))

    def remove_worker(self, name: str) -> None:
        self.r.zrem(WORKERS_KEY, name)
        self.r.delete(worker_key(name))

    def live_workers(self, stale_s: float) -> list[dict[str, str]]:
        """Workers whose engine stepped within stale_s seconds, with what they report."""
        names = self.r.zrangebyscore(WORKERS_KEY, time.time() - stale_s, "+inf")
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(worker_key(n))
        return [dict(info, name=n) for n, info in zip(names, pipe.execute()) if info]
