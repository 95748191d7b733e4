"""What a Responses API response keeps beside its sequence: the request as given (input items,
instructions, text format, metadata) and the conversation it continues, so that GET shows it
and a later `previous_response_id` rebuilds the conversation.

Keys:
  llmq:response:<seq id>   string  the response's request as JSON

The sequence's record (common/store.py) holds the output text, status, usage and times. The
document expires with the record: it is written with the record's pending TTL, and every read
cuts its TTL down to the record's (a finished record lives LLMQ_RESULT_TTL), so a conversation
lasts as long as the response it continues can be read.
"""
from __future__ import annotations

import json
from typing import Any

import redis

from .keys import Keys
from .protocol import SequenceStatus
from .store.lua_scripts import register

_FINISHED = ",".join(s.value for s in SequenceStatus if s.is_finished)


class ResponseStore:
    """Reads and writes responses' request documents."""

    def __init__(self, client: redis.Redis, ttl_s: int):
        self.r, self.ttl_s = client, ttl_s
        self._load = register(client, "response_load")
        self._delete = register(client, "response_delete")

    def save(self, seq_id: str, doc: dict[str, Any]) -> None:
        self.r.set(Keys.response(seq_id), json.dumps(doc, ensure_ascii=False,
                                                     separators=(",", ":")), ex=self.ttl_s)

    def load(self, seq_id: str) -> dict[str, Any] | None:
        raw = self._load(keys=[Keys.response(seq_id), Keys.record(seq_id)])
        return json.loads(raw) if raw else None

    def delete(self, seq_id: str) -> int | None:
        """Deletes the document, and the record with its events when the sequence has
        finished. Returns None when the record stays, else the bytes it counted toward its
        owner's storage quota (Admission.unstore gives them back)."""
        size = self._delete(keys=[Keys.response(seq_id), Keys.record(seq_id),
                                  Keys.events(seq_id)], args=[_FINISHED])
        return None if size is None else int(size or 0)
