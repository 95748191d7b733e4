"""The reconciler: every live worker, beside its reaper, sends again the accepted sequences whose
Celery message was lost in the broker, and clears kombu's unacknowledged messages of sequences
that have ended."""
from __future__ import annotations

import logging
import time
from typing import Callable

from common.reconcile_store import ReconcileStore

log = logging.getLogger("llmq.engine")


class Reconciler:
    """Finds sequences `queued` with no message anywhere (kombu's fetch is two round trips: a
    consumer killed between them loses the message) and queues them again, at most once per
    pass every LLMQ_WORKER_STALE / 2; a duplicate it may send is skipped by the start guard."""

    def __init__(self, settings, store: ReconcileStore,
                 requeue: Callable[[str, int | None], None]):
        self.settings = settings
        self.store = store
        self.requeue = requeue
        self._last = float("-inf")

    @property
    def lost_after_s(self) -> float:
        """How long a sequence may stay queued with no trace of its message before it is sent
        again: longer than any submission takes between its admission and its message, and
        than a consumer takes between a delivery and its held set."""
        return self.settings.worker_stale_s

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.settings.worker_stale_s / 2

    def run(self) -> list[str]:
        """One pass (the caller's heartbeat thread, once this worker has beaten steadily):
        returns the ids sent again."""
        self._last = time.monotonic()
        sent = []
        for seq_id, priority in self.store.claim_lost(self.lost_after_s):
            log.warning("re-queueing a sequence whose message was lost in the broker",
                        extra={"seq_id": seq_id})
            # A send that fails (the broker away) is retried by the pass after lost_after_s:
            # the claim only set the time it was last seen.
            self.requeue(seq_id, priority)
            sent.append(seq_id)
        # A dead consumer's message for a sequence that has ended goes once it was delivered
        # lost_after_s ago (a live worker acknowledges its message as the sequence ends, so
        # this is only a margin): none outlives its sequence's end by 1.5 x LLMQ_WORKER_STALE.
        dropped = self.store.sweep_unacked(self.lost_after_s)
        if dropped:
            log.info("dropped %d unacknowledged messages of ended sequences", dropped)
        return sent
