"""The API side of the LLM engine: turns requests into sequences, queues them, reads them back.

It never touches the model: it writes records to Redis, sends the Celery task by name, and
follows each sequence's event stream. The worker's EngineCore is the other half.
"""
from __future__ import annotations

import logging
import secrets
import time
import uuid
from typing import Any, Iterator

from celery import Celery

from common.protocol import (EVENT_DONE, GENERATE_TASK, FinishReason, SamplingParams,
                             SequenceRequest, SequenceStatus)
from common.store import SequenceStore

log = logging.getLogger("llmq.api")


class Overloaded(Exception):
    """The queue is full or the caller is over its rate limit (-> 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def new_seq_id() -> str:
    return f"seq-{uuid.uuid4().hex}"


class LLMEngine:
    """Submits, reads, cancels and follows sequences on behalf of the API server."""

    def __init__(self, settings, store: SequenceStore, celery: Celery):
        self.settings = settings
        self.store = store
        self.celery = celery

    def submit(self, inputs: list[dict[str, Any]], params: SamplingParams, owner: str = "",
               timeout_s: float | None = None, priority: int | None = None) -> list[dict[str, Any]]:
        """One sequence per input ({"prompt": str} or {"messages": [...]}, optionally with
        its own "params", as n > 1 gives each copy its own seed), queued in order.

        Raises Overloaded (-> 429) when the queue is full or the caller is over its rate limit;
        nothing is written in that case, and nothing accepted is ever dropped."""
        self._admission_control(len(inputs), params.max_tokens * len(inputs), owner)
        deadline = time.time() + timeout_s if timeout_s else None
        reqs = [SequenceRequest(seq_id=new_seq_id(), owner=owner, deadline=deadline,
                                priority=priority, **{"params": params, **inp})
                for inp in inputs]
        jobs = self.store.create(reqs, model=self.settings.model)
        try:
            for req in reqs:
                self.celery.send_task(GENERATE_TASK, args=[req.seq_id], task_id=req.seq_id,
                                      queue=self.settings.queue, priority=priority)
        except Exception:
            # The broker went away mid-batch: end what was not queued instead of leaving
            # records that no worker will ever take; the caller gets a 503.
            for req in reqs:
                try:
                    self.store.finish(req.seq_id, FinishReason.ERROR,
                                      error="could not queue the sequence (broker unavailable)",
                                      only_if=(SequenceStatus.QUEUED,))
                except Exception:  # noqa: BLE001 - Redis itself is down: the TTL cleans up
                    break
            raise
        for job in jobs:
            log.info("sequence queued", extra={"seq_id": job["id"], "owner": owner or None})
        return jobs

    def _admission_control(self, num_seqs: int, num_tokens: int, owner: str) -> None:
        s = self.settings
        depth = self.store.queue_depth(s.queue)
        if depth + num_seqs > s.max_queued:
            raise Overloaded(f"the queue is full ({depth} sequences waiting); retry later", 2)
        if s.rate_limit_rpm or s.rate_limit_tpm:
            used_requests, used_tokens, retry_after = self.store.count_usage(
                owner or "anonymous", 1, num_tokens)
            if s.rate_limit_rpm and used_requests > s.rate_limit_rpm:
                raise Overloaded(f"rate limit: {s.rate_limit_rpm} requests per minute",
                                 retry_after)
            if s.rate_limit_tpm and used_tokens > s.rate_limit_tpm:
                raise Overloaded(f"rate limit: {s.rate_limit_tpm} tokens per minute",
                                 retry_after)

    def get(self, seq_id: str, owner: str = "") -> dict[str, Any] | None:
        rec = self.store.get_record(seq_id)
        if not rec or not secrets.compare_digest(rec.get("owner", ""), owner):
            return None   # another key's sequence does not exist for this caller
        from common.store import job_from_record

        return job_from_record(rec)

    def cancel(self, seq_id: str, owner: str = "") -> dict[str, Any] | None:
        if self.get(seq_id, owner) is None:
            return None
        self.store.request_cancel(seq_id)
        return self.get(seq_id, owner)

    def events(self, seq_id: str, after: str = "0-0",
               keepalive_s: float | None = None) -> Iterator[tuple[str, str, dict] | None]:
        """Yields (entry_id, kind, data) after `after` until the done event; None while idle
        for keepalive_s (so a server can write a keep-alive)."""
        block_ms = int((keepalive_s or self.settings.sse_keepalive_s) * 1000)
        while True:
            events = self.store.read_events(seq_id, after, block_ms=block_ms)
            if not events:
                if self.store.get_record(seq_id) is None:
                    return   # expired underneath us
                yield None
                continue
            for entry_id, kind, data in events:
                after = entry_id
                yield entry_id, kind, data
                if kind == EVENT_DONE:
                    return

    def wait(self, seq_id: str, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Blocks until the sequence ends; returns its final job (None on timeout)."""
        deadline = time.monotonic() + (timeout_s or self.settings.wait_timeout_s)
        for ev in self.events(seq_id, keepalive_s=1.0):
            if ev is not None and ev[1] == EVENT_DONE:
                return ev[2]
            if time.monotonic() > deadline:
                return None
        return self.store.get_job(seq_id)
