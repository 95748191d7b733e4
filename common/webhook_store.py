"""Webhook registrations and events in Redis: what to send where, and what has been sent.

A job's webhook is registered at submit. Workers scan the registrations (`due_job_events`): an
event is due once its job has started (`started`) or ended (`completed`), and is marked
"dispatching" before its delivery task is queued and "sent" after. A dispatcher that dies in
between leaves the mark, which turns due again after a while: every event is queued at least
once, always under the same id (`event_id`), which receivers use to drop repeats.

Keys:
  llmq:webhook:job:<seq_id>   hash  url, events ("started,completed"), and per event its state
                                    ("" due when it happens, "d:<unix s>" dispatching, "sent")
  llmq:webhooks:watch         set   seq ids whose registration still has events to send
  llmq:webhook:event:<id>     hash  one event to deliver: url, body, owner; attempts, delivered_at,
                                    settled (the last attempt's result, once no attempt follows)
  llmq:webhooks:pending       zset  event ids queued for delivery and not settled -> when their
                                    message was last sent or seen (common/reconcile_store.py
                                    sends again those whose message the broker lost)

Deliveries in flight are capped per destination host and per owner, and a host whose attempts
keep ending without an answer is left alone for a while (a circuit breaker), so that one key's
receiver that accepts and never answers cannot hold the whole delivery pool:
  llmq:webhook:host:<host>:deliveries     zset  event id -> lease end
  llmq:owner:<owner>:webhook-deliveries   zset  event id -> lease end
  llmq:webhook:host:<host>:breaker        hash  failures (in a row), open_until (unix s)
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import redis

from .keys import Keys
from .store.lua_scripts import register

WATCH_KEY = Keys.webhooks_watch
PENDING_KEY = Keys.webhooks_pending
WEBHOOK_TASK = "llmq.webhook"   # the Celery task that delivers one event (sent by name)
EVENTS = ("started", "completed")        # in the order they happen
EVENT_TTL_S = 3 * 24 * 3600              # longer than any retry schedule


registration_key = Keys.webhook_registration
event_key = Keys.webhook_event


def event_id(subject_id: str, event_type: str) -> str:
    """The stable id of one event (the `webhook-id` header), the same on every attempt."""
    return f"msg_{uuid.uuid5(uuid.NAMESPACE_URL, f'{subject_id}/{event_type}').hex}"


def owner_key(server_key: bytes, owner: str) -> bytes:
    """The key that signs one API key's events (`GET /v1/webhooks/secret` gives it to that key):
    with one key for all, any tenant could have llmq sign an event of its own choosing to
    another tenant's receiver (by naming that receiver as its job's webhook). A keyless server
    (owner "") signs with LLMQ_WEBHOOK_SECRET's own key."""
    if not owner:
        return server_key
    return hmac.new(server_key, b"llmq-webhook-owner\0" + owner.encode(), hashlib.sha256).digest()


def secret_of(key: bytes) -> str:
    """A signing key as Standard Webhooks writes it (what its libraries take)."""
    return "whsec_" + base64.b64encode(key).decode()


def event_body(event_type: str, data: dict[str, Any], event_id_: str) -> str:
    """The payload, as Standard Webhooks suggests ({"type", "timestamp", "data"}) and in
    OpenAI's event shape as well ({"id": "evt_...", "object": "event", "type", "created_at",
    "data": {"id", ...}}: the SDK's `client.webhooks.unwrap` parses a batch's events)."""
    now = datetime.now(timezone.utc)
    stamp = now.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return json.dumps({"id": "evt_" + event_id_.removeprefix("msg_"), "object": "event",
                       "type": event_type, "created_at": int(now.timestamp()),
                       "timestamp": stamp, "data": data},
                      ensure_ascii=False, separators=(",", ":"))


