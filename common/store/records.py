"""A sequence's record: created, read, loaded for a run, cancelled and finished."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from ..keys import Keys
from ..metrics import METRICS_KEY, SUCCESS_COUNTER
from ..protocol import (EVENT_DONE, FinishReason, SamplingParams, SequenceRequest,
                        SequenceStatus, decode_event, encode_event, encode_pubsub)
from .admission import reserved_tokens
from .base import (CANCELLED_KEY, UNSTARTED_KEY, StorePart, channel, events_key, now, num,
                   owner_seqs_key, owner_stored_bytes_key, owner_stored_key, record_key,
                   running_key, text_key)
from .events import IN_EVENTS, LOGPROBS_FIELDS, gather_logprobs
from .jobs import Job, job_from_record


@dataclass(frozen=True)
class Finish:
    """One sequence's end, as RecordStore.finish_many writes it."""
    seq_id: str
    reason: FinishReason
    text: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    error_code: str | None = None      # a bad input's kind ("context_length_exceeded", ...)
    cached_tokens: int | None = None   # prompt tokens the prefix cache gave
    logprobs: list | None = None          # per output token, for sequences that asked
    prompt_logprobs: list | None = None   # per prompt token (echo)
    # Which of the two its token events carry whole (every token's entry; the prompt's on the
    # first): the record then keeps them there only, unless the stream may have been trimmed.
    in_events: tuple[str, ...] = ()
    only_if: tuple[SequenceStatus, ...] = (SequenceStatus.QUEUED, SequenceStatus.RUNNING)
    attempt: int | None = None   # set: only if the record still runs that start
    # The engine records a run sequence's full figures itself (EngineCore._record_metrics);
    # any other end (cancelled while queued, rejected at admission, not queued) is counted in
    # request_success_total by the finish script, in the same call that ends it: once.
    metrics_recorded: bool = False


# What a token event costs in Redis besides its data: its entry id and field names.
EVENT_OVERHEAD = 48
# Redis's own overhead on what is stored (allocations, encodings): with it, stored_size came
# within 10 % of MEMORY USAGE for 64-token sequences with and without 20 logprobs a token.
REDIS_OVERHEAD = 1.3


def stored_size(rec: dict[str, str]) -> int:
    """About the bytes an ended sequence keeps in Redis (its storage quota's count): its
    record's fields; its logprobs once, wherever they are kept; its events: the text again
    (a piece a token) and the done event's job (the record without logprobs, again)."""
    logprobs = sum(len(rec.get(name) or "") for name in LOGPROBS_FIELDS)
    fields = sum(len(k) + len(v) for k, v in rec.items()) - logprobs
    tokens = num(rec.get("completion_tokens"), int) or 0
    return int(REDIS_OVERHEAD * (2 * fields + logprobs + len(rec.get("text") or "")
                                 + EVENT_OVERHEAD * tokens))


