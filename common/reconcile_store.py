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
from .store.lua_scripts import register

# The task id in a kombu message (in its `headers`, JSON as kombu writes it; `root_id` and
# `parent_id` do not match): the generate task's id is its sequence's.
_ID_PATTERN = '"id":%s*"([^"]+)"'
_SEQ_ID_PATTERN = '"id":%s*"(seq%-%x+)"'   # a sequence's message (other tasks' ids differ)

_FINISHED = ",".join(s.value for s in SequenceStatus if s.is_finished)


class ReconcileStore:
    """The unstarted index, the broker's lists and kombu's unacked hash, read together."""

    def __init__(self, client: redis.Redis, queue_lists: list[str]):
        self.r = client
        self.queue_lists = queue_lists
        self._reconcile = register(client, "reconcile_claim")
        self._sweep = register(client, "reconcile_sweep_unacked")

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