class WebhookStore:
    """Registrations of job webhooks, and the events waiting for (or after) delivery."""

    def __init__(self, client: redis.Redis, ttl_s: int):
        self.r, self.ttl_s = client, ttl_s
        self._due = register(client, "webhook_due")
        self._sent = register(client, "webhook_sent")
        self._acquire = register(client, "webhook_acquire")
        self._release = register(client, "webhook_release")

    def register_jobs(self, seq_ids: list[str], url: str, events: list[str]) -> None:
        wanted = ",".join(e for e in EVENTS if e in events)
        pipe = self.r.pipeline(transaction=True)
        for seq_id in seq_ids:
            pipe.hset(registration_key(seq_id), mapping={"url": url, "events": wanted})
            pipe.expire(registration_key(seq_id), self.ttl_s)
        pipe.sadd(WATCH_KEY, *seq_ids)
        pipe.execute()

    def unregister_jobs(self, seq_ids: list[str]) -> None:
        """Takes registrations back (a submission refused after they were written)."""
        if not seq_ids:
            return
        pipe = self.r.pipeline(transaction=True)
        pipe.srem(WATCH_KEY, *seq_ids)
        pipe.delete(*(registration_key(seq_id) for seq_id in seq_ids))
        pipe.execute()

    def due_job_events(self, redispatch_after_s: float = 60.0) -> list[tuple[str, str, str]]:
        """(seq_id, event, url) of job events to queue now, marked dispatching."""
        now = time.time()
        flat = self._due(keys=[WATCH_KEY],
                         args=[registration_key(""), Keys.record(""), now,
                               now - redispatch_after_s])
        pairs = list(zip(flat[::2], flat[1::2]))
        pipe = self.r.pipeline(transaction=False)
        for seq_id, _ev in pairs:
            pipe.hget(registration_key(seq_id), "url")
        return [(s, e, u) for (s, e), u in zip(pairs, pipe.execute() if pairs else []) if u]

    def job_event_sent(self, seq_id: str, event: str) -> None:
        self._sent(keys=[WATCH_KEY, registration_key(seq_id)], args=[seq_id, event])

    def put_event(self, event_id_: str, url: str, body: str, owner: str) -> None:
        """Stores an event for its delivery task (kept if already there: a redispatch sends the
        body first built, so every attempt signs the same bytes), with the owner whose key
        signs it; pending until its delivery settles."""
        key = event_key(event_id_)
        pipe = self.r.pipeline(transaction=True)
        pipe.hsetnx(key, "url", url)
        pipe.hsetnx(key, "body", body)
        pipe.hsetnx(key, "owner", owner)
        pipe.expire(key, EVENT_TTL_S)
        pipe.zadd(PENDING_KEY, {event_id_: time.time()})
        pipe.execute()

    def get_event(self, event_id_: str) -> dict[str, str] | None:
        return self.r.hgetall(event_key(event_id_)) or None

    def record_attempt(self, event_id_: str, result: str, delivered: bool,
                       final: bool = False) -> int:
        """Counts an attempt and its result; returns the event's attempts so far. `final`
        (implied by `delivered`): no attempt follows, and the event is no longer pending."""
        fields = {"last_result": result}
        if delivered:
            fields["delivered_at"] = str(time.time())
        if delivered or final:
            fields["settled"] = result
        pipe = self.r.pipeline(transaction=True)
        pipe.hincrby(event_key(event_id_), "attempts", 1)
        pipe.hset(event_key(event_id_), mapping=fields)
        if delivered or final:
            pipe.zrem(PENDING_KEY, event_id_)
        return int(pipe.execute()[0])

    def settled(self, event_id_: str) -> None:
        """A delivery task found its event settled before (or expired): no longer pending."""
        self.r.zrem(PENDING_KEY, event_id_)

    def start_delivery(self, event_id_: str, host: str, owner: str, lease_s: float,
                       max_per_host: int, max_per_owner: int, breaker_s: float
                       ) -> tuple[str, float]:
        """("ok", 0) and the delivery's slots taken for lease_s, or why it must wait (its
        host's breaker is open, its "host" or its "key" is at its cap) and about how long."""
        now = time.time()
        reason, wait = self._acquire(
            keys=self._delivery_keys(host, owner),
            args=[event_id_, now, now + lease_s, max_per_host, max_per_owner, breaker_s])
        return reason, float(wait)

    def end_delivery(self, event_id_: str, host: str, owner: str, answered: bool,
                     breaker_failures: int, breaker_s: float) -> int:
        """Frees the delivery's slots and counts the host's answer or its failure to give one;
        returns the host's failures in a row."""
        return int(self._release(keys=self._delivery_keys(host, owner),
                                 args=[event_id_, int(answered), time.time(), breaker_failures,
                                       breaker_s]))

    @staticmethod
    def _delivery_keys(host: str, owner: str) -> list[str]:
        return [Keys.webhook_host_deliveries(host), Keys.webhook_owner_deliveries(owner),
                Keys.webhook_breaker(host)]