class RecordStore(StorePart):
    """Creates, reads, cancels and finishes sequence records."""

    SCRIPTS = {"_finish": "finish"}

    def create(self, requests: Iterable[SequenceRequest], model: str = "",
               charged_to: str = "", created_at: float | None = None) -> list[Job]:
        """Stores new queued records (one round trip for a whole batch) and returns their jobs.
        `charged_to`: the rate window their tokens were reserved in (settled at the end);
        `created_at`: the time their deadlines count from (default: now)."""
        created = str(now() if created_at is None else created_at)
        jobs, pipe = [], self.r.pipeline(transaction=True)
        for req in requests:
            if req.owner:
                pipe.zadd(owner_seqs_key(req.owner), {req.seq_id: float(created)})
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
                "created_at": created,
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

    def get_records(self, seq_ids: list[str], text: bool = True,
                    logprobs: bool | None = None) -> list[dict[str, str]]:
        """Many records in one round trip, in order ({} for one that does not exist). A
        running one's text is its running text (the record holds it only once it ended),
        read with the record in one transaction; `text` False leaves it out, for readers of
        the status alone (its reading grows with the length). Logprobs kept in the token
        events are gathered from them (a second round trip, for those records only) unless
        `logprobs` is False (by default, as `text`)."""
        if not seq_ids:
            return []
        pipe = self.r.pipeline(transaction=text)
        for seq_id in seq_ids:
            pipe.hgetall(record_key(seq_id))
            if text:
                pipe.get(text_key(seq_id))
        replies = pipe.execute()
        recs = replies[::2] if text else replies
        if text:
            for rec, running in zip(recs, replies[1::2]):
                if running is not None and rec.get("status") == SequenceStatus.RUNNING.value:
                    rec["text"] = running
        if text if logprobs is None else logprobs:
            self._gather_logprobs(recs)
        return recs

    def _gather_logprobs(self, recs: list[dict[str, str]]) -> None:
        """Fills the logprobs fields that say IN_EVENTS from the records' token events."""
        todo = [rec for rec in recs if any(rec.get(n) == IN_EVENTS for n in LOGPROBS_FIELDS)]
        if not todo:
            return
        pipe = self.r.pipeline(transaction=False)
        for rec in todo:
            pipe.xrange(events_key(rec["id"]))
        for rec, entries in zip(todo, pipe.execute()):
            found = gather_logprobs(decode_event(fields) for _id, fields in entries)
            for name in LOGPROBS_FIELDS:
                if rec.get(name) == IN_EVENTS:
                    rec[name] = json.dumps(found.get(name, []), separators=(",", ":"))

    def get_job(self, seq_id: str) -> Job | None:
        rec = self.get_record(seq_id)
        return job_from_record(rec) if rec else None

    def load_request(self, seq_id: str) -> SequenceRequest | None:
        """What a worker runs: the request a record was created from."""
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
            created_at=num(rec.get("created_at")),
            deadline=num(rec.get("deadline")),
        )

    def owner_of(self, seq_id: str) -> str:
        return self.r.hget(record_key(seq_id), "owner") or ""

    def priority_of(self, seq_id: str) -> int | None:
        """The Celery priority a sequence was queued at (None: the default)."""
        return num(self.r.hget(record_key(seq_id), "priority"), int)

    def set_prompt_tokens(self, seq_id: str, n: int) -> None:
        self.r.hset(record_key(seq_id), "prompt_tokens", n)

    def request_cancel(self, seq_id: str) -> None:
        """Flags a sequence; a queued one is finished here, a running one by its engine."""
        self.r.sadd(CANCELLED_KEY, seq_id)
        if not self.finish(seq_id, FinishReason.CANCELLED, only_if=(SequenceStatus.QUEUED,)):
            # Already finished (or gone): nobody would ever remove the flag, so drop it here.
            st = self.r.hget(record_key(seq_id), "status")
            if st is None or SequenceStatus(st).is_finished:
                self.r.srem(CANCELLED_KEY, seq_id)

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

    def finish_many(self, items: list[Finish]) -> list[bool]:
        """finish() for many sequences in two round trips: the records, then every script (an
        engine step can end its whole batch at once, and the last done event must not wait
        for a round trip per sequence)."""
        if not items:
            return []
        # (the running texts only for ends that bring no text: the engine's bring the whole)
        recs = self.get_records([it.seq_id for it in items],
                                text=any(it.text is None for it in items), logprobs=False)
        pipe = self.r.pipeline(transaction=False)
        queued = []
        running_pre, running_post = Keys.around(running_key)
        for i, (it, rec) in enumerate(zip(items, recs)):
            if not rec:
                continue
            fields = {"status": it.reason.status.value, "finish_reason": it.reason.value,
                      "finished_at": str(now())}
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
            for name in LOGPROBS_FIELDS:
                if getattr(it, name) is not None:
                    fields[name] = json.dumps(getattr(it, name), separators=(",", ":"))
            # The done event leaves the logprobs out (its readers read the record, see
            # LLMEngine.events): each is kept once, in the token events or the record.
            job = job_from_record({**rec, **{k: v for k, v in fields.items()
                                             if k not in LOGPROBS_FIELDS}})
            owner = rec.get("owner", "")
            self._finish(
                keys=[record_key(it.seq_id), events_key(it.seq_id), channel(it.seq_id),
                      CANCELLED_KEY, METRICS_KEY, owner_seqs_key(owner),
                      UNSTARTED_KEY, text_key(it.seq_id), owner_stored_key(owner),
                      owner_stored_bytes_key(owner)],
                args=[",".join(s.value for s in it.only_if), json.dumps(fields),
                      encode_event(EVENT_DONE, job)["data"], encode_pubsub(EVENT_DONE, job),
                      self.stream_maxlen, self.result_ttl_s, it.seq_id, running_pre,
                      "" if it.attempt is None else str(int(it.attempt)), running_post,
                      "" if it.metrics_recorded else f"c:{SUCCESS_COUNTER}:{it.reason.value}",
                      ",".join(it.in_events), IN_EVENTS, stored_size({**rec, **fields}),
                      now() + self.result_ttl_s],
                client=pipe)
            queued.append(i)
        written = [False] * len(items)
        for i, ok in zip(queued, pipe.execute() if queued else []):
            written[i] = bool(ok)
        return written
