"""Every Redis key llmq makes, named here and nowhere else (the stores' schema).

The store modules (`common/store/` and the batch, file, webhook and owner-index stores beside
it) are the only readers and writers of these keys; `tests/unit/test_keys.py` checks that no
other module spells a key. Celery's own keys (kombu's queues, `unacked`, `_kombu.binding.*`)
are kombu's. Ids are checked by shape before they become part of a name
(`store.is_seq_id`): "seq-<id>:events" names a stream, not a record.
"""
from __future__ import annotations

from typing import Callable

PREFIX = "llmq"


class Keys:
    """Redis key names: constants for the shared keys, a function per kind of keyed one."""

    cancelled = f"{PREFIX}:cancelled"          # set: ids whose cancellation was asked for
    workers = f"{PREFIX}:workers"              # zset: worker name -> last engine heartbeat
    owner_secret = f"{PREFIX}:owner-secret"    # string: the HMAC secret naming owners
    metrics = f"{PREFIX}:metrics"              # hash: histogram buckets and counters
    batches_active = f"{PREFIX}:batches:active"   # zset: batch id -> driver lease end
    webhooks_watch = f"{PREFIX}:webhooks:watch"   # set: ids with a webhook registration
    # zset: webhook events queued for delivery, neither delivered nor settled -> when their
    # message was last sent or seen (the reconciler's list of what might have lost it)
    webhooks_pending = f"{PREFIX}:webhooks:pending"
    # zset: ids admitted to the queue whose messages are not sent yet -> when (the queue cap
    # counts them with the broker's lists)
    admitting = f"{PREFIX}:admitting"
    # zset: ids accepted and not started (nor ended) -> when their message was last sent or
    # seen in the broker: the reconciler's list of what might have lost its message
    unstarted = f"{PREFIX}:unstarted"
    # kombu's own Redis keys (its Channel's unacked_key and unacked_index_key defaults, which
    # common/celery_config.py leaves as they are): delivered, unacknowledged messages by
    # delivery tag, and the time each was delivered
    kombu_unacked = "unacked"
    kombu_unacked_index = "unacked_index"

    @staticmethod
    def around(name: Callable[[str], str]) -> tuple[str, str]:
        """What a keyed name puts before and after its id, for a Lua script that names keys
        around ids it reads itself (a dead worker's running set, a record's worker), which
        cannot be passed to it as KEYS: it joins prefix .. id .. suffix and spells no part of
        a key itself."""
        pre, _, post = name("\x00").partition("\x00")
        return pre, post

    # --- sequences -------------------------------------------------------------------------
    @staticmethod
    def record(seq_id: str) -> str:
        """hash: the sequence record."""
        return f"{PREFIX}:seq:{seq_id}"

    @staticmethod
    def events(seq_id: str) -> str:
        """stream: token / reset / done events; entry ids are the SSE ids."""
        return f"{PREFIX}:seq:{seq_id}:events"

    @staticmethod
    def running_text(seq_id: str) -> str:
        """string: a running attempt's text so far, APPENDed to at each step, so a step writes
        its new text and not the whole (the record gets the whole text once, when it ends).
        Outside llmq:seq:*, whose scans find records and their streams."""
        return f"{PREFIX}:text:{seq_id}"

    @staticmethod
    def channel(seq_id: str) -> str:
        """pub/sub: the same events, at-most-once."""
        return f"{PREFIX}:tokens:{seq_id}"

    # --- workers ---------------------------------------------------------------------------
    @staticmethod
    def worker(name: str) -> str:
        """hash: what that worker reports (model, device, counters)."""
        return f"{PREFIX}:worker:{name}"

    @staticmethod
    def running(name: str) -> str:
        """set: the ids a worker has started and not finished (what to take back if it dies)."""
        return f"{PREFIX}:running:{name}"

    @staticmethod
    def held(name: str) -> str:
        """set: the ids whose Celery message a worker has received and not yet finished the
        task of: a message it took but had not started is taken back too if it dies."""
        return f"{PREFIX}:held:{name}"

    # --- keys (owners) ---------------------------------------------------------------------
    @staticmethod
    def owner(owner: str) -> str:
        """The prefix of an owner's keys."""
        return f"{PREFIX}:owner:{owner}"

    @staticmethod
    def owner_seqs(owner: str) -> str:
        """zset: an owner's unfinished sequences -> created (its queue share)."""
        return f"{Keys.owner(owner)}:seqs"

    @staticmethod
    def owner_streams(owner: str) -> str:
        """zset: an owner's open SSE streams -> lease end (its stream cap)."""
        return f"{Keys.owner(owner)}:streams"

    @staticmethod
    def owner_waiting(owner: str) -> str:
        """zset: an owner's requests waiting on an API thread for their result -> lease end
        (its waiting cap)."""
        return f"{Keys.owner(owner)}:waiting"

    @staticmethod
    def owner_index(owner: str, kind: str) -> str:
        """zset: an owner's jobs, files or batches, newest first."""
        return f"{Keys.owner(owner or 'anonymous')}:{kind}"

    @staticmethod
    def idempotency(owner: str, digest: str) -> str:
        """hash: one Idempotency-Key of an owner (its request's fingerprint, then its answer);
        `digest` is the key's hash, so a client's key never becomes part of a name."""
        return f"{Keys.owner(owner or 'anonymous')}:idem:{digest}"

    @staticmethod
    def rate(owner: str, window: int) -> str:
        """hash: an owner's sequences and tokens in one minute (rate limits), and its refused
        requests and grammar compile milliseconds (the API's per-key budgets)."""
        return f"{PREFIX}:rate:{owner}:{window}"

    # --- files, batches, webhooks ----------------------------------------------------------
    @staticmethod
    def file(file_id: str) -> str:
        return f"{PREFIX}:file:{file_id}"

    @staticmethod
    def file_content(file_id: str) -> str:
        return f"{PREFIX}:file:{file_id}:content"

    @staticmethod
    def batch(batch_id: str, part: str = "") -> str:
        """hash: a batch; with `part`, one of its lists and hashes (lines, answers)."""
        return f"{PREFIX}:batch:{batch_id}" + (f":{part}" if part else "")

    @staticmethod
    def response(seq_id: str) -> str:
        """string: a Responses API response's request (input items, instructions, the
        conversation so far) as JSON; its sequence's record holds the rest."""
        return f"{PREFIX}:response:{seq_id}"

    @staticmethod
    def webhook_registration(seq_id: str) -> str:
        return f"{PREFIX}:webhook:job:{seq_id}"

    @staticmethod
    def webhook_event(event_id: str) -> str:
        return f"{PREFIX}:webhook:event:{event_id}"

    @staticmethod
    def webhook_host_deliveries(host: str) -> str:
        """zset: event ids being delivered to one host -> lease end (its cap)."""
        return f"{PREFIX}:webhook:host:{host}:deliveries"

    @staticmethod
    def webhook_owner_deliveries(owner: str) -> str:
        """zset: event ids of one owner being delivered -> lease end (its cap)."""
        return f"{Keys.owner(owner or 'anonymous')}:webhook-deliveries"

    @staticmethod
    def webhook_breaker(host: str) -> str:
        """hash: one host's failures in a row, and until when its circuit breaker is open."""
        return f"{PREFIX}:webhook:host:{host}:breaker"
