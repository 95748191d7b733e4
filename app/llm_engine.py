"""The API side of the LLM engine: turns requests into sequences, queues them, reads them back.

It never touches the model: it writes records to Redis, sends the Celery task by name, and
follows each sequence's event stream. The worker's EngineCore is the other half.
"""
from __future__ import annotations

import secrets
import time
import uuid
from typing import Any, Iterator

from celery import Celery

from common.protocol import EVENT_DONE, GENERATE_TASK, SamplingParams, SequenceRequest
from common.store import SequenceStore


def new_seq_id() -> str:
    return f"seq-{uuid.uuid4().hex}"


class LLMEngine:
    """Submits, reads, cancels and follows sequences on behalf of the API server."""

    def __init__(self, settings, store: SequenceStore, celery: Celery):
        self.settings = settings
        self.store = store
        self.celery = celery

    def submit(self, inputs: list[dict[str, Any]], params: SamplingParams,
               owner: str = "") -> list[dict[str, Any]]:
        """One sequence per input ({"prompt": str} or {"messages": [...]}), queued in order."""
        reqs = [SequenceRequest(seq_id=new_seq_id(), params=params, owner=owner, **inp)
                for inp in inputs]
        jobs = self.store.create(reqs, model=self.settings.model)
        for req in reqs:
            self.celery.send_task(GENERATE_TASK, args=[req.seq_id], task_id=req.seq_id,
                                  queue=self.settings.queue)
        return jobs

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
