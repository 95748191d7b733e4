"""The submitting side of the LLM engine: turns requests into sequences, queues them, reads
them back.

It never touches the model: it writes records to Redis, sends the Celery task by name, and
follows each sequence's event stream. The API's routes use it, and so does the batch driver in
the worker (a batch line is submitted exactly as a request is); the worker's EngineCore is the
other half.
"""
from __future__ import annotations

import logging
import secrets
import time
import uuid
from typing import Any, Callable, Iterator

from celery import Celery

from common.protocol import (EVENT_DONE, EVENT_RESET, EVENT_TOKEN, GENERATE_TASK, FinishReason,
                             SamplingParams, SequenceRequest, SequenceStatus)
from common.store import Finish, Job, SequenceStore, job_from_record
from common.stream_hub import StreamHub

from .prompt_counter import LazyPromptCounter

log = logging.getLogger("llmq.api")

CONTEXT_RECHECK_S = 5.0   # how stale the workers' context length may be


class Overloaded(Exception):
    """The queue is full or the caller is over its rate limit (-> 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int, code: str = "rate_limit_exceeded"):
        super().__init__(message)
        self.retry_after_s, self.code = retry_after_s, code


class TooLarge(Exception):
    """A request that could never pass a limit, however long it waits (-> 400)."""


# Priority steps (of Celery's 0..9) a key's sequences beyond its fair share fall behind.
FAIR_DEMOTION = 5


def new_seq_id() -> str:
    return f"seq-{uuid.uuid4().hex}"


class LLMEngine:
    """Submits, reads, cancels and follows sequences on behalf of the API server."""

    def __init__(self, settings, store: SequenceStore, celery: Celery):
        self.settings = settings
        self.store = store
        self.celery = celery
        # The API process's one reader of the event streams it follows (its thread starts at
        # the first subscription: a process that never follows one has none)
        self.streams = StreamHub(store)
        # Each model's tokenizer and chat template, loaded at its first use.
        self.prompt_counters = {m.name: LazyPromptCounter(m.source, settings.model_cache_dir)
                                for m in settings.served_models()}
        self.prompt_counter = self.prompt_counters[settings.served_models()[0].name]
        self._workers: list[dict[str, str]] = []
        self._workers_read_at = -CONTEXT_RECHECK_S

    def submit(self, inputs: list[dict[str, Any]], params: SamplingParams, owner: str = "",
               timeout_s: float | None = None, priority: int | None = None,
               seq_ids: list[str] | None = None,
               before_queue: Callable[[list[dict[str, Any]]], None] | None = None,
               unqueue: Callable[[list[str]], None] | None = None,
               model: str | None = None) -> list[dict[str, Any]]:
        """One sequence per input ({"prompt": str} or {"messages": [...]}, optionally with
        its own "params", as n > 1 gives each copy its own seed), queued in order.
        `seq_ids` names them (a batch line's id is derived from its batch), else new ids.
        `before_queue(jobs)` runs between the records and their messages (the caller's own
        bookkeeping): when it fails, nothing is queued, as when the broker fails. When the
        submission fails after it, `unqueue(seq_ids)` takes that bookkeeping back before the
        records are ended (a refused job is neither listed nor reported to its webhook), and
        `before_queue` is run again for any that a worker took in the meantime.

        Raises Overloaded (-> 429) when the queue is full or the caller is over its rate limit;
        nothing is written in that case, and nothing accepted is ever dropped. `model`: a
        name of Settings.model_names (None: the default); its workers' queue takes them."""
        served = self.settings.resolve_model(model)
        if served is None:
            raise ValueError(f"no model named {model!r}")
        # The deadline counts from the record's own created_at, so a job never reports ending
        # on its timeout before the timeout has passed since it was created.
        created_at = time.time()
        deadline = created_at + timeout_s if timeout_s else None
        seq_ids = seq_ids or [new_seq_id() for _ in inputs]
        reqs = [SequenceRequest(seq_id=seq_id, owner=owner, deadline=deadline,
                                **{"params": params, **inp})
                for seq_id, inp in zip(seq_ids, inputs)]
        unfinished = self._admission_control(reqs, owner, served.queue)
        for i, req in enumerate(reqs):   # kept on the record: a hand-back queues it the same
            req.priority = self._fair_priority(priority, unfinished + i)
        try:
            charged_to = self._charge_rate_limits(reqs, owner)
            jobs = self.store.create(reqs, model=served.name, charged_to=charged_to,
                                     created_at=created_at)
        except BaseException:
            self.store.unadmit(seq_ids, owner)
            raise
        try:
            if before_queue is not None:
                before_queue(jobs)
            for req in reqs:
                self.celery.send_task(GENERATE_TASK, args=[req.seq_id], task_id=req.seq_id,
                                      queue=served.queue, priority=req.priority)
        except Exception:
            self._refused(jobs, before_queue, unqueue)
            raise
        finally:
            self.store.sent(seq_ids)
        for job in jobs:
            log.info("sequence queued", extra={"seq_id": job["id"], "owner": owner or None})
        return jobs

    def _refused(self, jobs: list[dict[str, Any]], before_queue, unqueue) -> None:
        """The broker (or Redis) went away mid-submission, which answers 503: the records are
        ended instead of left queued with no worker ever to take them, and the caller's
        bookkeeping is taken back first, so a refused job is neither listed nor reported to a
        webhook (its dispatcher would see it end). A message already sent that a worker took
        meanwhile runs: its bookkeeping is put back."""
        ids = [job["id"] for job in jobs]
        try:
            if unqueue is not None:
                unqueue(ids)
            ended = self.store.finish_many([
                Finish(seq_id, FinishReason.ERROR, only_if=(SequenceStatus.QUEUED,),
                       error="could not queue the sequence (broker or Redis unavailable)")
                for seq_id in ids])
            taken = [job for job, done in zip(jobs, ended) if not done]
            if taken and unqueue is not None and before_queue is not None:
                before_queue(taken)
        except Exception:  # noqa: BLE001 - Redis itself is down: the TTLs clean up
            log.warning("could not end the sequences of a refused submission",
                        extra={"seq_ids": ids}, exc_info=True)

    def _admission_control(self, reqs: list[SequenceRequest], owner: str, queue: str) -> int:
        """Refuses (429) what the queue cannot take: past LLMQ_MAX_QUEUED in the model's
        queue (unless, with API keys, the key stays within LLMQ_KEY_QUEUE_FLOOR: other keys'
        backlog never locks a light key out), or, with keys, past one key's share of it.
        Returns the key's unfinished sequences (0 without keys)."""
        s, n = self.settings, len(reqs)
        keyed = bool(owner and s.api_keys)
        cap = max(1, int(s.max_queued * s.key_queue_share)) if keyed else s.max_queued
        if n > cap:   # no retry could take it: a 400, not an endless 429
            raise TooLarge(f"this request has {n} sequences, more than "
                           + (f"a key's share of the queue, {cap} (LLMQ_KEY_QUEUE_SHARE of "
                              if keyed else "the queue holds (")
                           + f"LLMQ_MAX_QUEUED={s.max_queued})")
        # One atomic step: checked, then written, concurrent requests all passed the check.
        full, count = self.store.admit(queue, [r.seq_id for r in reqs], owner if keyed else "",
                                       s.max_queued, cap if keyed else 0,
                                       s.key_queue_floor if keyed else 0,
                                       storage_quota=s.key_storage_bytes, stored_by=owner)
        if full == "storage":
            raise Overloaded(f"this key's finished jobs keep {count} bytes in Redis, its "
                             f"quota is {s.key_storage_bytes} (LLMQ_KEY_STORAGE_BYTES); "
                             "retry when older results expire (LLMQ_RESULT_TTL)",
                             self.store.storage_frees_in(owner),
                             "storage_quota_exceeded")
        if full == "queue":
            raise Overloaded(f"the queue is full ({count} sequences waiting); retry later", 2,
                             "queue_full")
        if full == "key":
            raise Overloaded(f"this key has {count} unfinished sequences, its share of "
                             f"the queue is {cap} (LLMQ_KEY_QUEUE_SHARE); retry later", 2,
                             "queue_share_exceeded")
        return count

    def check_size(self, reqs: list[SequenceRequest]) -> int:
        """Raises TooLarge for sequences that no minute of the key's rate limits could take;
        returns the tokens they reserve (also how a batch line is checked when it is read)."""
        from common.store import reserved_tokens

        s = self.settings
        tokens = sum(reserved_tokens(r) for r in reqs)
        if s.rate_limit_tpm and tokens > s.rate_limit_tpm:
            raise TooLarge(f"this request may use {tokens} tokens (prompt + max_tokens), more "
                           f"than the key's {s.rate_limit_tpm} tokens per minute "
                           "(LLMQ_RATE_LIMIT_TPM)")
        if s.rate_limit_rpm and len(reqs) > s.rate_limit_rpm:
            raise TooLarge(f"this request has {len(reqs)} sequences, more than the key's "
                           f"{s.rate_limit_rpm} per minute (LLMQ_RATE_LIMIT_RPM)")
        return tokens

    def _charge_rate_limits(self, reqs: list[SequenceRequest], owner: str) -> str:
        """Charges the key's minute with its sequences (RPM) and their tokens (TPM: max_tokens
        plus the prompt, settled with the real counts when each ends). Returns the window
        charged ("" with no limits set)."""
        s = self.settings
        if not (s.rate_limit_rpm or s.rate_limit_tpm):
            return ""
        tokens = self.check_size(reqs)
        hit, retry_after, window = self.store.reserve_usage(
            owner or "anonymous", len(reqs), tokens, s.rate_limit_rpm, s.rate_limit_tpm)
        if hit == "rpm":
            raise Overloaded(f"rate limit reached: {s.rate_limit_rpm} sequences per minute "
                             "for this key (LLMQ_RATE_LIMIT_RPM)", retry_after)
        if hit == "tpm":
            raise Overloaded(f"rate limit reached: {s.rate_limit_tpm} tokens per minute for "
                             "this key (LLMQ_RATE_LIMIT_TPM; this request reserves "
                             f"{tokens})", retry_after)
        return window

    def _fair_priority(self, priority: int | None, num_before: int) -> int | None:
        """A key's sequences past its fair share of a worker's batch queue behind every other
        key's (FAIR_DEMOTION priority steps lower), so one key's flood cannot stand between
        another key and the next free slot. Without API keys nothing is demoted."""
        s = self.settings
        if not s.api_keys or num_before < max(1, int(s.max_num_seqs * s.key_batch_share)):
            return priority
        return min(9, (priority or 0) + FAIR_DEMOTION)

    def get(self, seq_id: str, owner: str = "") -> Job | None:
        rec = self.store.get_record(seq_id)
        if not rec or not secrets.compare_digest(rec.get("owner", ""), owner):
            return None   # another key's sequence does not exist for this caller

        return job_from_record(rec)

    def cancel(self, seq_id: str, owner: str = "") -> dict[str, Any] | None:
        if self.get(seq_id, owner) is None:
            return None
        self.store.request_cancel(seq_id)
        return self.get(seq_id, owner)

    def events(self, seq_id: str, after: str = "0-0",
               keepalive_s: float | None = None) -> Iterator[tuple[str, str, dict] | None]:
        """Yields (entry_id, kind, data) after `after` until the done event; None while idle
        for keepalive_s (so a server can write a keep-alive). Ends at once when the sequence
        has finished and nothing follows `after` (resumed with the done event's id)."""
        idle_s = keepalive_s or self.settings.sse_keepalive_s
        # Whether the run's token events carry logprobs: None until its first token event is
        # seen (a reader resumed past it cannot tell). The done event leaves them out (they
        # are kept once, see RecordStore.finish_many): the done job of a sequence that may
        # have some is read back whole from the record.
        has_logprobs: bool | None = None
        from_start = after == "0-0"
        with self.streams.subscribe({seq_id: after}) as sub:
            while True:
                events = sub.read(idle_s)
                if not events:
                    rec = self.store.get_record(seq_id, text=False)
                    # (from what this reader has had: entries may be on their way to it)
                    if rec is None or self._has_ended(rec, seq_id, after):
                        return   # expired underneath us, or the reader has had the done event
                    yield None
                    continue
                for _seq_id, entry_id, kind, data in events:
                    after = entry_id
                    if kind == EVENT_RESET:
                        has_logprobs, from_start = None, True
                    elif kind == EVENT_TOKEN and (from_start or has_logprobs is None):
                        carries = "logprobs" in data or "prompt_logprobs" in data
                        if from_start:
                            has_logprobs, from_start = carries, False
                        elif carries:
                            has_logprobs = True
                    elif kind == EVENT_DONE and has_logprobs is not False:
                        data = self.done_job(seq_id, data)
                    yield entry_id, kind, data
                    if kind == EVENT_DONE:
                        return

    def done_job(self, seq_id: str, data: dict[str, Any]) -> dict[str, Any]:
        """A done event's job with its logprobs, which the event leaves out: read back from
        the record (the event's own job if the record is gone)."""
        rec = self.store.get_record(seq_id)
        return job_from_record(rec) if rec else data

    def is_over(self, seq_id: str, after: str) -> bool:
        """True when a reader resumed after `after` has had everything, done event included."""
        rec = self.store.get_record(seq_id, text=False)
        return rec is not None and self._has_ended(rec, seq_id, after)

    def _has_ended(self, rec: dict, seq_id: str, after: str) -> bool:
        # The done event is written with the final status, in one script: a finished record
        # with no entry after `after` means the done event is at or before it.
        return (SequenceStatus(rec["status"]).is_finished
                and not self.store.read_events(seq_id, after, count=1))

    def prompt_counter_for(self, model: str | None) -> LazyPromptCounter:
        """The tokenizer and chat template of the model a request names (None: the default)."""
        served = self.settings.resolve_model(model)
        return self.prompt_counters[served.name] if served else self.prompt_counter

    def live_workers(self, fresh: bool = False) -> list[dict[str, str]]:
        """The live workers and what they report, re-read every few seconds (now when
        `fresh`): a request costs no round trip for them."""
        now = time.monotonic()
        if fresh or now >= self._workers_read_at + CONTEXT_RECHECK_S:
            self._workers = self.store.live_workers(self.settings.worker_stale_s)
            self._workers_read_at = now
        return self._workers

    def workers_of(self, model: str | None, fresh: bool = False) -> list[dict[str, str]]:
        """The live workers serving a model (a worker that names none serves the default)."""
        default = self.settings.served_models()[0].name
        name = (self.settings.resolve_model(model) or self.settings.served_models()[0]).name
        return [w for w in self.live_workers(fresh)
                if (w.get("model_name") or default) == name]

    def is_served(self, model: str | None) -> bool:
        """Whether a live worker serves the model (with several models: a request for one that
        none serves is refused, 503, instead of waiting for a worker that may never come).
        A model that seems to have none is looked at again at once: one that came back is
        served without waiting for the next re-read."""
        return bool(self.workers_of(model) or self.workers_of(model, fresh=True))

    def context_length(self, model: str | None = None) -> int | None:
        """The context per sequence the model's live workers report (the smallest: any of
        them may take what is accepted), re-read every few seconds; None before any has
        reported."""
        lens = [int(w["max_model_len"]) for w in self.workers_of(model)
                if w.get("max_model_len", "").isdigit() and int(w["max_model_len"]) > 0]
        return min(lens) if lens else None
